// A cluster of real pstrain processes on 127.0.0.1: one coordinator, S
// parameter servers and W workers, each a child process with its log in the
// run directory. Used by pstrain-local and by the integration tests.
#ifndef PSTRAIN_CLI_LOCAL_CLUSTER_H_
#define PSTRAIN_CLI_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pstrain::cli {

class LocalCluster {
 public:
  struct Options {
    // Directory holding pstrain-coordinator, pstrain-server, pstrain-worker.
    std::string bin_dir;
    // Directory for logs and address files; must exist.
    std::string run_dir;
    int num_servers = 1;
    int num_workers = 1;
    absl::Duration lease = absl::Seconds(10);
    // Children exit when the coordinator has been silent this long (a
    // second guard, beside the parent-death signal, against orphans).
    absl::Duration coordinator_loss_exit = absl::Seconds(30);
    // Extra flags for worker i and server i.
    std::map<int, std::vector<std::string>> worker_flags;
    std::map<int, std::vector<std::string>> server_flags;
    // The coordinator's --state_dir; empty: none.
    std::string state_dir;
    // The coordinator's --prometheus_sd_file; empty: none.
    std::string prometheus_sd_file;
    absl::Duration startup_timeout = absl::Seconds(30);
  };

  // Starts the coordinator, waits until it serves, then starts the servers
  // and workers (which register on their own). On error, every child
  // started so far is stopped.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(Options options);
  ~LocalCluster();  // Stop()

  const std::string& coordinator_address() const { return coordinator_address_; }

  // Starts one more server or worker process, named and with the node id
  // server-N / worker-N.
  absl::Status StartServer(const std::vector<std::string>& flags = {});
  absl::Status StartWorker(const std::vector<std::string>& flags = {});

  // Kills the coordinator with SIGKILL and starts it again on the same
  // address (and state directory); returns once it serves.
  absl::Status RestartCoordinator();
  // The two halves of a restart, for a longer outage.
  void KillCoordinator();
  absl::Status StartCoordinatorAgain() { return StartCoordinator(coordinator_address_); }

  // Children still running, with their names ("coordinator", "server-0", ...).
  std::vector<std::pair<std::string, pid_t>> children() const;

  // Describes the first child that has exited since the start ("worker-1
  // (exit 1), log: DIR/worker-1.log; it ends:" and the log's last 20
  // lines), or nullopt if all run.
  std::optional<std::string> CheckChildren();

  // SIGTERM to the workers, then the servers, then the coordinator, each
  // group given `grace` before SIGKILL. Idempotent.
  void Stop(absl::Duration grace = absl::Seconds(5));

  // Wait status of every child that has exited, by name.
  std::map<std::string, int> ExitStatuses() const;

 private:
  explicit LocalCluster(Options options) : options_(std::move(options)) {}
  absl::Status Spawn(const std::string& name, std::vector<std::string> argv);
  // Starts the coordinator listening on `listen` and waits for its address.
  absl::Status StartCoordinator(const std::string& listen);

  const Options options_;
  std::string coordinator_address_;
  int servers_started_ = 0;
  int workers_started_ = 0;
  struct Child {
    std::string name;
    pid_t pid;
    bool exited = false;
    int status = 0;  // wait status, once exited
  };
  std::vector<Child> children_;
};

// The directory of the running executable.
std::string ExecutableDir();

}  // namespace pstrain::cli

#endif  // PSTRAIN_CLI_LOCAL_CLUSTER_H_
