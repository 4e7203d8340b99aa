#include "common/chunk_codec.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_kernels.h"

namespace pstrain {
namespace {

std::atomic<int64_t> g_copied_payload_bytes{0};

grpc::Slice HeaderSlice(const v1::ChunkHeader& header) {
  const std::string body = header.SerializeAsString();
  std::string bytes(4 + body.size(), '\0');
  const uint32_t n = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(bytes.data() + 4, body.data(), body.size());
  return grpc::Slice(bytes);
}

size_t PayloadBytes(const v1::ChunkHeader& header) {
  return static_cast<size_t>(header.num_elements()) * DTypeBytes(header.dtype());
}

// Reads bytes across slice boundaries.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) {}

  // Copies n bytes to dst; false if fewer remain.
  bool Read(void* dst, size_t n) {
    char* out = static_cast<char*>(dst);
    while (n > 0) {
      if (slice_ == slices_.size()) return false;
      const grpc::Slice& s = slices_[slice_];
      const size_t take = std::min(n, s.size() - offset_);
      std::memcpy(out, s.begin() + offset_, take);
      out += take;
      n -= take;
      offset_ += take;
      if (offset_ == s.size()) {
        ++slice_;
        offset_ = 0;
      }
    }
    return true;
  }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
};

// Values of 16-bit dtypes are decoded through this many at a time: the
// source may sit at any address, the casts want aligned input.
constexpr int64_t kHalfBlock = 1024;

// Decodes `count` values of `dtype` at `src` (any alignment) into floats:
// stored to dst, or added to it.
void DecodeRun(v1::DType dtype, const unsigned char* src, int64_t count, float* dst, bool add) {
  if (dtype == v1::DTYPE_FP32) {
    if (add) {
      kernels::AddUnalignedFloats(src, dst, count);
    } else {
      std::memcpy(dst, src, static_cast<size_t>(count) * 4);
    }
    return;
  }
  uint16_t halves[kHalfBlock];
  float floats[kHalfBlock];
  for (int64_t done = 0; done < count; done += kHalfBlock) {
    const int64_t n = std::min(kHalfBlock, count - done);
    std::memcpy(halves, src + 2 * done, static_cast<size_t>(n) * 2);
    float* out = add ? floats : dst + done;
    if (dtype == v1::DTYPE_BF16) {
      kernels::CastFromBf16(halves, out, n);
    } else {
      kernels::CastFromFp16(halves, out, n);
    }
    if (add) {
      for (int64_t i = 0; i < n; ++i) dst[done + i] += floats[i];
    }
  }
}

}  // namespace

size_t DTypeBytes(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_FP32:
      return 4;
    case v1::DTYPE_BF16:
    case v1::DTYPE_FP16:
      return 2;
    default:
      return 0;
  }
}

int64_t CopiedPayloadBytes() { return g_copied_payload_bytes.load(std::memory_order_relaxed); }

grpc::ByteBuffer EncodeFrame(const v1::ChunkHeader& header, const void* payload) {
  const size_t bytes = PayloadBytes(header);
  if (bytes == 0) {
    grpc::Slice only = HeaderSlice(header);
    return grpc::ByteBuffer(&only, 1);
  }
  g_copied_payload_bytes.fetch_add(static_cast<int64_t>(bytes), std::memory_order_relaxed);
  grpc::Slice slices[2] = {HeaderSlice(header), grpc::Slice(payload, bytes)};
  return grpc::ByteBuffer(slices, 2);
}

grpc::ByteBuffer EncodeFrameShared(const v1::ChunkHeader& header, const void* payload,
                                   std::shared_ptr<const void> owner) {
  const size_t bytes = PayloadBytes(header);
  if (bytes == 0) {
    grpc::Slice only = HeaderSlice(header);
    return grpc::ByteBuffer(&only, 1);
  }
  auto* keep = new std::shared_ptr<const void>(std::move(owner));
  grpc::Slice slices[2] = {
      HeaderSlice(header),
      grpc::Slice(const_cast<void*>(payload), bytes,
                  [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }, keep)};
  return grpc::ByteBuffer(slices, 2);
}

absl::StatusOr<Frame> Frame::Parse(const grpc::ByteBuffer& buffer) {
  Frame frame;
  if (!buffer.Dump(&frame.slices_).ok()) {
    return absl::InvalidArgumentError("frame: unreadable byte buffer");
  }
  size_t total = 0;
  for (const grpc::Slice& s : frame.slices_) total += s.size();
  SliceCursor cursor(frame.slices_);
  unsigned char len_bytes[4];
  if (!cursor.Read(len_bytes, 4)) return absl::InvalidArgumentError("frame: truncated length");
  const size_t header_len = len_bytes[0] | (len_bytes[1] << 8) | (len_bytes[2] << 16) |
                            (static_cast<size_t>(len_bytes[3]) << 24);
  if (header_len > total - 4) return absl::InvalidArgumentError("frame: truncated header");
  std::string header_bytes(header_len, '\0');
  cursor.Read(header_bytes.data(), header_len);
  if (!frame.header_.ParseFromString(header_bytes)) {
    return absl::InvalidArgumentError("frame: unparsable header");
  }
  if (frame.header_.num_elements() > 0 && DTypeBytes(frame.header_.dtype()) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame: unknown dtype ", static_cast<int>(frame.header_.dtype())));
  }
  frame.payload_bytes_ = total - 4 - header_len;
  if (frame.payload_bytes_ != PayloadBytes(frame.header_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame: payload of ", frame.payload_bytes_, " bytes, header says ",
                     frame.header_.num_elements(), " values of ",
                     DTypeBytes(frame.header_.dtype()), " bytes"));
  }
  int64_t start = -static_cast<int64_t>(4 + header_len);
  for (const grpc::Slice& s : frame.slices_) {
    frame.slice_start_.push_back(start);
    start += static_cast<int64_t>(s.size());
  }
  return frame;
}

// Calls sink(bytes, n, out) for runs of n whole values lying in one slice,
// and for each value split between slices (gathered into 4 local bytes),
// covering values [first, first + count) in order; out is the index of the
// run's first value relative to `first`.
template <typename Sink>
void Frame::ForEachRun(int64_t first, int64_t count, Sink&& sink) const {
  const int64_t value_bytes = static_cast<int64_t>(DTypeBytes(header_.dtype()));
  int64_t at = first * value_bytes;  // payload byte
  // The last slice starting at or before `at`.
  size_t s = static_cast<size_t>(
      std::upper_bound(slice_start_.begin(), slice_start_.end(), at) - slice_start_.begin() - 1);
  int64_t done = 0;
  while (done < count) {
    while (slice_start_[s] + static_cast<int64_t>(slices_[s].size()) <= at) ++s;  // empty slices
    const unsigned char* data = slices_[s].begin() + (at - slice_start_[s]);
    const int64_t left = slice_start_[s] + static_cast<int64_t>(slices_[s].size()) - at;
    const int64_t whole = std::min(left / value_bytes, count - done);
    if (whole > 0) {
      sink(data, whole, done);
      done += whole;
      at += whole * value_bytes;
      continue;
    }
    // A value split between this slice and the next ones.
    unsigned char value[4];
    for (int64_t b = 0; b < value_bytes; ++b, ++at) {
      while (slice_start_[s] + static_cast<int64_t>(slices_[s].size()) <= at) ++s;
      value[b] = slices_[s].begin()[at - slice_start_[s]];
    }
    sink(value, 1, done);
    ++done;
  }
}

void Frame::ReadValues(int64_t first, int64_t count, float* dst) const {
  const v1::DType dtype = header_.dtype();
  ForEachRun(first, count, [&](const unsigned char* bytes, int64_t n, int64_t out) {
    DecodeRun(dtype, bytes, n, dst + out, /*add=*/false);
  });
}

void Frame::AddValues(int64_t first, int64_t count, float* dst) const {
  const v1::DType dtype = header_.dtype();
  ForEachRun(first, count, [&](const unsigned char* bytes, int64_t n, int64_t out) {
    DecodeRun(dtype, bytes, n, dst + out, /*add=*/true);
  });
}

void Frame::CopyPayloadTo(void* dst) const {
  g_copied_payload_bytes.fetch_add(static_cast<int64_t>(payload_bytes_),
                                   std::memory_order_relaxed);
  CopyPayload(dst);
}

Frame Frame::OwnedCopy() const {
  Frame copy;
  copy.header_ = header_;
  copy.payload_bytes_ = payload_bytes_;
  grpc::Slice payload(payload_bytes_);
  CopyPayload(const_cast<uint8_t*>(payload.begin()));
  copy.slices_.push_back(std::move(payload));
  copy.slice_start_.push_back(0);
  return copy;
}

void Frame::DropPayload() {
  slices_.clear();
  slice_start_.clear();
  payload_bytes_ = 0;
}

void Frame::CopyPayload(void* dst) const {
  char* out = static_cast<char*>(dst);
  for (size_t i = 0; i < slices_.size(); ++i) {
    const int64_t begin = std::max<int64_t>(0, -slice_start_[i]);
    const int64_t size = static_cast<int64_t>(slices_[i].size());
    if (begin >= size) continue;
    std::memcpy(out, slices_[i].begin() + begin, static_cast<size_t>(size - begin));
    out += size - begin;
  }
}

namespace {

// The magnitude whose bits (sign cleared) are `bits` in `dtype`, or
// infinity for a NaN or an infinity.
float MagnitudeOf(v1::DType dtype, uint32_t bits) {
  if (bits == 0) return 0.0f;
  if (DTypeBytes(dtype) == 4) {
    return bits >= 0x7f800000u ? std::numeric_limits<float>::infinity()
                               : std::bit_cast<float>(bits);
  }
  if (bits >= (dtype == v1::DTYPE_BF16 ? 0x7f80u : 0x7c00u)) {
    return std::numeric_limits<float>::infinity();
  }
  const uint16_t half = static_cast<uint16_t>(bits);
  float value;
  if (dtype == v1::DTYPE_BF16) {
    kernels::CastFromBf16(&half, &value, 1);
  } else {
    kernels::CastFromFp16(&half, &value, 1);
  }
  return value;
}

}  // namespace

float Frame::MaxAbs() const {
  const v1::DType dtype = header_.dtype();
  const int value_bytes = static_cast<int>(DTypeBytes(dtype));
  uint32_t max_bits = 0;
  ForEachRun(0, header_.num_elements(), [&](const unsigned char* bytes, int64_t n, int64_t) {
    max_bits = std::max(max_bits, kernels::MaxMagnitudeBits(bytes, value_bytes, n));
  });
  return MagnitudeOf(dtype, max_bits);
}

float MaxAbsOf(v1::DType dtype, const void* values, int64_t count) {
  return MagnitudeOf(dtype, kernels::MaxMagnitudeBits(
                                values, static_cast<int>(DTypeBytes(dtype)), count));
}

}  // namespace pstrain
