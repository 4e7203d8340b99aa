#include "cli/local_cluster.h"

#include <algorithm>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/clock.h"
#include "common/files.h"
#include "common/process.h"
#include "common/status.h"

namespace pstrain::cli {

std::string LastLines(const std::string& path, int count) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return absl::StrCat("(", text.status().message(), ")");
  size_t start = text->size();
  if (start > 0 && (*text)[start - 1] == '\n') --start;
  for (int i = 0; i < count && start > 0; ++i) {
    start = text->rfind('\n', start - 1);
    if (start == std::string::npos) {
      start = 0;
      break;
    }
  }
  return text->substr(start == 0 ? 0 : start + 1);
}

std::string ExecutableDir() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return ".";
  std::string exe(path, n);
  return exe.substr(0, exe.rfind('/'));
}

LocalCluster::Child* LocalCluster::Find(const std::string& name) {
  for (Child& c : children_) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

absl::Status LocalCluster::Spawn(Child& child) {
  SpawnOptions spawn;
  if (auto it = options_.wrappers.find(child.name); it != options_.wrappers.end()) {
    spawn.argv = it->second;
  }
  spawn.argv.insert(spawn.argv.end(), child.base_argv.begin(), child.base_argv.end());
  spawn.argv.insert(spawn.argv.end(), child.flags.begin(), child.flags.end());
  spawn.log_path = absl::StrCat(options_.run_dir, "/", child.name, ".log");
  PSTRAIN_ASSIGN_OR_RETURN(child.pid, pstrain::Spawn(spawn));
  child.exited = false;
  child.status = 0;
  return absl::OkStatus();
}

absl::Status LocalCluster::SpawnNew(const std::string& name, std::vector<std::string> base_argv,
                                    std::vector<std::string> flags) {
  Child* child = Find(name);
  if (child == nullptr) {
    children_.push_back(Child{});
    child = &children_.back();
    child->name = name;
  }
  if (!options_.tls_dir.empty()) {
    const std::string& dir = options_.tls_dir;
    base_argv.push_back(absl::StrCat("--tls_cert=", dir, "/", name, ".crt"));
    base_argv.push_back(absl::StrCat("--tls_key=", dir, "/", name, ".key"));
    base_argv.push_back(absl::StrCat("--tls_ca=", dir, "/ca.crt"));
    const std::string tokens = dir + "/auth_tokens";
    if (name == "coordinator" && access(tokens.c_str(), R_OK) == 0) {
      base_argv.push_back("--auth_tokens_file=" + tokens);
    }
  }
  if (options_.insecure && !absl::StartsWith(name, "worker")) base_argv.push_back("--insecure");
  child->base_argv = std::move(base_argv);
  child->flags = std::move(flags);
  child->restart = true;
  return Spawn(*child);
}

absl::Status LocalCluster::StartCoordinator(const std::string& listen) {
  const std::string address_file = absl::StrCat(options_.run_dir, "/coordinator.address");
  unlink(address_file.c_str());
  std::vector<std::string> argv = {absl::StrCat(options_.bin_dir, "/pstrain-coordinator"),
                                   absl::StrCat("--listen=", listen),
                                   absl::StrCat("--address_file=", address_file),
                                   absl::StrCat("--lease_s=", absl::ToInt64Seconds(options_.lease))};
  if (!options_.state_dir.empty()) argv.push_back(absl::StrCat("--state_dir=", options_.state_dir));
  if (!options_.prometheus_sd_file.empty()) {
    argv.push_back(absl::StrCat("--prometheus_sd_file=", options_.prometheus_sd_file));
  }
  PSTRAIN_RETURN_IF_ERROR(SpawnNew("coordinator", std::move(argv), options_.coordinator_flags));
  const absl::Time deadline = MonotonicNow() + options_.startup_timeout;
  while (true) {
    if (absl::StatusOr<std::string> text = ReadFile(address_file); text.ok()) {
      coordinator_address_ = std::string(absl::StripAsciiWhitespace(*text));
      return absl::OkStatus();
    }
    if (Child* c = Find("coordinator"); c != nullptr && !c->exited) {
      if (std::optional<int> status = TryReap(c->pid)) {
        c->exited = true;
        c->status = *status;
        const std::string log = absl::StrCat(options_.run_dir, "/coordinator.log");
        return absl::InternalError(absl::StrCat("the coordinator did not start (",
                                                DescribeWaitStatus(*status), "), log: ", log,
                                                "; it ends:\n", LastLines(log, 20)));
      }
    }
    if (MonotonicNow() > deadline) {
      return absl::DeadlineExceededError("the coordinator did not publish its address in time");
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

std::string LocalCluster::CheckpointRoot() const {
  return options_.checkpoint_root.empty() ? options_.run_dir : options_.checkpoint_root;
}

std::string LocalCluster::SharingFlag() const {
  const int sharing = options_.processes_sharing_cpus > 0
                          ? options_.processes_sharing_cpus
                          : std::max(1, options_.num_servers + options_.num_workers);
  return absl::StrCat("--processes_sharing_cpus=", sharing);
}

absl::Status LocalCluster::StartServer(const std::vector<std::string>& flags) {
  const std::string name = absl::StrCat("server-", servers_started_++);
  std::vector<std::string> argv = {
      absl::StrCat(options_.bin_dir, "/pstrain-server"),
      absl::StrCat("--listen=", options_.listen_host, ":0"),
      absl::StrCat("--coordinator=", coordinator_address_), absl::StrCat("--node_id=", name),
      absl::StrCat("--coordinator_loss_exit_s=",
                   absl::ToInt64Seconds(options_.coordinator_loss_exit)),
      absl::StrCat("--checkpoint_root=", CheckpointRoot()), SharingFlag()};
  return SpawnNew(name, std::move(argv), flags);
}

absl::Status LocalCluster::StartWorker(const std::vector<std::string>& flags) {
  const std::string name = absl::StrCat("worker-", workers_started_++);
  std::vector<std::string> argv = {
      absl::StrCat(options_.bin_dir, "/pstrain-worker"),
      absl::StrCat("--coordinator=", coordinator_address_), absl::StrCat("--node_id=", name),
      absl::StrCat("--coordinator_loss_exit_s=",
                   absl::ToInt64Seconds(options_.coordinator_loss_exit)),
      SharingFlag()};
  if (!options_.data_root.empty()) argv.push_back("--data_root=" + options_.data_root);
  if (options_.colocated_servers) {
    argv.push_back("--colocated_server");
    argv.push_back(absl::StrCat("--server_listen=", options_.listen_host, ":0"));
    argv.push_back(absl::StrCat("--checkpoint_root=", CheckpointRoot()));
  }
  return SpawnNew(name, std::move(argv), flags);
}

void LocalCluster::KillCoordinator() {
  if (Child* c = Find("coordinator"); c != nullptr && !c->exited) {
    kill(c->pid, SIGKILL);
    c->status = WaitOrKill(c->pid, MonotonicNow() + absl::Seconds(10));
    c->exited = true;
  }
}

absl::Status LocalCluster::RestartCoordinator() {
  KillCoordinator();
  return StartCoordinatorAgain();
}

bool LocalCluster::Kill(const std::string& name, int signal, bool restart) {
  Child* c = Find(name);
  if (c == nullptr || c->exited) return false;
  c->restart = restart;
  return kill(c->pid, signal) == 0;
}

absl::Status LocalCluster::RestartChild(const std::string& name,
                                        const std::vector<std::string>& flags) {
  Child* c = Find(name);
  if (c == nullptr) return absl::NotFoundError(absl::StrCat("no child ", name));
  if (!c->exited) return absl::FailedPreconditionError(absl::StrCat(name, " is running"));
  c->flags = flags;
  c->restart = true;
  if (name == "coordinator") return StartCoordinatorAgain();
  return Spawn(*c);
}

absl::StatusOr<int> LocalCluster::WaitForExit(const std::string& name, absl::Duration patience) {
  Child* c = Find(name);
  if (c == nullptr) return absl::NotFoundError(absl::StrCat("no child ", name));
  const absl::Time give_up = MonotonicNow() + patience;
  while (!c->exited) {
    if (std::optional<int> status = TryReap(c->pid)) {
      c->exited = true;
      c->status = *status;
      break;
    }
    if (MonotonicNow() > give_up) {
      return absl::DeadlineExceededError(absl::StrCat(name, " did not exit"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return c->status;
}

std::vector<std::string> LocalCluster::Supervise() {
  std::vector<std::string> lines;
  const absl::Time now = MonotonicNow();
  for (size_t i = 0; i < children_.size(); ++i) {
    Child& c = children_[i];
    if (!c.exited) {
      std::optional<int> status = TryReap(c.pid);
      if (!status.has_value()) continue;
      c.exited = true;
      c.status = *status;
      if (!c.restart) continue;
    } else {
      continue;  // exited before, and not restarted then
    }
    std::erase_if(c.restarts, [&](absl::Time t) { return now - t > absl::Minutes(1); });
    const bool config_error = WIFEXITED(c.status) && (WEXITSTATUS(c.status) == 2 ||
                                                       WEXITSTATUS(c.status) == 3);
    if (config_error || c.restarts.size() >= 10) {
      lines.push_back(absl::StrCat(c.name, " exited (", DescribeWaitStatus(c.status),
                                   "), not restarting"));
      c.restart = false;
      continue;
    }
    lines.push_back(absl::StrCat(c.name, " exited (", DescribeWaitStatus(c.status),
                                 "), restarting"));
    c.restarts.push_back(now);
    ++restarts_;
    const std::string name = c.name;
    absl::Status s = name == "coordinator" ? StartCoordinatorAgain() : Spawn(children_[i]);
    if (!s.ok()) lines.push_back(absl::StrCat(name, ": cannot restart: ", s.message()));
  }
  return lines;
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(Options options) {
  std::unique_ptr<LocalCluster> cluster(new LocalCluster(std::move(options)));
  const Options& o = cluster->options_;
  for (const char* binary : {"pstrain-coordinator", "pstrain-server", "pstrain-worker"}) {
    const std::string path = absl::StrCat(o.bin_dir, "/", binary);
    if (access(path.c_str(), X_OK) != 0) {
      return absl::NotFoundError(absl::StrCat("cannot execute ", path));
    }
  }
  PSTRAIN_RETURN_IF_ERROR(cluster->StartCoordinator(absl::StrCat(o.listen_host, ":0")));
  for (int s = 0; s < o.num_servers; ++s) {
    auto it = o.server_flags.find(s);
    PSTRAIN_RETURN_IF_ERROR(
        cluster->StartServer(it == o.server_flags.end() ? std::vector<std::string>{} : it->second));
  }
  for (int w = 0; w < o.num_workers; ++w) {
    auto it = o.worker_flags.find(w);
    PSTRAIN_RETURN_IF_ERROR(
        cluster->StartWorker(it == o.worker_flags.end() ? std::vector<std::string>{} : it->second));
  }
  return cluster;
}

LocalCluster::~LocalCluster() { Stop(); }

std::vector<std::pair<std::string, pid_t>> LocalCluster::children() const {
  std::vector<std::pair<std::string, pid_t>> out;
  for (const Child& c : children_) {
    if (!c.exited) out.emplace_back(c.name, c.pid);
  }
  return out;
}

std::optional<std::string> LocalCluster::CheckChildren() {
  if (options_.restart_exited_children) {
    for (const std::string& line : Supervise()) {
      if (!absl::EndsWith(line, ", restarting")) return line;
    }
    return std::nullopt;
  }
  for (Child& c : children_) {
    if (c.exited) continue;
    if (std::optional<int> status = TryReap(c.pid)) {
      c.exited = true;
      c.status = *status;
      const std::string log = absl::StrCat(options_.run_dir, "/", c.name, ".log");
      return absl::StrCat(c.name, " (", DescribeWaitStatus(*status), "), log: ", log,
                          "; it ends:\n", LastLines(log, 20));
    }
  }
  return std::nullopt;
}

void LocalCluster::Stop(absl::Duration grace) {
  // Workers first, so that none reports a failure of servers going away;
  // then the servers; the coordinator last.
  for (const char* role : {"worker-", "server-", "coordinator"}) {
    std::vector<Child*> group;
    for (Child& c : children_) {
      if (!c.exited && c.name.rfind(role, 0) == 0) group.push_back(&c);
    }
    for (Child* c : group) {
      c->restart = false;
      kill(c->pid, SIGTERM);
    }
    const absl::Time deadline = MonotonicNow() + grace;
    for (Child* c : group) {
      c->status = WaitOrKill(c->pid, deadline);
      c->exited = true;
    }
  }
}

std::map<std::string, int> LocalCluster::ExitStatuses() const {
  std::map<std::string, int> out;
  for (const Child& c : children_) {
    if (c.exited) out[c.name] = c.status;
  }
  return out;
}

}  // namespace pstrain::cli
