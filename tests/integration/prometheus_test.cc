// A real Prometheus server scrapes a local cluster through the coordinator's
// file_sd targets file while a sync job trains; its HTTP API then shows
// every documented metric, and every expression of the shipped dashboard
// returns data.
#include <unistd.h>

#include <fstream>
#include <memory>
#include <regex>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/files.h"
#include "common/job_yaml.h"
#include "common/process.h"
#include "common/status.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "gtest/gtest.h"
#include "pstrain/client.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// A Prometheus server of the test's own, on a free port, with a temporary
// data directory; stopped by the destructor.
class PrometheusServer {
 public:
  // Scrapes the targets in `sd_file` every second.
  absl::Status Start(const std::string& dir, const std::string& sd_file) {
    const std::string config = dir + "/prometheus.yml";
    PSTRAIN_RETURN_IF_ERROR(WriteFileAtomically(
        config, absl::StrCat("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n",
                             "scrape_configs:\n  - job_name: pstrain\n    file_sd_configs:\n",
                             "      - files: ['", sd_file, "']\n        refresh_interval: 1s\n")));
    address_ = absl::StrCat("127.0.0.1:", PickFreePort());
    SpawnOptions spawn;
    spawn.argv = {"/usr/bin/prometheus",
                  "--config.file=" + config,
                  "--storage.tsdb.path=" + dir + "/data",
                  "--web.listen-address=" + address_,
                  "--storage.tsdb.retention.time=1h"};
    spawn.log_path = dir + "/prometheus.log";
    PSTRAIN_ASSIGN_OR_RETURN(pid_, Spawn(spawn));
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (!HttpGet(address_, "/-/ready").ok()) {
      if (absl::Now() > give_up || TryReap(pid_).has_value()) {
        return absl::UnavailableError("prometheus did not start; see " + spawn.log_path);
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::OkStatus();
  }

  ~PrometheusServer() {
    if (pid_ > 0) StopProcess(pid_, absl::Seconds(10));
  }

  // The "result" array of an instant or range query.
  absl::StatusOr<std::vector<Value>> Query(const std::string& expr, const std::string& range = "") {
    std::string path = range.empty() ? "/api/v1/query?query=" : "/api/v1/query_range?query=";
    path += UrlEncode(expr) + range;
    PSTRAIN_ASSIGN_OR_RETURN(std::string body, HttpGet(address_, path));
    Struct response;
    if (!google::protobuf::util::JsonStringToMessage(body, &response).ok()) {
      return absl::InternalError("unparsable response: " + body.substr(0, 200));
    }
    const auto& result = response.fields().at("data").struct_value().fields().at("result");
    return std::vector<Value>(result.list_value().values().begin(),
                              result.list_value().values().end());
  }

  // The value of a single-series instant query; NaN if there is none (so
  // wait with !(x >= n), never x < n).
  double Scalar(const std::string& expr) {
    absl::StatusOr<std::vector<Value>> result = Query(expr);
    if (!result.ok() || result->empty()) return NAN;
    return std::stod(
        (*result)[0].struct_value().fields().at("value").list_value().values(1).string_value());
  }

 private:
  static std::string UrlEncode(const std::string& s) {
    std::string out;
    for (unsigned char c : s) {
      if (isalnum(c) || c == '_' || c == '.' || c == '-' || c == '~') {
        out += static_cast<char>(c);
      } else {
        out += absl::StrFormat("%%%02X", c);
      }
    }
    return out;
  }

  std::string address_;
  pid_t pid_ = -1;
};

// (name, type) of every metric in the table of docs/metrics.md.
std::vector<std::pair<std::string, std::string>> DocumentedMetrics() {
  std::ifstream in(std::string(PSTRAIN_SOURCE_DIR) + "/docs/metrics.md");
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::pair<std::string, std::string>> metrics;
  const std::regex row(R"(^\| `((?:pstrain|process)_[a-z_]+)` \| ([a-z]+) \|)");
  std::string line;
  while (std::getline(text, line)) {
    std::smatch m;
    if (std::regex_search(line, m, row)) metrics.emplace_back(m[1], m[2]);
  }
  return metrics;
}

// Every "expr" of the shipped Grafana dashboard, with its variables filled.
std::vector<std::string> DashboardExpressions() {
  std::ifstream in(std::string(PSTRAIN_SOURCE_DIR) + "/deploy/grafana/dashboards/pstrain.json");
  std::stringstream text;
  text << in.rdbuf();
  Struct dashboard;
  EXPECT_TRUE(google::protobuf::util::JsonStringToMessage(text.str(), &dashboard).ok());
  std::vector<std::string> exprs;
  for (const Value& panel : dashboard.fields().at("panels").list_value().values()) {
    for (const Value& target : panel.struct_value().fields().at("targets").list_value().values()) {
      exprs.push_back(absl::StrReplaceAll(
          target.struct_value().fields().at("expr").string_value(), {{"$job_id", ".*"}}));
    }
  }
  return exprs;
}

class PrometheusTest : public ClusterFixture {};

TEST_F(PrometheusTest, ARealPrometheusScrapesEveryProcess) {
  const std::string sd_file = dir_.path() + "/targets.json";
  cli::LocalCluster::Options options;
  options.prometheus_sd_file = sd_file;
  options.state_dir = dir_.path() + "/state";
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, options));
  PrometheusServer prometheus;
  absl::Status started = prometheus.Start(dir_.path(), sd_file);
  PSTRAIN_ASSERT_OK(started);

  // Prometheus sees all five processes before the job starts.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!(prometheus.Scalar("count(up == 1)") >= 5)) {
    ASSERT_LT(absl::Now(), give_up) << "prometheus did not find the five targets";
    absl::SleepFor(absl::Milliseconds(200));
  }
  // A job that runs until Prometheus has scraped every worker several times
  // while it trains (its step count seen changing three times: three scrapes
  // after the first step), whatever the machine's speed; then cancelled.
  v1::JobSpec long_spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 64, 2, 100000000);
  long_spec.mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints");
  long_spec.mutable_checkpoint()->set_every_steps(20);
  const std::string id = Submit(long_spec);
  const std::string job_label = "{job_id=\"" + id + "\"}";
  constexpr int kChanges = 3;
  while (!(prometheus.Scalar("count(changes(pstrain_worker_steps_total" + job_label +
                             "[10m]) >= " + std::to_string(kChanges) + ")") >= 2)) {
    ASSERT_LT(absl::Now(), give_up + absl::Minutes(2))
        << "the workers' steps were not seen changing " << kChanges << " times";
    ASSERT_EQ(Get(id).state(), v1::JOB_STATE_RUNNING) << Get(id).reason();
    absl::SleepFor(absl::Milliseconds(200));
  }
  const v1::Job job = Get(id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
  EXPECT_EQ(Cancel(id).state(), v1::JOB_STATE_CANCELLED);

  // A short job that succeeds: the series of a job's end (accuracy, jobs
  // ended), scraped from every process after the end (targets are scraped
  // independently): the coordinator's job count, the workers' last steps.
  const std::string short_id = Submit(MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 64, 2, 200));
  const v1::Job short_job = WaitForEnd(short_id);
  ASSERT_EQ(short_job.state(), v1::JOB_STATE_SUCCEEDED) << short_job.reason();
  const std::string short_label = "{job_id=\"" + short_id + "\"}";
  while (prometheus.Scalar("sum(pstrain_jobs{state=\"succeeded\"})") != 1 ||
         prometheus.Scalar("sum(pstrain_worker_steps_total" + short_label + ")") != 400) {
    ASSERT_LT(absl::Now(), give_up + absl::Minutes(4)) << "the end was never scraped";
    absl::SleepFor(absl::Milliseconds(200));
  }

  // A click model's job: its embedding tables' series.
  absl::StatusOr<v1::JobSpec> click_spec = ParseJobSpecYaml(R"(
model: {type: click, click: {bottom: [8], top: [8]}}
tables:
  - {name: users, dim: 4, fields: [1], max_memory_bytes: 100000000}
  - {name: ads, dim: 4, fields: [2], admission: {min_count: 2, filter_counters: 256}}
data:
  clicks:
    dense: 2
    fields: 2
    generate: {seed: 4, train_rows: 6400, test_rows: 256, vocabulary: 50}
optimizer: {type: sgd, learning_rate: 0.1}
batch_size: 32
steps: 100
num_workers: 2
num_servers: 2
)");
  PSTRAIN_ASSERT_OK(click_spec);
  const std::string click_id = Submit(*click_spec);
  const v1::Job click_job = WaitForEnd(click_id);
  ASSERT_EQ(click_job.state(), v1::JOB_STATE_SUCCEEDED) << click_job.reason();
  const std::string click_label = "{job_id=\"" + click_id + "\"}";
  // Every step, both workers push rows of both tables; and each series has
  // two samples (the dashboard's rates need them).
  while (!(prometheus.Scalar("sum(pstrain_server_table_rows_pushed_total" + click_label + ")") >=
           2 * 100 * 2) ||
         !(prometheus.Scalar("min(count_over_time(pstrain_server_table_rows_pushed_total" +
                             click_label + "[1m]))") >= 2)) {
    ASSERT_LT(absl::Now(), give_up + absl::Minutes(5)) << "the tables' end was never scraped";
    absl::SleepFor(absl::Milliseconds(200));
  }
  for (const char* series :
       {"pstrain_server_table_rows", "pstrain_server_table_bytes",
        "pstrain_server_table_admitted_total", "pstrain_server_table_rows_pulled_total",
        "pstrain_server_table_dropped_gradients_total", "pstrain_server_table_hot_key_share"}) {
    EXPECT_GT(prometheus.Scalar(std::string("sum(") + series + click_label + ")"), 0) << series;
  }
  EXPECT_EQ(prometheus.Scalar("max(pstrain_server_table_max_bytes{job_id=\"" + click_id +
                              "\",table=\"users\"})"),
            100000000);
  // Every token of a vocabulary of 50 is admitted at once in "users".
  EXPECT_LE(prometheus.Scalar("sum(pstrain_server_table_rows{job_id=\"" + click_id +
                              "\",table=\"users\"})"),
            50);

  // A job of the client library's whose program reports a metric of its
  // own (pstrain_job_metric).
  ConnectOptions connect;
  connect.coordinator = cluster_->coordinator_address();
  absl::StatusOr<std::string> external =
      SubmitJob(connect,
                "optimizer: {type: sgd, learning_rate: 0.1}\nbatch_size: 4\nsteps: 2\n"
                "num_workers: 1\nnum_servers: 2\n",
                {{"w", {3}}});
  PSTRAIN_ASSERT_OK(external);
  Client::Options client_options;
  client_options.connect = connect;
  client_options.job_id = *external;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Join(client_options);
  PSTRAIN_ASSERT_OK(client);
  std::vector<float> w(3, 0.0f), g(3, 1.0f);
  PSTRAIN_ASSERT_OK((*client)->BindTensor(0, w.data(), 3));
  PSTRAIN_ASSERT_OK((*client)->Start());
  while ((*client)->step() < (*client)->total_steps()) {
    PSTRAIN_ASSERT_OK((*client)->PushGradient(0, g.data(), 3));
    PSTRAIN_ASSERT_OK((*client)->ReportMetrics({{"mse", 0.25}}));
    PSTRAIN_ASSERT_OK((*client)->EndStep(1.0, 4));
  }
  PSTRAIN_ASSERT_OK((*client)->Finish());
  while (prometheus.Scalar("pstrain_job_metric{job_id=\"" + *external + "\",name=\"mse\"}") !=
         0.25) {
    ASSERT_LT(absl::Now(), give_up + absl::Minutes(5)) << "the script's metric was never scraped";
    absl::SleepFor(absl::Milliseconds(200));
  }

  // Every documented metric has a series.
  const auto documented = DocumentedMetrics();
  ASSERT_GE(documented.size(), 30u);
  for (const auto& [name, type] : documented) {
    const std::string series = type == "histogram" ? name + "_count" : name;
    EXPECT_GT(prometheus.Scalar("count(" + series + ")"), 0) << name << " has no series";
  }
  // What a sync run must move is not zero.
  for (const char* counter :
       {"pstrain_worker_steps_total", "pstrain_worker_samples_total",
        "pstrain_worker_pushed_bytes_total", "pstrain_worker_pulled_bytes_total",
        "pstrain_server_pushes_total", "pstrain_server_received_bytes_total",
        "pstrain_server_sent_bytes_total", "pstrain_server_updates_total",
        "pstrain_server_barrier_wait_seconds_count", "pstrain_server_apply_seconds_count",
        "pstrain_worker_step_seconds_count", "pstrain_server_checkpoint_seconds_count",
        "pstrain_server_checkpoint_bytes_total", "pstrain_job_last_checkpoint_step"}) {
    EXPECT_GT(prometheus.Scalar(std::string("sum(") + counter + job_label + ")"), 0) << counter;
  }
  EXPECT_GT(prometheus.Scalar(
                "sum(pstrain_worker_step_phase_seconds_total{phase=\"compute\",job_id=\"" + id +
                "\"})"),
            0);
  // The servers are processes of the workers' machine: the data plane is
  // shared memory (no RPC), chosen by a Hello, which is one.
  EXPECT_GT(prometheus.Scalar("sum(pstrain_rpc_server_seconds_count{method=\"/pstrain.v1."
                              "Parameters/Hello\",code=\"OK\"})"),
            0);
  EXPECT_GT(prometheus.Scalar("sum(pstrain_rpc_client_seconds_count)"), 0);
  EXPECT_GT(prometheus.Scalar("sum(pstrain_jobs_submitted_total)"), 0);
  EXPECT_GT(prometheus.Scalar("sum(pstrain_jobs_ended_total{state=\"succeeded\"})"), 0);
  EXPECT_GT(prometheus.Scalar("sum(process_cpu_seconds_total)"), 0);
  // Throughput.
  EXPECT_GT(prometheus.Scalar("max(pstrain_worker_samples_per_second" + job_label + ")"), 0);
  EXPECT_GT(prometheus.Scalar("pstrain_job_test_accuracy" + short_label), 0.5);

  // Over the long job: bytes pushed grow, the smoothed loss falls.
  const std::string range = absl::StrFormat("&start=%.3f&end=%.3f&step=1",
                                            job.start_time_ms() / 1000.0 - 1,
                                            absl::ToUnixMillis(absl::Now()) / 1000.0);
  // The first and last sample of `expr` over the job, leaving out the
  // scrapes before its first step (a worker's series start at 0 when it
  // binds the job; on a loaded machine a scrape may come before the step).
  auto first_and_last = [&](const std::string& expr) {
    absl::StatusOr<std::vector<Value>> result = prometheus.Query(expr, range);
    EXPECT_TRUE(result.ok() && result->size() == 1) << expr;
    if (!result.ok() || result->empty()) return std::make_pair(double{NAN}, double{NAN});
    const auto& values = (*result)[0].struct_value().fields().at("values").list_value().values();
    std::vector<double> samples;
    for (const auto& v : values) {
      const double sample = std::stod(v.list_value().values(1).string_value());
      if (sample > 0 || !samples.empty()) samples.push_back(sample);
    }
    EXPECT_GE(samples.size(), 2) << "fewer than two scrapes after the first step: " << expr;
    if (samples.size() < 2) return std::make_pair(double{NAN}, double{NAN});
    return std::make_pair(samples.front(), samples.back());
  };
  const auto [pushed_first, pushed_last] =
      first_and_last("sum(pstrain_worker_pushed_bytes_total" + job_label + ")");
  EXPECT_LT(pushed_first, pushed_last);
  const auto [loss_first, loss_last] =
      first_and_last("avg(pstrain_worker_loss_ema" + job_label + ")");
  EXPECT_LT(loss_last, loss_first);

  // One series per node, and five nodes.
  absl::StatusOr<std::vector<Value>> per_node =
      prometheus.Query("count by (node) (process_resident_memory_bytes)");
  PSTRAIN_ASSERT_OK(per_node);
  EXPECT_EQ(per_node->size(), 5u);
  for (const Value& series : *per_node) {
    EXPECT_EQ(series.struct_value().fields().at("value").list_value().values(1).string_value(),
              "1");
  }

  // Every expression of the dashboard returns data.
  const std::vector<std::string> exprs = DashboardExpressions();
  ASSERT_GE(exprs.size(), 10u);
  for (const std::string& expr : exprs) {
    absl::StatusOr<std::vector<Value>> result = prometheus.Query(expr);
    PSTRAIN_ASSERT_OK(result) << expr;
    EXPECT_FALSE(result->empty()) << "no data: " << expr;
  }
}

}  // namespace
}  // namespace pstrain::testing
