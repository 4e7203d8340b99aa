// Exported table files: written row by row, read back whole, damage and
// misuse named.
#include "common/table_file.h"

#include <fstream>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "common/files.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

TEST(TableFileTest, RowsComeBackByKey) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/t.rows";
  absl::StatusOr<std::unique_ptr<TableFileWriter>> w =
      TableFileWriter::Create(PosixFileSystem(), path, 2, 3);
  PSTRAIN_ASSERT_OK(w);
  PSTRAIN_ASSERT_OK((*w)->Append(3, std::vector<float>{1, 2}));
  PSTRAIN_ASSERT_OK((*w)->Append(70, std::vector<float>{3, 4}));
  EXPECT_FALSE(PosixFileSystem()->Exists(path)) << "in place before it is finished";
  PSTRAIN_ASSERT_OK((*w)->Append(uint64_t{1} << 63, std::vector<float>{5, 6}));
  PSTRAIN_ASSERT_OK((*w)->Finish());
  absl::StatusOr<TableFile> t = ReadTableFile(PosixFileSystem(), path);
  PSTRAIN_ASSERT_OK(t);
  EXPECT_EQ(t->dim, 2);
  EXPECT_EQ(t->keys, (std::vector<uint64_t>{3, 70, uint64_t{1} << 63}));
  EXPECT_EQ(t->values, (std::vector<float>{1, 2, 3, 4, 5, 6}));
  ASSERT_NE(t->Find(70), nullptr);
  EXPECT_EQ(t->Find(70)[1], 4);
  EXPECT_EQ(t->Find(4), nullptr);
}

TEST(TableFileTest, MisuseIsRefusedAndLeavesNoFile) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/t.rows";
  {
    absl::StatusOr<std::unique_ptr<TableFileWriter>> w =
        TableFileWriter::Create(PosixFileSystem(), path, 2, 2);
    PSTRAIN_ASSERT_OK(w);
    PSTRAIN_ASSERT_OK((*w)->Append(5, std::vector<float>{1, 2}));
    EXPECT_EQ((*w)->Append(5, std::vector<float>{1, 2}).code(),
              absl::StatusCode::kInvalidArgument);  // not above the last key
    EXPECT_EQ((*w)->Append(6, std::vector<float>{1}).code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*w)->Finish().code(), absl::StatusCode::kInvalidArgument);  // a row short
  }
  EXPECT_FALSE(PosixFileSystem()->Exists(path));
  EXPECT_FALSE(PosixFileSystem()->Exists(path + ".tmp"));
}

TEST(TableFileTest, DamageIsNamed) {
  testing::TempDir dir;
  const std::string path = dir.path() + "/t.rows";
  absl::StatusOr<std::unique_ptr<TableFileWriter>> w =
      TableFileWriter::Create(PosixFileSystem(), path, 1, 2);
  PSTRAIN_ASSERT_OK(w);
  PSTRAIN_ASSERT_OK((*w)->Append(1, std::vector<float>{1}));
  PSTRAIN_ASSERT_OK((*w)->Append(2, std::vector<float>{2}));
  PSTRAIN_ASSERT_OK((*w)->Finish());
  absl::StatusOr<std::string> good = ReadFile(path);
  PSTRAIN_ASSERT_OK(good);
  for (size_t at = 0; at < good->size(); at += 3) {
    std::string bad = *good;
    bad[at] ^= 0x40;
    std::ofstream(path, std::ios::binary | std::ios::trunc) << bad;
    absl::StatusOr<TableFile> t = ReadTableFile(PosixFileSystem(), path);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss) << "flip at " << at;
    EXPECT_TRUE(absl::StrContains(t.status().message(), path)) << t.status();
  }
  std::ofstream(path, std::ios::binary | std::ios::trunc) << good->substr(0, 30);
  EXPECT_EQ(ReadTableFile(PosixFileSystem(), path).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ReadTableFile(PosixFileSystem(), dir.path() + "/none").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pstrain
