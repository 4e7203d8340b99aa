#include "common/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/clock.h"
#include "glog/logging.h"

namespace pstrain {

absl::StatusOr<pid_t> Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("empty argv");
  // Everything the child needs is prepared before fork: after fork only
  // async-signal-safe calls are allowed.
  if (options.argv.empty()) return absl::InvalidArgumentError("no program to run");
  // A program without a slash is looked for in PATH, here: after fork only
  // async-signal-safe calls may be made.
  std::string program = options.argv[0];
  if (program.find('/') == std::string::npos) {
    const char* path = std::getenv("PATH");
    for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "/usr/bin:/bin", ':')) {
      const std::string candidate = absl::StrCat(dir, "/", options.argv[0]);
      if (access(candidate.c_str(), X_OK) == 0) {
        program = candidate;
        break;
      }
    }
  }
  std::vector<char*> argv;
  for (const std::string& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  // The environment: the parent's, less what options.env sets anew.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    const absl::string_view entry(*e);
    const bool replaced = std::any_of(options.env.begin(), options.env.end(),
                                      [&](const std::string& set) {
                                        return absl::StartsWith(entry, set.substr(0, set.find('=') + 1));
                                      });
    if (!replaced) env_strings.emplace_back(entry);
  }
  env_strings.insert(env_strings.end(), options.env.begin(), options.env.end());
  std::vector<char*> envp;
  for (const std::string& e : env_strings) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  auto open_log = [](const std::string& path) -> absl::StatusOr<int> {
    if (path.empty()) return -1;
    const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return absl::InternalError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
    return fd;
  };
  absl::StatusOr<int> log_fd = open_log(options.log_path);
  if (!log_fd.ok()) return log_fd.status();
  absl::StatusOr<int> err_fd = open_log(options.stderr_path);
  if (!err_fd.ok()) {
    if (*log_fd >= 0) close(*log_fd);
    return err_fd.status();
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    if (*log_fd >= 0) close(*log_fd);
    if (*err_fd >= 0) close(*err_fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    // The parent's handlers would write to its signal pipe until exec.
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (options.own_process_group) setpgid(0, 0);
    if (options.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);  // the parent died before prctl
    }
    if (*log_fd >= 0) {
      dup2(*log_fd, STDOUT_FILENO);
      dup2(*log_fd, STDERR_FILENO);
    }
    if (*err_fd >= 0) dup2(*err_fd, STDERR_FILENO);
    execve(program.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  // Both sides, so that the group exists whichever runs first.
  if (options.own_process_group) setpgid(pid, pid);
  if (*log_fd >= 0) close(*log_fd);
  if (*err_fd >= 0) close(*err_fd);
  return pid;
}

std::optional<int> TryReap(pid_t pid) {
  int status = 0;
  const pid_t r = waitpid(pid, &status, WNOHANG);
  if (r == pid) return status;
  if (r < 0 && errno == ECHILD) return kUnknownWaitStatus;  // not ours, or reaped
  return std::nullopt;
}

int WaitOrKill(pid_t pid, absl::Time deadline) {
  while (MonotonicNow() < deadline) {
    if (std::optional<int> status = TryReap(pid)) return *status;
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (std::optional<int> status = TryReap(pid)) return *status;
  kill(pid, SIGKILL);
  int status = 0;
  if (waitpid(pid, &status, 0) != pid) return kUnknownWaitStatus;
  return status;
}

int StopProcess(pid_t pid, absl::Duration grace) {
  if (std::optional<int> status = TryReap(pid)) return *status;
  kill(pid, SIGTERM);
  return WaitOrKill(pid, MonotonicNow() + grace);
}

int StopProcessGroup(pid_t pid, absl::Duration grace) {
  const int status = StopProcess(pid, grace);
  kill(-pid, SIGKILL);  // ESRCH once the group is empty
  return status;
}

std::string DescribeWaitStatus(int status) {
  if (status == kUnknownWaitStatus) return "exited, status unknown";
  if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

namespace {

// The write end is used by the signal handler: only async-signal-safe calls.
int g_signal_pipe[2] = {-1, -1};

void OnTerminationSignal(int signo) {
  const int saved_errno = errno;
  const char byte = static_cast<char>(signo);
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

}  // namespace

TerminationSignals::TerminationSignals(std::function<void(int)> on_signal) {
  CHECK_LT(g_signal_pipe[0], 0) << "one TerminationSignals per process";
  PCHECK(pipe2(g_signal_pipe, O_CLOEXEC) == 0) << "pipe2";
  struct sigaction action = {};
  action.sa_handler = OnTerminationSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, &previous_int_);
  sigaction(SIGTERM, &action, &previous_term_);
  thread_ = std::thread([on_signal = std::move(on_signal)] {
    int received = 0;
    while (true) {
      char byte = 0;
      const ssize_t n = read(g_signal_pipe[0], &byte, 1);
      if (n < 0 && errno == EINTR) continue;
      if (n != 1 || byte == 0) return;  // 0: the destructor's wake-up
      // A second signal while shutting down means: stop now.
      if (received++ > 0) _exit(128 + byte);
      on_signal(byte);
    }
  });
}

TerminationSignals::~TerminationSignals() {
  const char wake = 0;
  [[maybe_unused]] ssize_t n = write(g_signal_pipe[1], &wake, 1);
  thread_.join();
  sigaction(SIGINT, &previous_int_, nullptr);
  sigaction(SIGTERM, &previous_term_, nullptr);
  close(g_signal_pipe[0]);
  close(g_signal_pipe[1]);
  g_signal_pipe[0] = g_signal_pipe[1] = -1;
}

StopOnSignal::StopOnSignal()
    : signals_([this](int signo) {
        absl::MutexLock lock(&mu_);
        signalled_ = true;
        if (action_) action_();
      }) {}

void StopOnSignal::OnSignal(std::function<void()> action) {
  absl::MutexLock lock(&mu_);
  action_ = std::move(action);
  if (signalled_ && action_) action_();
}

void StopOnSignal::Wait() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&signalled_));
}

int64_t AvailableMemoryBytes() {
  int64_t bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
  // cgroup v2 ("max" when unlimited), then v1.
  for (const char* path : {"/sys/fs/cgroup/memory.max",
                           "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream in(path);
    int64_t limit = 0;
    if (in >> limit && limit > 0) bytes = std::min(bytes, limit);
  }
  return bytes;
}

}  // namespace pstrain
