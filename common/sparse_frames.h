// The payloads of sparse frames (parameters.proto: SPARSE_PUSH, SPARSE_PULL,
// ROWS) and where an embedding row lives. A payload is 4-byte little-endian
// words (num_elements of them, dtype fp32), one section a table, tables
// ascending:
//   SPARSE_PUSH: table, n, n keys (2 words each, low word first), n counts,
//                n x dim gradient floats (SPARSE_INIT: counts 1, the rows)
//   SPARSE_PULL: table, n, n keys
//   ROWS:        for each section of the pull, n x dim floats
#ifndef PSTRAIN_COMMON_SPARSE_FRAMES_H_
#define PSTRAIN_COMMON_SPARSE_FRAMES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/chunk_codec.h"

namespace pstrain {

// Keys a sparse frame may carry over all its sections, and the largest
// count of one key (a batch's occurrences).
inline constexpr int64_t kMaxSparseFrameKeys = int64_t{1} << 22;
inline constexpr uint32_t kMaxKeyCount = uint32_t{1} << 24;

// The server (of num_servers) that holds the row of `key` in table `table`.
uint32_t RowServer(uint32_t table, uint64_t key, uint32_t num_servers);

// One table's part of a sparse frame.
struct SparseSection {
  uint32_t table = 0;
  std::vector<uint64_t> keys;
  std::vector<uint32_t> counts;  // SPARSE_PUSH only
  std::vector<float> grads;      // SPARSE_PUSH only: keys.size() x dim
};

// The payload words of a SPARSE_PUSH (with_grads) or SPARSE_PULL, and the
// keys they hold (the header's num_keys). Sections must be valid (tables
// ascending, arrays of matching sizes).
std::string EncodeSparsePayload(const std::vector<SparseSection>& sections, bool with_grads,
                                int64_t* num_keys);

// Decodes and checks a received SPARSE_PUSH (or SPARSE_INIT, laid out as
// one) or SPARSE_PULL of a job whose
// tables have dimensions `dims`, addressed to server `server` of
// num_servers. INVALID_ARGUMENT saying what is wrong for a dtype other than
// fp32, a payload that ends inside a section or goes on past the last, an
// unknown table or one out of order, an empty section, keys that disagree
// with the header's num_keys or exceed kMaxSparseFrameKeys, a key twice in
// a section, a key another server holds, or a count outside [1,
// kMaxKeyCount].
absl::StatusOr<std::vector<SparseSection>> DecodeSparseFrame(const Frame& frame,
                                                             absl::Span<const int> dims,
                                                             uint32_t server, uint32_t num_servers);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_SPARSE_FRAMES_H_
