// Which CPUs a process runs on: Linux CPU lists ("0-3,8") and the --cpus
// flag of pstrain-server and pstrain-worker, which keeps every thread of
// the process on the CPUs it names, as a container runtime's cpuset does.
// pstrain-local gives each worker (and the server beside it) CPUs of its
// own this way: a training thread that shares its CPUs with nothing but
// its own process's connection and server threads keeps its caches and is
// never queued behind another worker's training thread.
#ifndef PSTRAIN_COMMON_CPU_AFFINITY_H_
#define PSTRAIN_COMMON_CPU_AFFINITY_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace pstrain {

// "0-3,8" -> {0, 1, 2, 3, 8}: ascending, without repeats. INVALID_ARGUMENT
// on an empty list, a number that is not one, a range that runs backwards,
// or a CPU of 1024 and up.
absl::StatusOr<std::vector<int>> ParseCpuList(absl::string_view list);

// The list's text, ranges joined: {0, 1, 2, 3, 8} -> "0-3,8". `cpus`
// ascending, without repeats.
std::string FormatCpuList(const std::vector<int>& cpus);

// The CPUs the calling thread may run on (at start-up: the process's),
// ascending.
std::vector<int> AllowedCpus();

// `cpus` cut into `groups` runs of consecutive entries, as even as they
// come (the first groups one longer where they do not divide); empty when
// there are fewer CPUs than groups.
std::vector<std::vector<int>> SplitCpus(const std::vector<int>& cpus, int groups);

// Keeps the calling thread, and every thread it starts from now on, on
// `cpus`. INVALID_ARGUMENT, naming the CPUs allowed, when none of `cpus`
// is.
absl::Status RunOnlyOn(const std::vector<int>& cpus);

// RunOnlyOn, and the same for every other thread of the process running
// now (a library may start threads before main: OpenBLAS does when it
// loads). Call before the process starts threads of its own.
absl::Status RunProcessOnlyOn(const std::vector<int>& cpus);

// --cpus: when given, every thread of the process runs only on its CPUs
// (RunProcessOnlyOn). Exits 2 with a line naming `program` on a bad list
// (with --check_flags too) or CPUs the process may not use.
void RunOnlyOnFlagCpus(absl::string_view program);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CPU_AFFINITY_H_
