// Checked CUDA, cuBLAS and NCCL calls: a failure becomes an absl::Status
// naming the call's file and line and the library's own error string.
// Included by kernels/cuda sources only.
#ifndef PSTRAIN_KERNELS_CUDA_CUDA_CHECK_H_
#define PSTRAIN_KERNELS_CUDA_CUDA_CHECK_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"

namespace pstrain::kernels::cuda {

inline absl::Status CudaError(cudaError_t e, const char* call, const char* file, int line) {
  return absl::InternalError(std::string(file) + ":" + std::to_string(line) + ": " + call +
                             ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

inline absl::Status CublasError(cublasStatus_t s, const char* call, const char* file, int line) {
  return absl::InternalError(std::string(file) + ":" + std::to_string(line) + ": " + call +
                             ": " + cublasGetStatusName(s) + ": " + cublasGetStatusString(s));
}

}  // namespace pstrain::kernels::cuda

#define CUDA_RETURN_IF_ERROR(call)                                                    \
  do {                                                                                \
    const cudaError_t pstrain_cuda_error_ = (call);                                   \
    if (pstrain_cuda_error_ != cudaSuccess) {                                         \
      return ::pstrain::kernels::cuda::CudaError(pstrain_cuda_error_, #call, __FILE__, \
                                                 __LINE__);                           \
    }                                                                                 \
  } while (0)

#define CUBLAS_RETURN_IF_ERROR(call)                                                    \
  do {                                                                                  \
    const cublasStatus_t pstrain_cublas_status_ = (call);                               \
    if (pstrain_cublas_status_ != CUBLAS_STATUS_SUCCESS) {                              \
      return ::pstrain::kernels::cuda::CublasError(pstrain_cublas_status_, #call, __FILE__, \
                                                   __LINE__);                           \
    }                                                                                   \
  } while (0)

namespace pstrain::kernels::cuda {

// Makes GPU `ordinal` current, runs `launch` (kernels on its default
// stream) and waits for them; the first error as a status.
template <typename Launch>
absl::Status RunOn(int ordinal, Launch launch) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal));
  launch();
  CUDA_RETURN_IF_ERROR(cudaGetLastError());
  CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  return absl::OkStatus();
}

}  // namespace pstrain::kernels::cuda

#endif  // PSTRAIN_KERNELS_CUDA_CUDA_CHECK_H_
