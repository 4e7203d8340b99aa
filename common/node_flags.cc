// The flags of nodes: pstrain-server and pstrain-worker (daemon_flags.h).
#include "common/daemon_flags.h"

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/node_id.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator host:port (required)");
ABSL_FLAG(std::string, node_id, "",
          "the node's id (e.g. server-1, a pod's name); default: $PSTRAIN_NODE_ID, else chosen at "
          "random. A process started under the id of a lost node takes its place");
ABSL_FLAG(int, coordinator_loss_exit_s, 0,
          "exit when the coordinator has not answered for this many seconds; 0: never");
ABSL_FLAG(int64_t, max_memory_bytes, -1,
          "pstrain-server: bytes of job state it may hold; pstrain-worker: bytes a job may take "
          "in the process per device (the coordinator places only jobs that fit); -1: 3/4 of "
          "the memory the process may use (the machine's, or the cgroup's memory.max), a "
          "worker's over its devices; 0: unlimited");
ABSL_FLAG(std::string, checkpoint_root, "/var/lib/pstrain/checkpoints",
          "a job's checkpoint.dir must lie in this directory (symbolic links resolved; a "
          "worker's for its --colocated_server); empty: anywhere");
ABSL_FLAG(bool, shared_memory, true,
          "shared-memory connections between processes of this machine (found and verified "
          "through Hello and a handshake): a server takes them, a worker prefers them to any "
          "socket; plaintext only");
ABSL_FLAG(bool, direct_tcp, true,
          "direct TCP connections (found and verified through Hello and a handshake): a "
          "server takes them, a worker prefers them to gRPC streams for servers that shared "
          "memory does not reach; plaintext only");
ABSL_FLAG(int, processes_sharing_cpus, 1,
          "pstrain processes of this machine, this one included, that share the CPUs this "
          "one may use (its affinity and cgroup CPU quota): compute threads not set by a flag "
          "are the CPUs divided among them. pstrain-local and pstrain-run set it, in [1, 4096]");

namespace pstrain {

NodeFlags NodeFlagsFromFlags(absl::string_view program) {
  NodeFlags flags;
  absl::StatusOr<std::string> node_id = NodeIdFromFlagOrEnvironment(absl::GetFlag(FLAGS_node_id));
  if (!node_id.ok()) ExitForBadFlag(program, node_id.status().message());
  flags.node_id = *node_id;
  flags.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (flags.coordinator.empty()) ExitForBadFlag(program, "--coordinator is required");
  flags.coordinator_loss_timeout = absl::Seconds(absl::GetFlag(FLAGS_coordinator_loss_exit_s));
  flags.max_memory_bytes = absl::GetFlag(FLAGS_max_memory_bytes);
  if (flags.max_memory_bytes < -1) {
    ExitForBadFlag(program, "--max_memory_bytes must be -1, 0 or positive");
  }
  flags.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  flags.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  flags.direct_tcp = absl::GetFlag(FLAGS_direct_tcp);
  flags.processes_sharing_cpus = absl::GetFlag(FLAGS_processes_sharing_cpus);
  if (flags.processes_sharing_cpus < 1 || flags.processes_sharing_cpus > 4096) {
    ExitForBadFlag(program, "--processes_sharing_cpus must be in [1, 4096]");
  }
  return flags;
}

}  // namespace pstrain
