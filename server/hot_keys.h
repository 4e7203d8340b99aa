// How much of a table's traffic its hottest keys take, in bounded memory:
// the figure behind pstrain_server_table_hot_key_share, for the hot spots a
// parameter server suffers from (a few keys that every batch names, all on
// one server).
//
// Two sketches over the keys added since the last Reset, with their
// counts:
//   - Misra-Gries (in the mergeable form of Agarwal et al.) keeps the
//     heaviest keys' counts: up to 2 x `capacity` counters; when they are
//     full, the (capacity+1)-th largest count is taken from every counter
//     and those left at zero go. A count is never more than the key's
//     true count, and less by at most total/(capacity+1). An Add is one
//     hash-map update (amortized), cheap enough for every key of every
//     step;
//   - K minimum values (Bar-Yossef et al.) counts the distinct keys from the
//     `capacity` smallest hashes.
// Below `capacity` distinct keys both are exact. HotShare is the share of
// the counts taken by the hottest ceil(1%) of the distinct keys (at most
// the counters held): from counts that are never too high, so it may miss
// part of a hot spot's traffic, never invent it.
#ifndef PSTRAIN_SERVER_HOT_KEYS_H_
#define PSTRAIN_SERVER_HOT_KEYS_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace pstrain::server {

class HotKeys {
 public:
  explicit HotKeys(int capacity = 8192);

  // `count` more sightings of `key`.
  void Add(uint64_t key, uint64_t count);

  // The share of the counts since the last Reset that the hottest 1% of
  // the distinct keys took (at least one key); 0 with none.
  double HotShare() const;
  // The distinct keys since the last Reset (estimated beyond `capacity`).
  double DistinctKeys() const;
  uint64_t total() const { return total_; }

  void Reset();

 private:
  void Compact();
  void AddDistinct(uint64_t key);

  size_t capacity_;
  uint64_t total_ = 0;
  absl::flat_hash_map<uint64_t, uint64_t> counts_;  // Misra-Gries
  // The smallest hashes seen, as a max-heap, and the same as a set.
  std::vector<uint64_t> smallest_;
  absl::flat_hash_set<uint64_t> smallest_set_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_HOT_KEYS_H_
