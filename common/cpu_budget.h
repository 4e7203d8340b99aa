// How many compute threads a process runs: the CPUs it may use — its
// affinity mask, capped by its cgroup's CPU quota, as a container runtime
// sets them — divided among the pstrain processes that share them (a
// launcher tells its children how many). Every process pstrain starts
// sizes its pools this way (the workers' OpenBLAS threads, the servers'
// apply threads, a torch script's OpenMP and OpenBLAS threads) unless the
// user set a flag or a variable, and says once at start what it chose and
// why.
#ifndef PSTRAIN_COMMON_CPU_BUDGET_H_
#define PSTRAIN_COMMON_CPU_BUDGET_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace pstrain {

// Where a process's cgroups are read from; a test points them at a tree of
// its own.
struct CgroupFiles {
  std::string mountinfo = "/proc/self/mountinfo";
  std::string cgroup = "/proc/self/cgroup";
  // Prepended to every mount point the mountinfo names.
  std::string root_prefix;
};

// The CPU quota of the process's cgroup in CPUs (quota over period), the
// smallest of its cgroup and every ancestor up to the hierarchy's mount:
// cgroup v2's cpu.max, or v1's cpu.cfs_quota_us over cpu.cfs_period_us.
// nullopt where no quota is set, or none can be read (no cgroup file
// system: the process then has its affinity mask alone).
std::optional<double> CgroupCpuQuota(const CgroupFiles& files = {});

// The CPUs a process may use.
struct CpuBudget {
  int cpus = 1;  // at least 1
  // Where the figure comes from: "2 CPUs (affinity 0-1, no cgroup CPU
  // quota)".
  std::string why;
};

// `allowed` (the affinity mask's CPUs) capped by `quota` (CPUs, rounded
// down: a quota of 1.5 CPUs keeps one thread from being throttled), at
// least 1.
CpuBudget BudgetOf(const std::vector<int>& allowed, std::optional<double> quota);
// This process's: BudgetOf(AllowedCpus(), CgroupCpuQuota()).
CpuBudget ProcessCpuBudget();

// A compute pool's size.
struct ThreadChoice {
  int threads = 1;
  std::string why;  // "2 CPUs (...) shared by 4 processes of the launch"
};

// The threads of one pool of a process that shares `budget` with
// `sharing_processes` processes (itself included) and runs such a pool for
// each of its `devices` side by side (a worker's CPU devices): the CPUs
// divided among them all, rounded down, at least 1.
ThreadChoice ThreadsFor(const CpuBudget& budget, int sharing_processes, int devices = 1);

// The environment variables that size a torch script's pools (OpenMP, which
// torch's intra-op threads and oneDNN use, OpenBLAS, which torch's and
// numpy's matrix products use, and MKL's), in the order they are set.
inline constexpr const char* kThreadVariables[] = {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                   "MKL_NUM_THREADS"};

// The one of kThreadVariables set in this process's environment ("NAME=value"
// of the first), or nullopt: a user who set one chose the threads.
std::optional<std::string> ThreadVariableSet();

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CPU_BUDGET_H_
