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
    // Restart a child that exits on its own (not by Stop), as a container
    // runtime does: under the same name, so the same node id (Supervise()).
    bool restart_exited_children = false;
    // The host the coordinator and the servers listen on (and advertise).
    std::string listen_host = "127.0.0.1";
    // Commands that child NAME runs under, e.g. {"ip", "netns", "exec", "ns1"}.
    std::map<std::string, std::vector<std::string>> wrappers;
    // Extra flags for the coordinator.
    std::vector<std::string> coordinator_flags;
    // A directory of deploy/tls/make-dev-certs.sh's files: every child
    // speaks mutual TLS with the certificate of its name (coordinator,
    // server-N, worker-N), and the coordinator takes DIR/auth_tokens as its
    // --auth_tokens_file if there is one. Empty: plaintext.
    std::string tls_dir;
    // --insecure for the coordinator and the servers: plaintext on a
    // listen_host that is not loopback.
    bool insecure = false;
    // The servers' --checkpoint_root; empty: run_dir.
    std::string checkpoint_root;
    // The workers' --data_root; empty: theirs (Debian's dataset directory).
    std::string data_root;
    // Every worker runs a parameter server in its process
    // (--colocated_server), for jobs with colocated_servers.
    bool colocated_servers = false;
    // The servers' and workers' --processes_sharing_cpus (their compute
    // threads are the CPUs divided among that many); 0: num_servers +
    // num_workers, every process of the cluster on every CPU. A child's own
    // flag (worker_flags, server_flags) wins.
    int processes_sharing_cpus = 0;
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
  // lines), or nullopt if all run. With restart_exited_children, exited
  // children are restarted instead (Supervise) and only one that is not
  // restarted is described.
  std::optional<std::string> CheckChildren();

  // Restarts every child that has exited on its own, as it was started;
  // returns a line for each ("server-1 exited (signal 9), restarting"). A
  // child that exited 2 (bad flags) or 3 (fenced: another process holds its
  // id) is not restarted, nor one that was restarted 10 times within a
  // minute. Called by CheckChildren when restart_exited_children is set.
  std::vector<std::string> Supervise();
  // Restarts done so far.
  int restarts() const { return restarts_; }

  // Sends `signal` to the child called `name`; false if there is none
  // running. With `restart` false, a supervised child is not restarted
  // after it (until RestartChild).
  bool Kill(const std::string& name, int signal, bool restart = true);
  // Starts the child called `name` again (after it exited), with its own
  // flags replaced by `flags`.
  absl::Status RestartChild(const std::string& name, const std::vector<std::string>& flags);
  // Waits until the child called `name` has exited; its wait status.
  absl::StatusOr<int> WaitForExit(const std::string& name, absl::Duration patience);

  // SIGTERM to the workers, then the servers, then the coordinator, each
  // group given `grace` before SIGKILL. Idempotent.
  void Stop(absl::Duration grace = absl::Seconds(5));

  // Wait status of every child that has exited, by name.
  std::map<std::string, int> ExitStatuses() const;

 private:
  struct Child {
    std::string name;
    std::vector<std::string> base_argv;  // without the extra flags
    std::vector<std::string> flags;      // the extra flags
    pid_t pid = -1;
    bool exited = false;
    int status = 0;  // wait status, once exited
    bool restart = true;  // if supervised
    std::vector<absl::Time> restarts;  // within the last minute
  };

  explicit LocalCluster(Options options) : options_(std::move(options)) {}
  // Starts (or starts again) a child; `child` is new or one that exited.
  absl::Status Spawn(Child& child);
  // The servers' --checkpoint_root.
  std::string CheckpointRoot() const;
  // The servers' and workers' --processes_sharing_cpus flag.
  std::string SharingFlag() const;
  absl::Status SpawnNew(const std::string& name, std::vector<std::string> base_argv,
                        std::vector<std::string> flags);
  // Starts the coordinator listening on `listen` and waits for its address.
  absl::Status StartCoordinator(const std::string& listen);
  Child* Find(const std::string& name);

  const Options options_;
  std::string coordinator_address_;
  int servers_started_ = 0;
  int workers_started_ = 0;
  int restarts_ = 0;
  std::vector<Child> children_;
};

// The directory of the running executable.
std::string ExecutableDir();

// The last `count` lines of the file at `path` (all of a shorter one), or
// "(why it cannot be read)".
std::string LastLines(const std::string& path, int count);

}  // namespace pstrain::cli

#endif  // PSTRAIN_CLI_LOCAL_CLUSTER_H_
