// Conversions between fp32 and the 16-bit float formats.
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cpu/simd.h"

namespace pstrain::kernels {
namespace {

PSTRAIN_INLINE_LOOP uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

PSTRAIN_INLINE_LOOP float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

PSTRAIN_INLINE_LOOP uint16_t ToBf16(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // NaN
  // Round to nearest even on the 16 bits that are dropped.
  const uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

uint16_t ToFp16(float f) {
  const uint32_t u = Bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;  // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: infinity
  if (abs < 0x38800000u) {
    // A subnormal or zero in fp16: the value in units of 2^-24, rounded to
    // nearest even.
    if (abs < 0x33000000u) return sign;  // below half the smallest subnormal
    const uint32_t exponent = abs >> 23;
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exponent;  // x / 2^-24 = mantissa * 2^(exponent - 126)
    uint32_t value = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (remainder > half || (remainder == half && (value & 1u))) ++value;
    return sign | static_cast<uint16_t>(value);
  }
  // Normal: rebias the exponent (127 -> 15), round the 13 dropped bits.
  const uint32_t rebased = abs - (112u << 23);
  const uint32_t rounding = 0xfffu + ((rebased >> 13) & 1u);
  return sign | static_cast<uint16_t>((rebased + rounding) >> 13);
}

// Round to nearest even on the 13 mantissa bits TF32 drops (TF32 has
// fp32's exponent): NaN and the infinities stay, a value that rounds
// beyond fp32's largest becomes an infinity.
PSTRAIN_INLINE_LOOP float ToTf32(float f) {
  const uint32_t u = Bits(f);
  if ((u & 0x7f800000u) == 0x7f800000u) return f;  // inf, NaN
  const uint32_t rounding = 0xfffu + ((u >> 13) & 1u);
  return FromBits((u + rounding) & ~0x1fffu);
}

float FromFp16(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return FromBits(sign | 0x7f800000u | (mantissa << 13));  // inf, NaN
  if (exponent == 0) {
    if (mantissa == 0) return FromBits(sign);
    // Subnormal: normalise.
    int e = -1;
    do {
      ++e;
      mantissa <<= 1;
    } while ((mantissa & 0x400u) == 0);
    return FromBits(sign | ((112u - e) << 23) | ((mantissa & 0x3ffu) << 13));
  }
  return FromBits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

}  // namespace

PSTRAIN_SIMD_CLONES void CastToBf16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToBf16(in[i]);
}

PSTRAIN_SIMD_CLONES void CastFromBf16(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FromBits(static_cast<uint32_t>(in[i]) << 16);
}

void CastToFp16(const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = ToFp16(in[i]);
}

void CastFromFp16(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = FromFp16(in[i]);
}

void RoundTo(Precision precision, const float* in, float* out, int64_t n) {
  switch (precision) {
    case Precision::kFp32:
      if (out != in) std::memcpy(out, in, n * sizeof(float));
      return;
    case Precision::kTf32:
      for (int64_t i = 0; i < n; ++i) out[i] = ToTf32(in[i]);
      return;
    case Precision::kBf16:
      for (int64_t i = 0; i < n; ++i) out[i] = FromBits(static_cast<uint32_t>(ToBf16(in[i])) << 16);
      return;
    case Precision::kFp16:
      for (int64_t i = 0; i < n; ++i) out[i] = FromFp16(ToFp16(in[i]));
      return;
  }
}

}  // namespace pstrain::kernels
