#include "common/daemon_flags.h"

#include <iostream>

#include "absl/flags/flag.h"
#include "common/init.h"
#include "common/node_id.h"

ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "host to serve /metrics on");
ABSL_FLAG(int, metrics_port, 0, "port to serve /metrics on; 0 picks a free port (logged)");
ABSL_FLAG(int, metrics_job_grace_s, 300,
          "seconds a finished job's metric series are still exported");

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

ABSL_FLAG(std::string, listen, "",
          "host:port of the service (the coordinator's control and membership APIs, a "
          "server's parameter service); port 0 picks a free port; default: 127.0.0.1:50050 "
          "for pstrain-coordinator, 127.0.0.1:0 for pstrain-server");
ABSL_FLAG(std::string, advertise_address, "",
          "what peers dial: host (with the bound port) or host:port, in which a server's "
          "{node_id} stands for its id (e.g. {node_id}.pstrain-server:50051 in a "
          "StatefulSet); required when --listen is a wildcard (0.0.0.0, [::]); default: the "
          "listen address");
ABSL_FLAG(std::string, address_file, "",
          "if set, write the bound host:port to this file once serving");
ABSL_FLAG(std::string, fs_fault_injection, "",
          "testing only: make writes to files whose path contains PATTERN fail or crash the "
          "process: no_space:PATTERN[:ROOM_BYTES], io_error:PATTERN or crash:PATTERN:BYTES");

namespace pstrain {
namespace {

[[noreturn]] void BadFlag(absl::string_view program, absl::string_view what) {
  std::cerr << program << ": " << what << "\n";
  std::exit(2);
}

}  // namespace

absl::Duration MetricsJobGraceFromFlags(absl::string_view program) {
  const int seconds = absl::GetFlag(FLAGS_metrics_job_grace_s);
  if (seconds < 0) BadFlag(program, "--metrics_job_grace_s must be >= 0");
  return absl::Seconds(seconds);
}

std::unique_ptr<MetricsServer> ServeMetricsFromFlags() {
  return ServeMetrics(absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port));
}

NodeFlags NodeFlagsFromFlags(absl::string_view program) {
  NodeFlags flags;
  absl::StatusOr<std::string> node_id = NodeIdFromFlagOrEnvironment(absl::GetFlag(FLAGS_node_id));
  if (!node_id.ok()) BadFlag(program, node_id.status().message());
  flags.node_id = *node_id;
  flags.coordinator = absl::GetFlag(FLAGS_coordinator);
  if (flags.coordinator.empty()) BadFlag(program, "--coordinator is required");
  flags.coordinator_loss_timeout = absl::Seconds(absl::GetFlag(FLAGS_coordinator_loss_exit_s));
  flags.max_memory_bytes = absl::GetFlag(FLAGS_max_memory_bytes);
  if (flags.max_memory_bytes < -1) {
    BadFlag(program, "--max_memory_bytes must be -1, 0 or positive");
  }
  flags.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  flags.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  flags.direct_tcp = absl::GetFlag(FLAGS_direct_tcp);
  return flags;
}

ServiceFlags ServiceFlagsFromFlags(absl::string_view program, const std::string& default_listen) {
  ServiceFlags flags;
  flags.listen = absl::GetFlag(FLAGS_listen);
  if (flags.listen.empty()) flags.listen = default_listen;
  flags.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  flags.address_file = absl::GetFlag(FLAGS_address_file);
  absl::StatusOr<std::unique_ptr<FaultInjectingFileSystem>> faulty_fs =
      FaultInjectingFileSystem::FromSpec(absl::GetFlag(FLAGS_fs_fault_injection));
  if (!faulty_fs.ok()) {
    BadFlag(program, absl::StrCat("--fs_fault_injection: ", faulty_fs.status().message()));
  }
  flags.faulty_fs = *std::move(faulty_fs);
  return flags;
}

}  // namespace pstrain
