#include "common/file_format.h"

#include <zlib.h>

#include <algorithm>

namespace pstrain {

void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t GetU32(absl::string_view bytes, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= static_cast<uint32_t>(static_cast<unsigned char>(bytes[at + i])) << (8 * i);
  }
  return v;
}

void PutU64(std::string& out, uint64_t v) {
  PutU32(out, static_cast<uint32_t>(v));
  PutU32(out, static_cast<uint32_t>(v >> 32));
}

uint64_t GetU64(absl::string_view bytes, size_t at) {
  return uint64_t{GetU32(bytes, at)} | (uint64_t{GetU32(bytes, at + 4)} << 32);
}

uint32_t Crc32(const void* data, size_t n, uint32_t crc) {
  uLong c = crc;
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {  // crc32 takes a uInt length
    const uInt piece = static_cast<uInt>(std::min<size_t>(n, 1u << 30));
    c = crc32(c, p, piece);
    p += piece;
    n -= piece;
  }
  return static_cast<uint32_t>(c);
}

absl::Status ChecksummedWriter::Flush(size_t at_least) {
  if (buffer_.size() < at_least || buffer_.empty()) return absl::OkStatus();
  crc_ = Crc32(buffer_.data(), buffer_.size(), crc_);
  absl::Status s = file_->Append(buffer_);
  buffer_.clear();
  return s;
}

}  // namespace pstrain
