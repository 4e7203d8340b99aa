// CPU implementations of the kernel interfaces, on OpenBLAS.
#ifndef PSTRAIN_KERNELS_CPU_CPU_KERNELS_H_
#define PSTRAIN_KERNELS_CPU_CPU_KERNELS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "kernels/model.h"

namespace pstrain::kernels {

// Model kernels for batches of up to max_batch samples. INVALID_ARGUMENT on
// a shape with a non-positive width or a max_batch < 1.
absl::StatusOr<std::unique_ptr<ModelKernels>> CreateCpuModelKernels(
    const ModelShape& shape, int max_batch, Precision precision = Precision::kFp32);

// INVALID_ARGUMENT on a non-positive learning rate or out-of-range factor.
absl::StatusOr<std::unique_ptr<Optimizer>> CreateCpuOptimizer(const OptimizerConfig& config);

// fp32 <-> bf16 / fp16 in host memory, round-to-nearest-even; NaN stays a
// (quiet) NaN, infinities and signed zeros are kept, fp16 overflows to
// infinity and keeps subnormals. The CUDA casts (cuda_api.h) are their twins.
void CastToBf16(const float* in, uint16_t* out, int64_t n);
void CastFromBf16(const uint16_t* in, float* out, int64_t n);
void CastToFp16(const float* in, uint16_t* out, int64_t n);
void CastFromFp16(const uint16_t* in, float* out, int64_t n);
// out[i] = in[i] rounded to the nearest TF32 (fp32 with a 10-bit
// mantissa), bf16 or fp16 value (fp32 for kFp32); out may be in.
void RoundTo(Precision precision, const float* in, float* out, int64_t n);

// dst[i] += src[i] for i < n; src holds n floats at any address (a received
// payload, straight from gRPC's slices).
void AddUnalignedFloats(const void* src, float* dst, int64_t n);

// The largest of n values' bits with the sign bit cleared, the values
// 32-bit (value_bytes 4) or 16-bit (2) IEEE floats at any address: their
// order is the order of the magnitudes, and a NaN or an infinity has the
// format's exponent bits all set, so this one integer says both.
uint32_t MaxMagnitudeBits(const void* src, int value_bytes, int64_t n);

// Number of threads OpenBLAS uses in this process (pstrain's default is 1:
// several processes usually share the machine's cores).
void SetBlasThreads(int threads);

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_CPU_CPU_KERNELS_H_
