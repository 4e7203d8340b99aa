// The CUDA API of a build without CUDA (PSTRAIN_CUDA=OFF, or no nvcc).
#include "kernels/cuda/cuda_api.h"

namespace pstrain::kernels {
namespace {

absl::Status NotBuilt() {
  return absl::FailedPreconditionError(
      "this pstrain was built without CUDA (configure with -DPSTRAIN_CUDA=ON where nvcc is)");
}

}  // namespace

bool CudaBuilt() { return false; }
absl::StatusOr<int> CudaDeviceCount() { return NotBuilt(); }
absl::StatusOr<std::unique_ptr<Device>> CreateCudaDevice(int) { return NotBuilt(); }
absl::StatusOr<std::unique_ptr<Reducer>> CreateNcclReducer(const std::vector<int>&) {
  return NotBuilt();
}
absl::StatusOr<std::unique_ptr<Optimizer>> CreateCudaOptimizer(const OptimizerConfig&, int) {
  return NotBuilt();
}
absl::Status CudaCastToBf16(int, const float*, uint16_t*, int64_t) { return NotBuilt(); }
absl::Status CudaCastFromBf16(int, const uint16_t*, float*, int64_t) { return NotBuilt(); }
absl::Status CudaCastToFp16(int, const float*, uint16_t*, int64_t) { return NotBuilt(); }
absl::Status CudaCastFromFp16(int, const uint16_t*, float*, int64_t) { return NotBuilt(); }
absl::Status CudaEmbeddingBagForward(int, const BagIndexView&, int, Pooling, const float*,
                                     float*) {
  return NotBuilt();
}
absl::Status CudaEmbeddingBagBackward(int, const BagIndexView&, int, Pooling, const float*,
                                      float*) {
  return NotBuilt();
}
absl::StatusOr<double> CudaGemmSeconds(int, int, int, int, Precision, int) { return NotBuilt(); }
absl::StatusOr<std::string> CudaDeviceName(int) { return NotBuilt(); }

}  // namespace pstrain::kernels
