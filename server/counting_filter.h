// A table's admission filter: how often keys that have no row were seen,
// in bounded memory, forgetting old sightings.
//
// A count-min sketch of 4 rows of 16-bit saturating counters (it may
// overestimate a count, never underestimate it) in two generations:
// sightings go to the current one, and once it holds a window's sightings
// it becomes the previous one and the one before is cleared to take the
// next. A key's count is what both hold, so a key seen n times within the
// last window counts at least n, and sightings older than two windows are
// forgotten. The window is what keeps the chance that a key seen once reads
// as seen twice (its counter shared with other sightings in all 4 rows)
// below a bound. Every count is a function of the keys and counts added, in
// order, and the seed: never of timing.
#ifndef PSTRAIN_SERVER_COUNTING_FILTER_H_
#define PSTRAIN_SERVER_COUNTING_FILTER_H_

#include <array>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"

namespace pstrain::server {

inline constexpr uint32_t kMaxSightings = 0xffff;  // a counter's most

// The sightings a generation of a filter of `counters` counters a row (half
// of them each generation's) takes before it becomes the previous one, for
// a chance of at most `max_false_admission` that a key seen once counts 2.
int64_t AdmissionWindow(int64_t counters, double max_false_admission);

// A filter as a checkpoint holds it.
struct AdmissionFilter {
  // Two generations of 4 rows of counters / 2 counters, interleaved (a
  // counter's two generations side by side); none for no filter.
  std::vector<uint16_t> counters;
  uint32_t current = 0;           // the generation sightings go to: 0 or 1
  int64_t current_sightings = 0;  // what it holds
  bool operator==(const AdmissionFilter&) const = default;
};

class CountingFilter {
 public:
  // `counters` a row (0: no filter, every count 0); `seed` picks the
  // counters a key hashes to.
  CountingFilter(int64_t counters, double max_false_admission, uint64_t seed);

  int64_t bytes() const { return static_cast<int64_t>(state_.counters.size()) * 2; }
  int64_t window() const { return window_; }

  // The key's sightings in both generations, at most kMaxSightings.
  uint32_t Sightings(uint64_t key) const;
  // n more sightings of the key.
  void Add(uint64_t key, uint32_t n);

  const AdmissionFilter& state() const { return state_; }
  // INVALID_ARGUMENT unless `state` is this filter's kind: its counters'
  // number (or none: an empty filter) and a generation of 0 or 1.
  absl::Status CheckLoadable(const AdmissionFilter& state) const;
  // A state CheckLoadable accepts.
  void Load(const AdmissionFilter& state);

 private:
  static constexpr int kRows = 4;
  // The index of the key's counter pair in row r.
  int64_t PairOf(uint64_t key, int r) const;

  int64_t width_ = 0;  // counter pairs a row
  int64_t window_ = 0;
  std::array<uint64_t, kRows> row_seeds_{};
  AdmissionFilter state_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_COUNTING_FILTER_H_
