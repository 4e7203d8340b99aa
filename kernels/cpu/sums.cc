// Sums on the CPU's vector units.
#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/simd.h"

namespace pstrain::kernels {
namespace {

// A float at any address, read through any type's storage.
typedef float UnalignedFloat __attribute__((aligned(1), may_alias));

}  // namespace

PSTRAIN_SIMD_CLONES void AddUnalignedFloats(const void* src, float* dst, int64_t n) {
  const UnalignedFloat* in = static_cast<const UnalignedFloat*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] += in[i];
}

}  // namespace pstrain::kernels
