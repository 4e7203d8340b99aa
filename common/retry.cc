#include "common/retry.h"

#include <algorithm>

#include "common/clock.h"

namespace pstrain {
namespace {

uint32_t Bit(absl::StatusCode code) { return uint32_t{1} << static_cast<int>(code); }

}  // namespace

RetryPolicy RetryPolicy::Transient() {
  RetryPolicy p;
  for (absl::StatusCode code :
       {absl::StatusCode::kOk, absl::StatusCode::kUnavailable,
        absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kResourceExhausted,
        absl::StatusCode::kCancelled, absl::StatusCode::kUnknown}) {
    p.retryable_ |= Bit(code);
  }
  return p;
}

RetryPolicy RetryPolicy::AlsoRetrying(std::initializer_list<absl::StatusCode> codes) const {
  RetryPolicy p = *this;
  for (absl::StatusCode code : codes) p.retryable_ |= Bit(code);
  return p;
}

RetryPolicy RetryPolicy::WithPatience(absl::Duration patience) const {
  RetryPolicy p = *this;
  p.patience_ = patience;
  return p;
}

RetryPolicy RetryPolicy::WithBackoff(absl::Duration initial, absl::Duration max) const {
  RetryPolicy p = *this;
  p.initial_backoff_ = initial;
  p.max_backoff_ = std::max(initial, max);
  return p;
}

bool RetryPolicy::Retryable(absl::StatusCode code) const {
  const int c = static_cast<int>(code);
  return c >= 0 && c < 32 && (retryable_ & (uint32_t{1} << c)) != 0;
}

absl::Duration Backoff::Next() {
  const absl::Duration pause = next_;
  next_ = std::min(next_ * 2, max_);
  return pause;
}

absl::Status Retry(const RetryPolicy& policy, absl::FunctionRef<absl::Status()> call,
                   absl::FunctionRef<bool(absl::Duration)> sleep) {
  const absl::Time give_up = MonotonicNow() + policy.patience();
  Backoff backoff(policy);
  while (true) {
    absl::Status status = call();
    if (status.ok() || !policy.Retryable(status)) return status;
    const absl::Duration pause = backoff.Next();
    if (MonotonicNow() + pause > give_up || !sleep(pause)) return status;
  }
}

}  // namespace pstrain
