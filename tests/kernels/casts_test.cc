// fp32 <-> bf16 / fp16, round-to-nearest-even, on the edge values.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_kernels.h"

namespace pstrain::kernels {
namespace {

float F(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t Bf16(float f) {
  uint16_t out;
  CastToBf16(&f, &out, 1);
  return out;
}

uint16_t Fp16(float f) {
  uint16_t out;
  CastToFp16(&f, &out, 1);
  return out;
}

float FromFp16(uint16_t h) {
  float f;
  CastFromFp16(&h, &f, 1);
  return f;
}

TEST(CastsTest, Bf16RoundsToNearestEven) {
  EXPECT_EQ(Bf16(1.0f), 0x3f80);
  EXPECT_EQ(Bf16(-2.0f), 0xc000);
  EXPECT_EQ(Bf16(F(0x3f808000)), 0x3f80);  // a tie, even below: stays
  EXPECT_EQ(Bf16(F(0x3f818000)), 0x3f82);  // a tie, odd below: up
  EXPECT_EQ(Bf16(F(0x3f808001)), 0x3f81);  // above the tie: up
  EXPECT_EQ(Bf16(F(0x3f807fff)), 0x3f80);  // below: down
  EXPECT_EQ(Bf16(F(0x7f7fffff)), 0x7f80);  // the largest float rounds to infinity
  EXPECT_EQ(Bf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(Bf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(Bf16(0.0f), 0x0000);
  EXPECT_EQ(Bf16(-0.0f), 0x8000);
  EXPECT_EQ(Bf16(F(0x00010000)), 0x0001);  // a subnormal, exactly
  EXPECT_EQ(Bf16(F(0x00008000)), 0x0000);  // half the smallest subnormal: even, down
  const uint16_t nan = Bf16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(nan & 0x7f80, 0x7f80);
  EXPECT_NE(nan & 0x007f, 0);
  // A signalling NaN whose payload is in the dropped bits stays a NaN.
  EXPECT_NE(Bf16(F(0x7f800001)) & 0x007f, 0);
}

TEST(CastsTest, Bf16RoundTripsWhatItCanHold) {
  for (uint32_t hi = 0; hi < 0x10000; hi += 7) {
    const uint16_t b = static_cast<uint16_t>(hi);
    float f;
    CastFromBf16(&b, &f, 1);
    if (std::isnan(f)) continue;
    EXPECT_EQ(Bf16(f), b) << std::hex << hi;
  }
}

TEST(CastsTest, Fp16RoundsToNearestEven) {
  EXPECT_EQ(Fp16(1.0f), 0x3c00);
  EXPECT_EQ(Fp16(-2.0f), 0xc000);
  EXPECT_EQ(Fp16(65504.0f), 0x7bff);             // the largest fp16
  EXPECT_EQ(Fp16(65519.0f), 0x7bff);             // rounds down to it
  EXPECT_EQ(Fp16(65520.0f), 0x7c00);             // the tie rounds to infinity (even)
  EXPECT_EQ(Fp16(1e10f), 0x7c00);
  EXPECT_EQ(Fp16(-1e10f), 0xfc00);
  EXPECT_EQ(Fp16(std::ldexp(1.0f, -14)), 0x0400);  // the smallest normal
  EXPECT_EQ(Fp16(std::ldexp(1.0f, -24)), 0x0001);  // the smallest subnormal
  EXPECT_EQ(Fp16(std::ldexp(1.0f, -25)), 0x0000);  // half of it: a tie, even, 0
  EXPECT_EQ(Fp16(std::ldexp(3.0f, -26)), 0x0001);  // 0.75 of it: up
  EXPECT_EQ(Fp16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 of it: a tie, up to even 2
  EXPECT_EQ(Fp16(std::ldexp(5.0f, -25)), 0x0002);  // 2.5 of it: a tie, down to even 2
  EXPECT_EQ(Fp16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie below even: stays
  EXPECT_EQ(Fp16(1.0f + std::ldexp(3.0f, -11)), 0x3c02);      // tie above odd: up
  EXPECT_EQ(Fp16(-0.0f), 0x8000);
  EXPECT_EQ(Fp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(Fp16(std::numeric_limits<float>::quiet_NaN()) & 0x7e00, 0x7e00);
}

TEST(CastsTest, Fp16DecodesEveryValue) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = FromFp16(static_cast<uint16_t>(h));
    const uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    const float sign = (h & 0x8000) ? -1.0f : 1.0f;
    if (exponent == 0x1f) {
      EXPECT_TRUE(mantissa ? std::isnan(f) : std::isinf(f)) << h;
      continue;
    }
    const float expected = exponent == 0
                               ? sign * std::ldexp(static_cast<float>(mantissa), -24)
                               : sign * std::ldexp(1.0f + mantissa / 1024.0f, exponent - 15);
    ASSERT_EQ(f, expected) << std::hex << h;
    ASSERT_EQ(Fp16(f), h) << std::hex << h;  // and back
  }
}

// The casts run vectorised over long arrays (AVX2 where the CPU has it):
// every lane must round like the one-value path, edge values included.
TEST(CastsTest, LongArraysRoundLikeSingleValues) {
  std::vector<float> in;
  for (uint32_t bits : {0x00000000u, 0x80000000u, 0x00000001u, 0x00008000u, 0x00018000u,
                        0x007fffffu, 0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x7f800000u,
                        0xff800000u, 0x7fc00000u, 0x7f800001u, 0x477fe000u, 0x477ff000u,
                        0x33000000u, 0x33400000u, 0x38800000u}) {
    in.push_back(F(bits));
  }
  uint64_t state = 12345;
  while (in.size() < 4099) {  // not a multiple of any vector width
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    in.push_back(F(static_cast<uint32_t>(state >> 32)));
  }
  const int64_t n = static_cast<int64_t>(in.size());
  std::vector<uint16_t> bf16(n), fp16(n);
  CastToBf16(in.data(), bf16.data(), n);
  CastToFp16(in.data(), fp16.data(), n);
  std::vector<float> from_bf16(n), from_fp16(n);
  CastFromBf16(bf16.data(), from_bf16.data(), n);
  CastFromFp16(fp16.data(), from_fp16.data(), n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], 4);
    if (std::isnan(in[i])) {
      EXPECT_TRUE(std::isnan(from_bf16[i]) && std::isnan(from_fp16[i])) << i;
      continue;
    }
    // Round to nearest even by integer arithmetic: the reference.
    const uint16_t expected_bf16 =
        static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    ASSERT_EQ(bf16[i], expected_bf16) << std::hex << bits;
    ASSERT_EQ(fp16[i], Fp16(in[i])) << std::hex << bits;
    uint32_t back;
    std::memcpy(&back, &from_bf16[i], 4);
    ASSERT_EQ(back, static_cast<uint32_t>(expected_bf16) << 16) << std::hex << bits;
    ASSERT_EQ(from_fp16[i], FromFp16(fp16[i])) << std::hex << bits;
  }
}

TEST(CastsTest, RoundToGivesTheValuesOfEachFormat) {
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> in = {1.0f, F(0x3f801000), 65504.0f, 65520.0f, -1e-8f, 3.0e38f, -inf};
  auto rounded = [&](Precision p) {
    std::vector<float> out(in.size());
    RoundTo(p, in.data(), out.data(), static_cast<int64_t>(in.size()));
    return out;
  };
  EXPECT_EQ(rounded(Precision::kFp32), in);
  // fp16: as the cast there and back; 65520 overflows to infinity.
  std::vector<float> fp16 = rounded(Precision::kFp16);
  for (size_t i = 0; i < in.size(); ++i) EXPECT_EQ(fp16[i], FromFp16(Fp16(in[i]))) << i;
  EXPECT_EQ(fp16[3], inf);
  EXPECT_EQ(fp16[1], 1.0f);  // 1 + 2^-12 is below fp16's resolution
  // bf16 and TF32 keep fp32's range, with 7 and 10 mantissa bits.
  std::vector<float> bf16 = rounded(Precision::kBf16);
  EXPECT_EQ(bf16[1], 1.0f);
  EXPECT_EQ(bf16[3], 65536.0f);
  EXPECT_TRUE(std::isfinite(bf16[5]));
  std::vector<float> tf32 = rounded(Precision::kTf32);
  EXPECT_EQ(tf32[1], 1.0f);          // 2^-12: below TF32's 2^-10 too
  EXPECT_EQ(tf32[2], 65504.0f);      // 11 significant bits hold it
  EXPECT_EQ(tf32[6], -inf);
  const float nan = std::nanf("");
  for (Precision p : {Precision::kTf32, Precision::kBf16, Precision::kFp16}) {
    float out = 0;
    RoundTo(p, &nan, &out, 1);
    EXPECT_TRUE(std::isnan(out));
  }
  // In place.
  std::vector<float> again = in;
  RoundTo(Precision::kFp16, again.data(), again.data(), static_cast<int64_t>(again.size()));
  EXPECT_EQ(again, fp16);
}

}  // namespace
}  // namespace pstrain::kernels
