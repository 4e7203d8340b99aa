#include "common/retry.h"

#include <vector>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

TEST(RetryPolicyTest, TransientCodesAreRetriedAndOthersArePermanent) {
  const RetryPolicy p = RetryPolicy::Transient();
  for (absl::StatusCode code :
       {absl::StatusCode::kOk, absl::StatusCode::kUnavailable,
        absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kResourceExhausted,
        absl::StatusCode::kCancelled, absl::StatusCode::kUnknown}) {
    EXPECT_TRUE(p.Retryable(code)) << code;
  }
  for (absl::StatusCode code :
       {absl::StatusCode::kInvalidArgument, absl::StatusCode::kNotFound,
        absl::StatusCode::kFailedPrecondition, absl::StatusCode::kPermissionDenied,
        absl::StatusCode::kAborted, absl::StatusCode::kAlreadyExists,
        absl::StatusCode::kInternal, absl::StatusCode::kDataLoss}) {
    EXPECT_FALSE(p.Retryable(code)) << code;
  }
  const RetryPolicy q = p.AlsoRetrying({absl::StatusCode::kNotFound});
  EXPECT_TRUE(q.Retryable(absl::StatusCode::kNotFound));
  EXPECT_FALSE(p.Retryable(absl::StatusCode::kNotFound)) << "the original is unchanged";
}

TEST(RetryPolicyTest, BackoffDoublesUpToTheMaximumAndResets) {
  Backoff b(RetryPolicy::Transient().WithBackoff(absl::Milliseconds(10), absl::Milliseconds(35)));
  EXPECT_EQ(b.Next(), absl::Milliseconds(10));
  EXPECT_EQ(b.Next(), absl::Milliseconds(20));
  EXPECT_EQ(b.Next(), absl::Milliseconds(35));
  EXPECT_EQ(b.Next(), absl::Milliseconds(35));
  b.Reset();
  EXPECT_EQ(b.Next(), absl::Milliseconds(10));
}

TEST(RetryTest, RetriesTransientErrorsUntilSuccess) {
  int calls = 0;
  std::vector<absl::Duration> pauses;
  const absl::Status s = Retry(
      RetryPolicy::Transient().WithBackoff(absl::Milliseconds(1), absl::Milliseconds(4)),
      [&] { return ++calls < 4 ? absl::UnavailableError("down") : absl::OkStatus(); },
      [&](absl::Duration pause) {
        pauses.push_back(pause);
        return true;
      });
  PSTRAIN_EXPECT_OK(s);
  EXPECT_EQ(calls, 4);
  EXPECT_EQ(pauses, (std::vector<absl::Duration>{absl::Milliseconds(1), absl::Milliseconds(2),
                                                  absl::Milliseconds(4)}));
}

TEST(RetryTest, APermanentErrorEndsAtOnce) {
  int calls = 0;
  const absl::Status s = Retry(
      RetryPolicy::Transient(), [&] { ++calls; return absl::NotFoundError("no such job"); },
      [](absl::Duration) { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(calls, 1);
}

TEST(RetryTest, StopsWhenTheSleepSaysSoOrPatienceRunsOut) {
  int calls = 0;
  absl::Status s = Retry(
      RetryPolicy::Transient(), [&] { ++calls; return absl::UnavailableError("down"); },
      [](absl::Duration) { return false; });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(calls, 1);

  calls = 0;
  s = Retry(RetryPolicy::Transient()
                .WithBackoff(absl::Seconds(1), absl::Seconds(1))
                .WithPatience(absl::Milliseconds(1)),
            [&] { ++calls; return absl::UnavailableError("down"); },
            [](absl::Duration) { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(calls, 1) << "a pause beyond the patience is not taken";
}

}  // namespace
}  // namespace pstrain
