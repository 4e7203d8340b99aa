// pstrain-coordinator: the control plane.
#include <iostream>

#include "absl/flags/flag.h"
#include "common/daemon_flags.h"
#include "common/init.h"
#include "common/metrics.h"
#include "common/process.h"
#include "common/rpc.h"
#include "common/tls_flags.h"
#include "glog/logging.h"
#include "server/coordinator.h"

ABSL_FLAG(std::string, state_dir, "",
          "directory for the durable job log and model files; empty: keep nothing");
ABSL_FLAG(std::string, default_checkpoint_dir, "",
          "checkpoint directory of jobs whose file names none (checkpoint.dir): a path every "
          "server sees, e.g. a shared volume; empty: such jobs are not checkpointed");
ABSL_FLAG(std::string, prometheus_sd_file, "",
          "if set, keep a Prometheus file_sd targets file of every process's /metrics here");
ABSL_FLAG(int, lease_s, 10, "seconds without a heartbeat after which a node is lost");
ABSL_FLAG(int, heartbeat_interval_ms, 500, "heartbeat interval suggested to nodes");
ABSL_FLAG(int, max_request_bytes, pstrain::server::Coordinator::Options::Limits().request_bytes,
          "bytes of one request message; larger ones are refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int64_t, max_heartbeat_reply_bytes,
          pstrain::server::Coordinator::Options::Limits().heartbeat_reply_bytes,
          "bytes of new jobs' specs and plans in one heartbeat reply (the rest follow in the "
          "next heartbeats)");
ABSL_FLAG(int, max_queued_jobs, pstrain::server::Coordinator::Options::Limits().queued_jobs,
          "jobs waiting to start; a submission beyond is refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int, max_finished_jobs, pstrain::server::Coordinator::Options::Limits().finished_jobs,
          "finished jobs remembered, with their model files; beyond, the oldest are forgotten");
ABSL_FLAG(int, max_registrations_per_minute,
          pstrain::server::Coordinator::Options::Limits().registrations_per_minute,
          "node registrations taken in any minute; beyond, refused (RESOURCE_EXHAUSTED)");
ABSL_FLAG(int, max_lost_nodes, pstrain::server::Coordinator::Options::Limits().lost_nodes,
          "lost nodes listed; beyond, the longest lost are forgotten");
ABSL_FLAG(int, upload_timeout_s,
          absl::ToInt64Seconds(pstrain::server::Coordinator::Options::Limits().upload_timeout),
          "seconds a model upload may stay open; then it is cancelled (worker 0 uploads again)");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "users of the control API, one per line: ROLE NAME SHA256 (ROLE viewer or operator, "
          "SHA256 the token's in hex); then every control call needs a bearer token. Default: "
          "no tokens (see docs/security.md)");

int main(int argc, char** argv) {
  constexpr absl::string_view kProgram = "pstrain-coordinator";
  pstrain::InitMain(argc, argv, "pstrain-coordinator [--listen=host:port] [flags]");
  pstrain::ServiceFlags service = pstrain::ServiceFlagsFromFlags(kProgram, "127.0.0.1:50050");
  const absl::Duration metrics_job_grace = pstrain::MetricsJobGraceFromFlags(kProgram);
  pstrain::server::Coordinator::Options options;
  options.listen_address = service.listen;
  options.advertise_address = service.advertise_address;
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.default_checkpoint_dir = absl::GetFlag(FLAGS_default_checkpoint_dir);
  if (!options.default_checkpoint_dir.empty() && options.default_checkpoint_dir[0] != '/') {
    std::cerr << "pstrain-coordinator: --default_checkpoint_dir must be an absolute path\n";
    return 2;
  }
  options.lease = absl::Seconds(absl::GetFlag(FLAGS_lease_s));
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  if (options.lease <= absl::ZeroDuration() || options.heartbeat_interval <= absl::ZeroDuration()) {
    std::cerr << "--lease_s and --heartbeat_interval_ms must be positive\n";
    return 2;
  }
  pstrain::server::Coordinator::Options::Limits& limits = options.limits;
  limits.request_bytes = absl::GetFlag(FLAGS_max_request_bytes);
  limits.heartbeat_reply_bytes = absl::GetFlag(FLAGS_max_heartbeat_reply_bytes);
  limits.queued_jobs = absl::GetFlag(FLAGS_max_queued_jobs);
  limits.finished_jobs = absl::GetFlag(FLAGS_max_finished_jobs);
  limits.registrations_per_minute = absl::GetFlag(FLAGS_max_registrations_per_minute);
  limits.lost_nodes = absl::GetFlag(FLAGS_max_lost_nodes);
  limits.upload_timeout = absl::Seconds(absl::GetFlag(FLAGS_upload_timeout_s));
  if (limits.request_bytes < (2 << 20) || limits.request_bytes > pstrain::kMaxMessageBytes) {
    std::cerr << "--max_request_bytes must be in [2 MiB, " << pstrain::kMaxMessageBytes
              << "]: job files of 1 MiB and model pieces of 1 MiB must fit\n";
    return 2;
  }
  if (limits.heartbeat_reply_bytes < 1 || limits.queued_jobs < 1 || limits.finished_jobs < 1 ||
      limits.registrations_per_minute < 1 || limits.lost_nodes < 0 ||
      limits.upload_timeout <= absl::ZeroDuration()) {
    std::cerr << "--max_heartbeat_reply_bytes, --max_queued_jobs, --max_finished_jobs, "
                 "--max_registrations_per_minute and --upload_timeout_s must be positive, "
                 "--max_lost_nodes at least 0\n";
    return 2;
  }
  if (service.faulty_fs != nullptr) options.fs = service.faulty_fs.get();
  std::unique_ptr<pstrain::TransportSecurity> security =
      pstrain::TransportSecurityFromFlags(kProgram, pstrain::PeerRole::kCoordinator);
  options.security = security.get();
  options.insecure = pstrain::InsecureFlag();
  pstrain::ExitIfOnlyCheckingFlags();
  if (const std::string path = absl::GetFlag(FLAGS_auth_tokens_file); !path.empty()) {
    absl::StatusOr<pstrain::server::AuthTokens> tokens = pstrain::server::AuthTokens::Load(path);
    if (!tokens.ok()) {
      std::cerr << "pstrain-coordinator: " << tokens.status().message() << "\n";
      return 2;
    }
    options.auth_tokens = std::move(*tokens);
  }
  pstrain::StopOnSignal signals;
  std::unique_ptr<pstrain::MetricsServer> metrics = pstrain::ServeMetricsFromFlags();
  absl::StatusOr<std::unique_ptr<pstrain::server::CoordinatorMetrics>> coordinator_metrics =
      pstrain::server::CoordinatorMetrics::Create(metrics->registry(), metrics_job_grace);
  if (!coordinator_metrics.ok()) {
    std::cerr << "pstrain-coordinator: " << coordinator_metrics.status() << "\n";
    return 1;
  }
  options.metrics = coordinator_metrics->get();
  options.rpc = &metrics->rpc();
  options.metrics_address = metrics->address();
  options.prometheus_sd_file = absl::GetFlag(FLAGS_prometheus_sd_file);
  auto coordinator = pstrain::server::Coordinator::Create(options);
  if (!coordinator.ok()) {
    std::cerr << "pstrain-coordinator: " << coordinator.status().message() << "\n";
    return coordinator.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  LOG(INFO) << "coordinator listening on " << (*coordinator)->address();
  pstrain::PublishAddress(service.address_file, (*coordinator)->address());
  // Ready once its state is read back and it serves.
  metrics->SetReadiness([] { return absl::OkStatus(); });
  signals.Wait();
  LOG(INFO) << "shutting down";
  metrics->SetReadiness([] { return absl::UnavailableError("shutting down"); });
  (*coordinator)->Shutdown(absl::Seconds(2));
  return 0;
}
