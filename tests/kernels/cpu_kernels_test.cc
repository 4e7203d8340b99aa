#include "kernels/cpu/cpu_kernels.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "tests/kernels/finite_differences.h"

namespace pstrain::kernels {
namespace {

// Sum of the batch's cross-entropy losses, all in double.
double ReferenceLoss(const ModelShape& shape, const std::vector<double>& params,
                     const std::vector<float>& x, const std::vector<int32_t>& y, int batch) {
  const std::vector<TensorDesc> tensors = ModelTensors(shape);
  std::vector<int> widths = {shape.input_dim};
  widths.insert(widths.end(), shape.hidden.begin(), shape.hidden.end());
  widths.push_back(shape.num_classes);
  double total = 0;
  for (int i = 0; i < batch; ++i) {
    std::vector<double> a(x.begin() + i * shape.input_dim, x.begin() + (i + 1) * shape.input_dim);
    for (size_t l = 0; l + 1 < widths.size(); ++l) {
      const int in = widths[l], out = widths[l + 1];
      std::vector<double> z(out);
      for (int j = 0; j < out; ++j) {
        double s = params[tensors[2 * l + 1].offset + j];
        for (int k = 0; k < in; ++k) s += a[k] * params[tensors[2 * l].offset + k * out + j];
        z[j] = (l + 2 < widths.size()) ? std::max(s, 0.0) : s;
      }
      a = std::move(z);
    }
    double zmax = *std::max_element(a.begin(), a.end());
    double sum = 0;
    for (double v : a) sum += std::exp(v - zmax);
    total += std::log(sum) - (a[y[i]] - zmax);
  }
  return total;
}

class CpuKernelsTest : public ::testing::TestWithParam<std::vector<int>> {};

TEST_P(CpuKernelsTest, GradientsMatchFiniteDifferences) {
  const ModelShape shape{7, GetParam(), 4};
  const int batch = 5;
  const int64_t n = NumParams(shape);
  std::vector<float> params(n);
  InitParams(shape, 3, 0, n, params.data());
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 0.3f);
  // Non-zero biases, so that ReLUs are not all on or all off.
  for (const TensorDesc& t : ModelTensors(shape)) {
    if (t.is_bias) {
      for (int64_t i = 0; i < t.size; ++i) params[t.offset + i] = normal(rng);
    }
  }
  std::vector<float> x(batch * shape.input_dim);
  for (float& v : x) v = normal(rng) + 0.5f;
  std::vector<int32_t> y = {0, 3, 1, 2, 3};

  auto kernels = CreateCpuModelKernels(shape, batch);
  ASSERT_TRUE(kernels.ok());
  std::vector<float> grad(n);
  BatchStats stats;
  ASSERT_TRUE((*kernels)->ForwardBackward(params.data(), x.data(), y.data(), batch, 1.0f,
                                          grad.data(), &stats)
                  .ok());
  std::vector<double> p(params.begin(), params.end());
  EXPECT_NEAR(stats.loss_sum, ReferenceLoss(shape, p, x, y, batch), 1e-4);

  const double worst = ExpectGradientMatchesFiniteDifferences(
      params, grad,
      [&](const std::vector<double>& q) { return ReferenceLoss(shape, q, x, y, batch); });
  RecordProperty("worst_relative_error", std::to_string(worst));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CpuKernelsTest,
                         ::testing::Values(std::vector<int>{}, std::vector<int>{6},
                                           std::vector<int>{6, 5}));

TEST(CpuKernelsTest, GradScaleScalesEverything) {
  const ModelShape shape{5, {4}, 3};
  const int64_t n = NumParams(shape);
  std::vector<float> params(n);
  InitParams(shape, 9, 0, n, params.data());
  std::vector<float> x(2 * 5, 0.7f);
  std::vector<int32_t> y = {1, 2};
  auto kernels = *CreateCpuModelKernels(shape, 2);
  std::vector<float> g1(n), g2(n);
  BatchStats stats;
  ASSERT_TRUE(kernels->ForwardBackward(params.data(), x.data(), y.data(), 2, 1.0f, g1.data(), &stats).ok());
  ASSERT_TRUE(kernels->ForwardBackward(params.data(), x.data(), y.data(), 2, 0.25f, g2.data(), &stats).ok());
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(g2[i], 0.25f * g1[i], 1e-6f);
}

// The CPU twin of the GPU's 16-bit precisions: the products' inputs
// rounded (close to fp32, not equal), and for fp16 a scaled gradient past
// 65504 an infinity, as tensor cores would see it; fp32 has the range.
TEST(CpuKernelsTest, SixteenBitPrecisionsRoundTheProductsInputs) {
  for (const ModelShape& shape :
       {ModelShape{784, {16}, 10}, ModelShape{784, {8}, 10, {4}, 1, 28, 28}}) {
    const int64_t n = NumParams(shape);
    std::vector<float> params(n);
    InitParams(shape, 3, 0, n, params.data());
    std::vector<float> x(4 * 784);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 97) / 97.0f;
    std::vector<int32_t> y = {1, 7, 3, 0};
    auto gradient = [&](Precision precision, float grad_scale) {
      auto kernels = *CreateCpuModelKernels(shape, 4, precision);
      std::vector<float> grad(n);
      BatchStats stats;
      EXPECT_TRUE(kernels->ForwardBackward(params.data(), x.data(), y.data(), 4, grad_scale,
                                           grad.data(), &stats).ok());
      return grad;
    };
    const std::vector<float> fp32 = gradient(Precision::kFp32, 0.25f);
    for (Precision p : {Precision::kTf32, Precision::kBf16, Precision::kFp16}) {
      const std::vector<float> rounded = gradient(p, 0.25f);
      double diff = 0, norm = 0;
      for (int64_t i = 0; i < n; ++i) {
        diff += (rounded[i] - fp32[i]) * (rounded[i] - fp32[i]);
        norm += fp32[i] * fp32[i];
      }
      EXPECT_GT(diff, 0) << static_cast<int>(p);
      EXPECT_LT(std::sqrt(diff / norm), 2e-2) << static_cast<int>(p);
    }
    auto finite = [](const std::vector<float>& g) {
      return std::all_of(g.begin(), g.end(), [](float v) { return std::isfinite(v); });
    };
    EXPECT_TRUE(finite(gradient(Precision::kFp32, 1 << 20)));
    EXPECT_FALSE(finite(gradient(Precision::kFp16, 1 << 20)));
  }
}

TEST(CpuKernelsTest, RejectsBadInput) {
  const ModelShape shape{5, {4}, 3};
  auto kernels = *CreateCpuModelKernels(shape, 2);
  std::vector<float> params(NumParams(shape)), grad(NumParams(shape)), x(15);
  std::vector<int32_t> y = {0, 1, 3};
  BatchStats stats;
  EXPECT_FALSE(kernels->ForwardBackward(params.data(), x.data(), y.data(), 3, 1, grad.data(), &stats).ok());
  EXPECT_FALSE(kernels->ForwardBackward(params.data(), x.data(), y.data() + 1, 2, 1, grad.data(), &stats).ok());
  EXPECT_FALSE(CreateCpuModelKernels({0, {}, 3}, 1).ok());
  EXPECT_FALSE(CreateCpuModelKernels({5, {0}, 3}, 1).ok());
}

// A caller whose values are still arriving: the parameters hold NaNs until
// the pass asks for them, and each call copies in what it asks for. The
// pass must ask before it reads (else a NaN shows in the loss or the
// gradient), in forward order (the MLP's first layer in row blocks), every
// layer in full before it writes the gradient, and compute bitwise what it
// computes from values that were there all along.
TEST(CpuKernelsTest, ForwardAsksForEachLayersParametersBeforeReadingThem) {
  for (const ModelShape& shape :
       {ModelShape{40, {16, 8}, 4}, ModelShape{64, {6}, 3, {2, 3}, 1, 8, 8}}) {
    SCOPED_TRACE(shape.conv.size());
    const int batch = 3;
    const int64_t n = NumParams(shape);
    const std::vector<TensorDesc> tensors = ModelTensors(shape);
    const int layers = static_cast<int>(tensors.size() / 2);
    std::vector<float> params(n);
    InitParams(shape, 7, 0, n, params.data());
    std::vector<float> x(batch * shape.input_dim);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) / 13.0f;
    const std::vector<int32_t> y = {0, 2, 1};
    auto kernels = *CreateCpuModelKernels(shape, batch);
    std::vector<float> expected(n);
    BatchStats expected_stats;
    ASSERT_TRUE(kernels->ForwardBackward(params.data(), x.data(), y.data(), batch, 1.0f,
                                         expected.data(), &expected_stats).ok());

    std::vector<float> arriving(n, std::nanf(""));
    std::vector<std::pair<int, int64_t>> asked;
    bool gradient_written = false;
    auto params_needed = [&](int layer, int64_t floats) {
      EXPECT_FALSE(gradient_written) << "layer " << layer;
      const int64_t offset = tensors[2 * layer].offset;
      EXPECT_LE(floats, tensors[2 * layer].size + tensors[2 * layer + 1].size);
      std::copy(params.begin() + offset, params.begin() + offset + floats,
                arriving.begin() + offset);
      asked.emplace_back(layer, floats);
      return absl::OkStatus();
    };
    auto on_ready = [&](int, int64_t) { gradient_written = true; };
    std::vector<float> grad(n);
    BatchStats stats;
    ASSERT_TRUE(kernels->ForwardBackward(arriving.data(), x.data(), y.data(), batch, 1.0f,
                                         grad.data(), &stats, on_ready, params_needed).ok());
    EXPECT_EQ(stats.loss_sum, expected_stats.loss_sum);
    EXPECT_EQ(grad, expected);
    EXPECT_TRUE(std::is_sorted(asked.begin(), asked.end()));
    for (int l = 0; l < layers; ++l) {
      EXPECT_NE(std::find(asked.begin(), asked.end(),
                          std::make_pair(l, tensors[2 * l].size + tensors[2 * l + 1].size)),
                asked.end())
          << "layer " << l << " never asked for in full";
    }
    if (shape.conv.empty()) {
      EXPECT_GT(std::count_if(asked.begin(), asked.end(), [](auto& a) { return a.first == 0; }), 2)
          << "the first layer in row blocks";
    }

    // An error ends the pass with it.
    auto refuse = [](int layer, int64_t) {
      return layer == 1 ? absl::UnavailableError("gone") : absl::OkStatus();
    };
    const absl::Status refused = kernels->ForwardBackward(params.data(), x.data(), y.data(), batch,
                                                          1.0f, grad.data(), &stats, nullptr, refuse);
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable);
  }
}

TEST(InitParamsTest, AnyRangeEqualsTheWhole) {
  const ModelShape shape{784, {256, 128}, 10};
  const int64_t n = NumParams(shape);
  std::vector<float> whole(n), part(1000);
  InitParams(shape, 5, 0, n, whole.data());
  for (int64_t begin : {int64_t{0}, int64_t{200000}, int64_t{200700}, n - 1000}) {
    InitParams(shape, 5, begin, begin + 1000, part.data());
    for (int i = 0; i < 1000; ++i) ASSERT_EQ(part[i], whole[begin + i]);
  }
}

// Textbook Adam in double against the optimizer's float update.
TEST(OptimizerTest, AdamMatchesTheTextbook) {
  OptimizerConfig c;
  c.type = OptimizerConfig::Type::kAdam;
  c.learning_rate = 0.01f;
  auto adam = *CreateCpuOptimizer(c);
  ASSERT_EQ(adam->StateFloatsPerParam(), 2);
  std::vector<float> p = {0.5f, -1.0f, 2.0f};
  std::vector<float> state(6, 0.0f);
  std::vector<double> rp(p.begin(), p.end()), m(3, 0), v(3, 0);
  for (int t = 1; t <= 20; ++t) {
    std::vector<float> g = {0.1f * t, -0.2f, 0.05f * (t % 3)};
    ASSERT_TRUE(adam->ApplyInPlace(p.data(), g.data(), state.data(), 3, t).ok());
    for (int i = 0; i < 3; ++i) {
      m[i] = 0.9 * m[i] + 0.1 * g[i];
      v[i] = 0.999 * v[i] + 0.001 * g[i] * g[i];
      const double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.999, t));
      rp[i] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
    }
  }
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(p[i], rp[i], 1e-5);
}

TEST(OptimizerTest, SgdMomentumAndValidation) {
  OptimizerConfig c;
  c.learning_rate = 0.1f;
  c.momentum = 0.5f;
  auto sgd = *CreateCpuOptimizer(c);
  std::vector<float> p = {1.0f}, g = {1.0f}, v = {0.0f};
  ASSERT_TRUE(sgd->ApplyInPlace(p.data(), g.data(), v.data(), 1, 1).ok());  // v=1, p=0.9
  ASSERT_TRUE(sgd->ApplyInPlace(p.data(), g.data(), v.data(), 1, 2).ok());  // v=1.5, p=0.75
  EXPECT_FLOAT_EQ(p[0], 0.75f);
  c.learning_rate = 0;
  EXPECT_FALSE(CreateCpuOptimizer(c).ok());
  c.learning_rate = 0.1f;
  c.momentum = 1.0f;
  EXPECT_FALSE(CreateCpuOptimizer(c).ok());
}

}  // namespace
}  // namespace pstrain::kernels
