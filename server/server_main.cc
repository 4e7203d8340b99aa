// pstrain-server: a parameter server.
#include <algorithm>
#include <iostream>

#include "absl/flags/flag.h"
#include "common/cpu_affinity.h"
#include "common/cpu_budget.h"
#include "common/daemon_flags.h"
#include "common/init.h"
#include "common/metrics.h"
#include "common/node_id.h"
#include "common/process.h"
#include "common/tls_flags.h"
#include "glog/logging.h"
#include "server/parameter_server.h"

ABSL_FLAG(int, max_streams_per_client, pstrain::server::ClientLimits().streams,
          "parameter streams one client (a certificate's node; in plaintext an IP address) may "
          "hold open; beyond, refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_waits_per_client, pstrain::server::ClientLimits().owed_replies,
          "pulls and pushes of one client waiting for their values; beyond, refused "
          "(RESOURCE_EXHAUSTED)");
ABSL_FLAG(int, apply_threads, 0,
          "threads that share the sum and update of a chunk of 2 MiB or more, in [1, 64]; 0: "
          "the CPUs this process may use (affinity, cgroup CPU quota) divided among "
          "--processes_sharing_cpus");
ABSL_FLAG(bool, local_socket, pstrain::server::ParameterServer::Options().local_socket,
          "also serve on an abstract Unix socket, which workers of this machine use instead "
          "of TCP (plaintext only)");

int main(int argc, char** argv) {
  constexpr absl::string_view kProgram = "pstrain-server";
  pstrain::InitMain(argc, argv, "pstrain-server --coordinator=host:port [flags]");
  pstrain::RunOnlyOnFlagCpus(kProgram);  // before any thread starts
  const pstrain::NodeFlags node = pstrain::NodeFlagsFromFlags(kProgram);
  pstrain::ServiceFlags service = pstrain::ServiceFlagsFromFlags(kProgram, "127.0.0.1:0");
  const absl::Duration metrics_job_grace = pstrain::MetricsJobGraceFromFlags(kProgram);
  pstrain::server::ParameterServer::Options options;
  options.listen_address = service.listen;
  options.coordinator_address = node.coordinator;
  options.coordinator_loss_timeout = node.coordinator_loss_timeout;
  options.store.max_memory_bytes = node.max_memory_bytes;
  std::unique_ptr<pstrain::TransportSecurity> security =
      pstrain::TransportSecurityFromFlags(kProgram, pstrain::PeerRole::kServer, node.node_id);
  options.security = security.get();
  options.insecure = pstrain::InsecureFlag();
  options.node_id = pstrain::CertifiedNodeId(kProgram, security.get(), node.node_id);
  absl::StatusOr<std::string> advertise =
      pstrain::ExpandNodeId("--advertise_address", service.advertise_address, options.node_id);
  if (!advertise.ok()) {
    std::cerr << "pstrain-server: " << advertise.status().message() << "\n";
    return 2;
  }
  options.advertise_address = *advertise;
  options.local_socket = absl::GetFlag(FLAGS_local_socket);
  options.shared_memory = node.shared_memory;
  options.direct_tcp = node.direct_tcp;
  options.store.apply_threads = absl::GetFlag(FLAGS_apply_threads);
  options.store.checkpoint_root = node.checkpoint_root;
  options.client_limits.streams = absl::GetFlag(FLAGS_max_streams_per_client);
  options.client_limits.owed_replies = absl::GetFlag(FLAGS_max_waits_per_client);
  if (options.client_limits.streams < 1 || options.client_limits.owed_replies < 1) {
    std::cerr << "pstrain-server: --max_streams_per_client and --max_waits_per_client must be "
                 "positive\n";
    return 2;
  }
  if (options.store.apply_threads < 0 || options.store.apply_threads > 64) {
    std::cerr << "pstrain-server: --apply_threads must be in [1, 64], or 0\n";
    return 2;
  }
  std::string threads_why = "--apply_threads";
  if (options.store.apply_threads == 0) {
    const pstrain::ThreadChoice choice =
        pstrain::ThreadsFor(pstrain::ProcessCpuBudget(), node.processes_sharing_cpus);
    options.store.apply_threads = std::min(choice.threads, 64);
    threads_why = choice.why;
  }
  if (options.store.max_memory_bytes == -1) {
    options.store.max_memory_bytes = pstrain::AvailableMemoryBytes() / 4 * 3;
  }
  if (service.faulty_fs != nullptr) options.store.fs = service.faulty_fs.get();
  // Said with --check_flags too: what the process would run.
  LOG(INFO) << "apply threads: " << options.store.apply_threads << " (" << threads_why << ")";
  pstrain::ExitIfOnlyCheckingFlags();
  pstrain::StopOnSignal signals;
  std::unique_ptr<pstrain::MetricsServer> metrics = pstrain::ServeMetricsFromFlags();
  absl::StatusOr<std::unique_ptr<pstrain::server::ServerMetrics>> server_metrics =
      pstrain::server::ServerMetrics::Create(metrics->registry(), metrics_job_grace);
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
  pstrain::PublishAddress(service.address_file, (*server)->address());
  metrics->SetReadiness([&] { return (*server)->Readiness(); });
  signals.OnSignal([&] { (*server)->RequestStop(); });
  (*server)->Wait();
  signals.OnSignal(nullptr);
  metrics->SetReadiness(nullptr);
  (*server)->Shutdown(absl::Seconds(2));
  // Fenced: another process holds the node's id now.
  return (*server)->fenced() ? 3 : 0;
}
