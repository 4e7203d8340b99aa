// In CI (CI=true) the hardening run (deploy/test/hardening.sh) runs the
// unit, cluster and integration tests under ASan+UBSan, all but the long
// ones; ctest marks each of those with PSTRAIN_SANITIZED_IN_CI=1
// (tests/CMakeLists.txt). The ordinary build skips them there, so that each
// test runs once in CI: such a test exits 77 before it starts, which ctest
// reports as skipped (SKIP_RETURN_CODE). Elsewhere every test runs in every
// build.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gtest/gtest.h"

namespace pstrain {
namespace {

#ifndef PSTRAIN_SANITIZED
constexpr int kSkipped = 77;

bool EnvIs(const char* name, const char* value) {
  const char* set = std::getenv(name);
  return set != nullptr && std::strcmp(set, value) == 0;
}

class SanitizedInCi : public testing::Environment {
 public:
  void SetUp() override {
    if (EnvIs("CI", "true") && EnvIs("PSTRAIN_SANITIZED_IN_CI", "1")) {
      std::printf("skipped: in CI this test runs under the sanitizers (deploy/test/hardening.sh)\n");
      std::fflush(stdout);
      _exit(kSkipped);
    }
  }
};

[[maybe_unused]] testing::Environment* const environment =
    testing::AddGlobalTestEnvironment(new SanitizedInCi);
#endif

}  // namespace
}  // namespace pstrain
