// A stand-in for the part of absl::Status that kernels/ uses; see
// kernels/standalone/README.md. Not used by normal builds.
#ifndef PSTRAIN_KERNELS_STANDALONE_ABSL_STATUS_STATUS_H_
#define PSTRAIN_KERNELS_STANDALONE_ABSL_STATUS_STATUS_H_

#include <ostream>
#include <string>
#include <utility>

namespace absl {

enum class StatusCode : int {
  kOk = 0,
  kCancelled = 1,
  kUnknown = 2,
  kInvalidArgument = 3,
  kDeadlineExceeded = 4,
  kNotFound = 5,
  kAlreadyExists = 6,
  kPermissionDenied = 7,
  kResourceExhausted = 8,
  kFailedPrecondition = 9,
  kAborted = 10,
  kOutOfRange = 11,
  kUnimplemented = 12,
  kInternal = 13,
  kUnavailable = 14,
  kDataLoss = 15,
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const {
    return ok() ? "OK" : "code " + std::to_string(static_cast<int>(code_)) + ": " + message_;
  }
  friend bool operator==(const Status& a, const Status& b) {
    return a.code_ == b.code_ && a.message_ == b.message_;
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline std::ostream& operator<<(std::ostream& out, const Status& s) { return out << s.ToString(); }

inline Status OkStatus() { return Status(); }
inline Status CancelledError(std::string m) { return {StatusCode::kCancelled, std::move(m)}; }
inline Status InvalidArgumentError(std::string m) {
  return {StatusCode::kInvalidArgument, std::move(m)};
}
inline Status DeadlineExceededError(std::string m) {
  return {StatusCode::kDeadlineExceeded, std::move(m)};
}
inline Status ResourceExhaustedError(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status FailedPreconditionError(std::string m) {
  return {StatusCode::kFailedPrecondition, std::move(m)};
}
inline Status InternalError(std::string m) { return {StatusCode::kInternal, std::move(m)}; }
inline Status UnavailableError(std::string m) { return {StatusCode::kUnavailable, std::move(m)}; }

}  // namespace absl

#endif  // PSTRAIN_KERNELS_STANDALONE_ABSL_STATUS_STATUS_H_
