// CPU implementations of the kernel interfaces, on OpenBLAS.
#ifndef PSTRAIN_KERNELS_CPU_CPU_KERNELS_H_
#define PSTRAIN_KERNELS_CPU_CPU_KERNELS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/model.h"

namespace pstrain::kernels {

// Model kernels for batches of up to max_batch samples. INVALID_ARGUMENT on
// a shape with a non-positive width or a max_batch < 1.
absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCpuModelKernels(const ModelShape& shape,
                                                                     int max_batch);

// INVALID_ARGUMENT on a non-positive learning rate or out-of-range factor.
absl::StatusOr<std::unique_ptr<Optimizer>> CreateCpuOptimizer(const OptimizerConfig& config);

// Number of threads OpenBLAS uses in this process (pstrain's default is 1:
// several processes usually share the machine's cores).
void SetBlasThreads(int threads);

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CPU_CPU_KERNELS_H_
