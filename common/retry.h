// One retry policy for every caller that talks to another process: which
// status codes are worth another try, how the pause between tries grows, and
// how long to keep trying. Each caller configures it for what a code means
// to it: NOT_FOUND from a parameter server means "the job is not loaded
// there yet, try again"; from the coordinator it means "no such job", which
// no retry changes.
#ifndef PSTRAIN_COMMON_RETRY_H_
#define PSTRAIN_COMMON_RETRY_H_

#include <cstdint>
#include <functional>
#include <initializer_list>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/time/time.h"

namespace pstrain {

class RetryPolicy {
 public:
  // Transient failures of the network or of a peer that is starting,
  // stopping or overloaded: UNAVAILABLE, DEADLINE_EXCEEDED,
  // RESOURCE_EXHAUSTED, CANCELLED (by the peer; a caller's own cancellation
  // is its own business) and UNKNOWN (what gRPC reports for a connection
  // broken mid-call). Everything else is permanent.
  static RetryPolicy Transient();

  // The same policy, also retrying `codes`.
  RetryPolicy AlsoRetrying(std::initializer_list<absl::StatusCode> codes) const;
  RetryPolicy WithPatience(absl::Duration patience) const;
  RetryPolicy WithBackoff(absl::Duration initial, absl::Duration max) const;

  // OK counts as retryable: nothing failed for good.
  bool Retryable(absl::StatusCode code) const;
  bool Retryable(const absl::Status& status) const { return Retryable(status.code()); }

  absl::Duration initial_backoff() const { return initial_backoff_; }
  absl::Duration max_backoff() const { return max_backoff_; }
  // How long a caller keeps trying without success before it gives up.
  absl::Duration patience() const { return patience_; }

 private:
  RetryPolicy() = default;
  uint32_t retryable_ = 0;  // bit per absl::StatusCode
  absl::Duration initial_backoff_ = absl::Milliseconds(50);
  absl::Duration max_backoff_ = absl::Seconds(2);
  absl::Duration patience_ = absl::Seconds(30);
};

// The pause before each next try: initial_backoff, doubling up to
// max_backoff; Reset() after progress.
class Backoff {
 public:
  explicit Backoff(const RetryPolicy& policy)
      : initial_(policy.initial_backoff()), max_(policy.max_backoff()), next_(initial_) {}
  absl::Duration Next();
  void Reset() { next_ = initial_; }

 private:
  absl::Duration initial_, max_, next_;
};

// Calls `call` until it returns OK or a permanent error, or until the
// policy's patience has run out (the last error is returned). Between tries
// it calls sleep(pause), which returns false to stop at once (the caller is
// shutting down; the last error is returned).
absl::Status Retry(const RetryPolicy& policy, absl::FunctionRef<absl::Status()> call,
                   absl::FunctionRef<bool(absl::Duration)> sleep);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_RETRY_H_
