// Helpers shared by the test suites.
#ifndef PSTRAIN_TESTS_TEST_UTIL_H_
#define PSTRAIN_TESTS_TEST_UTIL_H_

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/rpc.h"
#include "common/status.h"
#include "grpcpp/support/status.h"
#include "gtest/gtest.h"

// Expects (or asserts) that `expr`, an absl::Status, an absl::StatusOr or
// a grpc::Status, is OK; a failure shows the expression and the status.
// More may be streamed in, as into EXPECT_TRUE: PSTRAIN_ASSERT_OK(s) << id;
#define PSTRAIN_EXPECT_OK(expr) PSTRAIN_CHECK_OK_(expr, ADD_FAILURE())
#define PSTRAIN_ASSERT_OK(expr) PSTRAIN_CHECK_OK_(expr, FAIL())
#define PSTRAIN_CHECK_OK_(expr, fail)                                                  \
  switch (0)                                                                           \
  case 0:                                                                              \
  default:                                                                             \
    if (const ::absl::Status pstrain_status_ = ::pstrain::testing::StatusOf(expr);      \
        pstrain_status_.ok()) {                                                        \
    } else                                                                             \
      fail << #expr << ": " << pstrain_status_ << " "

// `lhs = value of expr` (an absl::StatusOr<T>), or a fatal failure that
// shows the expression and its status.
#define PSTRAIN_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  PSTRAIN_ASSERT_OK_AND_ASSIGN_(PSTRAIN_CONCAT_(pstrain_statusor_, __LINE__), lhs, expr)
#define PSTRAIN_ASSERT_OK_AND_ASSIGN_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  PSTRAIN_ASSERT_OK(tmp);                            \
  lhs = std::move(tmp).value()

namespace pstrain::testing {

// The status PSTRAIN_EXPECT_OK and PSTRAIN_ASSERT_OK check.
inline absl::Status StatusOf(const absl::Status& status) { return status; }
template <typename T>
absl::Status StatusOf(const absl::StatusOr<T>& value) {
  return value.status();
}
inline absl::Status StatusOf(const grpc::Status& status) { return FromGrpcStatus(status); }

// Where Debian's dataset-fashion-mnist puts the files.
inline const char* kFashionDir = "/usr/share/datasets/fashion-mnist";

// A small valid job file: an MLP trained by SGD for 10 steps, one server, one worker.
inline constexpr char kSmallJobYaml[] = R"(
model: {type: mlp, hidden: [32]}
optimizer: {type: sgd, learning_rate: 0.1}
batch_size: 8
steps: 10
num_servers: 1
num_workers: 1
)";

// Per tensor: relative L2 distance ||a-b||/||b|| and max |a-b|.
struct TensorDiff {
  std::string name;
  double relative_l2 = 0;
  double max_abs = 0;
};

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TEST_UTIL_H_
