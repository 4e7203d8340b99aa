#include "common/chunk_codec.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_kernels.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

v1::ChunkHeader Header(uint32_t n, v1::DType dtype = v1::DTYPE_FP32) {
  v1::ChunkHeader h;
  h.set_kind(v1::FRAME_KIND_PUSH);
  h.set_job_id("job-1");
  h.set_worker(3);
  h.set_step(17);
  h.set_chunk(5);
  h.set_dtype(dtype);
  h.set_num_elements(n);
  return h;
}

// The bytes of a frame as gRPC would put them on the wire.
std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  PSTRAIN_EXPECT_OK(buffer.Dump(&slices));
  std::string bytes;
  for (const grpc::Slice& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return bytes;
}

// Re-slices `bytes` at the given cut points.
grpc::ByteBuffer Cut(const std::string& bytes, const std::vector<size_t>& cuts) {
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + begin, cut - begin);
    begin = cut;
  }
  slices.emplace_back(bytes.data() + begin, bytes.size() - begin);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::vector<float> RandomFloats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> values(n);
  for (float& v : values) v = normal(rng);
  return values;
}

// `values` cast to the 16-bit `dtype` into wire[0, n), and what a reader
// decodes from it.
std::vector<float> CastForTheWire(v1::DType dtype, const std::vector<float>& values,
                                  uint16_t* wire) {
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<float> decoded(n);
  if (dtype == v1::DTYPE_BF16) {
    kernels::CastToBf16(values.data(), wire, n);
    kernels::CastFromBf16(wire, decoded.data(), n);
  } else {
    kernels::CastToFp16(values.data(), wire, n);
    kernels::CastFromFp16(wire, decoded.data(), n);
  }
  return decoded;
}

// ReadValues and AddValues of every value range a reader asks for.
void ExpectReadsMatch(const Frame& frame, const std::vector<float>& expected,
                      const std::string& context) {
  const int64_t n = static_cast<int64_t>(expected.size());
  std::vector<float> out(n, -1.0f);
  frame.ReadValues(0, n, out.data());
  ASSERT_EQ(out, expected) << context;
  // Sub-ranges start and end anywhere.
  for (int64_t first : {int64_t{0}, int64_t{1}, n / 3, n - 1}) {
    if (first < 0 || first >= n) continue;
    const int64_t count = std::min<int64_t>(n - first, 5 + n / 2);
    std::vector<float> sum(count, 0.5f);
    frame.AddValues(first, count, sum.data());
    for (int64_t i = 0; i < count; ++i) {
      ASSERT_EQ(sum[i], 0.5f + expected[first + i]) << context << " value " << first + i;
    }
  }
}

TEST(ChunkCodecTest, RoundTripSplitAtEveryByte) {
  std::vector<float> values(9);
  std::iota(values.begin(), values.end(), -3.25f);
  const std::string bytes = Flatten(EncodeFrame(Header(values.size()), values.data()));
  for (size_t a = 1; a < bytes.size(); ++a) {
    for (size_t b = a; b < bytes.size(); b += 3) {
      std::vector<size_t> cuts = {a};
      if (b > a) cuts.push_back(b);
      absl::StatusOr<Frame> frame = Frame::Parse(Cut(bytes, cuts));
      PSTRAIN_ASSERT_OK(frame) << "cuts " << a << "," << b;
      EXPECT_EQ(frame->header().step(), 17);
      ExpectReadsMatch(*frame, values, absl::StrCat("cuts ", a, ",", b));
    }
  }
}

TEST(ChunkCodecTest, RoundTripOfEverySize) {
  for (size_t n : {0, 1, 3, 7, 1023, 4097, 100003}) {
    const std::vector<float> values = RandomFloats(n, n);
    const std::string bytes = Flatten(EncodeFrame(Header(n), values.data()));
    const size_t payload_start = bytes.size() - 4 * n;
    // One slice; then slices of 4k+r bytes, so that every cut lands at
    // each offset mod 4 inside a value.
    for (size_t step : {size_t{0}, size_t{4093}, size_t{4094}, size_t{4095}, size_t{4096},
                        size_t{13}}) {
      std::vector<size_t> cuts;
      if (step > 0) {
        for (size_t at = payload_start + step % 4 + 1; at < bytes.size(); at += step) {
          cuts.push_back(at);
        }
      }
      absl::StatusOr<Frame> frame = Frame::Parse(Cut(bytes, cuts));
      PSTRAIN_ASSERT_OK(frame);
      ASSERT_EQ(frame->payload_bytes(), 4 * n);
      ExpectReadsMatch(*frame, values, absl::StrCat(n, " floats, slices of ", step));
    }
  }
}

TEST(ChunkCodecTest, RoundTripOf64MiBSharedAndCutLikeTheNetwork) {
  const size_t n = (64u << 20) / 4;
  auto values = std::make_shared<std::vector<float>>(RandomFloats(n, 7));
  const int64_t copied = CopiedPayloadBytes();
  const std::string bytes = Flatten(EncodeFrameShared(Header(n), values->data(), values));
  // gRPC delivers large messages in slices of a few KiB to a few hundred.
  std::vector<size_t> cuts;
  for (size_t at = 1; at < bytes.size(); at += 16381 + at % 7) cuts.push_back(at);
  absl::StatusOr<Frame> frame = Frame::Parse(Cut(bytes, cuts));
  PSTRAIN_ASSERT_OK(frame);
  std::vector<float> out(n);
  frame->ReadValues(0, n, out.data());
  EXPECT_TRUE(out == *values);
  EXPECT_EQ(CopiedPayloadBytes(), copied) << "encoding shared and reading copy nothing";
}

TEST(ChunkCodecTest, SixteenBitPayloadsDecodeToTheirCasts) {
  for (v1::DType dtype : {v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    for (size_t n : {1, 5, 1023, 1025, 3001}) {
      const std::vector<float> values = RandomFloats(n, n + dtype);
      std::vector<uint16_t> wire(n);
      const std::vector<float> expected = CastForTheWire(dtype, values, wire.data());
      const std::string bytes = Flatten(EncodeFrame(Header(n, dtype), wire.data()));
      for (size_t odd : {size_t{0}, size_t{1}}) {
        // Cuts that split a 16-bit value (odd) or fall between two.
        std::vector<size_t> cuts;
        for (size_t at = bytes.size() - 2 * n + odd + 1; at < bytes.size(); at += 998) {
          cuts.push_back(at);
        }
        absl::StatusOr<Frame> frame = Frame::Parse(Cut(bytes, cuts));
        PSTRAIN_ASSERT_OK(frame);
        EXPECT_EQ(frame->payload_bytes(), 2 * n);
        ExpectReadsMatch(*frame, expected, absl::StrCat("dtype ", dtype, ", ", n, " values"));
      }
    }
  }
}

// MaxAbs (frames cut anywhere) and MaxAbsOf (memory) against a plain
// loop over the decoded values, in each dtype, with NaNs and infinities.
TEST(ChunkCodecTest, MaxAbsMatchesAPlainLoop) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (v1::DType dtype : {v1::DTYPE_FP32, v1::DTYPE_BF16, v1::DTYPE_FP16}) {
    for (const float special : {0.0f, -kInf, std::numeric_limits<float>::quiet_NaN(), 1e-40f}) {
      for (size_t n : {0, 1, 7, 1023, 3001}) {
        const std::string context = absl::StrCat("dtype ", dtype, ", ", n, " values, ", special);
        std::vector<float> values = RandomFloats(n, n + dtype);
        if (n > 0) values[n / 2] = special == 0.0f ? values[n / 2] : special;
        std::vector<uint16_t> wire(n);
        const bool fp32 = dtype == v1::DTYPE_FP32;
        const std::vector<float> decoded = fp32 ? values : CastForTheWire(dtype, values, wire.data());
        const void* payload = fp32 ? static_cast<const void*>(values.data()) : wire.data();
        float expected = 0.0f;
        for (float v : decoded) expected = std::isfinite(v) ? std::max(expected, std::fabs(v)) : kInf;
        EXPECT_EQ(MaxAbsOf(dtype, payload, static_cast<int64_t>(n)), expected) << context;
        const std::string bytes = Flatten(EncodeFrame(Header(n, dtype), payload));
        // Cut inside values, so that some are split between slices.
        std::vector<size_t> cuts;
        for (size_t at = bytes.size() - DTypeBytes(dtype) * n + 1; at < bytes.size(); at += 777) {
          cuts.push_back(at);
        }
        absl::StatusOr<Frame> frame = Frame::Parse(Cut(bytes, cuts));
        PSTRAIN_ASSERT_OK(frame);
        EXPECT_EQ(frame->MaxAbs(), expected) << context;
      }
    }
  }
}

TEST(ChunkCodecTest, CopiesAreCounted) {
  std::vector<float> values(100, 2.0f);
  const int64_t before = CopiedPayloadBytes();
  const grpc::ByteBuffer buffer = EncodeFrame(Header(100), values.data());
  EXPECT_EQ(CopiedPayloadBytes(), before + 400);
  absl::StatusOr<Frame> frame = Frame::Parse(buffer);
  PSTRAIN_ASSERT_OK(frame);
  std::vector<float> out(100);
  frame->CopyPayloadTo(out.data());
  EXPECT_EQ(CopiedPayloadBytes(), before + 800);
}

TEST(ChunkCodecTest, SharedPayloadIsNotCopiedAndKeepsItsOwnerAlive) {
  auto owner = std::make_shared<std::vector<float>>(1000, 1.5f);
  std::weak_ptr<std::vector<float>> weak = owner;
  grpc::ByteBuffer buffer = EncodeFrameShared(Header(1000), owner->data(), owner);
  std::vector<grpc::Slice> slices;
  PSTRAIN_ASSERT_OK(buffer.Dump(&slices));
  ASSERT_EQ(slices.size(), 2u);
  EXPECT_EQ(static_cast<const void*>(slices[1].begin()), static_cast<const void*>(owner->data()));
  slices.clear();
  owner.reset();
  EXPECT_FALSE(weak.expired()) << "the frame must keep the payload alive";
  buffer.Clear();
  EXPECT_TRUE(weak.expired());
}

TEST(ChunkCodecTest, RejectsMalformedFrames) {
  std::vector<float> values(4, 1.0f);
  const std::string bytes = Flatten(EncodeFrame(Header(4), values.data()));
  // Truncated anywhere: the length prefix, the header or the payload.
  for (size_t n = 0; n < bytes.size(); ++n) {
    grpc::Slice slice(bytes.data(), n);
    EXPECT_FALSE(Frame::Parse(grpc::ByteBuffer(&slice, 1)).ok()) << n;
  }
  // One byte too many.
  std::string longer = bytes + "x";
  grpc::Slice slice(longer.data(), longer.size());
  EXPECT_FALSE(Frame::Parse(grpc::ByteBuffer(&slice, 1)).ok());
  // A length prefix beyond the buffer.
  std::string huge = bytes;
  huge[3] = '\x7f';
  grpc::Slice huge_slice(huge.data(), huge.size());
  EXPECT_FALSE(Frame::Parse(grpc::ByteBuffer(&huge_slice, 1)).ok());
}

TEST(ChunkCodecTest, RejectsAPayloadThatDisagreesWithItsHeader) {
  std::vector<float> values(4, 1.0f);
  // [fixed32 LE header length][header][payload], written by hand.
  auto parse = [](const v1::ChunkHeader& h, const void* payload, size_t payload_bytes) {
    const std::string header = h.SerializeAsString();
    std::string bytes;
    for (int i = 0; i < 4; ++i) bytes.push_back(static_cast<char>((header.size() >> (8 * i)) & 0xff));
    bytes += header;
    bytes.append(static_cast<const char*>(payload), payload_bytes);
    grpc::Slice slice(bytes.data(), bytes.size());
    return Frame::Parse(grpc::ByteBuffer(&slice, 1));
  };
  PSTRAIN_ASSERT_OK(parse(Header(4), values.data(), 16));
  // Three floats where the header says four, five, or 16-bit values.
  EXPECT_EQ(parse(Header(4), values.data(), 12).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parse(Header(3), values.data(), 16).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(parse(Header(4, v1::DTYPE_BF16), values.data(), 16).status().code(),
            absl::StatusCode::kInvalidArgument);
  PSTRAIN_EXPECT_OK(parse(Header(8, v1::DTYPE_BF16), values.data(), 16));
  // An unknown dtype.
  EXPECT_EQ(parse(Header(4, static_cast<v1::DType>(99)), values.data(), 16).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain
