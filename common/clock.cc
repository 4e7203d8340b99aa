#include "common/clock.h"

#include <algorithm>
#include <chrono>

namespace pstrain {
namespace {

class Monotonic final : public Clock {
 public:
  absl::Time Now() const override { return MonotonicNow(); }
};

// absl::Mutex as std::condition_variable_any's Lockable.
struct Lockable {
  absl::Mutex& mu;
  void lock() ABSL_NO_THREAD_SAFETY_ANALYSIS { mu.Lock(); }
  void unlock() ABSL_NO_THREAD_SAFETY_ANALYSIS { mu.Unlock(); }
};

}  // namespace

Clock* MonotonicClock() {
  static Monotonic* const clock = new Monotonic;
  return clock;
}

absl::Time MonotonicNow() {
  return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
}

bool MonotonicCondVar::AwaitWithTimeout(absl::Mutex& mu, absl::FunctionRef<bool()> done,
                                        absl::Duration timeout) {
  // std::condition_variable waits on steady_clock with
  // pthread_cond_clockwait(CLOCK_MONOTONIC). A year stands for "forever"
  // (steady_clock::now() + an infinite duration would overflow).
  const auto deadline = std::chrono::steady_clock::now() +
                        absl::ToChronoNanoseconds(std::min(timeout, absl::Hours(24 * 365)));
  Lockable lockable{mu};
  return cv_.wait_until(lockable, deadline, [&] { return done(); });
}

void MonotonicCondVar::NotifyAll() { cv_.notify_all(); }

}  // namespace pstrain
