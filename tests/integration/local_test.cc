// pstrain-local as a user runs it: bad job files, and signals.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/process.h"
#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"

namespace pstrain::testing {
namespace {

constexpr char kJob[] = R"(
model: {type: mlp, hidden: [64]}
optimizer: {type: adam, learning_rate: 0.001}
mode: sync
batch_size: 32
epochs: 100
num_servers: 2
num_workers: 2
chunk_bytes: 65536
)";

TEST(LocalTest, BadJobFilesExit2WithOneLineNamingTheField) {
  TempDir dir;
  auto with = [](std::string from, std::string to) {
    std::string yaml = kJob;
    yaml.replace(yaml.find(from), from.size(), to);
    return yaml;
  };
  const std::pair<std::string, std::string> cases[] = {
      {"model: [unclosed\n", "YAML error"},
      {with("type: mlp", "type: gpt"), "model.type"},
      {with("type: adam", "type: adamw"), "optimizer.type"},
      {std::string(kJob) + "batch_size: 16\n", "batch_size: duplicate key"},
      {with("num_workers: 2", "num_workers: 0"), "num_workers"},
  };
  for (const auto& [yaml, field] : cases) {
    const std::string path = dir.Write("job.yaml", yaml);
    ProcessResult r = RunProcess({BinDir() + "/pstrain-local", "--job", path});
    EXPECT_EQ(r.exit_code(), 2) << DescribeWaitStatus(r.status) << "\n" << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, field)) << r.err;
    const std::vector<std::string> lines = absl::StrSplit(r.err, '\n', absl::SkipEmpty());
    EXPECT_EQ(lines.size(), 1u) << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;
  }
  ProcessResult missing = RunProcess({BinDir() + "/pstrain-local", "--job", dir.path() + "/nope.yaml"});
  EXPECT_EQ(missing.exit_code(), 2) << missing.err;
}

class LocalSignalTest : public ::testing::TestWithParam<int> {};

TEST_P(LocalSignalTest, NoChildSurvives) {
  const int signo = GetParam();
  TempDir dir;
  const std::string job = dir.Write("job.yaml", kJob);
  SpawnOptions spawn;
  spawn.argv = {BinDir() + "/pstrain-local", "--job", job, "--run_dir", dir.path() + "/run"};
  spawn.log_path = dir.path() + "/local.out";
  absl::StatusOr<pid_t> local = Spawn(spawn);
  ASSERT_TRUE(local.ok());

  // Coordinator, 2 servers and 2 workers.
  std::vector<pid_t> children;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while ((children = ChildrenOf(*local)).size() < 5) {
    ASSERT_LT(absl::Now(), give_up) << "the cluster did not start";
    ASSERT_FALSE(TryReap(*local).has_value()) << "pstrain-local exited early";
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(kill(*local, signo), 0);

  int status = 0;
  const absl::Time exit_deadline = absl::Now() + absl::Seconds(60);
  while (true) {
    if (std::optional<int> s = TryReap(*local)) {
      status = *s;
      break;
    }
    ASSERT_LT(absl::Now(), exit_deadline) << "pstrain-local did not exit after the signal";
    absl::SleepFor(absl::Milliseconds(20));
  }
  if (signo == SIGKILL) {
    EXPECT_TRUE(WIFSIGNALED(status));
  } else {
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + signo)
        << DescribeWaitStatus(status);
  }
  const absl::Time gone_deadline = absl::Now() + absl::Seconds(30);
  for (pid_t child : children) {
    while (IsAlive(child)) {
      ASSERT_LT(absl::Now(), gone_deadline) << "child " << child << " survived";
      absl::SleepFor(absl::Milliseconds(20));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Signals, LocalSignalTest, ::testing::Values(SIGINT, SIGTERM, SIGKILL),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(sigabbrev_np(info.param));
                         });

}  // namespace
}  // namespace pstrain::testing
