#include "common/clock.h"

#include <chrono>

namespace pstrain {
namespace {

class Monotonic final : public Clock {
 public:
  absl::Time Now() const override {
    return absl::UnixEpoch() + absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
  }
};

}  // namespace

Clock* MonotonicClock() {
  static Monotonic* const clock = new Monotonic;
  return clock;
}

}  // namespace pstrain
