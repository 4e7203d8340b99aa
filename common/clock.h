// Time as leases and timeouts see it: a monotonic clock (immune to the wall
// clock being set), behind an interface so that a test can drive it.
#ifndef PSTRAIN_COMMON_CLOCK_H_
#define PSTRAIN_COMMON_CLOCK_H_

#include <atomic>
#include <cstdint>

#include "absl/time/time.h"

namespace pstrain {

// Thread-safe.
class Clock {
 public:
  virtual ~Clock() = default;
  // Only differences between two Now()s mean anything.
  virtual absl::Time Now() const = 0;
};

// The machine's monotonic clock. Lives for the process.
Clock* MonotonicClock();

// A clock that moves only when told to (tests).
class FakeClock final : public Clock {
 public:
  absl::Time Now() const override {
    return absl::UnixEpoch() + absl::Nanoseconds(nanos_.load());
  }
  void Advance(absl::Duration d) { nanos_ += absl::ToInt64Nanoseconds(d); }

 private:
  std::atomic<int64_t> nanos_{int64_t{1} << 40};
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CLOCK_H_
