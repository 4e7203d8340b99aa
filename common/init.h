// Start-up shared by every pstrain binary.
#ifndef PSTRAIN_COMMON_INIT_H_
#define PSTRAIN_COMMON_INIT_H_

#include <memory>
#include <string>

#include "absl/strings/string_view.h"

namespace pstrain {

// Parses Abseil flags (exits 1 with a message on bad flags), sends glog
// output to stderr, and sets the usage line shown by --help.
void InitMain(int argc, char** argv, absl::string_view usage);

// --help lists every flag the program links of pstrain's own (Abseil's
// are --helpfull's). InitMain calls this.
void HelpListsOwnFlags();

// Debian's Abseil is built with its debug checks, which record every mutex
// acquisition in a lock-order graph (a few percent of a training step's
// CPU). Release builds (NDEBUG) turn that off; the lock order is checked at
// compile time (clang's -Wthread-safety) and by the tests, which keep it.
// InitMain calls this.
void SkipMutexDeadlockDetection();

// Starts glibc's malloc where its dynamic thresholds end up once a large
// buffer has been freed: buffers up to 32 MiB come from the heap, not from
// fresh mappings, and up to 64 MiB of freed memory stays at a heap's top.
// The data plane allocates and frees buffers of up to megabytes for every
// message; handing each back to the kernel makes the next one fault its
// pages in again (1 MiB exchanges over TCP: 10-40% more bytes per second
// in alternate runs of `pstrain-bench transport`). InitMain calls this.
void KeepFreedMemoryForReuse();

// For a flag with a bad value: prints "PROGRAM: WHAT" to stderr and exits 2.
[[noreturn]] void ExitForBadFlag(absl::string_view program, absl::string_view what);

// Call once a daemon has checked its flags and before it starts anything:
// with --check_flags it prints "flags ok" and exits 0, so that a manifest's
// command line can be tried against the real binary's flag parser (an
// unknown or bad flag has already exited 1 or 2).
void ExitIfOnlyCheckingFlags();

// Whether --check_flags is given: files that flags name are then not read.
bool OnlyCheckingFlags();

// Writes "host:port\n" to `path` atomically if path is not empty; exits 1
// with a message if it cannot.
void PublishAddress(const std::string& path, const std::string& address);

class MetricsServer;

// Serves /metrics on host:port (port 0: a free one) and logs the address;
// exits 1 with a message if it cannot.
std::unique_ptr<MetricsServer> ServeMetrics(const std::string& host, int port);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_INIT_H_
