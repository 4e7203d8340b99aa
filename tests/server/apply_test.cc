// The server's update: gradients summed straight from received frames and
// applied tile by tile, over threads for large chunks, give the bits of a
// plain sum followed by one whole-array update.
#include "server/apply.h"

#include <random>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

// A gradient frame as the network delivers it: cut into slices of odd
// sizes, so that floats straddle slice boundaries.
Frame ReceivedFrame(const std::vector<float>& grad) {
  v1::ChunkHeader h;
  h.set_kind(v1::FRAME_KIND_PUSH);
  h.set_job_id("j");
  h.set_dtype(v1::DTYPE_FP32);
  h.set_num_elements(static_cast<uint32_t>(grad.size()));
  std::vector<grpc::Slice> whole;
  PSTRAIN_EXPECT_OK(EncodeFrame(h, grad.data()).Dump(&whole));
  std::string bytes;
  for (const grpc::Slice& s : whole) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  std::vector<grpc::Slice> cut;
  for (size_t at = 0; at < bytes.size(); at += 65537) {
    cut.emplace_back(bytes.data() + at, std::min<size_t>(65537, bytes.size() - at));
  }
  grpc::ByteBuffer buffer(cut.data(), cut.size());
  return *Frame::Parse(buffer);
}

TEST(ApplyTest, ThreadsAndTilesGiveTheBitsOfAWholeUpdate) {
  // Large enough for three threads of ApplyPool::kMinFloatsPerThread, and
  // not a multiple of the tile.
  const int64_t n = 3 * ApplyPool::kMinFloatsPerThread + 12345;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal;
  auto random = [&] {
    std::vector<float> v(n);
    for (float& x : v) x = normal(rng);
    return v;
  };
  const std::vector<float> initial = random();
  std::vector<std::vector<float>> grads = {random(), random(), random()};
  std::vector<Frame> frames;
  for (const auto& g : grads) frames.push_back(ReceivedFrame(g));
  std::vector<const Frame*> frame_ptrs;
  for (const Frame& f : frames) frame_ptrs.push_back(&f);

  for (kernels::OptimizerConfig::Type type :
       {kernels::OptimizerConfig::Type::kSgd, kernels::OptimizerConfig::Type::kAdam}) {
    kernels::OptimizerConfig config;
    config.type = type;
    config.momentum = 0.9f;
    std::unique_ptr<kernels::Optimizer> optimizer = *kernels::CreateCpuOptimizer(config);
    const int state_floats = optimizer->StateFloatsPerParam();

    // The reference: sum in order, then one update in place.
    std::vector<float> expected = initial;
    std::vector<float> expected_state(state_floats * n, 0.0f);
    std::vector<float> sum = grads[0];
    for (size_t w = 1; w < grads.size(); ++w) {
      for (int64_t i = 0; i < n; ++i) sum[i] += grads[w][i];
    }
    PSTRAIN_ASSERT_OK(
        optimizer->ApplyInPlace(expected.data(), sum.data(), expected_state.data(), n, 1));

    for (int threads : {1, 3}) {
      SCOPED_TRACE(::testing::Message() << threads << " threads");
      ApplyPool pool(threads);
      std::vector<float> params = initial, out(n);
      std::vector<float> state(state_floats * n, 0.0f);
      kernels::OptimizerSpan span;
      span.params = params.data();
      span.new_params = out.data();  // out of place, as when replies hold the values
      span.state = state.data();
      span.state_stride = n;
      span.n = n;
      PSTRAIN_ASSERT_OK(SumAndApply(*optimizer, frame_ptrs, span, 1, &pool));
      EXPECT_TRUE(out == expected);
      EXPECT_TRUE(state == expected_state);
      EXPECT_TRUE(params == initial) << "the current values must stay as they were";
    }
  }
}

}  // namespace
}  // namespace pstrain::server
