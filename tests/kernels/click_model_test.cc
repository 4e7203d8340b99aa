#include "kernels/click_model.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "gtest/gtest.h"
#include "tests/kernels/finite_differences.h"

namespace pstrain::kernels {
namespace {

// A batch of `samples` with `fields` bags over `rows` unique rows; some
// bags empty, some with several entries, one row twice in a bag.
BagIndex RandomBags(int samples, int fields, int rows, uint32_t seed) {
  std::mt19937 rng(seed);
  BagIndex index;
  index.rows = rows;
  index.bag_starts = {0};
  for (int b = 0; b < samples * fields; ++b) {
    const int entries = static_cast<int>(rng() % 4);  // 0..3
    for (int e = 0; e < entries; ++e)
      index.entry_rows.push_back(static_cast<int32_t>(rng() % rows));
    index.bag_starts.push_back(static_cast<int64_t>(index.entry_rows.size()));
  }
  index.entry_rows.push_back(index.entry_rows.back());  // a repeat in the last bag
  ++index.bag_starts.back();
  EXPECT_TRUE(TransposeBags(index).ok());
  return index;
}

// The model's summed logistic loss in double, over dense params followed
// by the rows (the vector the gradient check perturbs).
double ReferenceLoss(const ClickModelShape& shape, const std::vector<double>& all,
                     const std::vector<float>& dense, const std::vector<float>& labels,
                     const BagIndex& bags, int samples) {
  const std::vector<TensorDesc> tensors = ClickModelTensors(shape);
  const int64_t n_params = ClickModelParams(shape);
  const double* rows = all.data() + n_params;
  const int dim = shape.dim, fields = shape.fields;
  auto mlp = [&](std::vector<double> a, size_t first, size_t layers, bool relu_last) {
    for (size_t l = 0; l < layers; ++l) {
      const TensorDesc& w = tensors[first + 2 * l];
      const int64_t in = w.shape[0], out = w.shape[1];
      std::vector<double> z(out);
      for (int64_t j = 0; j < out; ++j) {
        double s = all[tensors[first + 2 * l + 1].offset + j];
        for (int64_t k = 0; k < in; ++k) s += a[k] * all[w.offset + k * out + j];
        z[j] = (l + 1 < layers || relu_last) ? std::max(s, 0.0) : s;
      }
      a = std::move(z);
    }
    return a;
  };
  const size_t bottom_layers = shape.bottom.size() + 1;
  double total = 0;
  for (int i = 0; i < samples; ++i) {
    std::vector<std::vector<double>> vectors;
    vectors.push_back(mlp(
        std::vector<double>(dense.begin() + i * shape.dense, dense.begin() + (i + 1) * shape.dense),
        0, bottom_layers, true));
    for (int f = 0; f < fields; ++f) {
      const int64_t b = int64_t{i} * fields + f;
      std::vector<double> pooled(dim, 0.0);
      const int64_t size = bags.bag_starts[b + 1] - bags.bag_starts[b];
      for (int64_t e = bags.bag_starts[b]; e < bags.bag_starts[b + 1]; ++e) {
        for (int d = 0; d < dim; ++d) pooled[d] += rows[int64_t{bags.entry_rows[e]} * dim + d];
      }
      if (shape.pooling == Pooling::kMean && size > 0) {
        for (double& v : pooled) v /= static_cast<double>(size);
      }
      vectors.push_back(pooled);
    }
    std::vector<double> x = vectors[0];
    if (shape.interaction == Interaction::kCat) {
      for (int f = 1; f <= fields; ++f) x.insert(x.end(), vectors[f].begin(), vectors[f].end());
    } else {
      for (int a = 1; a <= fields; ++a) {
        for (int b = 0; b < a; ++b) {
          double dot = 0;
          for (int d = 0; d < dim; ++d) dot += vectors[a][d] * vectors[b][d];
          x.push_back(dot);
        }
      }
    }
    const double z = mlp(x, 2 * bottom_layers, shape.top.size() + 1, false)[0];
    const double signed_z = labels[i] > 0.5f ? -z : z;
    total += std::max(signed_z, 0.0) + std::log1p(std::exp(-std::abs(signed_z)));
  }
  return total;
}

struct Case {
  Interaction interaction;
  Pooling pooling;
};

class ClickModelTest : public ::testing::TestWithParam<Case> {};

TEST_P(ClickModelTest, GradientsOfParamsAndRowsMatchFiniteDifferences) {
  ClickModelShape shape{.dense = 3, .fields = 3, .dim = 4, .bottom = {5}, .top = {6}};
  shape.interaction = GetParam().interaction;
  shape.pooling = GetParam().pooling;
  const int samples = 4, rows = 7;
  const int64_t n_params = ClickModelParams(shape);
  std::vector<float> params(n_params);
  InitClickParams(shape, 5, 0, n_params, params.data());
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 0.5f);
  for (const TensorDesc& t : ClickModelTensors(shape)) {
    if (t.is_bias) {
      for (int64_t i = 0; i < t.size; ++i) params[t.offset + i] = normal(rng) + 0.1f;
    }
  }
  std::vector<float> row_values(rows * shape.dim);
  for (float& v : row_values) v = normal(rng);
  std::vector<float> dense(samples * shape.dense);
  for (float& v : dense) v = std::abs(normal(rng)) * 2;
  const std::vector<float> labels = {1, 0, 0, 1};
  const BagIndex bags = RandomBags(samples, shape.fields, rows, 3);

  auto kernels = CreateCpuClickModelKernels(shape, 8);
  ASSERT_TRUE(kernels.ok()) << kernels.status();
  std::vector<float> grad(n_params, -1.0f), row_grad(rows * shape.dim, -1.0f), logits(samples);
  ClickStats stats;
  const ClickInputs inputs{samples, dense.data(), labels.data(), &bags};
  ASSERT_TRUE((*kernels)
                  ->ForwardBackward(params.data(), row_values.data(), inputs, 1.0f, grad.data(),
                                    row_grad.data(), logits.data(), &stats)
                  .ok());
  EXPECT_EQ(stats.samples, samples);
  std::vector<float> all = params;
  all.insert(all.end(), row_values.begin(), row_values.end());
  std::vector<double> all_double(all.begin(), all.end());
  EXPECT_NEAR(stats.loss_sum, ReferenceLoss(shape, all_double, dense, labels, bags, samples), 1e-4);
  std::vector<float> all_grad = grad;
  all_grad.insert(all_grad.end(), row_grad.begin(), row_grad.end());
  ExpectGradientMatchesFiniteDifferences(all, all_grad, [&](const std::vector<double>& p) {
    return ReferenceLoss(shape, p, dense, labels, bags, samples);
  });

  // Forward alone gives the same logits; a scaled pass scales the gradients.
  std::vector<float> again(samples);
  ASSERT_TRUE((*kernels)->Forward(params.data(), row_values.data(), inputs, again.data()).ok());
  EXPECT_EQ(again, logits);
  std::vector<float> half(n_params), half_rows(rows * shape.dim);
  ClickStats unused;
  ASSERT_TRUE((*kernels)
                  ->ForwardBackward(params.data(), row_values.data(), inputs, 0.5f, half.data(),
                                    half_rows.data(), nullptr, &unused)
                  .ok());
  for (int64_t i = 0; i < n_params; ++i) EXPECT_FLOAT_EQ(half[i], 0.5f * grad[i]);
  for (size_t i = 0; i < half_rows.size(); ++i) EXPECT_FLOAT_EQ(half_rows[i], 0.5f * row_grad[i]);
}

INSTANTIATE_TEST_SUITE_P(Shapes, ClickModelTest,
                         ::testing::Values(Case{Interaction::kDot, Pooling::kSum},
                                           Case{Interaction::kDot, Pooling::kMean},
                                           Case{Interaction::kCat, Pooling::kSum},
                                           Case{Interaction::kCat, Pooling::kMean}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.interaction == Interaction::kDot ? "Dot"
                                                                                          : "Cat") +
                                  (info.param.pooling == Pooling::kSum ? "Sum" : "Mean");
                         });

TEST(ClickModelShapeTest, TensorsAndWidths) {
  const ClickModelShape dot{.dense = 13, .fields = 26, .dim = 16, .bottom = {64}, .top = {32}};
  EXPECT_EQ(InteractionWidth(dot), 16 + 26 * 27 / 2);
  ClickModelShape cat = dot;
  cat.interaction = Interaction::kCat;
  EXPECT_EQ(InteractionWidth(cat), 16 * 27);
  const std::vector<TensorDesc> tensors = ClickModelTensors(dot);
  ASSERT_EQ(tensors.size(), 8u);
  EXPECT_EQ(tensors[0].name, "bottom0.weight");
  EXPECT_EQ(tensors[2].shape, (std::vector<int64_t>{64, 16}));
  EXPECT_EQ(tensors[4].name, "top0.weight");
  EXPECT_EQ(tensors[4].shape, (std::vector<int64_t>{16 + 351, 32}));
  EXPECT_EQ(tensors[7].shape, (std::vector<int64_t>{1}));
  EXPECT_EQ(ClickModelParams(dot), 13 * 64 + 64 + 64 * 16 + 16 + 367 * 32 + 32 + 32 + 1);
  for (auto bad :
       {ClickModelShape{.dense = 0}, ClickModelShape{.fields = 0}, ClickModelShape{.dim = 0},
        ClickModelShape{.dim = 2000}, ClickModelShape{.bottom = {0}}}) {
    EXPECT_EQ(CheckClickModelShape(bad).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_FALSE(CreateCpuClickModelKernels(bad, 4).ok());
  }
}

TEST(EmbeddingBagTest, PoolsAndScattersInAFixedOrder) {
  // Two bags over three rows: {0, 2, 0} and {}; then {1}.
  BagIndex index;
  index.rows = 3;
  index.bag_starts = {0, 3, 3, 4};
  index.entry_rows = {0, 2, 0, 1};
  ASSERT_TRUE(TransposeBags(index).ok());
  EXPECT_EQ(index.row_starts, (std::vector<int64_t>{0, 2, 3, 4}));
  EXPECT_EQ(index.row_bags, (std::vector<int64_t>{0, 0, 2, 0}));
  const std::vector<float> rows = {1, 2, 10, 20, 100, 200};
  std::vector<float> out(6, -1);
  EmbeddingBagForward(index.view(), 2, Pooling::kSum, rows.data(), out.data());
  EXPECT_EQ(out, (std::vector<float>{102, 204, 0, 0, 10, 20}));
  EmbeddingBagForward(index.view(), 2, Pooling::kMean, rows.data(), out.data());
  const float third = 1.0f / 3;  // the mean multiplies by the reciprocal
  EXPECT_EQ(out, (std::vector<float>{102 * third, 204 * third, 0, 0, 10, 20}));
  const std::vector<float> d_out = {1, -1, 5, 5, 3, 4};
  std::vector<float> grad(6, -1);
  EmbeddingBagBackward(index.view(), 2, Pooling::kSum, d_out.data(), grad.data());
  EXPECT_EQ(grad, (std::vector<float>{2, -2, 3, 4, 1, -1}));
  EmbeddingBagBackward(index.view(), 2, Pooling::kMean, d_out.data(), grad.data());
  EXPECT_EQ(grad, (std::vector<float>{third + third, -third - third, 3, 4, third, -third}));

  index.entry_rows[1] = 3;
  EXPECT_EQ(TransposeBags(index).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain::kernels
