// The embedding bags of the click model on the GPU: one thread per output
// float, each summing in the CPU twin's order with unfused roundings
// (__fadd_rn, __fmul_rn), so that both give the same bits.
#include <algorithm>

#include "kernels/click_model.h"
#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_check.h"

namespace pstrain::kernels {
namespace {

constexpr int kThreads = 256;

int Blocks(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 1 << 20));
}

__global__ void BagForwardKernel(BagIndexView index, int dim, bool mean, const float* rows,
                                 float* out) {
  const int64_t n = index.bags * dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t b = i / dim;
    const int d = static_cast<int>(i % dim);
    const int64_t begin = index.bag_starts[b], end = index.bag_starts[b + 1];
    float sum = 0.0f;
    for (int64_t e = begin; e < end; ++e) {
      sum = __fadd_rn(sum, rows[int64_t{index.entry_rows[e]} * dim + d]);
    }
    if (mean && end > begin) sum = __fmul_rn(sum, 1.0f / static_cast<float>(end - begin));
    out[i] = sum;
  }
}

__global__ void BagBackwardKernel(BagIndexView index, int dim, bool mean, const float* d_out,
                                  float* row_grad) {
  const int64_t n = index.rows * dim;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / dim;
    const int d = static_cast<int>(i % dim);
    float sum = 0.0f;
    for (int64_t k = index.row_starts[r]; k < index.row_starts[r + 1]; ++k) {
      const int64_t b = index.row_bags[k];
      const float scale =
          mean ? 1.0f / static_cast<float>(index.bag_starts[b + 1] - index.bag_starts[b]) : 1.0f;
      sum = __fadd_rn(sum, __fmul_rn(d_out[b * dim + d], scale));
    }
    row_grad[i] = sum;
  }
}

}  // namespace

absl::Status CudaEmbeddingBagForward(int ordinal, const BagIndexView& index, int dim,
                                     Pooling pooling, const float* rows, float* out) {
  return cuda::RunOn(ordinal, [&] {
    BagForwardKernel<<<Blocks(index.bags * dim), kThreads>>>(index, dim, pooling == Pooling::kMean,
                                                              rows, out);
  });
}

absl::Status CudaEmbeddingBagBackward(int ordinal, const BagIndexView& index, int dim,
                                      Pooling pooling, const float* d_out, float* row_grad) {
  return cuda::RunOn(ordinal, [&] {
    BagBackwardKernel<<<Blocks(index.rows * dim), kThreads>>>(
        index, dim, pooling == Pooling::kMean, d_out, row_grad);
  });
}

}  // namespace pstrain::kernels
