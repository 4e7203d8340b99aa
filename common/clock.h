// Time as leases and timeouts see it: a monotonic clock (immune to the wall
// clock being set), behind an interface so that a test can drive it.
#ifndef PSTRAIN_COMMON_CLOCK_H_
#define PSTRAIN_COMMON_CLOCK_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"
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
// Its time: what every duration, deadline and timeout inside pstrain is
// measured on (the wall clock only for times shown to people and for gRPC
// deadlines, which gRPC takes as wall-clock times).
absl::Time MonotonicNow();

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

// Waits on an absl::Mutex with timeouts on the monotonic clock. Abseil
// 20220623's Mutex::AwaitWithTimeout turns a timeout into a wall-clock
// deadline (FUTEX_CLOCK_REALTIME): a wall clock set back by an hour would
// stretch a one-second pause by an hour (heartbeats stop, leases lapse).
// Whoever changes what a waiter waits for calls NotifyAll() after the change
// (with or without the mutex held). Thread-safe.
class MonotonicCondVar {
 public:
  // With `mu` held: waits until `done()` (evaluated with `mu` held) or until
  // `timeout` has passed on the monotonic clock; returns done().
  bool AwaitWithTimeout(absl::Mutex& mu, absl::FunctionRef<bool()> done, absl::Duration timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void NotifyAll();

 private:
  std::condition_variable_any cv_;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_CLOCK_H_
