// The dense classifier on a GPU: cublasGemmEx for the products (fp32, TF32,
// or bf16 inputs with fp32 accumulation), CUDA kernels for the rest. The
// same computation as kernels/cpu/mlp.cc, layer for layer.
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
        max_batch_(max_batch),
        precision_(precision) {
    widths_.push_back(shape.input_dim);
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
    if (precision_ == Precision::kBf16) {
      // Operands converted to bf16: the largest activation or weight matrix.
      int64_t largest = static_cast<int64_t>(max_batch_) * max_width_;
      for (const TensorDesc& t : tensors_) largest = std::max(largest, t.size);
      for (DeviceBuffer* b : {&bf16_a_, &bf16_b_}) {
        absl::StatusOr<DeviceBuffer> a = device_->Allocate(largest * sizeof(uint16_t));
        if (!a.ok()) return a.status();
        *b = std::move(*a);
      }
    }
    return absl::OkStatus();
  }

  absl::Status ForwardBackward(const float* params, const float* x, const int32_t* labels,
                               int batch, float grad_scale, float* grad, BatchStats* stats,
                               const GradientReadyFn& on_ready) override {
    if (batch < 1 || batch > max_batch_) {
      return absl::InvalidArgumentError("batch " + std::to_string(batch) + " outside [1, " +
                                        std::to_string(max_batch_) + "]");
    }
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    if (absl::Status s = Forward(params, x, batch); !s.ok()) return s;
    const int layers = num_layers();
    const int classes = widths_[layers];
    LaunchSoftmaxCrossEntropy(stream_, activations_[layers].as<float>(), labels, batch, classes,
                              grad_scale, delta_.as<float>(), row_loss_.as<float>(),
                              row_correct_.as<int32_t>(), bad_label_.as<int32_t>());
    for (int l = layers - 1; l >= 0; --l) {
      const int in = widths_[l], out = widths_[l + 1];
      const float* a_in = l == 0 ? x : activations_[l].as<float>();
      float* dw = grad + tensors_[2 * l].offset;
      float* db = grad + tensors_[2 * l + 1].offset;
      // dW = A_in^T * delta
      if (absl::Status s = Gemm(true, false, in, out, batch, a_in, in, delta_.as<float>(), out,
                                0.0f, dw, out);
          !s.ok()) {
        return s;
      }
      LaunchColumnSums(stream_, delta_.as<float>(), batch, out, db);
      if (l > 0) {
        // delta_prev = (delta * W^T) masked by ReLU'(z) == (a > 0).
        const float* w = params + tensors_[2 * l].offset;
        if (absl::Status s = Gemm(false, true, batch, in, out, delta_.as<float>(), out, w, out,
                                  0.0f, delta_prev_.as<float>(), in);
            !s.ok()) {
          return s;
        }
        LaunchReluMask(stream_, activations_[l].as<float>(), delta_prev_.as<float>(),
                       static_cast<int64_t>(batch) * in);
        std::swap(delta_, delta_prev_);
      }
      CUDA_RETURN_IF_ERROR(cudaGetLastError());
      if (on_ready) {
        // The gradient must be in memory before anyone reads it.
        CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
        on_ready(l, static_cast<int64_t>(in) * out + out);
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
      if (absl::Status s = Forward(params, x + start * widths_[0], n); !s.ok()) return s;
      LaunchSoftmaxCrossEntropy(stream_, activations_[layers].as<float>(), labels + start, n,
                                classes, 0.0f, nullptr, row_loss_.as<float>(),
                                row_correct_.as<int32_t>(), bad_label_.as<int32_t>());
      if (absl::Status s = Collect(n, stats); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  int num_layers() const { return static_cast<int>(widths_.size()) - 1; }
  static size_t Bytes(int rows, int cols) {
    return static_cast<size_t>(rows) * cols * sizeof(float);
  }

  absl::Status Forward(const float* params, const float* x, int batch) {
    const int layers = num_layers();
    for (int l = 0; l < layers; ++l) {
      const int in = widths_[l], out = widths_[l + 1];
      const float* a_in = l == 0 ? x : activations_[l].as<float>();
      const float* w = params + tensors_[2 * l].offset;
      const float* b = params + tensors_[2 * l + 1].offset;
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
    if (precision_ == Precision::kBf16) {
      const int64_t a_elems = static_cast<int64_t>(trans_a ? k : m) * lda;
      const int64_t b_elems = static_cast<int64_t>(trans_b ? n : k) * ldb;
      LaunchToBf16(stream_, a, bf16_a_.as<uint16_t>(), a_elems);
      LaunchToBf16(stream_, b, bf16_b_.as<uint16_t>(), b_elems);
      a_data = bf16_a_.as<uint16_t>();
      b_data = bf16_b_.as<uint16_t>();
      in_type = CUDA_R_16BF;
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
  const int max_batch_;
  const Precision precision_;
  std::vector<int> widths_;
  int max_width_ = 0;
  std::vector<DeviceBuffer> activations_;  // [0] unused: the input is read in place
  DeviceBuffer delta_, delta_prev_, row_loss_, row_correct_, bad_label_, bf16_a_, bf16_b_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCudaMlp(Device* device, int ordinal,
                                                            cudaStream_t stream,
                                                            cublasHandle_t cublas,
                                                            const ModelShape& shape,
                                                            int max_batch, Precision precision) {
  if (shape.input_dim < 1 || shape.num_classes < 2 || max_batch < 1) {
    return absl::InvalidArgumentError("model needs input_dim >= 1, num_classes >= 2, max_batch >= 1");
  }
  for (int width : shape.hidden) {
    if (width < 1) return absl::InvalidArgumentError("hidden widths must be >= 1");
  }
  auto mlp = std::make_unique<CudaMlp>(device, ordinal, stream, cublas, shape, max_batch,
                                       precision);
  if (absl::Status s = mlp->Init(); !s.ok()) return s;
  return mlp;
}

}  // namespace pstrain::kernels::cuda
