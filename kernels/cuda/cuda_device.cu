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

absl::StatusOr<std::string> CudaDeviceName(int ordinal) {
  cudaDeviceProp properties;
  CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, ordinal));
  return std::string(properties.name);
}

absl::StatusOr<double> CudaGemmSeconds(int ordinal, int m, int n, int k, Precision precision,
                                       int iterations) {
  absl::StatusOr<std::unique_ptr<Device>> device = CreateCudaDevice(ordinal);
  if (!device.ok()) return device.status();
  const bool half = precision == Precision::kBf16 || precision == Precision::kFp16;
  const size_t in_bytes = half ? 2 : 4;
  absl::StatusOr<DeviceBuffer> a = (*device)->Allocate(static_cast<size_t>(m) * k * in_bytes);
  absl::StatusOr<DeviceBuffer> b = (*device)->Allocate(static_cast<size_t>(k) * n * in_bytes);
  absl::StatusOr<DeviceBuffer> c = (*device)->Allocate(static_cast<size_t>(m) * n * 4);
  if (!a.ok() || !b.ok() || !c.ok()) return absl::ResourceExhaustedError("GEMM buffers");
  cublasHandle_t handle;
  CUBLAS_RETURN_IF_ERROR(cublasCreate(&handle));
  const float alpha = 1.0f, beta = 0.0f;
  const cudaDataType_t type = !half                           ? CUDA_R_32F
                              : precision == Precision::kBf16 ? CUDA_R_16BF
                                                              : CUDA_R_16F;
  const cublasComputeType_t compute =
      precision == Precision::kTf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  auto gemm = [&] {
    return cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &alpha, b->as<void>(), type, n,
                        a->as<void>(), type, k, &beta, c->as<void>(), CUDA_R_32F, n, compute,
                        CUBLAS_GEMM_DEFAULT);
  };
  cudaEvent_t start, stop;
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&start));
  CUDA_RETURN_IF_ERROR(cudaEventCreate(&stop));
  absl::Status status;
  if (cublasStatus_t s = gemm(); s != CUBLAS_STATUS_SUCCESS) {  // warm-up
    status = cuda::CublasError(s, "cublasGemmEx", __FILE__, __LINE__);
  }
  float ms = 0;
  if (status.ok()) {
    cudaEventRecord(start);
    for (int i = 0; i < iterations; ++i) gemm();
    cudaEventRecord(stop);
    cudaEventSynchronize(stop);
    cudaEventElapsedTime(&ms, start, stop);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasDestroy(handle);
  if (!status.ok()) return status;
  return ms / 1e3 / iterations;
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
