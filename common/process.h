// Child processes and termination signals.
#ifndef PSTRAIN_COMMON_PROCESS_H_
#define PSTRAIN_COMMON_PROCESS_H_

#include <signal.h>
#include <sys/types.h>

#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pstrain {

struct SpawnOptions {
  // Program path and arguments; argv[0] is executed (looked for in PATH
  // when it has no slash).
  std::vector<std::string> argv;
  // Where the child's stdout and stderr go (appended); empty: inherited.
  std::string log_path;
  // If set, stderr goes here instead of log_path.
  std::string stderr_path;
  // The child gets SIGTERM when the spawning thread's process dies
  // (PR_SET_PDEATHSIG), so no child outlives a parent killed with SIGKILL.
  // Spawn from a thread that lives as long as the child should.
  bool die_with_parent = true;
  // "NAME=value" entries set in the child's environment, beside (or over)
  // what it inherits.
  std::vector<std::string> env;
  // The child leads a process group of its own (its pid), which the
  // processes it starts join unless they leave it: StopProcessGroup ends
  // them all, even after the child itself has died.
  bool own_process_group = false;
};

// fork + exec. INTERNAL if fork fails; a failing exec makes the child exit 127.
absl::StatusOr<pid_t> Spawn(const SpawnOptions& options);

// The wait status TryReap reports for a process that was already reaped.
inline constexpr int kUnknownWaitStatus = -1;

// If `pid` has exited, reaps it and returns its wait status; otherwise nullopt.
std::optional<int> TryReap(pid_t pid);

// Waits for the child to exit until `deadline` (on MonotonicNow()), then SIGKILLs it; reaps it
// and returns its wait status.
int WaitOrKill(pid_t pid, absl::Time deadline);

// SIGTERM (once: a second one means "stop now" to pstrain's binaries), then
// WaitOrKill after `grace`.
int StopProcess(pid_t pid, absl::Duration grace);

// For a child spawned with own_process_group: StopProcess, then SIGKILL to
// whatever is left of its group (what it started: a script's DataLoader
// workers, say). Returns the child's wait status (kUnknownWaitStatus if
// it was reaped before).
int StopProcessGroup(pid_t pid, absl::Duration grace);

// "exit 3", "killed by signal 9" for a wait status.
std::string DescribeWaitStatus(int status);

// The memory this process may use: the machine's physical memory, or the
// cgroup's limit (memory.max, a container's) where that is lower.
int64_t AvailableMemoryBytes();

// Routes SIGINT and SIGTERM to a callback on a dedicated thread: a handler
// writes the signal to a pipe that the thread reads, so it works whichever
// thread the kernel interrupts. One instance per process; children spawned
// with Spawn get the default handlers back.
class TerminationSignals {
 public:
  // on_signal runs once, on the first signal, with its number; a second
  // signal ends the process at once (exit status 128 + signal).
  explicit TerminationSignals(std::function<void(int)> on_signal);
  ~TerminationSignals();
  TerminationSignals(const TerminationSignals&) = delete;
  TerminationSignals& operator=(const TerminationSignals&) = delete;

 private:
  struct sigaction previous_int_ = {};
  struct sigaction previous_term_ = {};
  std::thread thread_;
};

// What a long-running binary's main() does with SIGINT and SIGTERM: the
// first one runs the action set with OnSignal (at once if the signal came
// before), and releases Wait().
class StopOnSignal {
 public:
  StopOnSignal();
  // Sets the action; replaces the previous one. Clear it (nullptr) before
  // whatever it refers to is destroyed.
  void OnSignal(std::function<void()> action);
  // Blocks until a signal has arrived.
  void Wait();

 private:
  absl::Mutex mu_;
  bool signalled_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> action_ ABSL_GUARDED_BY(mu_);
  TerminationSignals signals_;  // last: its thread uses the fields above
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_PROCESS_H_
