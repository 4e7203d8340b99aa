// A stand-in for the part of absl::StatusOr that kernels/ uses; see
// kernels/standalone/README.md. Not used by normal builds.
#ifndef PSTRAIN_KERNELS_STANDALONE_ABSL_STATUS_STATUSOR_H_
#define PSTRAIN_KERNELS_STANDALONE_ABSL_STATUS_STATUSOR_H_

#include <cstdlib>
#include <iostream>
#include <optional>
#include <utility>

#include "absl/status/status.h"

namespace absl {

template <typename T>
class StatusOr {
 public:
  StatusOr(const Status& status) : status_(status) {  // NOLINT: implicit, like absl
    if (status_.ok()) status_ = Status(StatusCode::kInternal, "OK status without a value");
  }
  template <typename U, typename = std::enable_if_t<std::is_convertible_v<U&&, T>>>
  StatusOr(U&& value) : value_(std::forward<U>(value)) {}  // NOLINT: implicit, like absl

  bool ok() const { return status_.ok(); }
  const Status& status() const { return status_; }

  T& value() & { return Checked(); }
  T&& value() && { return std::move(Checked()); }
  T& operator*() & { return Checked(); }
  T&& operator*() && { return std::move(Checked()); }
  T* operator->() { return &Checked(); }
  const T* operator->() const { return &const_cast<StatusOr*>(this)->Checked(); }

 private:
  T& Checked() {
    if (!value_.has_value()) {
      std::cerr << "StatusOr has no value: " << status_ << "\n";
      std::abort();
    }
    return *value_;
  }

  Status status_;
  std::optional<T> value_;
};

}  // namespace absl

#endif  // PSTRAIN_KERNELS_STANDALONE_ABSL_STATUS_STATUSOR_H_
