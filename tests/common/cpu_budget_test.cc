#include "common/cpu_budget.h"

#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

// A cgroup tree of the test's own, read as a process's would be.
class CgroupTreeTest : public ::testing::Test {
 protected:
  void Write(const std::string& path, const std::string& text) {
    const std::string full = dir_.path() + "/" + path;
    std::filesystem::create_directories(std::filesystem::path(full).parent_path());
    std::ofstream(full) << text;
  }
  std::optional<double> Quota() {
    return CgroupCpuQuota({.mountinfo = dir_.path() + "/mountinfo",
                           .cgroup = dir_.path() + "/cgroup",
                           .root_prefix = dir_.path() + "/fs"});
  }
  testing::TempDir dir_;
};

TEST_F(CgroupTreeTest, V2TakesTheSmallestQuotaAlongThePath) {
  Write("mountinfo",
        "22 1 0:21 / /proc rw - proc proc rw\n"
        "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n");
  Write("cgroup", "0::/kubepods/pod1/c1\n");
  Write("fs/sys/fs/cgroup/kubepods/cpu.max", "400000 100000\n");
  Write("fs/sys/fs/cgroup/kubepods/pod1/cpu.max", "max 100000\n");
  Write("fs/sys/fs/cgroup/kubepods/pod1/c1/cpu.max", "200000 100000\n");
  EXPECT_EQ(Quota(), 2.0);
  // The pod's limit below the container's.
  Write("fs/sys/fs/cgroup/kubepods/pod1/cpu.max", "150000 100000\n");
  EXPECT_EQ(Quota(), 1.5);
}

TEST_F(CgroupTreeTest, AContainerSeesItsOwnCgroupAsTheRoot) {
  // cgroup namespace: "0::/" and the mount's root is the container's cgroup.
  Write("mountinfo", "30 25 0:26 /kubepods/pod1/c1 /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n");
  Write("cgroup", "0::/kubepods/pod1/c1\n");
  Write("fs/sys/fs/cgroup/cpu.max", "300000 100000\n");
  EXPECT_EQ(Quota(), 3.0);
  Write("cgroup", "0::/\n");  // outside the mount's root: nothing read
  EXPECT_EQ(Quota(), std::nullopt);
}

TEST_F(CgroupTreeTest, V1ReadsTheCpuControllersQuotaOverPeriod) {
  Write("mountinfo",
        "35 30 0:30 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
        "36 30 0:31 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n");
  Write("cgroup", "5:memory:/job\n4:cpu,cpuacct:/job/task\n");
  Write("fs/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  Write("fs/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  Write("fs/sys/fs/cgroup/cpu,cpuacct/job/task/cpu.cfs_quota_us", "250000\n");
  Write("fs/sys/fs/cgroup/cpu,cpuacct/job/task/cpu.cfs_period_us", "100000\n");
  EXPECT_EQ(Quota(), 2.5);
  Write("fs/sys/fs/cgroup/cpu,cpuacct/job/task/cpu.cfs_quota_us", "-1\n");
  EXPECT_EQ(Quota(), std::nullopt);
}

TEST_F(CgroupTreeTest, NoCgroupFilesMeansNoQuota) {
  EXPECT_EQ(Quota(), std::nullopt);
  Write("mountinfo", "30 25 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
  Write("cgroup", "0::/\n");
  Write("fs/sys/fs/cgroup/cpu.max", "garbage\n");
  EXPECT_EQ(Quota(), std::nullopt);
}

TEST(CpuBudgetTest, TheQuotaCapsTheAffinityRoundedDown) {
  const std::vector<int> eight = {0, 1, 2, 3, 4, 5, 6, 7};
  EXPECT_EQ(BudgetOf(eight, std::nullopt).cpus, 8);
  EXPECT_EQ(BudgetOf(eight, 2.0).cpus, 2);
  EXPECT_EQ(BudgetOf(eight, 1.5).cpus, 1);
  EXPECT_EQ(BudgetOf(eight, 0.5).cpus, 1);
  EXPECT_EQ(BudgetOf({0, 1}, 4.0).cpus, 2);
  EXPECT_EQ(BudgetOf({}, std::nullopt).cpus, 1);
  EXPECT_EQ(BudgetOf(eight, 2.0).why, "2 CPUs (affinity 0-7, cgroup CPU quota 2.00)");
  EXPECT_EQ(BudgetOf({3}, std::nullopt).why, "1 CPU (affinity 3, no cgroup CPU quota)");
}

TEST(CpuBudgetTest, ThreadsAreTheCpusSharedAmongProcessesAndPools) {
  const CpuBudget eight = BudgetOf({0, 1, 2, 3, 4, 5, 6, 7}, std::nullopt);
  EXPECT_EQ(ThreadsFor(eight, 1).threads, 8);
  EXPECT_EQ(ThreadsFor(eight, 4).threads, 2);
  EXPECT_EQ(ThreadsFor(eight, 3).threads, 2);
  EXPECT_EQ(ThreadsFor(eight, 2, 2).threads, 2);
  EXPECT_EQ(ThreadsFor(eight, 16).threads, 1);
  EXPECT_EQ(ThreadsFor(eight, 0).threads, 8);
  EXPECT_EQ(ThreadsFor(eight, 4).why,
            "8 CPUs (affinity 0-7, no cgroup CPU quota) shared by 4 processes");
}

}  // namespace
}  // namespace pstrain
