// Dense layers forward/backward with cblas_sgemm, and the MLP made of them.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/cpu_models.h"

namespace pstrain::kernels {
namespace {

// Row blocks of the first layer's weight: its gradient's, each announced
// when done, and the forward pass's product, each asked for before it is
// read. Always in blocks, asked for or not: the sums are the same in every
// run.
constexpr int kFirstLayerBlocks = 8;

// Rows [RowBlockStart(rows, b), RowBlockStart(rows, b + 1)) are block b of
// `blocks`.
int RowBlockStart(int rows, int b, int blocks) {
  return static_cast<int>(static_cast<int64_t>(rows) * b / blocks);
}

// Adds loss and accuracy to stats; if dlogits is set, writes
// grad_scale * (softmax - onehot) there.
void SoftmaxCrossEntropy(const float* logits, const int32_t* labels, int batch, int classes,
                         float grad_scale, float* dlogits, BatchStats* stats) {
  for (int i = 0; i < batch; ++i) {
    const float* z = logits + static_cast<size_t>(i) * classes;
    int argmax = 0;
    for (int j = 1; j < classes; ++j) {
      if (z[j] > z[argmax]) argmax = j;
    }
    const float zmax = z[argmax];
    double sum = 0;
    for (int j = 0; j < classes; ++j) sum += std::exp(static_cast<double>(z[j] - zmax));
    const int y = labels[i];
    stats->loss_sum += std::log(sum) - static_cast<double>(z[y] - zmax);
    if (argmax == y) ++stats->correct;
    if (dlogits != nullptr) {
      float* d = dlogits + static_cast<size_t>(i) * classes;
      for (int j = 0; j < classes; ++j) {
        const double p = std::exp(static_cast<double>(z[j] - zmax)) / sum;
        d[j] = static_cast<float>((p - (j == y ? 1.0 : 0.0)) * grad_scale);
      }
    }
  }
}

class CpuMlp final : public ModelKernels {
 public:
  CpuMlp(const ModelShape& shape, int max_batch, Precision precision)
      : dense_(shape, max_batch, precision) {}

  absl::Status ForwardBackward(const float* params, const float* x, const int32_t* labels,
                               int batch, float grad_scale, float* grad, BatchStats* stats,
                               const GradientReadyFn& on_ready,
                               const ParamsNeededFn& params_needed) override {
    if (absl::Status s = dense_.CheckBatch(labels, batch); !s.ok()) return s;
    if (absl::Status s = dense_.Forward(params, x, batch, params_needed); !s.ok()) return s;
    dense_.Backward(params, x, labels, batch, grad_scale, grad, stats, on_ready,
                    /*d_input=*/nullptr);
    return absl::OkStatus();
  }

  absl::Status Evaluate(const float* params, const float* x, const int32_t* labels,
                        int64_t batch, BatchStats* stats) override {
    for (int64_t start = 0; start < batch; start += dense_.max_batch()) {
      const int n = static_cast<int>(std::min<int64_t>(dense_.max_batch(), batch - start));
      if (absl::Status s = dense_.CheckBatch(labels + start, n); !s.ok()) return s;
      if (absl::Status s = dense_.Forward(params, x + start * dense_.input_dim(), n); !s.ok()) {
        return s;
      }
      dense_.AddStats(labels + start, n, stats);
    }
    return absl::OkStatus();
  }

 private:
  DenseLayers dense_;
};

}  // namespace

void Gemm::operator()(bool trans_a, bool trans_b, int m, int n, int k, const float* a, int lda,
                      const float* b, int ldb, float beta, float* c, int ldc) {
  if (precision_ != Precision::kFp32) {
    // The floats each stored matrix spans: rows - 1 strides and one row.
    a = Rounded(a, int64_t{(trans_a ? k : m) - 1} * lda + (trans_a ? m : k), &rounded_a_);
    b = Rounded(b, int64_t{(trans_b ? n : k) - 1} * ldb + (trans_b ? k : n), &rounded_b_);
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
}

const float* Gemm::Rounded(const float* matrix, int64_t floats, std::vector<float>* into) const {
  if (static_cast<int64_t>(into->size()) < floats) into->resize(floats);
  RoundTo(precision_, matrix, into->data(), floats);
  return into->data();
}

DenseLayers::DenseLayers(const ModelShape& shape, int max_batch, Precision precision)
    : tensors_(ModelTensors(shape)),
      first_layer_(static_cast<int>(shape.conv.size())),
      max_batch_(max_batch),
      gemm_(precision) {
  widths_.push_back(DenseInputDim(shape));
  widths_.insert(widths_.end(), shape.hidden.begin(), shape.hidden.end());
  widths_.push_back(shape.num_classes);
  const int layers = num_layers();
  activations_.resize(layers + 1);
  for (int l = 1; l <= layers; ++l) {
    activations_[l].resize(static_cast<size_t>(max_batch) * widths_[l]);
  }
  // The deltas hold any layer's (the input's, when asked for, go to the caller's buffer).
  const int64_t widest = *std::max_element(widths_.begin() + 1, widths_.end());
  delta_.resize(static_cast<size_t>(max_batch) * widest);
  delta_prev_.resize(static_cast<size_t>(max_batch) * widest);
}

absl::Status DenseLayers::CheckBatch(const int32_t* labels, int batch) const {
  if (batch < 1 || batch > max_batch_) {
    return absl::InvalidArgumentError("batch " + std::to_string(batch) + " outside [1, " +
                                      std::to_string(max_batch_) + "]");
  }
  const int64_t classes = widths_.back();
  for (int i = 0; i < batch; ++i) {
    if (labels[i] < 0 || labels[i] >= classes) {
      return absl::InvalidArgumentError("label " + std::to_string(labels[i]) + " outside [0, " +
                                        std::to_string(classes) + ")");
    }
  }
  return absl::OkStatus();
}

// activations_[l+1] = ReLU(A_l W_l + b_l); the logits (last) have no ReLU.
absl::Status DenseLayers::Forward(const float* params, const float* x, int batch,
                                  const ParamsNeededFn& params_needed) {
  const int layers = num_layers();
  for (int l = 0; l < layers; ++l) {
    const int in = static_cast<int>(widths_[l]), out = static_cast<int>(widths_[l + 1]);
    const int model_layer = first_layer_ + l;
    const float* a_in = l == 0 ? x : activations_[l].data();
    const float* w = params + weight(l).offset;
    float* z = activations_[l + 1].data();
    // The model's first layer in row blocks of W (blocks of A's columns),
    // each read once it is there; the bias, which follows the weight, last.
    const int blocks = model_layer == 0 ? std::min(in, kFirstLayerBlocks) : 1;
    for (int b = 0; b < blocks; ++b) {
      const int r0 = RowBlockStart(in, b, blocks), r1 = RowBlockStart(in, b + 1, blocks);
      if (params_needed) {
        if (absl::Status s = params_needed(model_layer, int64_t{r1} * out); !s.ok()) return s;
      }
      gemm_(false, false, batch, out, r1 - r0, a_in + r0, in, w + static_cast<size_t>(r0) * out,
            out, b == 0 ? 0.0f : 1.0f, z, out);
    }
    if (params_needed) {
      if (absl::Status s = params_needed(model_layer, int64_t{in} * out + out); !s.ok()) return s;
    }
    const float* bias_values = params + bias(l).offset;
    for (int i = 0; i < batch; ++i) {
      float* row = z + static_cast<size_t>(i) * out;
      for (int j = 0; j < out; ++j) row[j] += bias_values[j];
    }
    if (l + 1 < layers) {
      const size_t n = static_cast<size_t>(batch) * out;
      for (size_t i = 0; i < n; ++i) z[i] = std::max(z[i], 0.0f);
    }
  }
  return absl::OkStatus();
}

void DenseLayers::AddStats(const int32_t* labels, int batch, BatchStats* stats) const {
  SoftmaxCrossEntropy(activations_.back().data(), labels, batch,
                      static_cast<int>(widths_.back()), /*grad_scale=*/0.0f,
                      /*dlogits=*/nullptr, stats);
}

void DenseLayers::Backward(const float* params, const float* x, const int32_t* labels,
                           int batch, float grad_scale, float* grad, BatchStats* stats,
                           const GradientReadyFn& on_ready, float* d_input) {
  const int layers = num_layers();
  // delta_ = d(loss)/d(logits), scaled.
  SoftmaxCrossEntropy(activations_[layers].data(), labels, batch,
                      static_cast<int>(widths_[layers]), grad_scale, delta_.data(), stats);
  for (int l = layers - 1; l >= 0; --l) {
    const int in = static_cast<int>(widths_[l]), out = static_cast<int>(widths_[l + 1]);
    const int model_layer = first_layer_ + l;
    const float* a_in = l == 0 ? x : activations_[l].data();
    float* dw = grad + weight(l).offset;
    float* db = grad + bias(l).offset;
    const int64_t layer_floats = static_cast<int64_t>(in) * out + out;
    // dW = A_in^T * delta. The model's first layer's, the last product of
    // the pass, in row blocks announced one by one, so that their pushes
    // overlap the rest of it (row r of dW is input feature r).
    const int blocks = model_layer == 0 && on_ready ? std::min(in, kFirstLayerBlocks) : 1;
    for (int b = 0; b < blocks; ++b) {
      const int r0 = RowBlockStart(in, b, blocks), r1 = RowBlockStart(in, b + 1, blocks);
      gemm_(true, false, r1 - r0, out, batch, a_in + r0, in, delta_.data(), out, 0.0f,
            dw + static_cast<size_t>(r0) * out, out);
      if (b + 1 < blocks) on_ready(0, static_cast<int64_t>(r1) * out);
    }
    std::fill(db, db + out, 0.0f);
    for (int i = 0; i < batch; ++i) {
      const float* row = delta_.data() + static_cast<size_t>(i) * out;
      for (int j = 0; j < out; ++j) db[j] += row[j];
    }
    if (l == 0 && d_input == nullptr) {
      if (on_ready) on_ready(model_layer, layer_floats);
      break;
    }
    // delta_prev = delta * W^T, masked by ReLU'(z) == (a > 0) inside the
    // dense layers (the input's own mask is its producer's business).
    const float* w = params + weight(l).offset;
    float* d_prev = l == 0 ? d_input : delta_prev_.data();
    gemm_(false, true, batch, in, out, delta_.data(), out, w, out, 0.0f, d_prev, in);
    // W_l has been used for the last time in this pass.
    if (on_ready) on_ready(model_layer, layer_floats);
    if (l == 0) break;
    const float* a = activations_[l].data();
    const size_t n = static_cast<size_t>(batch) * in;
    for (size_t i = 0; i < n; ++i) {
      if (a[i] <= 0.0f) delta_prev_[i] = 0.0f;
    }
    std::swap(delta_, delta_prev_);
  }
}

std::unique_ptr<ModelKernels> NewCpuMlp(const ModelShape& shape, int max_batch,
                                        Precision precision) {
  return std::make_unique<CpuMlp>(shape, max_batch, precision);
}

absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCpuModelKernels(const ModelShape& shape,
                                                                     int max_batch,
                                                                     Precision precision) {
  if (absl::Status s = CheckModelShape(shape); !s.ok()) return s;
  if (max_batch < 1) return absl::InvalidArgumentError("max_batch must be >= 1");
  return shape.conv.empty() ? NewCpuMlp(shape, max_batch, precision)
                            : NewCpuCnn(shape, max_batch, precision);
}

void SetBlasThreads(int threads) { openblas_set_num_threads(threads); }

}  // namespace pstrain::kernels
