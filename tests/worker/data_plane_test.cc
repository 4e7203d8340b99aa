// The data plane's fast paths change no result: many chunks in flight on a
// pool of channels give the bits of one chunk at a time on one, nothing is
// copied on the way, and 16-bit gradients on the wire halve the bytes and
// still train.
#include "common/chunk_codec.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"
#include "worker/in_process.h"

namespace pstrain::testing {
namespace {

class DataPlaneTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { data_ = new DatasetCache; }
  static void TearDownTestSuite() { delete data_; }

  struct Trained {
    WorkersResult workers;
    std::vector<float> server_params;  // as the servers hold them
  };

  Trained Train(const v1::JobSpec& spec, const RunOptions& run) {
    const v1::PartitionPlan plan = PlanFor(spec);
    InProcessServers servers(spec.num_servers());
    PSTRAIN_EXPECT_OK(servers.AddJob("job-dp", spec, plan));
    Trained out;
    out.workers = RunWorkers("job-dp", spec, plan, servers.addresses(), data_, run);
    PSTRAIN_EXPECT_OK(out.workers.status);
    out.server_params = servers.Gather("job-dp", plan);
    return out;
  }

  double TestAccuracy(const v1::JobSpec& spec, const std::vector<float>& params) {
    const std::shared_ptr<const Dataset> test = *data_->FashionMnist(kFashionDir, false);
    return worker::Evaluate(spec, params, *test)->accuracy;
  }

  static DatasetCache* data_;
};

DatasetCache* DataPlaneTest::data_ = nullptr;

TEST_F(DataPlaneTest, ParallelPushesGiveTheBitsOfTheSequentialPath) {
  // 4 KiB chunks: about 230 over 3 servers, so every stream has more
  // chunks than its window.
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 4, 16, 3, 8, 4096);
  RunOptions sequential;
  sequential.grpc.channels_per_server = 1;
  sequential.grpc.window = 1;
  sequential.grpc.window_bytes = 0;
  const Trained reference = Train(spec, sequential);

  // Every exchange over all four channels of each server.
  RunOptions parallel;
  parallel.grpc.channels_per_server = 4;
  parallel.grpc.window = 8;
  parallel.grpc.window_bytes = 0;
  parallel.bytes_per_stream = 1;
  const int64_t copied_before = CopiedPayloadBytes();
  const Trained result = Train(spec, parallel);
  // Workers and servers share this process: neither side copied a payload.
  EXPECT_EQ(CopiedPayloadBytes(), copied_before);

  ASSERT_EQ(result.server_params.size(), reference.server_params.size());
  EXPECT_TRUE(result.server_params == reference.server_params)
      << "the servers' parameters differ";
  EXPECT_TRUE(result.workers.params == reference.workers.params)
      << "worker 0's parameters differ";
  EXPECT_TRUE(result.workers.params == result.server_params);
  for (int64_t steps : result.workers.steps_done) EXPECT_EQ(steps, 8);
}

TEST_F(DataPlaneTest, SixteenBitWireHalvesTheBytesAndStillTrains) {
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 64, 2, 300);
  const Trained fp32 = Train(spec, {});
  const double fp32_accuracy = TestAccuracy(spec, fp32.workers.params);
  EXPECT_GT(fp32_accuracy, 0.75);
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    SCOPED_TRACE(::testing::Message() << "wire dtype " << v1::DType_Name(dtype));
    spec.set_wire_dtype(dtype);
    const Trained half = Train(spec, {});
    for (int w = 0; w < 2; ++w) {
      EXPECT_EQ(2 * half.workers.stats[w].bytes_pushed, fp32.workers.stats[w].bytes_pushed);
      EXPECT_EQ(2 * half.workers.stats[w].bytes_pulled, fp32.workers.stats[w].bytes_pulled);
    }
    // Not the same bits, but the same training.
    EXPECT_NE(half.server_params, fp32.server_params);
    EXPECT_NEAR(TestAccuracy(spec, half.workers.params), fp32_accuracy, 0.02);
    // The master copy on the servers stays fp32 and is what workers see,
    // rounded once.
    EXPECT_NEAR(TestAccuracy(spec, half.server_params), fp32_accuracy, 0.02);
  }
}

}  // namespace
}  // namespace pstrain::testing
