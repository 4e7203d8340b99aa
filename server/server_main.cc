// pstrain-server: a parameter server.
#include <iostream>

#include "absl/flags/flag.h"
#include "common/file_system.h"
#include "common/cpu_affinity.h"
#include "common/init.h"
#include "common/metrics.h"
#include "common/node_id.h"
#include "common/process.h"
#include "common/tls_flags.h"
#include "glog/logging.h"
#include "server/parameter_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "host:port for the parameter service; port 0 picks a free port");
ABSL_FLAG(std::string, coordinator, "", "coordinator host:port (required)");
ABSL_FLAG(std::string, node_id, "",
          "the node's id (e.g. server-1, a pod's name); default: $PSTRAIN_NODE_ID, else chosen at "
          "random. A process started under the id of a lost node takes its place");
ABSL_FLAG(std::string, advertise_address, "",
          "what peers dial: host (with the bound port) or host:port, in which {node_id} stands "
          "for the node's id (e.g. {node_id}.pstrain-server:50051 in a StatefulSet); required "
          "when --listen is a wildcard (0.0.0.0, [::]); default: the listen address");
ABSL_FLAG(std::string, fs_fault_injection, "",
          "testing only: make writes to files whose path contains PATTERN fail or crash the "
          "process: no_space:PATTERN[:ROOM_BYTES], io_error:PATTERN or crash:PATTERN:BYTES");
ABSL_FLAG(std::string, address_file, "",
          "if set, write the bound host:port to this file once serving");
ABSL_FLAG(int64_t, max_memory_bytes, -1,
          "bytes of job state this server may hold (jobs are scheduled to fit); -1: three "
          "quarters of the memory the process may use (the machine's, or its cgroup's limit); "
          "0: unlimited");
ABSL_FLAG(std::string, checkpoint_root, "/var/lib/pstrain/checkpoints",
          "a job's checkpoint.dir must lie in this directory (symbolic links resolved); empty: "
          "anywhere");
ABSL_FLAG(int, max_streams_per_client, pstrain::server::ClientLimits().streams,
          "parameter streams one client (a certificate's node; in plaintext an IP address) may "
          "hold open; beyond, refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_waits_per_client, pstrain::server::ClientLimits().owed_replies,
          "pulls and pushes of one client waiting for their values; beyond, refused "
          "(RESOURCE_EXHAUSTED)");
ABSL_FLAG(int, apply_threads, 1,
          "threads that share the sum and update of a chunk of 2 MiB or more, in [1, 64]");
ABSL_FLAG(bool, local_socket, pstrain::server::ParameterServer::Options().local_socket,
          "also serve on an abstract Unix socket, which workers of this machine use instead "
          "of TCP (plaintext only)");
ABSL_FLAG(bool, shared_memory, pstrain::server::ParameterServer::Options().shared_memory,
          "also take shared-memory connections, which workers of this machine prefer to any "
          "socket (plaintext only)");
ABSL_FLAG(bool, direct_tcp, pstrain::server::ParameterServer::Options().direct_tcp,
          "also take direct TCP connections, which workers of other machines prefer to gRPC "
          "(plaintext only)");
ABSL_FLAG(std::string, metrics_host, "127.0.0.1", "host to serve /metrics on");
ABSL_FLAG(int, metrics_port, 0, "port to serve /metrics on; 0 picks a free port (logged)");
ABSL_FLAG(int, metrics_job_grace_s, 300,
          "seconds a finished job's metric series are still exported");
ABSL_FLAG(int, coordinator_loss_exit_s, 0,
          "exit when the coordinator has not answered for this many seconds; 0: never");

int main(int argc, char** argv) {
  pstrain::InitMain(argc, argv, "pstrain-server --coordinator=host:port [flags]");
  pstrain::RunOnlyOnFlagCpus("pstrain-server");  // before any thread starts
  pstrain::server::ParameterServer::Options options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.advertise_address = absl::GetFlag(FLAGS_advertise_address);
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.coordinator_loss_timeout = absl::Seconds(absl::GetFlag(FLAGS_coordinator_loss_exit_s));
  options.store.max_memory_bytes = absl::GetFlag(FLAGS_max_memory_bytes);
  absl::StatusOr<std::string> node_id =
      pstrain::NodeIdFromFlagOrEnvironment(absl::GetFlag(FLAGS_node_id));
  if (!node_id.ok()) {
    std::cerr << "pstrain-server: " << node_id.status().message() << "\n";
    return 2;
  }
  std::unique_ptr<pstrain::TransportSecurity> security =
      pstrain::TransportSecurityFromFlags("pstrain-server", pstrain::PeerRole::kServer, *node_id);
  options.security = security.get();
  options.insecure = pstrain::InsecureFlag();
  options.node_id = pstrain::CertifiedNodeId("pstrain-server", security.get(), *node_id);
  absl::StatusOr<std::string> advertise =
      pstrain::ExpandNodeId("--advertise_address", options.advertise_address, options.node_id);
  if (!advertise.ok()) {
    std::cerr << "pstrain-server: " << advertise.status().message() << "\n";
    return 2;
  }
  options.advertise_address = *advertise;
  if (options.coordinator_address.empty()) {
    std::cerr << "pstrain-server: --coordinator is required\n";
    return 2;
  }
  options.local_socket = absl::GetFlag(FLAGS_local_socket);
  options.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  options.direct_tcp = absl::GetFlag(FLAGS_direct_tcp);
  options.store.apply_threads = absl::GetFlag(FLAGS_apply_threads);
  options.store.checkpoint_root = absl::GetFlag(FLAGS_checkpoint_root);
  options.client_limits.streams = absl::GetFlag(FLAGS_max_streams_per_client);
  options.client_limits.owed_replies = absl::GetFlag(FLAGS_max_waits_per_client);
  if (options.client_limits.streams < 1 || options.client_limits.owed_replies < 1) {
    std::cerr << "pstrain-server: --max_streams_per_client and --max_waits_per_client must be "
                 "positive\n";
    return 2;
  }
  if (options.store.apply_threads < 1 || options.store.apply_threads > 64) {
    std::cerr << "pstrain-server: --apply_threads must be in [1, 64]\n";
    return 2;
  }
  if (options.store.max_memory_bytes < -1) {
    std::cerr << "pstrain-server: --max_memory_bytes must be -1, 0 or positive\n";
    return 2;
  }
  if (options.store.max_memory_bytes == -1) {
    options.store.max_memory_bytes = pstrain::AvailableMemoryBytes() / 4 * 3;
  }
  absl::StatusOr<std::unique_ptr<pstrain::FaultInjectingFileSystem>> faulty_fs =
      pstrain::FaultInjectingFileSystem::FromSpec(absl::GetFlag(FLAGS_fs_fault_injection));
  if (!faulty_fs.ok()) {
    std::cerr << "pstrain-server: --fs_fault_injection: " << faulty_fs.status().message() << "\n";
    return 2;
  }
  if (*faulty_fs != nullptr) options.store.fs = faulty_fs->get();
  if (absl::GetFlag(FLAGS_metrics_job_grace_s) < 0) {
    std::cerr << "--metrics_job_grace_s must be >= 0\n";
    return 2;
  }
  pstrain::ExitIfOnlyCheckingFlags();
  pstrain::StopOnSignal signals;
  std::unique_ptr<pstrain::MetricsServer> metrics =
      pstrain::ServeMetrics(absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port));
  absl::StatusOr<std::unique_ptr<pstrain::server::ServerMetrics>> server_metrics =
      pstrain::server::ServerMetrics::Create(
          metrics->registry(), absl::Seconds(absl::GetFlag(FLAGS_metrics_job_grace_s)));
  if (!server_metrics.ok()) {
    std::cerr << "pstrain-server: " << server_metrics.status() << "\n";
    return 1;
  }
  options.store.metrics = server_metrics->get();
  options.rpc = &metrics->rpc();
  options.metrics_address = metrics->address();
  auto server = pstrain::server::ParameterServer::Create(options);
  if (!server.ok()) {
    std::cerr << "pstrain-server: " << server.status().message() << "\n";
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  pstrain::PublishAddress(absl::GetFlag(FLAGS_address_file), (*server)->address());
  metrics->SetReadiness([&] { return (*server)->Readiness(); });
  signals.OnSignal([&] { (*server)->RequestStop(); });
  (*server)->Wait();
  signals.OnSignal(nullptr);
  metrics->SetReadiness(nullptr);
  (*server)->Shutdown(absl::Seconds(2));
  // Fenced: another process holds the node's id now.
  return (*server)->fenced() ? 3 : 0;
}
