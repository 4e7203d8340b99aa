// The click model on the CPU: OpenBLAS products for the MLPs, plain loops
// for the bags and the interaction.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "kernels/click_model.h"

namespace pstrain::kernels {

void EmbeddingBagForward(const BagIndexView& index, int dim, Pooling pooling, const float* rows,
                         float* out) {
  for (int64_t b = 0; b < index.bags; ++b) {
    float* o = out + b * dim;
    std::fill(o, o + dim, 0.0f);
    const int64_t begin = index.bag_starts[b], end = index.bag_starts[b + 1];
    for (int64_t e = begin; e < end; ++e) {
      const float* row = rows + int64_t{index.entry_rows[e]} * dim;
      for (int d = 0; d < dim; ++d) o[d] += row[d];
    }
    if (pooling == Pooling::kMean && end - begin > 0) {
      const float scale = 1.0f / static_cast<float>(end - begin);
      for (int d = 0; d < dim; ++d) o[d] *= scale;
    }
  }
}

void EmbeddingBagBackward(const BagIndexView& index, int dim, Pooling pooling, const float* d_out,
                          float* row_grad) {
  for (int64_t r = 0; r < index.rows; ++r) {
    float* g = row_grad + r * dim;
    std::fill(g, g + dim, 0.0f);
    for (int64_t i = index.row_starts[r]; i < index.row_starts[r + 1]; ++i) {
      const int64_t b = index.row_bags[i];
      const float* d = d_out + b * dim;
      const int64_t size = index.bag_starts[b + 1] - index.bag_starts[b];
      const float scale = pooling == Pooling::kMean ? 1.0f / static_cast<float>(size) : 1.0f;
      for (int k = 0; k < dim; ++k) g[k] += d[k] * scale;
    }
  }
}

namespace {

// A stack of dense layers (weights {in, out} row-major, then biases) with
// ReLU after each but, optionally, the last; activations kept for backward.
class Layers {
 public:
  Layers(const std::vector<TensorDesc>& tensors, size_t first, size_t count, bool relu_last,
         int max_batch)
      : tensors_(tensors.begin() + first, tensors.begin() + first + 2 * count),
        relu_last_(relu_last) {
    int64_t widest = 0;
    for (size_t l = 0; l < count; ++l) {
      activations_.emplace_back(static_cast<size_t>(max_batch) * out(l));
      widest = std::max({widest, in(l), out(l)});
    }
    delta_.resize(static_cast<size_t>(max_batch) * widest);
    delta_prev_.resize(delta_.size());
  }

  size_t count() const { return activations_.size(); }
  int64_t in(size_t l) const { return tensors_[2 * l].shape[0]; }
  int64_t out(size_t l) const { return tensors_[2 * l].shape[1]; }
  const float* output() const { return activations_.back().data(); }
  // Where Backward wants d(loss)/d(output): batch x out(last).
  float* d_output() { return delta_.data(); }

  void Forward(const float* params, const float* x, int batch) {
    for (size_t l = 0; l < count(); ++l) {
      const int n_in = static_cast<int>(in(l)), n_out = static_cast<int>(out(l));
      float* z = activations_[l].data();
      const float* bias = params + tensors_[2 * l + 1].offset;
      for (int i = 0; i < batch; ++i) std::copy(bias, bias + n_out, z + int64_t{i} * n_out);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, batch, n_out, n_in, 1.0f,
                  l == 0 ? x : activations_[l - 1].data(), n_in,
                  params + tensors_[2 * l].offset, n_out, 1.0f, z, n_out);
      if (l + 1 < count() || relu_last_) {
        for (int64_t i = 0; i < int64_t{batch} * n_out; ++i) z[i] = std::max(z[i], 0.0f);
      }
    }
  }

  // From d_output() (overwritten): the layers' gradients into grad, and
  // d(loss)/d(x) into d_input if set.
  void Backward(const float* params, const float* x, int batch, float* grad, float* d_input) {
    for (size_t l = count(); l-- > 0;) {
      const int n_in = static_cast<int>(in(l)), n_out = static_cast<int>(out(l));
      float* delta = delta_.data();
      if (l + 1 < count() || relu_last_) {
        const float* a = activations_[l].data();
        for (int64_t i = 0; i < int64_t{batch} * n_out; ++i) {
          if (a[i] <= 0.0f) delta[i] = 0.0f;
        }
      }
      const float* a_in = l == 0 ? x : activations_[l - 1].data();
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n_in, n_out, batch, 1.0f, a_in, n_in,
                  delta, n_out, 0.0f, grad + tensors_[2 * l].offset, n_out);
      float* db = grad + tensors_[2 * l + 1].offset;
      std::fill(db, db + n_out, 0.0f);
      for (int i = 0; i < batch; ++i) {
        for (int j = 0; j < n_out; ++j) db[j] += delta[int64_t{i} * n_out + j];
      }
      float* d_prev = l == 0 ? d_input : delta_prev_.data();
      if (d_prev == nullptr) break;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, batch, n_in, n_out, 1.0f, delta, n_out,
                  params + tensors_[2 * l].offset, n_out, 0.0f, d_prev, n_in);
      std::swap(delta_, delta_prev_);
    }
  }

 private:
  const std::vector<TensorDesc> tensors_;
  const bool relu_last_;
  std::vector<std::vector<float>> activations_;
  std::vector<float> delta_, delta_prev_;
};

class CpuClickModel final : public ClickModelKernels {
 public:
  CpuClickModel(const ClickModelShape& shape, int max_batch)
      : shape_(shape),
        max_batch_(max_batch),
        width_(InteractionWidth(shape)),
        bottom_(ClickModelTensors(shape), 0, shape.bottom.size() + 1, /*relu_last=*/true,
                max_batch),
        top_(ClickModelTensors(shape), 2 * (shape.bottom.size() + 1), shape.top.size() + 1,
             /*relu_last=*/false, max_batch),
        pooled_(static_cast<size_t>(max_batch) * shape.fields * shape.dim),
        d_pooled_(pooled_.size()),
        interaction_(static_cast<size_t>(max_batch) * width_),
        d_interaction_(interaction_.size()) {}

  absl::Status ForwardBackward(const float* params, const float* rows, const ClickInputs& inputs,
                               float grad_scale, float* grad, float* row_grad, float* logits,
                               ClickStats* stats) override {
    if (absl::Status s = Forward(params, rows, inputs, logits); !s.ok()) return s;
    const int n = inputs.samples;
    const float* out = top_.output();
    float* d_logit = top_.d_output();
    for (int i = 0; i < n; ++i) {
      const double z = out[i];
      const bool clicked = inputs.labels[i] > 0.5f;
      // log(1 + e^-z) for a click, log(1 + e^z) otherwise; d/dz = sigmoid(z) - label.
      const double signed_z = clicked ? -z : z;
      stats->loss_sum += std::max(signed_z, 0.0) + std::log1p(std::exp(-std::abs(signed_z)));
      const double sigmoid = 1.0 / (1.0 + std::exp(-z));
      d_logit[i] = static_cast<float>(grad_scale * (sigmoid - (clicked ? 1.0 : 0.0)));
    }
    stats->samples += n;
    top_.Backward(params, interaction_.data(), n, grad, d_interaction_.data());
    InteractionBackward(n);
    bottom_.Backward(params, inputs.dense, n, grad, nullptr);
    EmbeddingBagBackward(inputs.bags->view(), shape_.dim, shape_.pooling, d_pooled_.data(),
                         row_grad);
    return absl::OkStatus();
  }

  absl::Status Forward(const float* params, const float* rows, const ClickInputs& inputs,
                       float* logits) override {
    const int n = inputs.samples;
    if (n < 1 || n > max_batch_) {
      return absl::InvalidArgumentError("batch " + std::to_string(n) + " outside [1, " +
                                        std::to_string(max_batch_) + "]");
    }
    if (inputs.bags->bag_starts.size() != static_cast<size_t>(n) * shape_.fields + 1) {
      return absl::InvalidArgumentError("the bags are not samples x fields");
    }
    bottom_.Forward(params, inputs.dense, n);
    EmbeddingBagForward(inputs.bags->view(), shape_.dim, shape_.pooling, rows, pooled_.data());
    InteractionForward(n);
    top_.Forward(params, interaction_.data(), n);
    if (logits != nullptr) std::copy(top_.output(), top_.output() + n, logits);
    return absl::OkStatus();
  }

 private:
  // Vector v (0: the bottom output, f + 1: field f) of sample i.
  const float* Vector(int i, int v) const {
    return v == 0 ? bottom_.output() + int64_t{i} * shape_.dim
                  : pooled_.data() + (int64_t{i} * shape_.fields + v - 1) * shape_.dim;
  }

  void InteractionForward(int n) {
    const int dim = shape_.dim, vectors = shape_.fields + 1;
    for (int i = 0; i < n; ++i) {
      float* o = interaction_.data() + i * width_;
      if (shape_.interaction == Interaction::kCat) {
        for (int v = 0; v < vectors; ++v) std::copy(Vector(i, v), Vector(i, v) + dim, o + v * dim);
        continue;
      }
      std::copy(Vector(i, 0), Vector(i, 0) + dim, o);
      int64_t k = dim;
      for (int a = 1; a < vectors; ++a) {
        for (int b = 0; b < a; ++b) {
          const float *x = Vector(i, a), *y = Vector(i, b);
          float dot = 0;
          for (int d = 0; d < dim; ++d) dot += x[d] * y[d];
          o[k++] = dot;
        }
      }
    }
  }

  // From d_interaction_: the bottom output's gradient into bottom_'s
  // d_output() and the pooled fields' into d_pooled_.
  void InteractionBackward(int n) {
    const int dim = shape_.dim, vectors = shape_.fields + 1;
    float* d_bottom = bottom_.d_output();
    for (int i = 0; i < n; ++i) {
      const float* g = d_interaction_.data() + i * width_;
      auto d_vector = [&](int v) {
        return v == 0 ? d_bottom + int64_t{i} * dim
                      : d_pooled_.data() + (int64_t{i} * shape_.fields + v - 1) * dim;
      };
      if (shape_.interaction == Interaction::kCat) {
        for (int v = 0; v < vectors; ++v) std::copy(g + v * dim, g + (v + 1) * dim, d_vector(v));
        continue;
      }
      std::copy(g, g + dim, d_vector(0));
      for (int v = 1; v < vectors; ++v) std::fill(d_vector(v), d_vector(v) + dim, 0.0f);
      int64_t k = dim;
      for (int a = 1; a < vectors; ++a) {
        for (int b = 0; b < a; ++b) {
          const float dot_grad = g[k++];
          const float *x = Vector(i, a), *y = Vector(i, b);
          float *dx = d_vector(a), *dy = d_vector(b);
          for (int d = 0; d < dim; ++d) {
            dx[d] += dot_grad * y[d];
            dy[d] += dot_grad * x[d];
          }
        }
      }
    }
  }

  const ClickModelShape shape_;
  const int max_batch_;
  const int64_t width_;
  Layers bottom_, top_;
  std::vector<float> pooled_, d_pooled_, interaction_, d_interaction_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ClickModelKernels>> CreateCpuClickModelKernels(
    const ClickModelShape& shape, int max_batch) {
  if (absl::Status s = CheckClickModelShape(shape); !s.ok()) return s;
  if (max_batch < 1) return absl::InvalidArgumentError("max_batch must be >= 1");
  return std::unique_ptr<ClickModelKernels>(new CpuClickModel(shape, max_batch));
}

}  // namespace pstrain::kernels
