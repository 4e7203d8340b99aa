// The CPU CNN against a plain reference in double: its loss, its gradients
// (central finite differences of the reference), its announcements.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/kernels/finite_differences.h"

namespace pstrain::kernels {
namespace {

// Sum of the batch's cross-entropy losses, convolution by convolution in
// nested loops, all in double.
double ReferenceLoss(const ModelShape& shape, const std::vector<double>& p,
                     const std::vector<float>& x, const std::vector<int32_t>& y, int batch) {
  const std::vector<TensorDesc> tensors = ModelTensors(shape);
  double total = 0;
  for (int s = 0; s < batch; ++s) {
    std::vector<double> a(x.begin() + s * shape.input_dim, x.begin() + (s + 1) * shape.input_dim);
    size_t t = 0;
    for (const ConvLayer& c : ConvLayers(shape)) {
      const int h = c.height, w = c.width;
      std::vector<double> relu(static_cast<size_t>(c.out_channels) * h * w);
      for (int o = 0; o < c.out_channels; ++o) {
        for (int i = 0; i < h; ++i) {
          for (int j = 0; j < w; ++j) {
            double z = p[tensors[t + 1].offset + o];
            for (int ci = 0; ci < c.in_channels; ++ci) {
              for (int ky = 0; ky < 3; ++ky) {
                for (int kx = 0; kx < 3; ++kx) {
                  const int yy = i + ky - 1, xx = j + kx - 1;
                  if (yy < 0 || yy >= h || xx < 0 || xx >= w) continue;
                  z += a[(ci * h + yy) * w + xx] *
                       p[tensors[t].offset + ((o * c.in_channels + ci) * 3 + ky) * 3 + kx];
                }
              }
            }
            relu[(o * h + i) * w + j] = std::max(z, 0.0);
          }
        }
      }
      const int ph = c.pooled_height(), pw = c.pooled_width();
      std::vector<double> pooled(static_cast<size_t>(c.out_channels) * ph * pw);
      for (int o = 0; o < c.out_channels; ++o) {
        for (int i = 0; i < ph; ++i) {
          for (int j = 0; j < pw; ++j) {
            const double* r = &relu[(o * h + 2 * i) * w + 2 * j];
            pooled[(o * ph + i) * pw + j] = std::max({r[0], r[1], r[w], r[w + 1]});
          }
        }
      }
      a = std::move(pooled);
      t += 2;
    }
    std::vector<int64_t> widths = {DenseInputDim(shape)};
    widths.insert(widths.end(), shape.hidden.begin(), shape.hidden.end());
    widths.push_back(shape.num_classes);
    for (size_t l = 0; l + 1 < widths.size(); ++l, t += 2) {
      std::vector<double> z(widths[l + 1]);
      for (int64_t j = 0; j < widths[l + 1]; ++j) {
        double v = p[tensors[t + 1].offset + j];
        for (int64_t k = 0; k < widths[l]; ++k) {
          v += a[k] * p[tensors[t].offset + k * widths[l + 1] + j];
        }
        z[j] = l + 2 < widths.size() ? std::max(v, 0.0) : v;
      }
      a = std::move(z);
    }
    const double zmax = *std::max_element(a.begin(), a.end());
    double sum = 0;
    for (double v : a) sum += std::exp(v - zmax);
    total += std::log(sum) - (a[y[s]] - zmax);
  }
  return total;
}

struct CnnCase {
  const char* name;
  ModelShape shape;
};

void PrintTo(const CnnCase& c, std::ostream* out) { *out << c.name; }

class CpuCnnTest : public ::testing::TestWithParam<CnnCase> {
 protected:
  // Parameters with non-zero biases (so that ReLUs are neither all on nor
  // all off), inputs and labels for a batch.
  void SetUp() override {
    shape_ = GetParam().shape;
    const int64_t n = NumParams(shape_);
    params_.resize(n);
    InitParams(shape_, 3, 0, n, params_.data());
    std::mt19937 rng(1);
    std::normal_distribution<float> normal(0.0f, 0.3f);
    for (const TensorDesc& t : ModelTensors(shape_)) {
      if (t.is_bias) {
        for (int64_t i = 0; i < t.size; ++i) params_[t.offset + i] = normal(rng);
      }
    }
    x_.resize(static_cast<size_t>(kBatch) * shape_.input_dim);
    for (float& v : x_) v = normal(rng) + 0.5f;
    for (int i = 0; i < kBatch; ++i) y_.push_back(i % shape_.num_classes);
  }

  static constexpr int kBatch = 3;
  ModelShape shape_;
  std::vector<float> params_, x_;
  std::vector<int32_t> y_;
};

TEST_P(CpuCnnTest, LossAndGradientsMatchTheReference) {
  const int64_t n = NumParams(shape_);
  auto kernels = CreateCpuModelKernels(shape_, kBatch);
  ASSERT_TRUE(kernels.ok()) << kernels.status();
  std::vector<float> grad(n);
  BatchStats stats;
  ASSERT_TRUE((*kernels)->ForwardBackward(params_.data(), x_.data(), y_.data(), kBatch, 1.0f,
                                          grad.data(), &stats)
                  .ok());
  std::vector<double> p(params_.begin(), params_.end());
  EXPECT_NEAR(stats.loss_sum, ReferenceLoss(shape_, p, x_, y_, kBatch), 1e-4);

  const double worst = ExpectGradientMatchesFiniteDifferences(
      params_, grad,
      [&](const std::vector<double>& q) { return ReferenceLoss(shape_, q, x_, y_, kBatch); });
  RecordProperty("worst_relative_error", std::to_string(worst));
}

// Every layer is announced once, last layer first, covering all of it, and
// what was announced is the final gradient; Evaluate (in pieces of the
// batch) gives the loss of ForwardBackward.
TEST_P(CpuCnnTest, LayersAreAnnouncedFinalAndEvaluateAgrees) {
  const std::vector<TensorDesc> tensors = ModelTensors(shape_);
  const int layers = static_cast<int>(tensors.size() / 2);
  auto kernels = *CreateCpuModelKernels(shape_, kBatch);
  std::vector<float> grad(NumParams(shape_));
  std::vector<int> order;
  std::vector<std::vector<float>> announced(layers);
  BatchStats trained;
  ASSERT_TRUE(kernels
                  ->ForwardBackward(params_.data(), x_.data(), y_.data(), kBatch, 0.5f,
                                    grad.data(), &trained,
                                    [&](int layer, int64_t ready) {
                                      const int64_t floats =
                                          tensors[2 * layer].size + tensors[2 * layer + 1].size;
                                      if (ready < floats) return;  // an early prefix
                                      order.push_back(layer);
                                      const float* g = grad.data() + tensors[2 * layer].offset;
                                      announced[layer].assign(g, g + floats);
                                    })
                  .ok());
  std::vector<int> expected(layers);
  for (int l = 0; l < layers; ++l) expected[l] = layers - 1 - l;
  EXPECT_EQ(order, expected);
  for (int l = 0; l < layers; ++l) {
    const float* g = grad.data() + tensors[2 * l].offset;
    EXPECT_EQ(announced[l], std::vector<float>(g, g + announced[l].size())) << "layer " << l;
  }

  auto one_at_a_time = *CreateCpuModelKernels(shape_, 2);
  BatchStats evaluated;
  ASSERT_TRUE(
      one_at_a_time->Evaluate(params_.data(), x_.data(), y_.data(), kBatch, &evaluated).ok());
  EXPECT_NEAR(evaluated.loss_sum, trained.loss_sum, 1e-5 * kBatch);
  EXPECT_EQ(evaluated.correct, trained.correct);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CpuCnnTest,
    ::testing::Values(
        // Two channels, an odd side (pooling drops a column), two convolutions.
        CnnCase{"two_convolutions_and_a_hidden_layer", {2 * 6 * 5, {5}, 3, {3, 4}, 2, 6, 5}},
        CnnCase{"one_convolution_straight_to_the_logits", {1 * 4 * 4, {}, 3, {2}, 1, 4, 4}}),
    [](const ::testing::TestParamInfo<CnnCase>& info) { return std::string(info.param.name); });

TEST(CpuCnnShapeTest, BadShapesAreRefused) {
  EXPECT_FALSE(CreateCpuModelKernels({784, {}, 10, {8}, 1, 28, 27}, 1).ok());  // not 784 values
  EXPECT_FALSE(CreateCpuModelKernels({784, {}, 10, {8, 0}, 1, 28, 28}, 1).ok());
  EXPECT_FALSE(CreateCpuModelKernels({4, {}, 10, {8, 8}, 1, 2, 2}, 1).ok());  // pooled below 1x1
  EXPECT_TRUE(CreateCpuModelKernels({784, {128}, 10, {32, 64}, 1, 28, 28}, 64).ok());
}

}  // namespace
}  // namespace pstrain::kernels
