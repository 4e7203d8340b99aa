// pstrain's CUDA side, seen from code that includes no CUDA header: GPU
// devices (cuBLAS kernels), the NCCL node reducer, and the fp32<->bf16/fp16
// casts. Built from kernels/cuda/*.cu where CMake found nvcc (PSTRAIN_CUDA);
// otherwise every call answers FAILED_PRECONDITION saying so.
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_API_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_API_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/click_model.h"
#include "kernels/device.h"
#include "kernels/model.h"
#include "kernels/reducer.h"

namespace pstrain::kernels {

// Whether this binary was built with CUDA.
bool CudaBuilt();

// The number of usable GPUs; FAILED_PRECONDITION with CUDA's own reason
// when there is no GPU or no driver, or CUDA was not built in.
absl::StatusOr<int> CudaDeviceCount();

// GPU `ordinal` as a Device: cuBLAS GEMMs (cublasGemmEx: fp32, TF32, bf16 or
// fp16 inputs with fp32 accumulation), bias, ReLU, softmax cross-entropy and
// accuracy kernels, memory on that GPU.
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal);

// One NCCL communicator over these local GPUs (rank k = ordinals[k]).
absl::StatusOr<std::unique_ptr<Reducer>> CreateNcclReducer(const std::vector<int>& ordinals);

// An optimizer whose Apply takes pointers in GPU `ordinal`'s memory.
absl::StatusOr<std::unique_ptr<Optimizer>> CreateCudaOptimizer(const OptimizerConfig& config,
                                                               int ordinal);

// Casts on GPU `ordinal`, device pointers, round-to-nearest-even; NaN stays
// NaN, infinities stay infinite.
absl::Status CudaCastToBf16(int ordinal, const float* in, uint16_t* out, int64_t n);
absl::Status CudaCastFromBf16(int ordinal, const uint16_t* in, float* out, int64_t n);
absl::Status CudaCastToFp16(int ordinal, const float* in, uint16_t* out, int64_t n);
absl::Status CudaCastFromFp16(int ordinal, const uint16_t* in, float* out, int64_t n);

// The click model's embedding bags (click_model.h) on GPU `ordinal`: the
// index arrays, rows and outputs in its memory; bitwise the CPU twins'.
absl::Status CudaEmbeddingBagForward(int ordinal, const BagIndexView& index, int dim,
                                     Pooling pooling, const float* rows, float* out);
absl::Status CudaEmbeddingBagBackward(int ordinal, const BagIndexView& index, int dim,
                                      Pooling pooling, const float* d_out, float* row_grad);

// Mean seconds of one m x n x k cublasGemmEx on GPU `ordinal` at the given
// precision (inputs fp32, or bf16 / fp16 for kBf16 / kFp16; fp32 output), over
// `iterations` runs after a warm-up (the GPU benchmark).
absl::StatusOr<double> CudaGemmSeconds(int ordinal, int m, int n, int k, Precision precision,
                                       int iterations);

// "NVIDIA H200" and the like.
absl::StatusOr<std::string> CudaDeviceName(int ordinal);

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_API_H_
