// The daemons size their compute threads from the CPUs the system gives
// them — the affinity mask and the cgroup CPU quota a container runtime
// sets — and a flag the user gives wins. Real binaries, started under
// taskset or in a cgroup of the test's own (root only; skipped otherwise),
// each say what they chose (with --check_flags, which starts nothing).
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/cpu_affinity.h"
#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

// The daemon's log line about its threads (its stderr), "" if none.
std::string ThreadsLine(const std::vector<std::string>& argv) {
  ProcessResult r = RunProcess(argv);
  EXPECT_EQ(r.exit_code(), 0) << absl::StrJoin(argv, " ") << "\n" << r.err;
  for (absl::string_view line : absl::StrSplit(r.err, '\n')) {
    if (absl::StrContains(line, "threads: ")) return std::string(line);
  }
  return "";
}

std::vector<std::string> Server(std::vector<std::string> flags = {}) {
  std::vector<std::string> argv = {BinDir() + "/pstrain-server", "--coordinator=c:1",
                                   "--check_flags"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

std::vector<std::string> Worker(std::vector<std::string> flags = {}) {
  std::vector<std::string> argv = {BinDir() + "/pstrain-worker", "--coordinator=c:1",
                                   "--check_flags"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return argv;
}

std::vector<std::string> Under(std::vector<std::string> wrapper, std::vector<std::string> argv) {
  wrapper.insert(wrapper.end(), argv.begin(), argv.end());
  return wrapper;
}

TEST(ComputeThreadsTest, TheAffinityMaskBoundsThem) {
  if (access("/usr/bin/taskset", X_OK) != 0) GTEST_SKIP() << "no taskset (util-linux)";
  const std::vector<std::string> one_cpu = {"/usr/bin/taskset", "-c",
                                            absl::StrCat(AllowedCpus().front())};
  const std::string cpu = absl::StrCat("affinity ", AllowedCpus().front(), ",");
  std::string line = ThreadsLine(Under(one_cpu, Server()));
  EXPECT_TRUE(absl::StrContains(line, "apply threads: 1 (1 CPU (" + cpu)) << line;
  line = ThreadsLine(Under(one_cpu, Worker()));
  EXPECT_TRUE(absl::StrContains(line, "OpenBLAS threads: 1 (1 CPU (" + cpu)) << line;
  // The user's flag wins.
  line = ThreadsLine(Under(one_cpu, Server({"--apply_threads=3"})));
  EXPECT_TRUE(absl::StrContains(line, "apply threads: 3 (--apply_threads)")) << line;
  line = ThreadsLine(Under(one_cpu, Worker({"--blas_threads=3"})));
  EXPECT_TRUE(absl::StrContains(line, "OpenBLAS threads: 3 (--blas_threads)")) << line;
}

TEST(ComputeThreadsTest, TheProcessesSharingTheCpusDivideThem) {
  const int cpus = static_cast<int>(AllowedCpus().size());
  std::string line = ThreadsLine(Server({"--processes_sharing_cpus=2"}));
  EXPECT_TRUE(absl::StrContains(line, absl::StrCat("apply threads: ", std::max(1, cpus / 2))))
      << line;
  EXPECT_TRUE(absl::StrContains(line, "shared by 2 processes")) << line;
  // A worker of two CPU devices: each device's share.
  line = ThreadsLine(Worker({"--devices=cpu:2"}));
  EXPECT_TRUE(absl::StrContains(line, absl::StrCat("OpenBLAS threads: ", std::max(1, cpus / 2))))
      << line;
  EXPECT_EQ(RunProcess(Server({"--processes_sharing_cpus=0"})).exit_code(), 2);
}

// A cgroup of the test's own under the CPU controller's mount, with a
// quota of `cpus` CPUs; removed at the end. Needs root and a writable
// cgroup file system (v1's cpu controller or v2 with cpu enabled).
class QuotaCgroup {
 public:
  explicit QuotaCgroup(int cpus) {
    const std::string name = absl::StrCat("pstrain-test-", getpid(), "-", cpus);
    if (std::filesystem::exists("/sys/fs/cgroup/cpu/cpu.cfs_period_us")) {
      dir_ = "/sys/fs/cgroup/cpu/" + name;  // v1
      if (!Make() || !Put("cpu.cfs_period_us", "100000") ||
          !Put("cpu.cfs_quota_us", absl::StrCat(cpus * 100000))) {
        dir_.clear();
      }
    } else if (std::ifstream controls("/sys/fs/cgroup/cgroup.subtree_control");
               controls && absl::StrContains(std::string(std::istreambuf_iterator<char>(controls),
                                                         {}),
                                             "cpu")) {
      dir_ = "/sys/fs/cgroup/" + name;  // v2
      if (!Make() || !Put("cpu.max", absl::StrCat(cpus * 100000, " 100000"))) dir_.clear();
    }
  }
  ~QuotaCgroup() {
    if (!dir_.empty()) rmdir(dir_.c_str());
  }
  bool ok() const { return !dir_.empty(); }
  // `argv` run inside the cgroup.
  std::vector<std::string> Run(const std::vector<std::string>& argv) const {
    return Under({"/bin/sh", "-c", "echo $$ > " + dir_ + "/cgroup.procs && exec \"$@\"", "sh"},
                 argv);
  }

 private:
  bool Make() { return getuid() == 0 && mkdir(dir_.c_str(), 0755) == 0; }
  bool Put(const std::string& file, const std::string& value) {
    std::ofstream out(dir_ + "/" + file);
    out << value << "\n";
    out.close();
    return out.good();
  }
  std::string dir_;
};

TEST(ComputeThreadsTest, TheCgroupQuotaBoundsThem) {
  const int cpus = static_cast<int>(AllowedCpus().size());
  for (int quota : {1, 2}) {
    QuotaCgroup cgroup(quota);
    if (!cgroup.ok()) GTEST_SKIP() << "needs root and a writable cgroup CPU controller";
    const int expected = std::min(cpus, quota);
    std::string line = ThreadsLine(cgroup.Run(Server()));
    EXPECT_TRUE(absl::StrContains(line, absl::StrCat("apply threads: ", expected, " (")))
        << line;
    EXPECT_TRUE(absl::StrContains(line, absl::StrCat("cgroup CPU quota ", quota, ".00)"))) << line;
    line = ThreadsLine(cgroup.Run(Worker()));
    EXPECT_TRUE(absl::StrContains(line, absl::StrCat("OpenBLAS threads: ", expected, " (")))
        << line;
    // The user's flag wins.
    line = ThreadsLine(cgroup.Run(Server({"--apply_threads=4"})));
    EXPECT_TRUE(absl::StrContains(line, "apply threads: 4 (--apply_threads)")) << line;
  }
}

}  // namespace
}  // namespace pstrain::testing
