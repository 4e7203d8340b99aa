// What pstrain's file formats share (the job log, model files, checkpoint
// files, table exports): little-endian integers and CRC-32 checksums.
#ifndef PSTRAIN_COMMON_FILE_FORMAT_H_
#define PSTRAIN_COMMON_FILE_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/file_system.h"

namespace pstrain {

// Appends v as 4 little-endian bytes.
void PutU32(std::string& out, uint32_t v);
// The little-endian u32 at `at` (the caller checks that 4 bytes are there).
uint32_t GetU32(absl::string_view bytes, size_t at);
// The same for 8 bytes.
void PutU64(std::string& out, uint64_t v);
uint64_t GetU64(absl::string_view bytes, size_t at);

// zlib's CRC-32 of n bytes, continuing `crc` (0 to start), for any n.
uint32_t Crc32(const void* data, size_t n, uint32_t crc = 0);

// Appends bytes to a file through a buffer, keeping the CRC-32 of
// everything appended (files written a piece at a time: checkpoints,
// exported tables).
class ChecksummedWriter {
 public:
  // `crc`: of what the file already holds (0 for nothing).
  ChecksummedWriter(WritableFile* file, uint32_t crc = 0) : file_(file), crc_(crc) {}
  // Where to put the next bytes.
  std::string& buffer() { return buffer_; }
  // Writes the buffer out once it holds `at_least` bytes (0: now).
  absl::Status Flush(size_t at_least = 0);
  // Of everything flushed.
  uint32_t crc() const { return crc_; }

 private:
  WritableFile* const file_;
  uint32_t crc_;
  std::string buffer_;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_FILE_FORMAT_H_
