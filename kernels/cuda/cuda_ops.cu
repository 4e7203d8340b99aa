// Element-wise CUDA kernels, the optimizers on the GPU, and the casts.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <string>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

namespace pstrain::kernels {
namespace cuda {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20));
}

__global__ void FillRowsKernel(const float* row, int rows, int cols, float* out) {
  const int64_t n = static_cast<int64_t>(rows) * cols;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = row[i % cols];
  }
}

__global__ void ReluKernel(float* z, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    z[i] = fmaxf(z[i], 0.0f);
  }
}

__global__ void ReluMaskKernel(const float* a, float* delta, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    if (a[i] <= 0.0f) delta[i] = 0.0f;
  }
}

__global__ void ColumnSumsKernel(const float* m, int rows, int cols, float* out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  float sum = 0.0f;
  for (int i = 0; i < rows; ++i) sum += m[static_cast<int64_t>(i) * cols + j];
  out[j] = sum;
}

// One thread per row, in double like the CPU twin.
__global__ void SoftmaxCrossEntropyKernel(const float* logits, const int32_t* labels, int rows,
                                          int classes, float grad_scale, float* dlogits,
                                          float* row_loss, int32_t* row_correct,
                                          int32_t* bad_label) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows) return;
  const float* z = logits + static_cast<int64_t>(i) * classes;
  const int y = labels[i];
  if (y < 0 || y >= classes) {
    *bad_label = 1;
    row_loss[i] = 0;
    row_correct[i] = 0;
    return;
  }
  int argmax = 0;
  for (int j = 1; j < classes; ++j) {
    if (z[j] > z[argmax]) argmax = j;
  }
  const float zmax = z[argmax];
  double sum = 0;
  for (int j = 0; j < classes; ++j) sum += exp(static_cast<double>(z[j] - zmax));
  row_loss[i] = static_cast<float>(log(sum) - static_cast<double>(z[y] - zmax));
  row_correct[i] = argmax == y ? 1 : 0;
  if (dlogits != nullptr) {
    float* d = dlogits + static_cast<int64_t>(i) * classes;
    for (int j = 0; j < classes; ++j) {
      const double p = exp(static_cast<double>(z[j] - zmax)) / sum;
      d[j] = static_cast<float>((p - (j == y ? 1.0 : 0.0)) * grad_scale);
    }
  }
}

__global__ void ToBf16Kernel(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const __nv_bfloat16 b = __float2bfloat16_rn(in[i]);
    out[i] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

__global__ void FromBf16Kernel(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

__global__ void ToFp16Kernel(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const __half h = __float2half_rn(in[i]);
    out[i] = *reinterpret_cast<const uint16_t*>(&h);
  }
}

__global__ void FromFp16Kernel(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    out[i] = __half2float(*reinterpret_cast<const __half*>(&in[i]));
  }
}

// The updates of kernels/cpu/optimizers.cc, element for element; `out` may
// be `p`.
__global__ void SgdKernel(const float* p, float* out, const float* g, float* v, int64_t n,
                          float lr, float wd, float mu) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    if (mu > 0) {
      v[i] = mu * v[i] + (g[i] + wd * p[i]);
      out[i] = p[i] - lr * v[i];
    } else {
      out[i] = p[i] - lr * (g[i] + wd * p[i]);
    }
  }
}

__global__ void AdamKernel(const float* p, float* out, const float* g, float* m, float* v,
                           int64_t n, float b1, float b2, float wd, float step, float eps_hat) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float gi = g[i] + wd * p[i];
    m[i] = b1 * m[i] + (1.0f - b1) * gi;
    v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
    out[i] = p[i] - step * m[i] / (sqrtf(v[i]) + eps_hat);
  }
}

__global__ void AdagradKernel(const float* p, float* out, const float* g, float* s, int64_t n,
                              float lr, float wd, float eps) {
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const float gi = g[i] + wd * p[i];
    s[i] += gi * gi;
    out[i] = p[i] - lr * gi / (sqrtf(s[i]) + eps);
  }
}

class CudaOptimizer final : public Optimizer {
 public:
  CudaOptimizer(const OptimizerConfig& c, int ordinal, int state_floats)
      : c_(c), ordinal_(ordinal), state_floats_(state_floats) {}

  int StateFloatsPerParam() const override { return state_floats_; }

  absl::Status Apply(const OptimizerSpan& s, int64_t update_count) const override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    const int64_t n = s.n;
    switch (c_.type) {
      case OptimizerConfig::Type::kSgd:
        SgdKernel<<<Blocks(n), kThreads>>>(s.params, s.new_params, s.grad, s.state, n,
                                           RateOf(c_, s), c_.weight_decay, c_.momentum);
        break;
      case OptimizerConfig::Type::kAdam: {
        const double t = static_cast<double>(update_count);
        const float step = static_cast<float>(RateOf(c_, s) * std::sqrt(1.0 - std::pow(c_.beta2, t)) /
                                              (1.0 - std::pow(c_.beta1, t)));
        const float eps_hat = static_cast<float>(c_.epsilon * std::sqrt(1.0 - std::pow(c_.beta2, t)));
        AdamKernel<<<Blocks(n), kThreads>>>(s.params, s.new_params, s.grad, s.state,
                                            s.state + s.state_stride, n, c_.beta1, c_.beta2,
                                            c_.weight_decay, step, eps_hat);
        break;
      }
      case OptimizerConfig::Type::kAdagrad:
        AdagradKernel<<<Blocks(n), kThreads>>>(s.params, s.new_params, s.grad, s.state, n,
                                               RateOf(c_, s), c_.weight_decay, c_.epsilon);
        break;
    }
    CUDA_RETURN_IF_ERROR(cudaGetLastError());
    CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
    return absl::OkStatus();
  }

 private:
  const OptimizerConfig c_;
  const int ordinal_;
  const int state_floats_;
};

}  // namespace

void LaunchFillRows(cudaStream_t stream, const float* row, int rows, int cols, float* out) {
  FillRowsKernel<<<Blocks(static_cast<int64_t>(rows) * cols), kThreads, 0, stream>>>(row, rows,
                                                                                     cols, out);
}
void LaunchRelu(cudaStream_t stream, float* z, int64_t n) {
  ReluKernel<<<Blocks(n), kThreads, 0, stream>>>(z, n);
}
void LaunchReluMask(cudaStream_t stream, const float* a, float* delta, int64_t n) {
  ReluMaskKernel<<<Blocks(n), kThreads, 0, stream>>>(a, delta, n);
}
void LaunchColumnSums(cudaStream_t stream, const float* m, int rows, int cols, float* out) {
  ColumnSumsKernel<<<Blocks(cols), kThreads, 0, stream>>>(m, rows, cols, out);
}
void LaunchSoftmaxCrossEntropy(cudaStream_t stream, const float* logits, const int32_t* labels,
                               int rows, int classes, float grad_scale, float* dlogits,
                               float* row_loss, int32_t* row_correct, int32_t* bad_label) {
  SoftmaxCrossEntropyKernel<<<Blocks(rows), kThreads, 0, stream>>>(
      logits, labels, rows, classes, grad_scale, dlogits, row_loss, row_correct, bad_label);
}
void LaunchToBf16(cudaStream_t stream, const float* in, uint16_t* out, int64_t n) {
  ToBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
}
void LaunchFromBf16(cudaStream_t stream, const uint16_t* in, float* out, int64_t n) {
  FromBf16Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
}
void LaunchToFp16(cudaStream_t stream, const float* in, uint16_t* out, int64_t n) {
  ToFp16Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
}
void LaunchFromFp16(cudaStream_t stream, const uint16_t* in, float* out, int64_t n) {
  FromFp16Kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
}

}  // namespace cuda

absl::StatusOr<std::unique_ptr<Optimizer>> CreateCudaOptimizer(const OptimizerConfig& c,
                                                               int ordinal) {
  if (!(c.learning_rate > 0)) return absl::InvalidArgumentError("learning_rate must be > 0");
  if (!(c.momentum >= 0 && c.momentum < 1)) {
    return absl::InvalidArgumentError("momentum must be in [0, 1)");
  }
  int state = 0;
  switch (c.type) {
    case OptimizerConfig::Type::kSgd:
      state = c.momentum > 0 ? 1 : 0;
      break;
    case OptimizerConfig::Type::kAdam:
      state = 2;
      break;
    case OptimizerConfig::Type::kAdagrad:
      state = 1;
      break;
  }
  return std::make_unique<cuda::CudaOptimizer>(c, ordinal, state);
}

absl::Status CudaCastToBf16(int ordinal, const float* in, uint16_t* out, int64_t n) {
  return cuda::RunOn(ordinal, [&] { cuda::LaunchToBf16(nullptr, in, out, n); });
}
absl::Status CudaCastFromBf16(int ordinal, const uint16_t* in, float* out, int64_t n) {
  return cuda::RunOn(ordinal, [&] { cuda::LaunchFromBf16(nullptr, in, out, n); });
}
absl::Status CudaCastToFp16(int ordinal, const float* in, uint16_t* out, int64_t n) {
  return cuda::RunOn(ordinal, [&] { cuda::LaunchToFp16(nullptr, in, out, n); });
}
absl::Status CudaCastFromFp16(int ordinal, const uint16_t* in, float* out, int64_t n) {
  return cuda::RunOn(ordinal, [&] { cuda::LaunchFromFp16(nullptr, in, out, n); });
}

}  // namespace pstrain::kernels
