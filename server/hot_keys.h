// How much of a table's traffic its hottest keys take, in bounded memory:
// the figure behind pstrain_server_table_hot_key_share, for the hot spots a
// parameter server suffers from (a few keys that every batch names, all on
// one server).
//
// Two sketches of `capacity` entries each over the keys added since the
// last Reset, with their counts:
//   - Space-Saving (Metwally et al.) keeps the heaviest keys' counts: a key
//     not held replaces the lightest held one, inheriting its count as its
//     error, so that every key whose count exceeds total/capacity is held;
//   - K minimum values (Bar-Yossef et al.) counts the distinct keys from the
//     `capacity` smallest hashes.
// Below `capacity` distinct keys both are exact. HotShare is the share of
// the counts taken by the hottest ceil(1%) of the distinct keys (at most
// `capacity` of them), from each held key's guaranteed count (its count less
// its error): it may miss part of a hot spot's traffic, never invent it.
#ifndef PSTRAIN_SERVER_HOT_KEYS_H_
#define PSTRAIN_SERVER_HOT_KEYS_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"

namespace pstrain::server {

class HotKeys {
 public:
  explicit HotKeys(int capacity = 4096);

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
  struct Entry {
    uint64_t key = 0;
    uint64_t count = 0;
    uint64_t error = 0;
  };
  // The Space-Saving entries as a min-heap by count; slot_ says where each
  // key's entry is.
  void SiftDown(size_t i);
  void Swap(size_t a, size_t b);
  void AddDistinct(uint64_t key);

  size_t capacity_;
  uint64_t total_ = 0;
  std::vector<Entry> heap_;
  absl::flat_hash_map<uint64_t, size_t> slot_;
  // The smallest hashes seen, as a max-heap, and the same as a set.
  std::vector<uint64_t> smallest_;
  absl::flat_hash_set<uint64_t> smallest_set_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_HOT_KEYS_H_
