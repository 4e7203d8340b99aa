#include "common/clock.h"

#include <thread>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"

namespace pstrain {
namespace {

// What waits on a MonotonicCondVar: a flag under a mutex.
struct Flag {
  absl::Mutex mu;
  bool set ABSL_GUARDED_BY(mu) = false;
  MonotonicCondVar changed;

  bool Await(absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    return changed.AwaitWithTimeout(
        mu, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return set; }, timeout);
  }
  void Set() {
    {
      absl::MutexLock lock(&mu);
      set = true;
    }
    changed.NotifyAll();
  }
};

TEST(MonotonicCondVarTest, ReturnsAtOnceWhenTheConditionHolds) {
  Flag flag;
  flag.Set();
  EXPECT_TRUE(flag.Await(absl::ZeroDuration()));
  EXPECT_TRUE(flag.Await(absl::InfiniteDuration()));
}

TEST(MonotonicCondVarTest, TimesOutAfterTheTimeoutOnTheMonotonicClock) {
  Flag flag;
  const absl::Time start = MonotonicNow();
  EXPECT_FALSE(flag.Await(absl::Milliseconds(50)));
  EXPECT_GE(MonotonicNow() - start, absl::Milliseconds(50));
  EXPECT_FALSE(flag.Await(absl::ZeroDuration()));
  EXPECT_FALSE(flag.Await(-absl::Seconds(1)));
}

TEST(MonotonicCondVarTest, ANotifiedChangeEndsTheWaitBeforeItsTimeout) {
  for (const absl::Duration timeout : {absl::Minutes(10), absl::InfiniteDuration()}) {
    Flag flag;
    const absl::Time start = MonotonicNow();
    std::thread setter([&] {
      absl::SleepFor(absl::Milliseconds(20));
      flag.Set();
    });
    EXPECT_TRUE(flag.Await(timeout));
    // Woken by the change, not by the timeout: far less than ten minutes
    // on any machine.
    EXPECT_LT(MonotonicNow() - start, absl::Minutes(5));
    setter.join();
  }
}

}  // namespace
}  // namespace pstrain
