// What pstrain's file formats share (the job log, model files, checkpoint
// files, table exports): little-endian integers and CRC-32 checksums.
#ifndef PSTRAIN_COMMON_FILE_FORMAT_H_
#define PSTRAIN_COMMON_FILE_FORMAT_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

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

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_FILE_FORMAT_H_
