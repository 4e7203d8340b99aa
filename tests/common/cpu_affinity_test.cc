#include "common/cpu_affinity.h"

#include <sched.h>

#include <atomic>
#include <cstdlib>
#include <thread>

#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

TEST(CpuListTest, ParsesLinuxCpuLists) {
  EXPECT_EQ(ParseCpuList("0").value(), (std::vector<int>{0}));
  EXPECT_EQ(ParseCpuList("0-3,8").value(), (std::vector<int>{0, 1, 2, 3, 8}));
  EXPECT_EQ(ParseCpuList("5,1-2,2").value(), (std::vector<int>{1, 2, 5}));
  EXPECT_EQ(ParseCpuList("1023").value(), (std::vector<int>{1023}));
  for (const char* bad :
       {"", ",", "a", "1-", "-1", "3-1", "1024", "0-1024", "1,,2", "1-2-3", "0x1"}) {
    absl::StatusOr<std::vector<int>> cpus = ParseCpuList(bad);
    EXPECT_EQ(cpus.status().code(), absl::StatusCode::kInvalidArgument) << "'" << bad << "'";
  }
  EXPECT_NE(ParseCpuList("3-1").status().message().find("runs backwards"), std::string::npos);
}

TEST(CpuListTest, FormatsRangesAndRoundTrips) {
  EXPECT_EQ(FormatCpuList({0}), "0");
  EXPECT_EQ(FormatCpuList({0, 1, 2, 3, 8}), "0-3,8");
  EXPECT_EQ(FormatCpuList({1, 3, 4, 6}), "1,3-4,6");
  EXPECT_EQ(FormatCpuList({}), "");
  for (const char* list : {"0-3,8", "1,3-4,6", "7", "0-1023"}) {
    EXPECT_EQ(FormatCpuList(ParseCpuList(list).value()), list);
  }
}

TEST(CpuListTest, SplitsIntoConsecutiveGroupsAsEvenAsTheyCome) {
  EXPECT_EQ(SplitCpus({0, 1}, 2), (std::vector<std::vector<int>>{{0}, {1}}));
  EXPECT_EQ(SplitCpus({0, 1, 2, 3, 4}, 2), (std::vector<std::vector<int>>{{0, 1, 2}, {3, 4}}));
  EXPECT_EQ(SplitCpus({2, 5, 6, 9}, 3), (std::vector<std::vector<int>>{{2, 5}, {6}, {9}}));
  EXPECT_TRUE(SplitCpus({0}, 2).empty());
  EXPECT_TRUE(SplitCpus({0, 1}, 0).empty());
}

// On a thread of its own, so that the test process keeps its CPUs.
TEST(CpuAffinityTest, KeepsTheThreadAndTheThreadsItStartsOnTheCpus) {
  const std::vector<int> allowed = AllowedCpus();
  ASSERT_FALSE(allowed.empty());
  const std::vector<int> one = {allowed.back()};
  std::thread([&] {
    PSTRAIN_ASSERT_OK(RunOnlyOn(one));
    EXPECT_EQ(AllowedCpus(), one);
    std::thread([&] { EXPECT_EQ(AllowedCpus(), one); }).join();
  }).join();
  EXPECT_EQ(AllowedCpus(), allowed);
}

// The threads a process runs before it pins itself (OpenBLAS starts some
// when it loads) move too. In a child process (a death test), so that the
// test process keeps its CPUs.
TEST(CpuAffinityDeathTest, TheProcessesThreadsAlreadyRunningMoveToo) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const std::vector<int> one = {AllowedCpus().back()};
  EXPECT_EXIT(
      {
        std::atomic<bool> moved{false};
        std::vector<int> seen;
        std::thread earlier([&] {
          while (!moved) std::this_thread::yield();
          seen = AllowedCpus();
        });
        const bool ok = RunProcessOnlyOn(one).ok();
        moved = true;
        earlier.join();
        std::exit(ok && seen == one && AllowedCpus() == one ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(CpuAffinityTest, CpusNotAllowedAreAnErrorNamingTheAllowedOnes) {
  const std::vector<int> allowed = AllowedCpus();
  if (allowed.back() == CPU_SETSIZE - 1) GTEST_SKIP() << "every CPU number is allowed here";
  std::thread([&] {
    absl::Status s = RunOnlyOn({CPU_SETSIZE - 1});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("may use CPUs " + FormatCpuList(allowed)), std::string::npos)
        << s.message();
    EXPECT_EQ(AllowedCpus(), allowed);  // unchanged
  }).join();
}

}  // namespace
}  // namespace pstrain
