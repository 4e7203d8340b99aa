#include "cli/local_cluster.h"

#include <signal.h>
#include <unistd.h>

#include <climits>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/files.h"
#include "common/process.h"
#include "common/status.h"

namespace pstrain::cli {

namespace {

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

}  // namespace

std::string ExecutableDir() {
  char path[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return ".";
  std::string exe(path, n);
  return exe.substr(0, exe.rfind('/'));
}

absl::Status LocalCluster::Spawn(const std::string& name, std::vector<std::string> argv) {
  SpawnOptions spawn;
  spawn.argv = std::move(argv);
  spawn.log_path = absl::StrCat(options_.run_dir, "/", name, ".log");
  PSTRAIN_ASSIGN_OR_RETURN(pid_t pid, pstrain::Spawn(spawn));
  children_.push_back(Child{name, pid});
  return absl::OkStatus();
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
  PSTRAIN_RETURN_IF_ERROR(Spawn("coordinator", std::move(argv)));
  const absl::Time deadline = absl::Now() + options_.startup_timeout;
  while (true) {
    if (absl::StatusOr<std::string> text = ReadFile(address_file); text.ok()) {
      coordinator_address_ = std::string(absl::StripAsciiWhitespace(*text));
      return absl::OkStatus();
    }
    if (std::optional<std::string> dead = CheckChildren()) {
      return absl::InternalError(absl::StrCat("the coordinator did not start: ", *dead));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError("the coordinator did not publish its address in time");
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

absl::Status LocalCluster::StartServer(const std::vector<std::string>& flags) {
  const std::string name = absl::StrCat("server-", servers_started_++);
  std::vector<std::string> argv = {
      absl::StrCat(options_.bin_dir, "/pstrain-server"), "--listen=127.0.0.1:0",
      absl::StrCat("--coordinator=", coordinator_address_), absl::StrCat("--node_id=", name),
      absl::StrCat("--coordinator_loss_exit_s=",
                   absl::ToInt64Seconds(options_.coordinator_loss_exit))};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return Spawn(name, std::move(argv));
}

absl::Status LocalCluster::StartWorker(const std::vector<std::string>& flags) {
  const std::string name = absl::StrCat("worker-", workers_started_++);
  std::vector<std::string> argv = {
      absl::StrCat(options_.bin_dir, "/pstrain-worker"),
      absl::StrCat("--coordinator=", coordinator_address_), absl::StrCat("--node_id=", name),
      absl::StrCat("--coordinator_loss_exit_s=",
                   absl::ToInt64Seconds(options_.coordinator_loss_exit))};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return Spawn(name, std::move(argv));
}

void LocalCluster::KillCoordinator() {
  for (Child& c : children_) {
    if (c.name != "coordinator" || c.exited) continue;
    kill(c.pid, SIGKILL);
    c.status = WaitOrKill(c.pid, absl::Now() + absl::Seconds(10));
    c.exited = true;
  }
}

absl::Status LocalCluster::RestartCoordinator() {
  KillCoordinator();
  return StartCoordinatorAgain();
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
  PSTRAIN_RETURN_IF_ERROR(cluster->StartCoordinator("127.0.0.1:0"));
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
    for (Child* c : group) kill(c->pid, SIGTERM);
    const absl::Time deadline = absl::Now() + grace;
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
