#include "common/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace pstrain {

absl::StatusOr<pid_t> Spawn(const SpawnOptions& options) {
  if (options.argv.empty()) return absl::InvalidArgumentError("empty argv");
  // Everything the child needs is prepared before fork: after fork only
  // async-signal-safe calls are allowed.
  std::vector<char*> argv;
  for (const std::string& a : options.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int log_fd = -1;
  if (!options.log_path.empty()) {
    log_fd = open(options.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      return absl::InternalError(
          absl::StrCat("cannot open ", options.log_path, ": ", std::strerror(errno)));
    }
  }
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    if (log_fd >= 0) close(log_fd);
    return absl::InternalError(absl::StrCat("fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (options.die_with_parent) {
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);  // the parent died before prctl
    }
    if (log_fd >= 0) {
      dup2(log_fd, STDOUT_FILENO);
      dup2(log_fd, STDERR_FILENO);
    }
    execv(argv[0], argv.data());
    _exit(127);
  }
  if (log_fd >= 0) close(log_fd);
  return pid;
}

std::optional<int> TryReap(pid_t pid) {
  int status = 0;
  const pid_t r = waitpid(pid, &status, WNOHANG);
  if (r == pid) return status;
  if (r < 0 && errno == ECHILD) return 0;  // already reaped
  return std::nullopt;
}

int StopProcess(pid_t pid, absl::Duration grace) {
  if (std::optional<int> status = TryReap(pid)) return *status;
  kill(pid, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  while (absl::Now() < deadline) {
    if (std::optional<int> status = TryReap(pid)) return *status;
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  return status;
}

std::string DescribeWaitStatus(int status) {
  if (WIFEXITED(status)) return absl::StrCat("exit ", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  return absl::StrCat("wait status ", status);
}

TerminationSignals::TerminationSignals(std::function<void(int)> on_signal) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGUSR2);  // wakes the thread at destruction
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  thread_ = std::thread([set, on_signal = std::move(on_signal)] {
    int signo = 0;
    if (sigwait(&set, &signo) != 0 || signo == SIGUSR2) return;
    on_signal(signo);
    // A second signal while shutting down means: stop now.
    if (sigwait(&set, &signo) != 0 || signo == SIGUSR2) return;
    _exit(128 + signo);
  });
}

TerminationSignals::~TerminationSignals() {
  pthread_kill(thread_.native_handle(), SIGUSR2);
  thread_.join();
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

}  // namespace pstrain
