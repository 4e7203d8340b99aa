// precision fp16 with dynamic loss scaling, on CPU devices (the GPU's twin:
// the products' inputs rounded to fp16, an overflow an infinity) over real
// gRPC servers: a step whose scaled gradient overflows is skipped on every
// server and halves the worker's scale; without overflows fp16 trains what
// fp32 does, to fp16's rounding; every run gives the same bits.
#include <cmath>

#include "gtest/gtest.h"
#include "common/job_spec.h"
#include "kernels/model.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"
#include "worker/in_process.h"

namespace pstrain::testing {
namespace {

class MixedPrecisionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { data_ = new DatasetCache; }
  static void TearDownTestSuite() { delete data_; }

  // 2 workers x 32, 2 servers, plain SGD (whose update is the gradient
  // itself, not Adam's normalised one), precision fp16 from `initial_scale`.
  static v1::JobSpec Fp16Spec(int64_t steps, double initial_scale, int growth_steps) {
    v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.05f, /*workers=*/2, /*batch=*/32,
                               /*servers=*/2, steps);
    spec.set_precision(v1::PRECISION_FP16);
    spec.mutable_loss_scale()->set_initial(initial_scale);
    spec.mutable_loss_scale()->set_growth_steps(growth_steps);
    return spec;
  }

  struct Run {
    WorkersResult result;
    double overflows = 0;   // both workers'
    double last_scale = 0;  // the last worker to set it
  };
  Run Train(const v1::JobSpec& spec) {
    prometheus::Registry registry;
    auto metrics = worker::WorkerMetrics::Create(registry, absl::Minutes(1));
    PSTRAIN_EXPECT_OK(metrics);
    const v1::PartitionPlan plan = PlanFor(spec);
    InProcessServers servers(2);
    PSTRAIN_EXPECT_OK(servers.AddJob("job-fp16", spec, plan));
    RunOptions options;
    options.metrics = metrics->get();
    Run run;
    run.result = RunWorkers("job-fp16", spec, plan, servers.addresses(), data_, options);
    PSTRAIN_EXPECT_OK(run.result.status);
    EXPECT_EQ(servers.Gather("job-fp16", plan), run.result.params);
    const prometheus::Labels labels = {{"job_id", "job-fp16"}};
    run.overflows = (*metrics)->overflows->Add(labels).Value();
    run.last_scale = (*metrics)->loss_scale->Add(labels).Value();
    return run;
  }

  static DatasetCache* data_;
};

DatasetCache* MixedPrecisionTest::data_ = nullptr;

TEST_F(MixedPrecisionTest, AnOverflowingStepIsSkippedOnEveryServerAndHalvesTheScale) {
  // 2^24 / 64 samples: the logits' scaled gradients alone pass fp16's 65504.
  const v1::JobSpec spec = Fp16Spec(/*steps=*/1, 1 << 24, 2000);
  const Run run = Train(spec);
  // The step was skipped: the servers hold the seed's initial values.
  const kernels::ModelShape shape = ModelShapeOf(spec);
  std::vector<float> initial(kernels::NumParams(shape));
  kernels::InitParams(shape, spec.seed(), 0, static_cast<int64_t>(initial.size()), initial.data());
  EXPECT_EQ(run.result.params, initial);
  EXPECT_EQ(run.overflows, 2);  // each worker's gradient overflowed
  EXPECT_EQ(run.last_scale, 1 << 23);
}

TEST_F(MixedPrecisionTest, TheScaleFindsItsLevelAndEveryRunGivesTheSameBits) {
  // From far too high, doubling every 4 steps: overflows at the start and
  // again whenever the scale outgrows the gradients.
  const v1::JobSpec spec = Fp16Spec(/*steps=*/40, 1 << 24, 4);
  const Run first = Train(spec);
  EXPECT_GE(first.overflows, 2);
  EXPECT_LT(first.last_scale, 1 << 24);
  for (float v : first.result.params) ASSERT_TRUE(std::isfinite(v));
  const Run second = Train(spec);
  EXPECT_EQ(second.result.params, first.result.params);
  EXPECT_EQ(second.overflows, first.overflows);
}

TEST_F(MixedPrecisionTest, WithoutOverflowsFp16TrainsWhatFp32Does) {
  constexpr int64_t kSteps = 40;
  const v1::JobSpec fp16 = Fp16Spec(kSteps, 1 << 16, 2000);
  const Run run = Train(fp16);
  EXPECT_EQ(run.overflows, 0);
  EXPECT_EQ(run.last_scale, 1 << 16);
  v1::JobSpec fp32 = fp16;
  fp32.set_precision(v1::PRECISION_FP32);
  fp32.clear_loss_scale();
  const std::shared_ptr<const Dataset> train = *data_->FashionMnist(kFashionDir, true);
  absl::StatusOr<std::vector<float>> reference = worker::TrainInProcess(fp32, kSteps, *train);
  PSTRAIN_ASSERT_OK(reference);
  // fp16 keeps 11 significant bits of the products' inputs: each tensor's
  // training (its values' change from the initial ones) differs from fp32's
  // by a few percent, where sums of the batch's deltas cancel (the biases).
  const kernels::ModelShape shape = ModelShapeOf(fp16);
  std::vector<float> initial(kernels::NumParams(shape));
  kernels::InitParams(shape, fp16.seed(), 0, static_cast<int64_t>(initial.size()), initial.data());
  for (const kernels::TensorDesc& t : kernels::ModelTensors(shape)) {
    double differs = 0, moved = 0;
    for (int64_t i = t.offset; i < t.offset + t.size; ++i) {
      differs += std::pow(run.result.params[i] - (*reference)[i], 2);
      moved += std::pow((*reference)[i] - initial[i], 2);
    }
    EXPECT_LE(std::sqrt(differs / moved), 0.1) << t.name;
    EXPECT_GT(differs, 0) << t.name << ": fp16 rounded nothing";
  }
}

}  // namespace
}  // namespace pstrain::testing
