// A GPU as a Device: its memory, a stream, a cuBLAS handle, the model kernels.
#include <string>

#include "kernels/cuda/cuda_api.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/cuda_internal.h"

namespace pstrain::kernels {
namespace cuda {
namespace {

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(int ordinal) : ordinal_(ordinal) {}

  ~CudaDevice() override {
    cudaSetDevice(ordinal_);
    if (cublas_ != nullptr) cublasDestroy(cublas_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  absl::Status Init() {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CUBLAS_RETURN_IF_ERROR(cublasCreate(&cublas_));
    CUBLAS_RETURN_IF_ERROR(cublasSetStream(cublas_, stream_));
    return absl::OkStatus();
  }

  std::string name() const override { return "cuda:" + std::to_string(ordinal_); }
  bool host_memory() const override { return false; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    void* data = nullptr;
    const cudaError_t e = cudaMalloc(&data, bytes == 0 ? 1 : bytes);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it
      return absl::ResourceExhaustedError(name() + ": out of GPU memory allocating " +
                                          std::to_string(bytes) + " bytes");
    }
    CUDA_RETURN_IF_ERROR(e);
    CUDA_RETURN_IF_ERROR(cudaMemsetAsync(data, 0, bytes, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return DeviceBuffer(this, data, bytes);
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyHostToDevice);
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return Copy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  }
  absl::Status Synchronize() override {
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  absl::StatusOr<std::unique_ptr<ModelKernels>> CreateModelKernels(const ModelShape& shape,
                                                                   int max_batch,
                                                                   Precision precision) override {
    return CreateCudaMlp(this, ordinal_, stream_, cublas_, shape, max_batch, precision);
  }

 protected:
  void Free(void* data) override {
    cudaSetDevice(ordinal_);
    cudaFree(data);
  }

 private:
  // Synchronous: what follows (another stream, NCCL, the host) sees the data.
  absl::Status Copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return absl::OkStatus();
    CUDA_RETURN_IF_ERROR(cudaSetDevice(ordinal_));
    CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, kind, stream_));
    CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
    return absl::OkStatus();
  }

  const int ordinal_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
};

}  // namespace
}  // namespace cuda

bool CudaBuilt() { return true; }

absl::StatusOr<int> CudaDeviceCount() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError(std::string("CUDA: ") + cudaGetErrorString(e));
  }
  if (n == 0) return absl::FailedPreconditionError("CUDA: no GPU found");
  return n;
}

absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int ordinal) {
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) return count.status();
  if (ordinal < 0 || ordinal >= *count) {
    return absl::InvalidArgumentError("cuda:" + std::to_string(ordinal) + " does not exist (" +
                                      std::to_string(*count) + " GPU(s))");
  }
  auto device = std::make_unique<cuda::CudaDevice>(ordinal);
  if (absl::Status s = device->Init(); !s.ok()) return s;
  return device;
}

}  // namespace pstrain::kernels
