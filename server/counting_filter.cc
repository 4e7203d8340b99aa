#include "server/counting_filter.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace pstrain::server {

int64_t AdmissionWindow(int64_t counters, double max_false_admission) {
  // A key seen once reads as seen twice when other sightings share its
  // counter in each of the 4 rows: with n sightings over w counters a row,
  // a chance of (1 - e^(-n/w))^4 at most. The two generations hold at most
  // 2 windows' sightings (a generation is full at a window, and the
  // sightings added to it while it fills are those of one key at most
  // past it), so n = 2 x the window keeps it to the bound.
  const double width = static_cast<double>(counters / 2);
  const double per_counter = -std::log1p(-std::pow(max_false_admission, 1.0 / 4));
  return std::max<int64_t>(1, static_cast<int64_t>(width * per_counter / 2));
}

CountingFilter::CountingFilter(int64_t counters, double max_false_admission, uint64_t seed) {
  if (counters == 0) return;
  width_ = counters / 2;
  window_ = AdmissionWindow(counters, max_false_admission);
  for (int r = 0; r < kRows; ++r) row_seeds_[r] = Mix64(seed + r);
  state_.counters.assign(width_ * kRows * 2, 0);
}

int64_t CountingFilter::PairOf(uint64_t key, int r) const {
  return r * width_ + static_cast<int64_t>(BelowN(Mix64(key ^ row_seeds_[r]), width_));
}

uint32_t CountingFilter::Sightings(uint64_t key) const {
  if (width_ == 0) return 0;
  uint32_t least = kMaxSightings;
  for (int r = 0; r < kRows; ++r) {
    const uint16_t* pair = state_.counters.data() + 2 * PairOf(key, r);
    least = std::min<uint32_t>(least, uint32_t{pair[0]} + pair[1]);
  }
  return least;
}

void CountingFilter::Add(uint64_t key, uint32_t n) {
  if (width_ == 0) return;
  if (state_.current_sightings >= window_) {
    // The current generation becomes the previous one; the previous one's
    // counts are forgotten, and it becomes the current one.
    state_.current ^= 1;
    for (size_t c = state_.current; c < state_.counters.size(); c += 2) state_.counters[c] = 0;
    state_.current_sightings = 0;
  }
  for (int r = 0; r < kRows; ++r) {
    uint16_t& counter = state_.counters[2 * PairOf(key, r) + state_.current];
    counter = static_cast<uint16_t>(std::min<uint32_t>(kMaxSightings, counter + n));
  }
  state_.current_sightings += n;
}

absl::Status CountingFilter::CheckLoadable(const AdmissionFilter& state) const {
  if (!state.counters.empty() && state.counters.size() != state_.counters.size()) {
    return absl::InvalidArgumentError(absl::StrCat("a filter of ", state.counters.size(),
                                                   " counters, expected ",
                                                   state_.counters.size()));
  }
  if (state.current > 1 || state.current_sightings < 0) {
    return absl::InvalidArgumentError(absl::StrCat("a filter's generation ", state.current,
                                                   " holding ", state.current_sightings,
                                                   " sightings"));
  }
  return absl::OkStatus();
}

void CountingFilter::Load(const AdmissionFilter& state) {
  if (state.counters.empty()) {
    state_ = AdmissionFilter{.counters = std::vector<uint16_t>(state_.counters.size(), 0)};
  } else {
    state_ = state;
  }
}

}  // namespace pstrain::server
