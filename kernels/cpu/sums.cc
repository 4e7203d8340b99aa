// Sums on the CPU's vector units.
#include "kernels/cpu/cpu_kernels.h"

#include <cstring>
#include <limits>

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

namespace {

template <typename Bits>
PSTRAIN_INLINE_LOOP uint32_t MaxMagnitudeBitsOf(const unsigned char* src, int64_t n) {
  constexpr Bits kMagnitude = std::numeric_limits<Bits>::max() >> 1;
  Bits max = 0;
  for (int64_t i = 0; i < n; ++i) {
    Bits bits;
    std::memcpy(&bits, src + i * int64_t{sizeof(Bits)}, sizeof(Bits));
    bits &= kMagnitude;
    max = bits > max ? bits : max;
  }
  return max;
}

}  // namespace

PSTRAIN_SIMD_CLONES uint32_t MaxMagnitudeBits(const void* src, int value_bytes, int64_t n) {
  const auto* bytes = static_cast<const unsigned char*>(src);
  return value_bytes == 2 ? MaxMagnitudeBitsOf<uint16_t>(bytes, n)
                          : MaxMagnitudeBitsOf<uint32_t>(bytes, n);
}

}  // namespace pstrain::kernels
