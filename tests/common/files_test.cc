#include "common/files.h"

#include <sys/stat.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

TEST(CheckPathWithinTest, ResolvesLinksAndDotsBeforeComparing) {
  testing::TempDir dir;
  const std::string root = dir.path() + "/root", outside = dir.path() + "/outside";
  ASSERT_EQ(mkdir(root.c_str(), 0755), 0);
  ASSERT_EQ(mkdir(outside.c_str(), 0755), 0);
  ASSERT_EQ(mkdir((root + "/data").c_str(), 0755), 0);
  ASSERT_EQ(symlink(outside.c_str(), (root + "/escape").c_str()), 0);
  ASSERT_EQ(symlink((root + "/data").c_str(), (outside + "/back-in").c_str()), 0);
  for (const std::string& in : {root, root + "/data", root + "/data/", root + "/not-yet/made",
                                outside + "/back-in", root + "/data/../data"}) {
    PSTRAIN_EXPECT_OK(CheckPathWithin("data.dir", in, "--data_root", root));
  }
  for (const std::string& out :
       {outside, root + "/escape", root + "/escape/x", root + "/../outside",
        root + "/not-yet/../../outside", root + "-sibling", std::string("relative/path"), std::string("/etc"), std::string()}) {
    const absl::Status s = CheckPathWithin("data.dir", out, "--data_root", root);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << out;
    EXPECT_TRUE(absl::StrContains(s.message(), "data.dir")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "is outside this node's --data_root")) << s;
  }
  PSTRAIN_EXPECT_OK(CheckPathWithin("data.dir", "/etc", "--data_root", ""));
  PSTRAIN_EXPECT_OK(CheckPathWithin("data.dir", "/etc", "--data_root", "/"));
  EXPECT_EQ(CheckPathWithin("data.dir", root, "--data_root", dir.path() + "/missing").code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain
