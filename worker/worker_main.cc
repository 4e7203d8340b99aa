// pstrain-worker: trains the jobs the coordinator assigns, one at a time.
#include <algorithm>
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/cpu_affinity.h"
#include "common/cpu_budget.h"
#include "common/daemon_flags.h"
#include "common/init.h"
#include "common/metrics.h"
#include "common/node_id.h"
#include "common/process.h"
#include "common/status.h"
#include "common/tls_flags.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_api.h"
#include "server/parameter_server.h"
#include "server/server_metrics.h"
#include "worker/devices.h"
#include "worker/fault_injecting_transport.h"
#include "worker/worker_node.h"

ABSL_FLAG(std::string, devices, "cpu:1",
          "devices to train on: cpu:N (N CPU devices, threads) or cuda:0,cuda:1,... (GPUs)");
ABSL_FLAG(int, blas_threads, 0,
          "OpenBLAS threads of each CPU device; 0: the CPUs this process may use (affinity, "
          "cgroup CPU quota) divided among --processes_sharing_cpus and the devices");
ABSL_FLAG(int, channels_per_server, pstrain::worker::GrpcTransportOptions().channels_per_server,
          "gRPC channels (TCP connections) to each parameter server, in [1, 16]");
ABSL_FLAG(int, stream_window, pstrain::worker::GrpcTransportOptions().window,
          "chunks a stream sends ahead of their replies, in [1, 1024]");
ABSL_FLAG(bool, same_machine_sockets, pstrain::worker::GrpcTransportOptions().same_machine_sockets,
          "reach servers of this machine over their Unix sockets (found and verified through "
          "Hello) instead of TCP; plaintext only");
ABSL_FLAG(int64_t, shm_pipe_bytes, pstrain::ShmOptions().pipe_bytes,
          "bytes of each shared-memory pipe (one each way per connection), a power of two in "
          "[64 KiB, 1 GiB]");
ABSL_FLAG(int, shm_connections, pstrain::worker::GrpcTransportOptions().shm_connections,
          "shared-memory connections per server, in [1, 16]: a large exchange's streams are "
          "spread over them");
ABSL_FLAG(int, report_interval_ms, 500, "interval of progress reports to the coordinator");
ABSL_FLAG(bool, colocated_server, false,
          "also run a parameter server in this process (node id NODE_ID-server), which holds "
          "this worker's shard of the jobs that ask for colocated_servers; plaintext only");
ABSL_FLAG(std::string, server_listen, "127.0.0.1:0",
          "--colocated_server: host:port its parameter service listens on");
ABSL_FLAG(std::string, server_advertise_address, "",
          "--colocated_server: host[:port] workers dial, when --server_listen is a wildcard");
ABSL_FLAG(std::string, data_root, "/usr/share/datasets",
          "a job's data.dir must lie in this directory (symbolic links resolved); empty: "
          "anywhere");
ABSL_FLAG(std::string, fault_injection, "",
          "testing only: faults to inject into the traffic to the parameter servers, e.g. "
          "drop_reply=0.05,duplicate_request=0.1,delay=0.2,max_delay_ms=20,seed=7 "
          "(worker/fault_injecting_transport.h)");

int main(int argc, char** argv) {
  constexpr absl::string_view kProgram = "pstrain-worker";
  pstrain::InitMain(argc, argv, "pstrain-worker --coordinator=host:port [flags]");
  pstrain::RunOnlyOnFlagCpus(kProgram);  // before any thread starts
  const pstrain::NodeFlags flags = pstrain::NodeFlagsFromFlags(kProgram);
  const absl::Duration metrics_job_grace = pstrain::MetricsJobGraceFromFlags(kProgram);
  pstrain::worker::WorkerNode::Options options;
  options.coordinator_address = flags.coordinator;
  options.coordinator_loss_timeout = flags.coordinator_loss_timeout;
  options.report_interval = absl::Milliseconds(absl::GetFlag(FLAGS_report_interval_ms));
  std::unique_ptr<pstrain::TransportSecurity> security =
      pstrain::TransportSecurityFromFlags(kProgram, pstrain::PeerRole::kWorker, flags.node_id);
  options.security = security.get();
  options.node_id = pstrain::CertifiedNodeId(kProgram, security.get(), flags.node_id);
  if (absl::GetFlag(FLAGS_colocated_server)) {
    if (security != nullptr) {
      std::cerr << "pstrain-worker: --colocated_server runs in plaintext only\n";
      return 2;
    }
    // The server's id is the worker's with "-server": the worker needs one.
    if (options.node_id.empty()) {
      options.node_id = absl::StrCat("worker-", absl::Hex(pstrain::RandomProcessToken()));
    }
    if (!pstrain::IsValidNodeId(options.node_id + "-server")) {
      std::cerr << "pstrain-worker: --colocated_server: the node id " << options.node_id
                << " is too long for its server's (" << options.node_id << "-server)\n";
      return 2;
    }
  }
  if (absl::GetFlag(FLAGS_blas_threads) < 0) {
    std::cerr << "pstrain-worker: --blas_threads must be >= 1, or 0\n";
    return 2;
  }
  pstrain::worker::GrpcTransportOptions transport;
  transport.channels_per_server = absl::GetFlag(FLAGS_channels_per_server);
  transport.window = absl::GetFlag(FLAGS_stream_window);
  transport.same_machine_sockets = absl::GetFlag(FLAGS_same_machine_sockets);
  transport.shared_memory = flags.shared_memory;
  transport.direct_tcp = flags.direct_tcp;
  transport.shm.pipe_bytes = absl::GetFlag(FLAGS_shm_pipe_bytes);
  transport.shm_connections = absl::GetFlag(FLAGS_shm_connections);
  if (absl::Status s = pstrain::worker::ValidateGrpcTransportOptions(transport); !s.ok()) {
    std::cerr << "pstrain-worker: --channels_per_server / --stream_window / --shm_pipe_bytes / "
                 "--shm_connections: "
              << s.message() << "\n";
    return 2;
  }
  absl::StatusOr<pstrain::worker::FaultInjection> faults =
      pstrain::worker::ParseFaultInjection(absl::GetFlag(FLAGS_fault_injection));
  if (!faults.ok()) {
    std::cerr << "pstrain-worker: --fault_injection: " << faults.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<pstrain::worker::DeviceList> devices =
      pstrain::worker::ParseDevices(absl::GetFlag(FLAGS_devices));
  if (!devices.ok()) {
    std::cerr << "pstrain-worker: --" << devices.status().message() << "\n";
    return 2;
  }
  // The CPUs are shared by the process's CPU devices (one compute thread
  // each); a GPU's host thread mostly waits.
  const bool cpu_devices = devices->kind == pstrain::worker::DeviceList::Kind::kCpu;
  const pstrain::ThreadChoice compute =
      pstrain::ThreadsFor(pstrain::ProcessCpuBudget(), flags.processes_sharing_cpus,
                          cpu_devices ? static_cast<int>(devices->indices.size()) : 1);
  const int blas_threads =
      absl::GetFlag(FLAGS_blas_threads) > 0 ? absl::GetFlag(FLAGS_blas_threads) : compute.threads;
  pstrain::kernels::SetBlasThreads(blas_threads);
  // Said with --check_flags too: what the process would run.
  LOG(INFO) << "OpenBLAS threads: " << blas_threads << " ("
            << (absl::GetFlag(FLAGS_blas_threads) > 0 ? "--blas_threads" : compute.why) << ")";
  // Before the GPUs are looked at: a manifest is checked where there are none.
  pstrain::ExitIfOnlyCheckingFlags();
  if (devices->kind == pstrain::worker::DeviceList::Kind::kCuda) {
    // Say at once, not at the first job, that the GPUs are not usable.
    absl::StatusOr<int> gpus = pstrain::kernels::CudaDeviceCount();
    if (!gpus.ok()) {
      std::cerr << "pstrain-worker: --devices=" << absl::GetFlag(FLAGS_devices)
                << ": no usable GPU: " << gpus.status().message() << "\n";
      return 2;
    }
    for (int ordinal : devices->indices) {
      if (ordinal >= *gpus) {
        std::cerr << "pstrain-worker: --devices: cuda:" << ordinal << " does not exist ("
                  << *gpus << " GPU(s))\n";
        return 2;
      }
    }
  }
  options.devices = *devices;
  LOG(INFO) << "training on " << absl::GetFlag(FLAGS_devices);
  options.max_memory_bytes = flags.max_memory_bytes;
  if (options.max_memory_bytes == -1) {
    options.max_memory_bytes =
        pstrain::AvailableMemoryBytes() / 4 * 3 / std::max<int64_t>(devices->indices.size(), 1);
  }
  pstrain::StopOnSignal signals;
  std::unique_ptr<pstrain::MetricsServer> metrics = pstrain::ServeMetricsFromFlags();
  absl::StatusOr<std::unique_ptr<pstrain::worker::WorkerMetrics>> worker_metrics =
      pstrain::worker::WorkerMetrics::Create(metrics->registry(), metrics_job_grace);
  if (!worker_metrics.ok()) {
    std::cerr << "pstrain-worker: " << worker_metrics.status() << "\n";
    return 1;
  }
  options.metrics = worker_metrics->get();
  options.rpc = &metrics->rpc();
  // The colocated server first: the worker's jobs need it.
  std::unique_ptr<pstrain::server::ServerMetrics> server_metrics;
  std::unique_ptr<pstrain::server::ParameterServer> server;
  if (absl::GetFlag(FLAGS_colocated_server)) {
    absl::StatusOr<std::unique_ptr<pstrain::server::ServerMetrics>> m =
        pstrain::server::ServerMetrics::Create(metrics->registry(), metrics_job_grace);
    if (!m.ok()) {
      std::cerr << "pstrain-worker: " << m.status() << "\n";
      return 1;
    }
    server_metrics = *std::move(m);
    pstrain::server::ParameterServer::Options s;
    s.listen_address = absl::GetFlag(FLAGS_server_listen);
    s.advertise_address = absl::GetFlag(FLAGS_server_advertise_address);
    s.coordinator_address = options.coordinator_address;
    s.coordinator_loss_timeout = options.coordinator_loss_timeout;
    s.node_id = options.node_id + "-server";
    s.colocated_with = options.node_id;
    s.insecure = pstrain::InsecureFlag();
    s.store.checkpoint_root = flags.checkpoint_root;
    // Its updates run between the worker's steps: the process's share.
    s.store.apply_threads = std::min(
        pstrain::ThreadsFor(pstrain::ProcessCpuBudget(), flags.processes_sharing_cpus).threads, 64);
    s.store.metrics = server_metrics.get();
    s.rpc = &metrics->rpc();
    // Its series are on the worker's /metrics, which Prometheus scrapes
    // once, as the worker's: no address of its own.
    absl::StatusOr<std::unique_ptr<pstrain::server::ParameterServer>> created =
        pstrain::server::ParameterServer::Create(std::move(s));
    if (!created.ok()) {
      std::cerr << "pstrain-worker: --colocated_server: " << created.status().message() << "\n";
      return created.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    }
    server = *std::move(created);
    transport.in_process = &server->in_process();
  }
  transport.metrics = options.rpc;
  transport.security = security.get();
  options.make_transport = pstrain::worker::GrpcTransportFactory(transport);
  if (faults->any()) {
    options.make_transport = [grpc = options.make_transport, faults = *faults](
                                 const std::vector<std::string>& addresses)
        -> absl::StatusOr<std::unique_ptr<pstrain::worker::ParameterTransport>> {
      PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<pstrain::worker::ParameterTransport> inner,
                               grpc(addresses));
      return pstrain::worker::FaultInjectingTransport::Create(std::move(inner), faults);
    };
  }
  options.metrics_address = metrics->address();
  options.data_root = absl::GetFlag(FLAGS_data_root);
  auto node = pstrain::worker::WorkerNode::Create(options);
  if (!node.ok()) {
    std::cerr << "pstrain-worker: " << node.status() << "\n";
    return 1;
  }
  metrics->SetReadiness([&]() -> absl::Status {
    PSTRAIN_RETURN_IF_ERROR((*node)->Readiness());
    return server != nullptr ? server->Readiness() : absl::OkStatus();
  });
  signals.OnSignal([&] { (*node)->RequestStop(); });
  (*node)->Wait();
  signals.OnSignal(nullptr);
  metrics->SetReadiness(nullptr);
  (*node)->Shutdown();
  if (server != nullptr) server->Shutdown(absl::Seconds(2));
  // Fenced: another process holds the node's id now.
  return (*node)->fenced() ? 3 : 0;
}
