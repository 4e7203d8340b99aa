// Status helpers shared by every library.
#ifndef PSTRAIN_COMMON_STATUS_H_
#define PSTRAIN_COMMON_STATUS_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define PSTRAIN_RETURN_IF_ERROR(expr)                 \
  do {                                                \
    ::absl::Status pstrain_status_ = (expr);          \
    if (!pstrain_status_.ok()) return pstrain_status_; \
  } while (0)

#define PSTRAIN_CONCAT_INNER_(a, b) a##b
#define PSTRAIN_CONCAT_(a, b) PSTRAIN_CONCAT_INNER_(a, b)

// `lhs = value of expr` (an absl::StatusOr<T>), or return its error.
#define PSTRAIN_ASSIGN_OR_RETURN(lhs, expr) \
  PSTRAIN_ASSIGN_OR_RETURN_IMPL_(PSTRAIN_CONCAT_(pstrain_statusor_, __LINE__), lhs, expr)
#define PSTRAIN_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                  \
  if (!tmp.ok()) return tmp.status();                 \
  lhs = std::move(tmp).value()

#endif  // PSTRAIN_COMMON_STATUS_H_
