#include "common/chunk_codec.h"

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace pstrain {
namespace {

grpc::Slice HeaderSlice(const v1::ChunkHeader& header) {
  const std::string body = header.SerializeAsString();
  std::string bytes(4 + body.size(), '\0');
  const uint32_t n = static_cast<uint32_t>(body.size());
  for (int i = 0; i < 4; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  std::memcpy(bytes.data() + 4, body.data(), body.size());
  return grpc::Slice(bytes);
}

size_t PayloadBytes(const v1::ChunkHeader& header) {
  return static_cast<size_t>(header.num_elements()) * sizeof(float);
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
      Advance(take);
    }
    return true;
  }

  void Advance(size_t n) {
    offset_ += n;
    while (slice_ < slices_.size() && offset_ >= slices_[slice_].size()) {
      offset_ -= slices_[slice_].size();
      ++slice_;
    }
  }

  size_t slice() const { return slice_; }
  size_t offset() const { return offset_; }

 private:
  const std::vector<grpc::Slice>& slices_;
  size_t slice_ = 0;
  size_t offset_ = 0;
};

}  // namespace

grpc::ByteBuffer EncodeFrame(const v1::ChunkHeader& header, const float* values) {
  grpc::Slice slices[2] = {HeaderSlice(header),
                           grpc::Slice(values, PayloadBytes(header))};
  return grpc::ByteBuffer(slices, PayloadBytes(header) > 0 ? 2 : 1);
}

grpc::ByteBuffer EncodeFrameShared(const v1::ChunkHeader& header, const float* values,
                                   std::shared_ptr<const void> owner) {
  if (PayloadBytes(header) == 0) {
    grpc::Slice only = HeaderSlice(header);
    return grpc::ByteBuffer(&only, 1);
  }
  auto* keep = new std::shared_ptr<const void>(std::move(owner));
  grpc::Slice slices[2] = {
      HeaderSlice(header),
      grpc::Slice(const_cast<float*>(values), PayloadBytes(header),
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
  frame.payload_bytes_ = total - 4 - header_len;
  if (frame.payload_bytes_ != PayloadBytes(frame.header_)) {
    return absl::InvalidArgumentError(
        absl::StrCat("frame: payload of ", frame.payload_bytes_, " bytes, header says ",
                     frame.header_.num_elements(), " values"));
  }
  frame.payload_slice_ = cursor.slice();
  frame.payload_offset_ = cursor.offset();
  return frame;
}

void Frame::CopyPayloadTo(void* dst) const {
  char* out = static_cast<char*>(dst);
  size_t offset = payload_offset_;
  for (size_t i = payload_slice_; i < slices_.size(); ++i) {
    const grpc::Slice& s = slices_[i];
    std::memcpy(out, s.begin() + offset, s.size() - offset);
    out += s.size() - offset;
    offset = 0;
  }
}

}  // namespace pstrain
