// Every metric family is registered once, under its documented name, type
// and labels; per-job series expire; a live exposition passes promtool.
#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/http_client.h"
#include "gtest/gtest.h"
#include "server/coordinator_metrics.h"
#include "server/server_metrics.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"
#include "worker/worker_metrics.h"

namespace pstrain {
namespace {

struct Expected {
  prometheus::MetricType type;
  std::set<std::string> labels;
};

// The table of docs/metrics.md, "Metrics and dashboards".
const std::map<std::string, Expected>& Documented() {
  using T = prometheus::MetricType;
  static const auto* table = new std::map<std::string, Expected>{
      {"pstrain_rpc_server_seconds", {T::Histogram, {"method", "code"}}},
      {"pstrain_rpc_client_seconds", {T::Histogram, {"method", "code"}}},
      {"pstrain_server_pushes_total", {T::Counter, {"job_id"}}},
      {"pstrain_server_received_bytes_total", {T::Counter, {"job_id"}}},
      {"pstrain_server_sent_bytes_total", {T::Counter, {"job_id"}}},
      {"pstrain_server_updates_total", {T::Counter, {"job_id"}}},
      {"pstrain_server_skipped_updates_total", {T::Counter, {"job_id"}}},
      {"pstrain_server_learning_rate", {T::Gauge, {"job_id"}}},
      {"pstrain_server_barrier_wait_seconds", {T::Histogram, {"job_id"}}},
      {"pstrain_server_apply_seconds", {T::Histogram, {"job_id"}}},
      {"pstrain_server_gradient_staleness", {T::Histogram, {"job_id"}}},
      {"pstrain_server_step_staleness", {T::Histogram, {"job_id"}}},
      {"pstrain_server_slowest_worker_wait_seconds", {T::Histogram, {"job_id"}}},
      {"pstrain_server_checkpoint_seconds", {T::Histogram, {"job_id"}}},
      {"pstrain_server_checkpoint_copy_seconds", {T::Histogram, {"job_id"}}},
      {"pstrain_server_checkpoint_bytes_total", {T::Counter, {"job_id"}}},
      {"pstrain_server_last_checkpoint_step", {T::Gauge, {"job_id"}}},
      {"pstrain_server_straggler", {T::Gauge, {"job_id", "worker"}}},
      {"pstrain_server_table_rows", {T::Gauge, {"job_id", "table"}}},
      {"pstrain_server_table_bytes", {T::Gauge, {"job_id", "table"}}},
      {"pstrain_server_table_max_bytes", {T::Gauge, {"job_id", "table"}}},
      {"pstrain_server_table_admitted_total", {T::Counter, {"job_id", "table"}}},
      {"pstrain_server_table_evicted_total", {T::Counter, {"job_id", "table"}}},
      {"pstrain_server_table_dropped_gradients_total", {T::Counter, {"job_id", "table"}}},
      {"pstrain_server_table_rows_pulled_total", {T::Counter, {"job_id", "table"}}},
      {"pstrain_server_table_rows_pushed_total", {T::Counter, {"job_id", "table"}}},
      {"pstrain_server_table_hot_key_share", {T::Gauge, {"job_id", "table"}}},
      {"pstrain_server_held_bytes", {T::Gauge, {}}},
      {"pstrain_server_jobs", {T::Gauge, {}}},
      {"pstrain_server_open_waits", {T::Gauge, {}}},
      {"pstrain_worker_steps_total", {T::Counter, {"job_id"}}},
      {"pstrain_worker_samples_total", {T::Counter, {"job_id"}}},
      {"pstrain_worker_samples_per_second", {T::Gauge, {"job_id"}}},
      {"pstrain_worker_step_seconds", {T::Histogram, {"job_id"}}},
      {"pstrain_worker_step_phase_seconds_total", {T::Counter, {"job_id", "phase"}}},
      {"pstrain_worker_pushed_bytes_total", {T::Counter, {"job_id"}}},
      {"pstrain_worker_pulled_bytes_total", {T::Counter, {"job_id"}}},
      {"pstrain_worker_retries_total", {T::Counter, {"job_id"}}},
      {"pstrain_worker_loss", {T::Gauge, {"job_id"}}},
      {"pstrain_worker_loss_ema", {T::Gauge, {"job_id"}}},
      {"pstrain_worker_loss_scale", {T::Gauge, {"job_id"}}},
      {"pstrain_worker_loss_scale_overflows_total", {T::Counter, {"job_id"}}},
      {"pstrain_jobs", {T::Gauge, {"state"}}},
      {"pstrain_jobs_ended_total", {T::Counter, {"state"}}},
      {"pstrain_jobs_submitted_total", {T::Counter, {}}},
      {"pstrain_nodes", {T::Gauge, {"role", "state"}}},
      {"pstrain_job_running", {T::Gauge, {"job_id"}}},
      {"pstrain_job_progress_steps", {T::Gauge, {"job_id"}}},
      {"pstrain_job_test_accuracy", {T::Gauge, {"job_id"}}},
      {"pstrain_job_test_loss", {T::Gauge, {"job_id"}}},
      {"pstrain_job_metric", {T::Gauge, {"job_id", "name"}}},
      {"pstrain_job_last_checkpoint_step", {T::Gauge, {"job_id"}}},
      {"pstrain_job_generation", {T::Gauge, {"job_id"}}},
      {"pstrain_job_recoveries", {T::Gauge, {"job_id"}}},
      {"pstrain_job_log_append_seconds", {T::Histogram, {}}},
  };
  return *table;
}

struct AllMetrics {
  std::unique_ptr<MetricsServer> server;
  std::unique_ptr<pstrain::server::ServerMetrics> shard;
  std::unique_ptr<pstrain::worker::WorkerMetrics> worker;
  std::unique_ptr<pstrain::server::CoordinatorMetrics> coordinator;
};

AllMetrics BuildAll(bool serve, absl::Duration grace = absl::Minutes(5)) {
  AllMetrics m;
  absl::StatusOr<std::unique_ptr<MetricsServer>> server =
      serve ? MetricsServer::Create("127.0.0.1:0") : MetricsServer::CreateUnserved();
  PSTRAIN_EXPECT_OK(server);
  m.server = std::move(*server);
  prometheus::Registry& r = m.server->registry();
  m.shard = *pstrain::server::ServerMetrics::Create(r, grace);
  m.worker = *pstrain::worker::WorkerMetrics::Create(r, grace);
  m.coordinator = *pstrain::server::CoordinatorMetrics::Create(r, grace);
  m.server->rpc().Observe(true, "/pstrain.v1.Control/GetJob", grpc::StatusCode::OK, 0.001);
  m.server->rpc().Observe(false, "/pstrain.v1.Parameters/PushPull", grpc::StatusCode::UNAVAILABLE,
                          0.01);
  return m;
}

TEST(MetricsTest, EveryFamilyOnceWithItsDocumentedNameTypeAndLabels) {
  AllMetrics m = BuildAll(/*serve=*/false);
  m.shard->BindJob("job-1");
  m.shard->BindStraggler("job-1", 0);
  m.shard->BindTable("job-1", "users");
  m.worker->BindJob("job-1");
  pstrain::server::CoordinatorMetrics::Job job = m.coordinator->BindJob("job-1");
  m.coordinator->SetScriptMetric(job, "mse", 0.5);
  std::map<std::string, int> seen;
  for (const prometheus::MetricFamily& family : m.server->registry().Collect()) {
    ++seen[family.name];
    auto it = Documented().find(family.name);
    ASSERT_NE(it, Documented().end()) << family.name << " is not documented";
    EXPECT_EQ(family.type, it->second.type) << family.name;
    EXPECT_FALSE(family.help.empty()) << family.name;
    ASSERT_FALSE(family.metric.empty()) << family.name;
    for (const prometheus::ClientMetric& metric : family.metric) {
      std::set<std::string> labels;
      for (const auto& label : metric.label) labels.insert(label.name);
      EXPECT_EQ(labels, it->second.labels) << family.name;
    }
  }
  for (const auto& [name, count] : seen) EXPECT_EQ(count, 1) << name;
  EXPECT_EQ(seen.size(), Documented().size());
}

TEST(MetricsTest, BadNamesAreAnErrorNotACrash) {
  prometheus::Registry registry;
  absl::Status s = BuildMetrics([&] {
    prometheus::BuildCounter().Name("pstrain-bad-name").Register(registry);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

TEST(MetricsTest, AJobsSeriesLeaveAfterTheGracePeriod) {
  AllMetrics m = BuildAll(/*serve=*/false, /*grace=*/absl::ZeroDuration());
  m.worker->BindJob("job-1").steps->Increment();
  m.worker->BindJob("job-2");
  auto has = [&](const std::string& job) {
    for (const auto& family : m.server->registry().Collect()) {
      for (const auto& metric : family.metric) {
        for (const auto& label : metric.label) {
          if (label.name == "job_id" && label.value == job) return true;
        }
      }
    }
    return false;
  };
  m.worker->expiring.Sweep();
  EXPECT_TRUE(has("job-1"));  // still running
  m.worker->expiring.JobEnded("job-1");
  m.worker->expiring.Sweep();
  EXPECT_FALSE(has("job-1"));
  EXPECT_TRUE(has("job-2"));
}

// A job bound again before its old series expired (a server that releases
// and takes back a job, a worker that runs it again) keeps its series.
TEST(MetricsTest, BindingAgainWithinTheGracePeriodKeepsTheSeries) {
  AllMetrics m = BuildAll(/*serve=*/false, /*grace=*/absl::ZeroDuration());
  m.worker->BindJob("job-1");
  m.worker->expiring.JobEnded("job-1");
  pstrain::worker::WorkerMetrics::Job again = m.worker->BindJob("job-1");
  m.worker->expiring.Sweep();
  again.steps->Increment();  // still registered: no use after free
  bool found = false;
  for (const auto& family : m.server->registry().Collect()) {
    if (family.name == "pstrain_worker_steps_total") found = !family.metric.empty();
  }
  EXPECT_TRUE(found);
  m.worker->expiring.JobEnded("job-1");
  m.worker->expiring.Sweep();
  for (const auto& family : m.server->registry().Collect()) {
    if (family.name == "pstrain_worker_steps_total") {
      EXPECT_TRUE(family.metric.empty());
    }
  }
}

// A script's metrics, bound as it names them, leave with the job's other
// series; setting one again changes its value, not the series.
TEST(MetricsTest, AScriptsMetricsLeaveWithTheJob) {
  AllMetrics m = BuildAll(/*serve=*/false, /*grace=*/absl::ZeroDuration());
  pstrain::server::CoordinatorMetrics::Job job = m.coordinator->BindJob("job-1");
  m.coordinator->SetScriptMetric(job, "mse", 0.5);
  m.coordinator->SetScriptMetric(job, "auc", 0.75);
  m.coordinator->SetScriptMetric(job, "mse", 0.25);
  auto values = [&] {
    std::map<std::string, double> by_name;
    for (const auto& family : m.server->registry().Collect()) {
      if (family.name != "pstrain_job_metric") continue;
      for (const auto& metric : family.metric) {
        for (const auto& label : metric.label) {
          if (label.name == "name") by_name[label.value] = metric.gauge.value;
        }
      }
    }
    return by_name;
  };
  EXPECT_EQ(values(), (std::map<std::string, double>{{"auc", 0.75}, {"mse", 0.25}}));
  m.coordinator->expiring.JobEnded("job-1");
  m.coordinator->expiring.Sweep();
  EXPECT_TRUE(values().empty());
}

TEST(MetricsTest, MethodsThatAreNotPstrainsAreLabelledUnknown) {
  AllMetrics m = BuildAll(/*serve=*/false);
  m.server->rpc().Observe(true, "/evil/\xff\xfe", grpc::StatusCode::UNIMPLEMENTED, 0.001);
  m.server->rpc().Observe(true, "/another/one", grpc::StatusCode::UNIMPLEMENTED, 0.001);
  std::set<std::string> methods;
  for (const auto& family : m.server->registry().Collect()) {
    if (family.name != "pstrain_rpc_server_seconds") continue;
    for (const auto& metric : family.metric) {
      for (const auto& label : metric.label) {
        if (label.name == "method") methods.insert(label.value);
      }
    }
  }
  EXPECT_EQ(methods, (std::set<std::string>{"/pstrain.v1.Control/GetJob", "unknown"}));
}

TEST(MetricsTest, ASilentClientDoesNotBlockScrapes) {
  AllMetrics m = BuildAll(/*serve=*/true);
  // Connect and send nothing.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(
      std::stoi(m.server->address().substr(m.server->address().rfind(':') + 1))));
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  // A scrape still gets through (after the silent one's 2 s deadline).
  PSTRAIN_EXPECT_OK(testing::HttpGet(m.server->address(), "/metrics"));
  close(fd);
}

TEST(MetricsTest, ALiveExpositionPassesPromtool) {
  AllMetrics m = BuildAll(/*serve=*/true);
  pstrain::server::ServerMetrics::Job shard = m.shard->BindJob("job-1");
  shard.barrier_wait->Observe(0.002);
  shard.staleness->Observe(3);
  pstrain::worker::WorkerMetrics::Job worker = m.worker->BindJob("job-1");
  worker.loss_ema->Set(0.5);
  worker.phase_seconds[0]->Increment(1.5);
  m.coordinator->BindJob("job-1");
  absl::StatusOr<std::string> text = testing::HttpGet(m.server->address(), "/metrics");
  PSTRAIN_ASSERT_OK(text);
  EXPECT_TRUE(absl::StrContains(*text, "process_resident_memory_bytes"));
  EXPECT_TRUE(absl::StrContains(*text, "pstrain_worker_loss_ema{job_id=\"job-1\"} 0.5"));
  EXPECT_FALSE(testing::HttpGet(m.server->address(), "/other").ok());

  testing::TempDir dir;
  const std::string file = dir.Write("metrics.txt", *text);
  testing::ProcessResult check =
      testing::RunProcess({"/bin/sh", "-c", "promtool check metrics < " + file});
  EXPECT_EQ(check.exit_code(), 0) << "promtool (Debian package prometheus) says:\n"
                                  << check.out << check.err;
}

}  // namespace
}  // namespace pstrain

namespace pstrain {
namespace {

// The probes' endpoints: /healthz while the process lives, /readyz from the
// moment the process says it is ready, with its reason before.
TEST(MetricsTest, HealthAndReadinessEndpoints) {
  absl::StatusOr<std::unique_ptr<MetricsServer>> server = MetricsServer::Create("127.0.0.1:0");
  PSTRAIN_ASSERT_OK(server);
  const std::string address = (*server)->address();
  auto get = [&](const std::string& path) {
    absl::StatusOr<HttpResponse> r = HttpGet(address, path, absl::Seconds(10));
    PSTRAIN_EXPECT_OK(r);
    return r.ok() ? *r : HttpResponse{};
  };
  EXPECT_EQ(get("/healthz").status, 200);
  EXPECT_EQ(get("/healthz").body, "ok\n");
  HttpResponse starting = get("/readyz");
  EXPECT_EQ(starting.status, 503);
  EXPECT_EQ(starting.body, "starting\n");

  absl::Status readiness = absl::UnavailableError("not registered with the coordinator yet");
  (*server)->SetReadiness([&] { return readiness; });
  EXPECT_EQ(get("/readyz").status, 503);
  EXPECT_EQ(get("/readyz").body, "not registered with the coordinator yet\n");
  readiness = absl::OkStatus();
  EXPECT_EQ(get("/readyz").status, 200);
  EXPECT_EQ(get("/readyz").body, "ready\n");
  EXPECT_EQ(get("/readyz?verbose=1").status, 200);
  (*server)->SetReadiness(nullptr);
  EXPECT_EQ(get("/readyz").status, 503);
  EXPECT_EQ(get("/nothing").status, 404);
}

TEST(HttpClientTest, ClearErrorsForBadAddressesAndSilence) {
  EXPECT_EQ(HttpGet("no-port", "/", absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(HttpGet(absl::StrCat("127.0.0.1:", testing::PickFreePort()), "/", absl::Seconds(5))
                .status()
                .code(),
            absl::StatusCode::kUnavailable);
  // A listener that never answers: the deadline ends the wait.
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  absl::StatusOr<HttpResponse> silent =
      HttpGet(absl::StrCat("127.0.0.1:", ntohs(addr.sin_port)), "/", absl::Milliseconds(300));
  EXPECT_EQ(silent.status().code(), absl::StatusCode::kUnavailable) << silent.status();
  close(fd);
}

}  // namespace
}  // namespace pstrain
