// pstrain-clickgen as a user runs it.
#include "absl/strings/match.h"
#include "common/click_data.h"
#include "common/files.h"
#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

TEST(ClickgenTest, WritesTheFilesAndPrintsTheOracle) {
  TempDir dir;
  ProcessResult r = RunProcess({BinDir() + "/pstrain-clickgen", "--out", dir.path() + "/data",
                                "--train_rows", "300", "--test_rows", "2000", "--fields", "5",
                                "--dense", "2", "--gzip"});
  ASSERT_EQ(r.exit_code(), 0) << r.err;
  EXPECT_TRUE(absl::StartsWith(r.out, "{\"seed\": 1, \"train_rows\": 300, \"test_rows\": 2000"))
      << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "\"oracle_auc\": 0.")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, "\"dense_only_oracle_auc\": 0.")) << r.out;
  PSTRAIN_ASSERT_OK_AND_ASSIGN(std::string json, ReadFile(dir.path() + "/data/clicks.json"));
  EXPECT_EQ(json, r.out);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(
      ClickBatch train,
      ReadClickFiles({dir.path() + "/data/train.txt.gz"}, {.dense = 2, .fields = 5}));
  EXPECT_EQ(train.size(), 300);
}

TEST(ClickgenTest, BadFlagsExit2AndAnUnwritableDirectoryExits1) {
  TempDir dir;
  for (const auto& [flag, message] : std::vector<std::pair<std::string, std::string>>{
           {"--vocabulary=0", "vocabulary 0 is outside [1, 2^32]"},
           {"--zipf=-1", "zipf -1 is outside (0, 10]"},
           {"--out=", "--out is required"}}) {
    ProcessResult r = RunProcess({BinDir() + "/pstrain-clickgen", "--out", dir.path(), flag});
    EXPECT_EQ(r.exit_code(), 2) << flag;
    EXPECT_TRUE(absl::StrContains(r.err, message)) << r.err;
  }
  const std::string file = dir.Write("file", "x");
  ProcessResult r = RunProcess({BinDir() + "/pstrain-clickgen", "--out", file + "/data",
                                "--train_rows", "10", "--test_rows", "10"});
  EXPECT_EQ(r.exit_code(), 1);
  EXPECT_TRUE(absl::StartsWith(r.err, "pstrain-clickgen: ")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, file)) << r.err;
}

}  // namespace
}  // namespace pstrain::testing
