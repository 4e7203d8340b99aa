// The classifier on a GPU, convolutions (a CNN) then dense layers:
// cublasGemmEx for the products (fp32, TF32, or bf16 or fp16 inputs with
// fp32 accumulation), CUDA kernels for the rest. The same computation as
// kernels/cpu/mlp.cc and kernels/cpu/cnn.cc, layer for layer, in the same
// layouts: a convolution is im2col + one product over the batch.
#include <algorithm>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

namespace pstrain::kernels::cuda {
namespace {

class CudaMlp final : public ModelKernels {
 public:
  CudaMlp(Device* device, int ordinal, cudaStream_t stream, cublasHandle_t cublas,
          const ModelShape& shape, int max_batch, Precision precision)
      : device_(device),
        ordinal_(ordinal),
        stream_(stream),
        cublas_(cublas),
        tensors_(ModelTensors(shape)),
        convs_(ConvLayers(shape)),
        max_batch_(max_batch),
        precision_(precision),
        input_dim_(shape.input_dim) {
    widths_.push_back(DenseInputDim(shape));
    widths_.insert(widths_.end(), shape.hidden.begin(), shape.hidden.end());
    widths_.push_back(shape.num_classes);
  }

  absl::Status Init() {
    const int layers = num_layers();
    max_width_ = *std::max_element(widths_.begin(), widths_.end());
    activations_.resize(layers + 1);
    for (int l = 1; l <= layers; ++l) {
      absl::StatusOr<DeviceBuffer> b = device_->Allocate(Bytes(max_batch_, widths_[l]));
      if (!b.ok()) return b.status();
      activations_[l] = std::move(*b);
    }
    // The convolutions' buffers, [C][B][H][W] each.
    int64_t largest_conv = 0;
    auto allocate = [&](int64_t floats, DeviceBuffer* b) -> absl::Status {
      absl::StatusOr<DeviceBuffer> a = device_->Allocate(floats * sizeof(float));
      if (!a.ok()) return a.status();
      *b = std::move(*a);
      largest_conv = std::max(largest_conv, floats);
      return absl::OkStatus();
    };
    int64_t widest_out = 0, widest_pooled = 0;
    for (const ConvLayer& c : convs_) {
      const int64_t pixels = int64_t{max_batch_} * c.height * c.width;
      const int64_t pooled =
          int64_t{max_batch_} * c.out_channels * c.pooled_height() * c.pooled_width();
      ConvBuffers b;
      for (auto [floats, buffer] : {std::pair{c.patch() * pixels, &b.col},
                                    std::pair{c.out_channels * pixels, &b.relu},
                                    std::pair{pooled, &b.pooled}, std::pair{pooled, &b.from}}) {
        if (absl::Status s = allocate(floats, buffer); !s.ok()) return s;  // int32 fits a float
      }
      conv_.push_back(std::move(b));
      widest_out = std::max(widest_out, c.out_channels * pixels);
      widest_pooled = std::max(widest_pooled, pooled);
    }
    if (!convs_.empty()) {
      const ConvLayer& first = convs_.front();
      const int64_t features = int64_t{max_batch_} * widths_[0];
      for (auto [floats, buffer] :
           {std::pair{features, &features_}, std::pair{features, &d_features_},
            std::pair{widest_out, &d_out_}, std::pair{widest_pooled, &d_in_},
            std::pair{first.in_channels > 1
                          ? int64_t{max_batch_} * first.in_channels * first.height * first.width
                          : 1,
                      &input_}}) {
        if (absl::Status s = allocate(floats, buffer); !s.ok()) return s;
      }
    }
    for (DeviceBuffer* b : {&delta_, &delta_prev_}) {
      absl::StatusOr<DeviceBuffer> a = device_->Allocate(Bytes(max_batch_, max_width_));
      if (!a.ok()) return a.status();
      *b = std::move(*a);
    }
    absl::StatusOr<DeviceBuffer> loss = device_->Allocate(max_batch_ * sizeof(float));
    absl::StatusOr<DeviceBuffer> correct = device_->Allocate(max_batch_ * sizeof(int32_t));
    absl::StatusOr<DeviceBuffer> flag = device_->Allocate(sizeof(int32_t));
    if (!loss.ok() || !correct.ok() || !flag.ok()) {
      return absl::ResourceExhaustedError("cuda:" + std::to_string(ordinal_) +
                                          ": out of memory for the loss buffers");
    }
    row_loss_ = std::move(*loss);
    row_correct_ = std::move(*correct);
    bad_label_ = std::move(*flag);
    if (precision_ == Precision::kBf16 || precision_ == Precision::kFp16) {
      // Operands converted to 16 bits: the largest activation or weight matrix.
      int64_t largest = std::max(static_cast<int64_t>(max_batch_) * max_width_, largest_conv);
      for (const TensorDesc& t : tensors_) largest = std::max(largest, t.size);
      for (DeviceBuffer* b : {&half_a_, &half_b_}) {
        absl::StatusOr<DeviceBuffer> a = device_->Allocate(largest * sizeof(uint16_t));
        if (!a.ok()) return a.status();
        *b = std::move(*a);
      }
    }
    return absl::OkStatus();
  }

  absl::Status ForwardBackward(const float* params, const float* x, const int32_t* labels,
                               int batch, float grad_scale, float* grad, BatchStats* stats,
                               const GradientReadyFn& on_ready,
                               const ParamsNeededFn& params_needed) override {
    if (batch < 1 || batch > max_batch_) {
      return absl::InvalidArgumentError("batch " + std::to_string(batch) + " outside [1, " +
                                        std::to_string(max_batch_) + "]");
    }
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    if (absl::Status s = Forward(params, x, batch, params_needed); !s.ok()) return s;
    const int layers = num_layers();
    const int classes = widths_[layers];
    LaunchSoftmaxCrossEntropy(stream_, activations_[layers].as<float>(), labels, batch, classes,
                              grad_scale, delta_.as<float>(), row_loss_.as<float>(),
                              row_correct_.as<int32_t>(), bad_label_.as<int32_t>());
    const float* dense_in = convs_.empty() ? x : features_.as<float>();
    for (int l = layers - 1; l >= 0; --l) {
      const int in = widths_[l], out = widths_[l + 1];
      const float* a_in = l == 0 ? dense_in : activations_[l].as<float>();
      float* dw = grad + weight(l).offset;
      float* db = grad + bias(l).offset;
      // dW = A_in^T * delta
      if (absl::Status s = Gemm(true, false, in, out, batch, a_in, in, delta_.as<float>(), out,
                                0.0f, dw, out);
          !s.ok()) {
        return s;
      }
      LaunchColumnSums(stream_, delta_.as<float>(), batch, out, db);
      if (l > 0 || !convs_.empty()) {
        // delta_prev = delta * W^T, masked by ReLU'(z) == (a > 0) inside
        // the dense layers; below them, the convolutions' d(features).
        const float* w = params + weight(l).offset;
        float* d_prev = l > 0 ? delta_prev_.as<float>() : d_features_.as<float>();
        if (absl::Status s = Gemm(false, true, batch, in, out, delta_.as<float>(), out, w, out,
                                  0.0f, d_prev, in);
            !s.ok()) {
          return s;
        }
        if (l > 0) {
          LaunchReluMask(stream_, activations_[l].as<float>(), delta_prev_.as<float>(),
                         static_cast<int64_t>(batch) * in);
          std::swap(delta_, delta_prev_);
        }
      }
      if (absl::Status s = Announce(on_ready, first_dense() + l, int64_t{in} * out + out);
          !s.ok()) {
        return s;
      }
    }
    if (!convs_.empty()) {
      const ConvLayer& last = convs_.back();
      LaunchTranspose(stream_, d_features_.as<float>(), last.out_channels, batch,
                      last.pooled_height() * last.pooled_width(), /*to_rows=*/false,
                      d_in_.as<float>());
      for (int l = static_cast<int>(convs_.size()) - 1; l >= 0; --l) {
        if (absl::Status s = BackwardConv(l, params, batch, grad, on_ready); !s.ok()) return s;
      }
    }
    return Collect(batch, stats);
  }

  absl::Status Evaluate(const float* params, const float* x, const int32_t* labels,
                        int64_t batch, BatchStats* stats) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    const int layers = num_layers();
    const int classes = widths_[layers];
    for (int64_t start = 0; start < batch; start += max_batch_) {
      const int n = static_cast<int>(std::min<int64_t>(max_batch_, batch - start));
      if (absl::Status s = Forward(params, x + start * input_dim_, n); !s.ok()) return s;
      LaunchSoftmaxCrossEntropy(stream_, activations_[layers].as<float>(), labels + start, n,
                                classes, 0.0f, nullptr, row_loss_.as<float>(),
                                row_correct_.as<int32_t>(), bad_label_.as<int32_t>());
      if (absl::Status s = Collect(n, stats); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  int num_layers() const { return static_cast<int>(widths_.size()) - 1; }
  int first_dense() const { return static_cast<int>(convs_.size()); }
  const TensorDesc& weight(int dense_layer) const {
    return tensors_[2 * (first_dense() + dense_layer)];
  }
  const TensorDesc& bias(int dense_layer) const {
    return tensors_[2 * (first_dense() + dense_layer) + 1];
  }

  // Layer `layer`'s gradient is final: once it is in memory, on_ready.
  absl::Status Announce(const GradientReadyFn& on_ready, int layer, int64_t floats) {
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
    if (on_ready) {
      CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      on_ready(layer, floats);
    }
    return absl::OkStatus();
  }
  static size_t Bytes(int rows, int cols) {
    return static_cast<size_t>(rows) * cols * sizeof(float);
  }

  // Asks for each layer's parameters (if params_needed is set) before it
  // launches the layer's kernels: the host waits for a layer's values while
  // the device computes the layers before it.
  absl::Status Forward(const float* params, const float* x, int batch,
                       const ParamsNeededFn& params_needed = nullptr) {
    auto ask = [&](int layer) {
      if (!params_needed) return absl::OkStatus();
      return params_needed(layer, tensors_[2 * layer].size + tensors_[2 * layer + 1].size);
    };
    const float* dense_in = x;
    if (!convs_.empty()) {
      const ConvLayer& first = convs_.front();
      const float* in = x;
      if (first.in_channels > 1) {  // [B][C][H][W] -> [C][B][H][W]
        LaunchTranspose(stream_, x, first.in_channels, batch, first.height * first.width,
                        /*to_rows=*/false, input_.as<float>());
        in = input_.as<float>();
      }
      for (size_t l = 0; l < convs_.size(); ++l) {
        if (absl::Status s = ask(static_cast<int>(l)); !s.ok()) return s;
        if (absl::Status s = ForwardConv(l, params, in, batch); !s.ok()) return s;
        in = conv_[l].pooled.as<float>();
      }
      const ConvLayer& last = convs_.back();
      LaunchTranspose(stream_, in, last.out_channels, batch,
                      last.pooled_height() * last.pooled_width(), /*to_rows=*/true,
                      features_.as<float>());
      dense_in = features_.as<float>();
    }
    const int layers = num_layers();
    for (int l = 0; l < layers; ++l) {
      if (absl::Status s = ask(first_dense() + l); !s.ok()) return s;
      const int in = widths_[l], out = widths_[l + 1];
      const float* a_in = l == 0 ? dense_in : activations_[l].as<float>();
      const float* w = params + weight(l).offset;
      const float* b = params + bias(l).offset;
      float* z = activations_[l + 1].as<float>();
      LaunchFillRows(stream_, b, batch, out, z);
      if (absl::Status s = Gemm(false, false, batch, out, in, a_in, in, w, out, 1.0f, z, out);
          !s.ok()) {
        return s;
      }
      if (l + 1 < layers) LaunchRelu(stream_, z, static_cast<int64_t>(batch) * out);
    }
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }

  // col = im2col(in), relu = ReLU(W col + b), pooled = its 2x2 maxima.
  absl::Status ForwardConv(size_t l, const float* params, const float* in, int batch) {
    const ConvLayer& c = convs_[l];
    ConvBuffers& b = conv_[l];
    const int pixels = batch * c.height * c.width;
    LaunchIm2Col(stream_, c, in, batch, b.col.as<float>());
    LaunchFillChannels(stream_, params + tensors_[2 * l + 1].offset, c.out_channels, pixels,
                       b.relu.as<float>());
    if (absl::Status s = Gemm(false, false, c.out_channels, pixels, c.patch(),
                              params + tensors_[2 * l].offset, c.patch(), b.col.as<float>(),
                              pixels, 1.0f, b.relu.as<float>(), pixels);
        !s.ok()) {
      return s;
    }
    LaunchRelu(stream_, b.relu.as<float>(), int64_t{c.out_channels} * pixels);
    LaunchMaxPool(stream_, c, batch, b.relu.as<float>(), b.pooled.as<float>(),
                  b.from.as<int32_t>());
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return absl::OkStatus();
  }

  // From d(pooled) in d_in_: the layer's gradients and, below the first
  // layer, d(the pooled output beneath) back in d_in_.
  absl::Status BackwardConv(int l, const float* params, int batch, float* grad,
                            const GradientReadyFn& on_ready) {
    const ConvLayer& c = convs_[l];
    ConvBuffers& b = conv_[l];
    const int pixels = batch * c.height * c.width;
    const int64_t outputs = int64_t{c.out_channels} * pixels;
    float* dz = d_out_.as<float>();
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dz, 0, outputs * sizeof(float), stream_));
    LaunchUnpool(stream_, b.from.as<int32_t>(), d_in_.as<float>(),
                 int64_t{c.out_channels} * batch * c.pooled_height() * c.pooled_width(), dz);
    LaunchReluMask(stream_, b.relu.as<float>(), dz, outputs);
    const float* w = params + tensors_[2 * l].offset;
    if (absl::Status s = Gemm(false, true, c.out_channels, c.patch(), pixels, dz, pixels,
                              b.col.as<float>(), pixels, 0.0f, grad + tensors_[2 * l].offset,
                              c.patch());
        !s.ok()) {
      return s;
    }
    LaunchRowSums(stream_, dz, c.out_channels, pixels, grad + tensors_[2 * l + 1].offset);
    if (l > 0) {
      // d(col) = W^T dZ over col (used for the last time), then col2im.
      if (absl::Status s = Gemm(true, false, c.patch(), pixels, c.out_channels, w, c.patch(), dz,
                                pixels, 0.0f, b.col.as<float>(), pixels);
          !s.ok()) {
        return s;
      }
      LaunchCol2Im(stream_, c, b.col.as<float>(), batch, d_in_.as<float>());
    }
    return Announce(on_ready, l, int64_t{c.out_channels} * c.patch() + c.out_channels);
  }

  // Sums the per-row loss and accuracy on the host (in double, like the
  // CPU twin) and checks the labels.
  absl::Status Collect(int batch, BatchStats* stats) {
    std::vector<float> loss(batch);
    std::vector<int32_t> correct(batch);
    int32_t bad = 0;
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(loss.data(), row_loss_.as<float>(), batch * sizeof(float),
                                         cudaMemcpyDeviceToHost, stream_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(correct.data(), row_correct_.as<int32_t>(),
                                         batch * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                         stream_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&bad, bad_label_.as<int32_t>(), sizeof(int32_t),
                                         cudaMemcpyDeviceToHost, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    if (bad != 0) {
      CUDA_RETURN_IF_ERROR(cudaMemsetAsync(bad_label_.as<int32_t>(), 0, sizeof(int32_t), stream_));
      return absl::InvalidArgumentError("a label is outside [0, " +
                                        std::to_string(widths_.back()) + ")");
    }
    for (int i = 0; i < batch; ++i) {
      stats->loss_sum += loss[i];
      stats->correct += correct[i];
    }
    return absl::OkStatus();
  }

  // Row-major C = op(A) * op(B) (+ beta C), op(A) M x K, op(B) K x N; lda,
  // ldb, ldc are the row strides of the stored matrices. cuBLAS is
  // column-major, so it computes C^T = op(B)^T op(A)^T on the same memory.
  absl::Status Gemm(bool trans_a, bool trans_b, int m, int n, int k, const float* a, int lda,
                    const float* b, int ldb, float beta, float* c, int ldc) {
    const float alpha = 1.0f;
    const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const void* a_data = a;
    const void* b_data = b;
    cudaDataType_t in_type = CUDA_R_32F;
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    if (precision_ == Precision::kTf32) compute = CUBLAS_COMPUTE_32F_FAST_TF32;
    if (precision_ == Precision::kBf16 || precision_ == Precision::kFp16) {
      // fp16: a value beyond 65504 becomes an infinity (the overflow that
      // dynamic loss scaling detects).
      const int64_t a_elems = static_cast<int64_t>(trans_a ? k : m) * lda;
      const int64_t b_elems = static_cast<int64_t>(trans_b ? n : k) * ldb;
      const auto cast = precision_ == Precision::kBf16 ? LaunchToBf16 : LaunchToFp16;
      cast(stream_, a, half_a_.as<uint16_t>(), a_elems);
      cast(stream_, b, half_b_.as<uint16_t>(), b_elems);
      a_data = half_a_.as<uint16_t>();
      b_data = half_b_.as<uint16_t>();
      in_type = precision_ == Precision::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
    }
    CUBLAS_RETURN_IF_ERROR(cublasGemmEx(cublas_, op_b, op_a, n, m, k, &alpha, b_data, in_type, ldb,
                                        a_data, in_type, lda, &beta, c, CUDA_R_32F, ldc, compute,
                                        CUBLAS_GEMM_DEFAULT));
    return absl::OkStatus();
  }

  Device* const device_;
  const int ordinal_;
  const cudaStream_t stream_;
  const cublasHandle_t cublas_;
  const std::vector<TensorDesc> tensors_;
  const std::vector<ConvLayer> convs_;
  const int max_batch_;
  const Precision precision_;
  const int64_t input_dim_;
  std::vector<int> widths_;
  int max_width_ = 0;
  std::vector<DeviceBuffer> activations_;  // [0] unused: the input is read in place
  DeviceBuffer delta_, delta_prev_, row_loss_, row_correct_, bad_label_, half_a_, half_b_;
  // Per convolution: im2col, ReLU output, pooled output, where each pooled
  // value came from (int32).
  struct ConvBuffers {
    DeviceBuffer col, relu, pooled, from;
  };
  std::vector<ConvBuffers> conv_;
  // The dense input and its gradient, d(a ReLU output), d(a pooled output),
  // a multi-channel input as [C][B][H][W].
  DeviceBuffer features_, d_features_, d_out_, d_in_, input_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCudaMlp(Device* device, int ordinal,
                                                            cudaStream_t stream,
                                                            cublasHandle_t cublas,
                                                            const ModelShape& shape,
                                                            int max_batch, Precision precision) {
  if (absl::Status s = CheckModelShape(shape); !s.ok()) return s;
  if (max_batch < 1) return absl::InvalidArgumentError("max_batch must be >= 1");
  auto mlp = std::make_unique<CudaMlp>(device, ordinal, stream, cublas, shape, max_batch,
                                       precision);
  if (absl::Status s = mlp->Init(); !s.ok()) return s;
  return mlp;
}

}  // namespace pstrain::kernels::cuda
