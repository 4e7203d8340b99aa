#include "common/job_spec.h"

#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

constexpr char kValid[] = R"(
name: t
model: {type: mlp, hidden: [256, 128]}
optimizer: {type: adam, learning_rate: 0.001}
mode: sync
batch_size: 64
epochs: 3
num_servers: 2
num_workers: 2
chunk_bytes: 65536
seed: 7
)";

TEST(JobSpecTest, ParsesEveryKindOfField) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(kValid);
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(spec->model().type(), v1::MODEL_TYPE_MLP);
  ASSERT_EQ(spec->model().hidden_size(), 2);
  EXPECT_EQ(spec->model().hidden(1), 128);
  EXPECT_EQ(spec->optimizer().type(), v1::OPTIMIZER_TYPE_ADAM);
  EXPECT_FLOAT_EQ(spec->optimizer().learning_rate(), 0.001f);
  EXPECT_EQ(spec->mode(), v1::MODE_SYNC);
  EXPECT_EQ(spec->chunk_bytes(), 65536);
  EXPECT_EQ(spec->seed(), 7u);
}

TEST(JobSpecTest, NormalizeFillsDefaults) {
  absl::StatusOr<v1::JobSpec> spec = NormalizeJobSpec(*ParseJobSpecYaml(R"(
model: {type: softmax}
optimizer: {type: adam, learning_rate: 0.01}
batch_size: 10
steps: 5
num_servers: 1
num_workers: 1
)"));
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(spec->mode(), v1::MODE_SYNC);
  EXPECT_EQ(spec->data().dir(), kDefaultDataDir);
  EXPECT_EQ(spec->chunk_bytes(), kDefaultChunkBytes);
  EXPECT_FLOAT_EQ(spec->optimizer().beta1(), 0.9f);
  EXPECT_FLOAT_EQ(spec->optimizer().beta2(), 0.999f);
  EXPECT_EQ(TotalSteps(*spec), 5);
}

TEST(JobSpecTest, ExampleJobIsValid) {
  absl::StatusOr<v1::JobSpec> spec =
      LoadJobSpecFile(std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion_mlp.yaml");
  PSTRAIN_ASSERT_OK(spec);
  spec = NormalizeJobSpec(*spec);
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(kernels::NumParams(ModelShapeOf(*spec)), 235146);
  EXPECT_EQ(StepsPerEpoch(*spec), 468);
}

TEST(JobSpecTest, EveryExampleIsValid) {
  for (const char* name : {"fashion_mlp_colocated", "fashion_mlp", "fashion_mlp_async",
                           "fashion_mlp_ssp", "fashion_mlp_bf16", "fashion_mlp_gpu",
                           "fashion_cnn", "ctr_small", "ctr_large"}) {
    absl::StatusOr<v1::JobSpec> spec = LoadJobSpecFile(
        absl::StrCat(PSTRAIN_SOURCE_DIR, "/examples/", name, ".yaml"));
    PSTRAIN_ASSERT_OK(spec) << name;
    PSTRAIN_EXPECT_OK(NormalizeJobSpec(*spec)) << name;
  }
}

// What only the proto path (SubmitJob with a JobSpec message) can carry:
// enum numbers no name stands for and non-finite floats. Each is refused
// naming the field, as the YAML path refuses what it cannot parse.
TEST(JobSpecTest, TheProtoPathIsValidatedLikeTheYamlPath) {
  absl::StatusOr<v1::JobSpec> valid = ParseJobSpecYaml(kValid);
  PSTRAIN_ASSERT_OK(valid);
  PSTRAIN_ASSERT_OK(NormalizeJobSpec(*valid));
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<std::function<void(v1::JobSpec&)>, std::string>> cases = {
      {[](v1::JobSpec& s) { s.set_mode(static_cast<v1::Mode>(77)); }, "mode: unknown value 77"},
      {[](v1::JobSpec& s) {
         s.mutable_optimizer()->set_type(static_cast<v1::OptimizerType>(99));
       },
       "optimizer.type: unknown value 99"},
      {[](v1::JobSpec& s) { s.set_precision(static_cast<v1::Precision>(42)); },
       "precision: unknown value 42"},
      {[](v1::JobSpec& s) {
         s.mutable_recovery()->set_on_worker_loss(static_cast<v1::WorkerLossPolicy>(9));
       },
       "recovery.on_worker_loss: unknown value 9"},
      {[&](v1::JobSpec& s) { s.mutable_optimizer()->set_weight_decay(inf); },
       "optimizer.weight_decay: must be finite and >= 0"},
      {[&](v1::JobSpec& s) {
         s.mutable_optimizer()->set_weight_decay(std::numeric_limits<float>::quiet_NaN());
       },
       "optimizer.weight_decay: must be finite and >= 0"},
      {[&](v1::JobSpec& s) {
         s.mutable_optimizer()->set_type(v1::OPTIMIZER_TYPE_ADAM);
         s.mutable_optimizer()->set_epsilon(inf);
       },
       "optimizer.epsilon: must be finite and > 0"},
  };
  for (const auto& [change, message] : cases) {
    v1::JobSpec spec = *valid;
    change(spec);
    absl::StatusOr<v1::JobSpec> normalized = NormalizeJobSpec(spec);
    EXPECT_EQ(normalized.status().code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_EQ(normalized.status().message(), message);
  }
}

struct BadSpec {
  const char* what;
  std::string yaml;
  const char* field;  // the error message starts with it
};

void PrintTo(const BadSpec& b, std::ostream* out) { *out << b.what; }

class BadSpecTest : public ::testing::TestWithParam<BadSpec> {};

std::string With(const std::string& line_to_replace, const std::string& replacement) {
  std::string yaml = kValid;
  const size_t at = yaml.find(line_to_replace);
  yaml.replace(at, line_to_replace.size(), replacement);
  return yaml;
}

// The valid spec with optimizer.schedule set to `fields`.
std::string WithSchedule(const std::string& fields) {
  return With("learning_rate: 0.001}", "learning_rate: 0.001, schedule: {" + fields + "}}");
}

// The valid spec at precision fp16 with loss_scale {fields}.
std::string Fp16WithLossScale(const std::string& fields) {
  return std::string(kValid) + "precision: fp16\nloss_scale: {" + fields + "}\n";
}

// The valid spec with an external model of `tensors` (YAML list) instead.
std::string External(const std::string& tensors, const std::string& more = "") {
  return With("model: {type: mlp, hidden: [256, 128]}",
              "model: {type: external, tensors: " + tensors + "}\ndata: {train_samples: 1000}") +
         more;
}

TEST(JobSpecTest, ColocatedServersAreOnePerWorker) {
  absl::StatusOr<v1::JobSpec> parsed =
      ParseJobSpecYaml(With("num_servers: 2", "colocated_servers: true"));
  PSTRAIN_ASSERT_OK(parsed);
  absl::StatusOr<v1::JobSpec> spec = NormalizeJobSpec(*parsed);
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_TRUE(spec->colocated_servers());
  EXPECT_EQ(spec->num_servers(), 2);
}

TEST(JobSpecTest, AnExternalModelIsItsTensors) {
  absl::StatusOr<v1::JobSpec> spec =
      ParseJobSpecYaml(External("[{name: w, shape: [3, 4]}, {name: b, shape: [4]}, {name: s}]"));
  PSTRAIN_ASSERT_OK(spec);
  spec = NormalizeJobSpec(*spec);
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_TRUE(spec->data().dir().empty());  // no data of pstrain's
  const std::vector<kernels::TensorDesc> tensors = JobTensors(*spec);
  ASSERT_EQ(tensors.size(), 3u);
  EXPECT_EQ(tensors[1].name, "b");
  EXPECT_EQ(tensors[1].offset, 12);
  EXPECT_EQ(tensors[2].size, 1);  // a scalar
  EXPECT_EQ(NumParamsOf(*spec), 17);
  EXPECT_EQ(WorkerBytesNeeded(*spec), 0);
  // 1000 samples over a global batch of 128, 3 epochs.
  EXPECT_EQ(StepsPerEpoch(*spec), 7);
  EXPECT_EQ(TotalSteps(*spec), 21);
  // A buffer takes its bytes' floats: 3 int64s are 6 floats, 3 bools 1.
  spec = NormalizeJobSpec(*ParseJobSpecYaml(
      External("[{name: w}, {name: n, shape: [3], buffer: true, dtype: int64},\n"
               "  {name: f, shape: [3], buffer: true, dtype: bool}]")));
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(NumParamsOf(*spec), 1 + 6 + 1);
  EXPECT_TRUE(JobTensors(*spec)[1].buffer);
  // The script computes in its precision; fp16 keeps a loss scale.
  spec = NormalizeJobSpec(*ParseJobSpecYaml(External("[{name: w}]", "precision: fp16\n")));
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(spec->loss_scale().initial(), 65536);
  // The script accumulates micro-batches itself: 2 x 128 a step.
  spec = NormalizeJobSpec(*ParseJobSpecYaml(External("[{name: w}]", "accumulate_steps: 2\n")));
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(StepsPerEpoch(*spec), 3);
}

TEST(JobSpecTest, EmbeddingTablesGetTheirDefaultsAndBadFieldsAreNamed) {
  absl::StatusOr<v1::JobSpec> spec = NormalizeJobSpec(*ParseJobSpecYaml(
      External("[{name: w}]",
               "tables:\n"
               "  - {name: users, dim: 16}\n"
               "  - {name: ads.v2, dim: 8, optimizer: {type: ftrl, l1: 0.1},\n"
               "     admission: {min_count: 3}, eviction: {ttl_steps: 100, policy: lfu},\n"
               "     initializer: {type: normal, scale: 0.05}, max_memory_bytes: 1000000}\n")));
  PSTRAIN_ASSERT_OK(spec);
  ASSERT_EQ(spec->tables_size(), 2);
  const v1::EmbeddingTableSpec& users = spec->tables(0);
  EXPECT_EQ(users.optimizer().type(), v1::TABLE_OPTIMIZER_TYPE_ADAGRAD);
  EXPECT_FLOAT_EQ(users.optimizer().learning_rate(), 0.01f);
  EXPECT_FLOAT_EQ(users.optimizer().initial_accumulator(), 0.1f);
  EXPECT_FLOAT_EQ(users.optimizer().epsilon(), 1e-8f);
  EXPECT_EQ(users.initializer().type(), v1::TABLE_INITIALIZER_TYPE_UNIFORM);
  EXPECT_FLOAT_EQ(users.initializer().scale(), 0.01f);
  EXPECT_EQ(users.admission().min_count(), 1);
  EXPECT_EQ(users.admission().probability(), 1.0);
  EXPECT_EQ(users.admission().filter_counters(), 0);  // no filter needed
  EXPECT_EQ(users.eviction().policy(), v1::TABLE_EVICTION_POLICY_LRU);
  const v1::EmbeddingTableSpec& ads = spec->tables(1);
  EXPECT_FLOAT_EQ(ads.optimizer().beta(), 1.0f);
  EXPECT_EQ(ads.admission().filter_counters(), 1 << 20);
  EXPECT_EQ(ads.admission().max_false_admission(), 0.01);
  EXPECT_FALSE(users.admission().has_max_false_admission());
  EXPECT_EQ(users.value_dtype(), v1::DTYPE_FP32);
  EXPECT_EQ(ads.eviction().policy(), v1::TABLE_EVICTION_POLICY_LFU);

  const std::vector<std::pair<std::string, std::string>> bad = {
      {"- {name: '', dim: 4}", "tables[0].name"},
      {"- {name: 'a b', dim: 4}", "tables[0].name"},
      {"- {name: a, dim: 0}", "tables[0].dim"},
      {"- {name: a, dim: 4}\n  - {name: a, dim: 4}", "tables[1].name: \"a\" twice"},
      {"- {name: a, dim: 4, optimizer: {type: sgd, beta1: 0.5}}", "tables[0].optimizer.beta1"},
      {"- {name: a, dim: 4, optimizer: {type: adam, l1: 0.5}}", "tables[0].optimizer.l1"},
      {"- {name: a, dim: 4, optimizer: {learning_rate: -1}}", "tables[0].optimizer.learning_rate"},
      {"- {name: a, dim: 4, value_dtype: fp16}", "tables[0].value_dtype"},
      {"- {name: a, dim: 4, optimizer: {type: rowwise_adagrad, beta1: 0.5}}",
       "tables[0].optimizer.beta1"},
      {"- {name: a, dim: 4, admission: {probability: 0}}", "tables[0].admission.probability"},
      {"- {name: a, dim: 4, admission: {min_count: 70000}}", "tables[0].admission.min_count"},
      {"- {name: a, dim: 4, admission: {filter_counters: 8}}",
       "tables[0].admission.filter_counters"},
      {"- {name: a, dim: 4, admission: {min_count: 2, filter_counters: 1}}",
       "tables[0].admission.filter_counters"},
      {"- {name: a, dim: 4, admission: {max_false_admission: 0.1}}",
       "tables[0].admission.max_false_admission"},
      {"- {name: a, dim: 4, admission: {min_count: 2, max_false_admission: 0.6}}",
       "tables[0].admission.max_false_admission"},
      {"- {name: a, dim: 4, eviction: {ttl_steps: -1}}", "tables[0].eviction.ttl_steps"},
      {"- {name: a, dim: 4, initializer: {type: zeros, scale: 1}}",
       "tables[0].initializer.scale"},
      {"- {name: a, dim: 4, max_memory_bytes: -1}", "tables[0].max_memory_bytes"},
      {"- {name: a, dim: 4, initial_rows: -1}", "tables[0].initial_rows"},
      {"- {name: a, dim: 4, initial_rows: 300000000}", "tables[0].initial_rows"},
      {"- {name: a, dim: 4, initial_rows: 10, eviction: {ttl_steps: 5}}",
       "tables[0].initial_rows: a table that starts from given rows keeps them"},
      {"- {name: a, dim: 4, initial_rows: 10, max_memory_bytes: 100000}",
       "tables[0].initial_rows"},
  };
  for (const auto& [table, field] : bad) {
    absl::StatusOr<v1::JobSpec> s =
        NormalizeJobSpec(*ParseJobSpecYaml(External("[{name: w}]", "tables:\n  " + table + "\n")));
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << table;
    EXPECT_TRUE(absl::StartsWith(s.status().message(), field)) << s.status() << " for " << table;
  }
  // Row-wise Adagrad takes Adagrad's fields and defaults.
  absl::StatusOr<v1::JobSpec> rowwise = NormalizeJobSpec(*ParseJobSpecYaml(External(
      "[{name: w}]", "tables:\n  - {name: a, dim: 4, optimizer: {type: rowwise_adagrad}}\n")));
  PSTRAIN_ASSERT_OK(rowwise);
  EXPECT_EQ(rowwise->tables(0).optimizer().type(), v1::TABLE_OPTIMIZER_TYPE_ROWWISE_ADAGRAD);
  EXPECT_FLOAT_EQ(rowwise->tables(0).optimizer().initial_accumulator(), 0.1f);
  EXPECT_FLOAT_EQ(rowwise->tables(0).optimizer().epsilon(), 1e-8f);
  // Built-in models read no tables.
  absl::StatusOr<v1::JobSpec> mlp = NormalizeJobSpec(
      *ParseJobSpecYaml(std::string(kValid) + "tables: [{name: a, dim: 4}]\n"));
  EXPECT_TRUE(absl::StartsWith(mlp.status().message(), "tables:")) << mlp.status();
}

TEST(JobSpecTest, AClickModelReadsEveryFieldFromOneTable) {
  const std::string job = R"(
model: {type: click}
data: {clicks: {dense: 2, fields: 3, generate: {train_rows: 1000, test_rows: 100}}}
tables:
  - {name: a, dim: 4, fields: [1, 3]}
  - {name: b, dim: 4, fields: [2]}
optimizer: {type: sgd, learning_rate: 0.1}
batch_size: 10
epochs: 2
num_servers: 1
num_workers: 2
)";
  absl::StatusOr<v1::JobSpec> spec = NormalizeJobSpec(*ParseJobSpecYaml(job));
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(spec->data().dataset(), v1::DATASET_CLICKS);
  EXPECT_EQ(spec->model().click().bottom(0), 64);
  EXPECT_EQ(spec->model().click().interaction(), v1::INTERACTION_DOT);
  EXPECT_EQ(spec->model().click().pooling(), v1::POOLING_SUM);
  EXPECT_EQ(spec->data().clicks().generate().vocabulary(), 1000000);
  EXPECT_EQ(StepsPerEpoch(*spec), 50);  // 1000 rows, global batch 20
  EXPECT_EQ(TotalSteps(*spec), 100);
  EXPECT_EQ(NumParamsOf(*spec), kernels::ClickModelParams(ClickModelShapeOf(*spec)));
  EXPECT_EQ(ClickModelShapeOf(*spec).dim, 4);
  EXPECT_GT(WorkerBytesNeeded(*spec), 0);

  auto with = [&](const std::string& from, const std::string& to) {
    std::string yaml = job;
    yaml.replace(yaml.find(from), from.size(), to);
    absl::StatusOr<v1::JobSpec> parsed = ParseJobSpecYaml(yaml);
    return parsed.ok() ? NormalizeJobSpec(*parsed).status() : parsed.status();
  };
  const std::vector<std::tuple<std::string, std::string, std::string>> bad = {
      {"fields: [1, 3]", "fields: [1]", "tables: no table reads field 3"},
      {"fields: [2]", "fields: [2, 1]", "tables[1].fields[1]: field 1 is read from tables[0]"},
      {"fields: [2]", "fields: [4]", "tables[1].fields[0]: 4 is not a field"},
      {"{name: b, dim: 4,", "{name: b, dim: 8,", "tables[1].dim"},
      {"- {name: b, dim: 4, fields: [2]}", "", "tables: no table reads field 2"},
      {"generate: {train_rows: 1000, test_rows: 100}", "train_files: [data.txt]",
       "data.clicks.train_files"},
      {"generate: {train_rows: 1000, test_rows: 100}", "train_files: [/d.txt]",
       "data.clicks.test_files: required"},
      {"generate: {train_rows: 1000, test_rows: 100}",
       "train_files: [/d.txt], test_files: [/t.txt]", "epochs: click data from files"},
      {"generate: {train_rows: 1000, test_rows: 100}", "generate: {train_rows: 0, test_rows: 1}",
       "data.clicks.generate: train_rows"},
      {"test_rows: 100}", "test_rows: 100, zipf: -1}", "data.clicks.generate: zipf"},
      {"model: {type: click}", "model: {type: click, hidden: [8]}", "model.hidden"},
      {"model: {type: click}", "model: {type: click, click: {top: [0]}}", "model.click.top[0]"},
      {"batch_size: 10", "batch_size: 10\naccumulate_steps: 2", "accumulate_steps"},
      {"batch_size: 10", "batch_size: 10\nprecision: bf16", "precision"},
      {"batch_size: 10", "batch_size: 600", "batch_size"},  // more than the 1000 rows
      {"model: {type: click}", "model: {type: mlp, hidden: [8]}", "tables"},
  };
  for (const auto& [from, to, message] : bad) {
    const absl::Status status = with(from, to);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << to;
    EXPECT_TRUE(absl::StartsWith(status.message(), message)) << status << " for " << to;
  }
}

// The three modes' bounds and what a worker computing a step waits for.
TEST(JobSpecTest, StalenessBoundsOfTheThreeModes) {
  absl::StatusOr<v1::JobSpec> ssp = ParseJobSpecYaml(With("mode: sync", "mode: ssp\nstaleness: 3"));
  PSTRAIN_ASSERT_OK(ssp);
  PSTRAIN_ASSERT_OK(NormalizeJobSpec(*ssp));
  EXPECT_EQ(StalenessOf(*ssp), 3);
  EXPECT_TRUE(ScalesToTheGlobalBatch(*ssp));
  EXPECT_EQ(StepsAppliedBefore(10, 3), 7);
  EXPECT_EQ(StepsAppliedBefore(2, 3), 0);

  v1::JobSpec sync = *ssp;
  sync.set_mode(v1::MODE_SYNC);
  EXPECT_EQ(StalenessOf(sync), 0);
  EXPECT_EQ(StepsAppliedBefore(10, StalenessOf(sync)), 10);

  v1::JobSpec async = sync;
  async.set_mode(v1::MODE_ASYNC);
  EXPECT_EQ(StalenessOf(async), kUnboundedStaleness);
  EXPECT_FALSE(ScalesToTheGlobalBatch(async));
  EXPECT_EQ(StepsAppliedBefore(10, kUnboundedStaleness), 0);
}

// Each schedule's rate at chosen steps, worked out by hand: a job of 100
// steps at 0.1.
TEST(LearningRateTest, EachScheduleGivesItsRateAtChosenSteps) {
  v1::OptimizerSpec opt;
  opt.set_learning_rate(0.1f);
  const double lr = opt.learning_rate();
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 0, 100), lr);  // no schedule: constant
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 99, 100), lr);
  v1::LearningRateSchedule& s = *opt.mutable_schedule();
  s.set_warmup_steps(10);  // linear warm-up, then constant
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 0, 100), lr / 10);
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 4, 100), lr / 2);
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 9, 100), lr);
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 50, 100), lr);
  s.set_type(v1::SCHEDULE_TYPE_STEP);  // after 10 warm-up steps, halved every 20
  s.set_decay_every_steps(20);
  s.set_decay_factor(0.5f);
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 29, 100), lr);
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 30, 100), lr / 2);
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 99, 100), lr / 16);
  s.Clear();  // cosine over 100 steps, from 0.1 to 0.02
  s.set_type(v1::SCHEDULE_TYPE_COSINE);
  s.set_min_learning_rate(0.02f);
  const double min = s.min_learning_rate();
  EXPECT_DOUBLE_EQ(LearningRateAt(opt, 0, 100), lr);
  EXPECT_NEAR(LearningRateAt(opt, 50, 100), (lr + min) / 2, 1e-12);
  EXPECT_NEAR(LearningRateAt(opt, 100, 100), min, 1e-12);
  EXPECT_LT(LearningRateAt(opt, 75, 100), LearningRateAt(opt, 74, 100));
}

TEST(LearningRateTest, ScheduleFieldsParseFromYaml) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(With(
      "learning_rate: 0.001}",
      "learning_rate: 0.001, schedule: {type: cosine, warmup_steps: 50, "
      "min_learning_rate: 0.0001}}"));
  PSTRAIN_ASSERT_OK(spec);
  spec = NormalizeJobSpec(*spec);
  PSTRAIN_ASSERT_OK(spec);
  EXPECT_EQ(spec->optimizer().schedule().type(), v1::SCHEDULE_TYPE_COSINE);
  EXPECT_EQ(spec->optimizer().schedule().warmup_steps(), 50);
  EXPECT_FLOAT_EQ(spec->optimizer().schedule().min_learning_rate(), 0.0001f);
}

TEST_P(BadSpecTest, RejectedNamingTheField) {
  const BadSpec& bad = GetParam();
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(bad.yaml);
  if (spec.ok()) spec = NormalizeJobSpec(*spec);
  ASSERT_FALSE(spec.ok()) << bad.what;
  EXPECT_EQ(spec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(spec.status().message(), bad.field))
      << bad.what << ": " << spec.status().message();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadSpecTest,
    ::testing::Values(
        BadSpec{"yaml syntax", "model: {type: mlp\nbatch_size: [", "job spec: YAML error"},
        BadSpec{"not a mapping", "- 1\n- 2\n", "job spec"},
        BadSpec{"empty", "", "job spec"},
        BadSpec{"unknown model", With("type: mlp", "type: transformer"), "model.type"},
        BadSpec{"unknown optimizer", With("type: adam", "type: lion"), "optimizer.type"},
        BadSpec{"duplicate key", std::string(kValid) + "epochs: 4\n", "epochs: duplicate key"},
        BadSpec{"zero workers", With("num_workers: 2", "num_workers: 0"), "num_workers"},
        BadSpec{"negative batch", With("batch_size: 64", "batch_size: -1"), "batch_size"},
        BadSpec{"huge global batch", With("batch_size: 64", "batch_size: 40000"), "batch_size"},
        BadSpec{"zero learning rate", With("learning_rate: 0.001", "learning_rate: 0"),
                "optimizer.learning_rate"},
        BadSpec{"unknown field", std::string(kValid) + "learning_rate: 1\n", "learning_rate"},
        BadSpec{"unknown nested field", With("hidden: [256, 128]", "hiden: [256]"),
                "model.hiden: unknown field"},
        BadSpec{"wrong type", With("epochs: 3", "epochs: three"), "epochs"},
        BadSpec{"wrong list item", With("[256, 128]", "[256, x]"), "model.hidden[1]"},
        BadSpec{"zero width", With("[256, 128]", "[256, 0]"), "model.hidden[1]"},
        BadSpec{"list for scalar", With("seed: 7", "seed: [7]"), "seed"},
        BadSpec{"no steps", With("epochs: 3", "epochs: 0"), "epochs"},
        BadSpec{"negative max_skipped_steps", std::string(kValid) + "max_skipped_steps: -1\n",
                "max_skipped_steps"},
        BadSpec{"odd chunk", With("chunk_bytes: 65536", "chunk_bytes: 65537"), "chunk_bytes"},
        BadSpec{"unknown mode", With("mode: sync", "mode: eventually"), "mode"},
        BadSpec{"missing value", With("seed: 7", "seed:"), "seed"},
        BadSpec{"absurd model", With("[256, 128]", "[16384, 16384, 16384, 16384, 16384]"),
                "model.hidden"},
        BadSpec{"absurd chunk count",
                "model: {type: mlp, hidden: [4096, 4096]}\noptimizer: {type: sgd, "
                "learning_rate: 1}\nbatch_size: 8\nsteps: 1\nnum_servers: 1\nnum_workers: 1\n"
                "chunk_bytes: 4\n",
                "chunk_bytes"},
        BadSpec{"unknown schedule", WithSchedule("type: linear"), "optimizer.schedule.type"},
        BadSpec{"warm-up past the end", WithSchedule("warmup_steps: 100000"), "optimizer.schedule.warmup_steps"},
        BadSpec{"step without a period", WithSchedule("type: step, decay_factor: 0.5"), "optimizer.schedule.decay_every_steps"},
        BadSpec{"step growing", WithSchedule("type: step, decay_every_steps: 10, decay_factor: 2"), "optimizer.schedule.decay_factor"},
        BadSpec{"cosine below zero", WithSchedule("type: cosine, min_learning_rate: -1"), "optimizer.schedule.min_learning_rate"},
        BadSpec{"decay for cosine", WithSchedule("type: cosine, decay_factor: 0.5"), "optimizer.schedule.decay_factor"},
        BadSpec{"cnn without convolutions", With("type: mlp", "type: cnn, conv: []"), "model.conv"},
        BadSpec{"convolutions of an mlp", With("hidden: [256, 128]", "hidden: [256], conv: [8]"), "model.conv"},
        BadSpec{"zero filters", With("type: mlp", "type: cnn, conv: [8, 0]"), "model.conv[1]"},
        BadSpec{"too many convolutions", With("type: mlp", "type: cnn, conv: [4, 4, 4, 4, 4]"), "model.conv"},
        BadSpec{"absurd convolution batch",
                "model: {type: cnn, conv: [512]}\noptimizer: {type: sgd, learning_rate: 1}\n"
                "batch_size: 1000\nsteps: 1\nnum_servers: 1\nnum_workers: 1\n",
                "batch_size"},
        BadSpec{"evaluations past the end", std::string(kValid) + "eval_every_steps: 100000\n",
                "eval_every_steps"},
        BadSpec{"early stopping without evaluations",
                std::string(kValid) + "early_stopping: {patience: 3}\n", "early_stopping.patience"},
        BadSpec{"early stopping in async",
                With("mode: sync", "mode: async") +
                    "eval_every_steps: 100\nearly_stopping: {patience: 3}\n",
                "early_stopping.patience"},
        BadSpec{"ssp without a bound", With("mode: sync", "mode: ssp"), "staleness"},
        BadSpec{"negative staleness", With("mode: sync", "mode: ssp\nstaleness: -1"),
                "staleness"},
        BadSpec{"staleness of sync", std::string(kValid) + "staleness: 2\n", "staleness"},
        BadSpec{"staleness of async", With("mode: sync", "mode: async\nstaleness: 2"),
                "staleness"},
        BadSpec{"negative accumulation", std::string(kValid) + "accumulate_steps: -1\n",
                "accumulate_steps"},
        BadSpec{"loss scale without fp16", std::string(kValid) + "loss_scale: {initial: 1024}\n",
                "loss_scale"},
        BadSpec{"loss scale not a power of two", Fp16WithLossScale("initial: 1000"),
                "loss_scale.initial"},
        BadSpec{"loss scale above 2^24", Fp16WithLossScale("initial: 33554432"),
                "loss_scale.initial"},
        BadSpec{"loss scale NaN", Fp16WithLossScale("initial: .nan"), "loss_scale.initial"},
        BadSpec{"negative growth steps", Fp16WithLossScale("growth_steps: -5"),
                "loss_scale.growth_steps"},
        BadSpec{"accumulation past the training set",
                std::string(kValid) + "accumulate_steps: 1000\n", "batch_size"},
        BadSpec{"negative min_delta",
                std::string(kValid) + "eval_every_steps: 100\nearly_stopping: {patience: 3, "
                "min_delta: -0.1}\n",
                "early_stopping.min_delta"},
        BadSpec{"colocated with other servers",
                With("num_servers: 2", "num_servers: 3\ncolocated_servers: true"), "num_servers"},
        BadSpec{"colocated elastic",
                With("num_servers: 2", "colocated_servers: true") +
                    "recovery: {on_worker_loss: elastic}\n",
                "colocated_servers"},
        BadSpec{"colocated external",
                External("[{name: w, shape: [3]}]", "\ncolocated_servers: true\n"),
                "colocated_servers"},
        BadSpec{"external without tensors", External("[]"), "model.tensors"},
        BadSpec{"external tensor of zero size", External("[{name: w, shape: [3, 0]}]"),
                "model.tensors[0].shape[1]"},
        BadSpec{"external tensors of one name",
                External("[{name: w, shape: [3]}, {name: w, shape: [2]}]"),
                "model.tensors[1].name"},
        BadSpec{"external tensor without a name", External("[{shape: [3]}]"),
                "model.tensors[0].name"},
        BadSpec{"external model with hidden layers",
                With("model: {type: mlp, hidden: [256, 128]}",
                     "model: {type: external, hidden: [3], tensors: [{name: w}]}"),
                "model.hidden"},
        BadSpec{"tensors of a built-in model",
                With("hidden: [256, 128]}", "hidden: [256, 128], tensors: [{name: w}]}"),
                "model.tensors"},
        BadSpec{"external with pstrain's data",
                With("model: {type: mlp, hidden: [256, 128]}",
                     "model: {type: external, tensors: [{name: w}]}\n"
                     "data: {train_samples: 1000, dir: /tmp}"),
                "data.dir"},
        BadSpec{"external epochs without train_samples",
                With("model: {type: mlp, hidden: [256, 128]}",
                     "model: {type: external, tensors: [{name: w}]}"),
                "data.train_samples"},
        BadSpec{"external with eval_every_steps",
                External("[{name: w}]", "eval_every_steps: 10\n"), "eval_every_steps"},
        BadSpec{"a parameter of int64", External("[{name: w, dtype: int64}]"),
                "model.tensors[0].dtype"},
        BadSpec{"a buffer of no dtype there is",
                External("[{name: w}, {name: b, buffer: true, dtype: int4}]"),
                "model.tensors[1].dtype"},
        BadSpec{"train_samples of a built-in model", std::string(kValid) + "data: {train_samples: 5}\n",
                "data.train_samples"},
        BadSpec{"absurd activations",
                "model: {type: mlp, hidden: [16384]}\noptimizer: {type: sgd, learning_rate: 1}\n"
                "batch_size: 20000\nsteps: 1\nnum_servers: 1\nnum_workers: 1\n",
                "batch_size"}),
    [](const ::testing::TestParamInfo<BadSpec>& info) {
      std::string name = info.param.what;
      for (char& c : name) {
        if (!isalnum(static_cast<unsigned char>(c))) c = '_';
      }
      return name;
    });

}  // namespace
}  // namespace pstrain
