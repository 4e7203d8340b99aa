// The click model over real gRPC servers with embedding tables: sync mode
// with tables is one big batch (2 workers x b train the dense model and
// every row as 1 x 2b does, to rounding; a rerun is bitwise the same,
// admission and eviction included), servers that own no dense chunk take
// part, click files (gzip) train as generated rows do, and async trains.
#include <cmath>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/click_generator.h"
#include "common/job_spec.h"
#include "common/file_system.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "tests/cluster_util.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"
#include "worker/click_trainer.h"

namespace pstrain::testing {
namespace {

// The job without its data, and the generated data.
constexpr char kJob[] = R"(
model: {type: click, click: {bottom: [8], top: [8]}}
tables:
  - {name: a, dim: 4, fields: [1, 3], optimizer: {type: adagrad, learning_rate: 0.1}}
  - {name: b, dim: 4, fields: [2], optimizer: {type: adam, learning_rate: 0.01},
     admission: {min_count: 3, filter_counters: 256}, eviction: {ttl_steps: 6}}
optimizer: {type: sgd, learning_rate: 0.2}
steps: 30
seed: 9
)";
constexpr char kGenerated[] = R"(
data:
  clicks:
    dense: 2
    fields: 3
    generate: {seed: 4, train_rows: 4096, test_rows: 512, vocabulary: 60, max_values: 2,
               missing: 0.1, token_weight: 0.8}
)";

v1::JobSpec Spec(int workers, int batch, int servers, const std::string& more = "",
                 const std::string& data = kGenerated) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(
      absl::StrCat(kJob, data, "num_workers: ", workers, "\nbatch_size: ", batch,
                   "\nnum_servers: ", servers, "\n", more));
  EXPECT_TRUE(spec.ok()) << spec.status();
  spec = NormalizeJobSpec(*spec);
  EXPECT_TRUE(spec.ok()) << spec.status();
  return *spec;
}

struct Trained {
  absl::Status status;
  std::vector<float> params;  // the servers' dense values
  // Every table's rows, gathered from the servers, by table and key.
  std::vector<std::map<uint64_t, std::vector<float>>> rows;
  std::map<std::string, double> metrics;  // worker 0's final report's
};

// Runs the job's workers (ClickTrainers, one thread each) against
// in-process servers over gRPC until they finish: at generation 1 from the
// start, or as `start` says (its generation and the checkpoint its servers
// restore), the workers resuming at `resume_step`.
Trained Train(const v1::JobSpec& spec, v1::ServerAssignment start = {},
              int64_t resume_step = 0) {
  Trained result;
  InProcessServers servers(spec.num_servers());
  const v1::PartitionPlan plan = PlanFor(spec);
  if (start.generation() == 0) start.set_generation(1);
  const int64_t generation = start.generation();
  result.status = servers.AddJob("job", spec, plan, start);
  if (!result.status.ok()) return result;
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int w = 0; w < spec.num_workers(); ++w) {
    threads.emplace_back([&, w] {
      worker::TrainerOptions options;
      options.assignment.set_job_id("job");
      options.assignment.set_worker_index(w);
      options.assignment.set_generation(generation);
      options.assignment.set_resume_step(resume_step);
      *options.assignment.mutable_spec() = spec;
      *options.assignment.mutable_plan() = plan;
      for (const std::string& a : servers.addresses()) options.assignment.add_server_addresses(a);
      options.client.retry = options.client.retry.WithPatience(absl::Seconds(30));
      options.report = [&, w](const v1::ReportProgressRequest& r) {
        if (w != 0 || !r.finished()) return;
        absl::MutexLock lock(&mu);
        for (const auto& [name, value] : r.metrics()) result.metrics[name] = value;
      };
      absl::StatusOr<std::unique_ptr<worker::JobTrainer>> trainer =
          worker::CreateJobTrainer(std::move(options));
      const absl::Status status = trainer.ok() ? (*trainer)->Run() : trainer.status();
      absl::MutexLock lock(&mu);
      if (!status.ok() && result.status.ok()) result.status = status;
    });
  }
  for (std::thread& t : threads) t.join();
  result.params = servers.Gather("job", plan);
  result.rows.resize(spec.tables_size());
  for (int s = 0; s < spec.num_servers(); ++s) {
    for (int t = 0; t < spec.tables_size(); ++t) {
      absl::StatusOr<std::vector<server::SparseTable::Row>> rows =
          servers.server(s).store().ReadTable("job", t);
      EXPECT_TRUE(rows.ok()) << rows.status();
      if (!rows.ok()) continue;
      for (server::SparseTable::Row& row : *rows) {
        EXPECT_FALSE(result.rows[t].contains(row.key)) << "a row on two servers";
        result.rows[t][row.key] = std::move(row.values);
      }
    }
  }
  return result;
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double worst = a.size() == b.size() ? 0 : INFINITY;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    worst = std::max(worst, std::abs(double{a[i]} - b[i]));
  }
  return worst;
}

TEST(ClickTrainingTest, SyncWorkersWithTablesTrainWhatOneProcessOfTheirBatchTrains) {
  const Trained two = Train(Spec(2, 32, 2));
  PSTRAIN_ASSERT_OK(two.status);
  const Trained one = Train(Spec(1, 64, 2));
  PSTRAIN_ASSERT_OK(one.status);
  EXPECT_LT(MaxAbsDiff(two.params, one.params), 1e-5);
  for (size_t t = 0; t < one.rows.size(); ++t) {
    ASSERT_GT(one.rows[t].size(), 10u) << "table " << t;
    ASSERT_EQ(two.rows[t].size(), one.rows[t].size()) << "table " << t;
    for (const auto& [key, values] : one.rows[t]) {
      ASSERT_TRUE(two.rows[t].contains(key)) << "table " << t << " key " << key;
      EXPECT_LT(MaxAbsDiff(two.rows[t].at(key), values), 1e-5) << "table " << t << " key " << key;
    }
  }
  ASSERT_TRUE(one.metrics.contains("test_auc"));
  EXPECT_NEAR(two.metrics.at("test_auc"), one.metrics.at("test_auc"), 1e-3);
  EXPECT_GT(one.metrics.at("oracle_auc"), 0.5);

  // The same job again: bitwise the same model, rows and evaluation.
  const Trained again = Train(Spec(2, 32, 2));
  PSTRAIN_ASSERT_OK(again.status);
  EXPECT_EQ(again.params, two.params);
  EXPECT_EQ(again.rows, two.rows);
  EXPECT_EQ(again.metrics, two.metrics);
}

// Servers that start again from the checkpoint of step 20 (rows, optimizer
// state and admission filters of every table) and workers that resume
// there end bitwise as the run that went through.
TEST(ClickTrainingTest, ARecoveryFromACheckpointWithTablesEndsBitwiseAsTheRunWithout) {
  TempDir dir;
  const v1::JobSpec spec =
      Spec(2, 32, 2, absl::StrCat("checkpoint: {dir: ", dir.path(), ", every_steps: 10}\n"));
  const Trained through = Train(spec);
  PSTRAIN_ASSERT_OK(through.status);
  v1::ServerAssignment start;
  start.set_generation(2);
  start.set_restore_step(20);
  start.set_restore_generation(1);
  const Trained recovered = Train(spec, start, /*resume_step=*/20);
  PSTRAIN_ASSERT_OK(recovered.status);
  EXPECT_EQ(recovered.params, through.params);
  EXPECT_EQ(recovered.rows, through.rows);
  EXPECT_EQ(recovered.metrics, through.metrics);
  // What the servers restored: every table's rows and admission filter.
  absl::StatusOr<server::ServerCheckpoint> saved = server::ReadCheckpoint(
      PosixFileSystem(), server::CheckpointPath(dir.path(), "job", 0, 20, 1));
  PSTRAIN_ASSERT_OK(saved);
  ASSERT_EQ(saved->tables.size(), 2u);
  EXPECT_GT(saved->tables[0].rows.size(), 5u);
  EXPECT_EQ(saved->tables[1].filter.counters.size(), 4u * 256);  // min_count 3: 256 counters
  EXPECT_EQ(saved->tables[1].version, 20);
}

// Checkpoints every 5 steps, every third full: 5 (full), 10 and 15 (the
// rows changed since the one before, the keys evicted since), 20 (full),
// 25, and 30, the last step's (full, written from the tables themselves).
// Recoveries from incremental ones (15: its chain goes down to 5) end
// bitwise as the run that went through.
TEST(ClickTrainingTest, RecoveriesFromIncrementalCheckpointsEndBitwiseAsTheRunWithout) {
  TempDir dir;
  const v1::JobSpec spec =
      Spec(2, 32, 2,
           absl::StrCat("checkpoint: {dir: ", dir.path(), ", every_steps: 5, full_every: 3, ",
                        "keep: 10}\n"));
  const Trained through = Train(spec);
  PSTRAIN_ASSERT_OK(through.status);
  for (int64_t step : {15, 25}) {
    v1::ServerAssignment start;
    start.set_generation(2);
    start.set_restore_step(step);
    start.set_restore_generation(1);
    const Trained recovered = Train(spec, start, /*resume_step=*/step);
    PSTRAIN_ASSERT_OK(recovered.status);
    EXPECT_EQ(recovered.params, through.params) << "from step " << step;
    EXPECT_EQ(recovered.rows, through.rows) << "from step " << step;
    EXPECT_EQ(recovered.metrics, through.metrics) << "from step " << step;
  }
  // The files: full ones at 5 and 20, the others over the one before,
  // holding fewer rows than the whole tables (this small vocabulary is
  // mostly touched every 5 steps); evictions (table b's ttl_steps) among
  // their deletions.
  // Each chain reads back as the full checkpoint of the same step of a run
  // whose checkpoints are all full, row for row.
  TempDir full_dir;
  PSTRAIN_ASSERT_OK(
      Train(Spec(2, 32, 2,
                 absl::StrCat("checkpoint: {dir: ", full_dir.path(),
                              ", every_steps: 5, full_every: 1, keep: 10}\n")))
          .status);
  auto same = [](const server::SparseTable::Row& a, const server::SparseTable::Row& b) {
    return a.key == b.key && a.values == b.values && a.state == b.state &&
           a.last_step == b.last_step && a.touches == b.touches && a.updates == b.updates;
  };
  int64_t changed_rows = 0, all_rows = 0, deleted = 0;
  for (uint32_t server = 0; server < 2; ++server) {
    for (int64_t step = 5; step <= 30; step += 5) {
      absl::StatusOr<server::ServerCheckpoint> expected = server::ReadCheckpoint(
          PosixFileSystem(), server::CheckpointPath(full_dir.path(), "job", server, step, 1));
      PSTRAIN_ASSERT_OK(expected);
      ASSERT_EQ(expected->base_step, 0);
      absl::StatusOr<server::ServerCheckpoint> file = server::ReadCheckpoint(
          PosixFileSystem(), server::CheckpointPath(dir.path(), "job", server, step, 1));
      PSTRAIN_ASSERT_OK(file);
      const bool full = step == 5 || step == 20 || step == 30;  // 30: the last step's
      EXPECT_EQ(file->base_step, full ? 0 : step - 5) << "server " << server << " step " << step;
      absl::StatusOr<server::ServerCheckpoint> whole =
          server::ReadCheckpointChain(PosixFileSystem(), dir.path(), "job", server, step, 1);
      PSTRAIN_ASSERT_OK(whole);
      for (size_t t = 0; t < file->tables.size(); ++t) {
        const std::vector<server::SparseTable::Row>& rows = whole->tables[t].rows;
        ASSERT_EQ(rows.size(), expected->tables[t].rows.size()) << "step " << step;
        EXPECT_TRUE(std::equal(rows.begin(), rows.end(), expected->tables[t].rows.begin(), same))
            << "server " << server << " step " << step << " table " << t;
        EXPECT_EQ(whole->tables[t].filter, expected->tables[t].filter);
        if (full) continue;
        EXPECT_LE(file->tables[t].rows.size(), whole->tables[t].rows.size());
        changed_rows += static_cast<int64_t>(file->tables[t].rows.size());
        all_rows += static_cast<int64_t>(whole->tables[t].rows.size());
        deleted += static_cast<int64_t>(file->tables[t].deleted.size());
      }
    }
  }
  EXPECT_LT(changed_rows, all_rows);
  EXPECT_GT(deleted, 0);
}

TEST(ClickTrainingTest, ServersThatOwnNoDenseChunkServeTheirRows) {
  const v1::JobSpec spec = Spec(2, 16, 12);
  const v1::PartitionPlan plan = PlanFor(spec);
  std::vector<bool> owns(12, false);
  for (const v1::ChunkInfo& c : plan.chunks()) owns[c.server()] = true;
  ASSERT_LT(std::count(owns.begin(), owns.end(), true), 12);  // the case under test
  const Trained trained = Train(spec);
  PSTRAIN_ASSERT_OK(trained.status);
  int64_t rows = 0;
  for (const auto& table : trained.rows) rows += static_cast<int64_t>(table.size());
  EXPECT_GT(rows, 20);
  EXPECT_TRUE(trained.metrics.contains("test_auc"));
}

TEST(ClickTrainingTest, ClickFilesTrainAsTheirGeneratedRowsDo) {
  TempDir dir;
  PSTRAIN_ASSERT_OK(WriteClickData(ClickDataSpecOf(Spec(1, 64, 1).data()), dir.path(),
                                    /*gzip=*/true));
  const v1::JobSpec spec = Spec(2, 32, 2, "", absl::StrCat(R"(
data:
  clicks:
    dense: 2
    fields: 3
    shuffle_window: 1000
    train_files: [)", dir.path(), "/train.txt.gz]\n    test_files: [", dir.path(),
                                                         "/test.txt.gz]\n"));
  const Trained files = Train(spec);
  PSTRAIN_ASSERT_OK(files.status);
  ASSERT_TRUE(files.metrics.contains("test_auc"));
  EXPECT_FALSE(files.metrics.contains("oracle_auc"));  // files carry no oracle
  // The same rows in another order (the files' windows): a model as good.
  const Trained generated_rows = Train(Spec(2, 32, 2));
  PSTRAIN_ASSERT_OK(generated_rows.status);
  EXPECT_NEAR(files.metrics.at("test_auc"), generated_rows.metrics.at("test_auc"), 0.05);
}

TEST(ClickTrainingTest, AsyncTrainsTheTablesToo) {
  const Trained trained = Train(Spec(2, 32, 2, "mode: async\n"));
  PSTRAIN_ASSERT_OK(trained.status);
  EXPECT_GT(trained.rows[0].size(), 10u);
  EXPECT_TRUE(trained.metrics.contains("test_auc"));
}

}  // namespace
}  // namespace pstrain::testing
