// Helpers shared by the test suites.
#ifndef PSTRAIN_TESTS_TEST_UTIL_H_
#define PSTRAIN_TESTS_TEST_UTIL_H_

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gtest/gtest.h"

#define PSTRAIN_EXPECT_OK(expr)                 \
  do {                                          \
    const ::absl::Status s_ = (expr);           \
    EXPECT_TRUE(s_.ok()) << s_;                 \
  } while (0)
#define PSTRAIN_ASSERT_OK(expr)                 \
  do {                                          \
    const ::absl::Status s_ = (expr);           \
    ASSERT_TRUE(s_.ok()) << s_;                 \
  } while (0)

namespace pstrain::testing {

// Where Debian's dataset-fashion-mnist puts the files.
inline const char* kFashionDir = "/usr/share/datasets/fashion-mnist";

// Per tensor: relative L2 distance ||a-b||/||b|| and max |a-b|.
struct TensorDiff {
  std::string name;
  double relative_l2 = 0;
  double max_abs = 0;
};

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_TEST_UTIL_H_
