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

struct Exit {
  int status = -1;
  std::string output;
};

// Runs pstrain-local to completion (bounded by `patience`).
Exit RunLocal(const TempDir& dir, const std::vector<std::string>& args,
              absl::Duration patience = absl::Seconds(60)) {
  SpawnOptions spawn;
  spawn.argv = {BinDir() + "/pstrain-local"};
  spawn.argv.insert(spawn.argv.end(), args.begin(), args.end());
  spawn.log_path = dir.path() + "/local.out";
  unlink(spawn.log_path.c_str());
  absl::StatusOr<pid_t> pid = Spawn(spawn);
  EXPECT_TRUE(pid.ok());
  Exit exit;
  const absl::Time give_up = absl::Now() + patience;
  while (true) {
    if (std::optional<int> status = TryReap(*pid)) {
      exit.status = *status;
      break;
    }
    if (absl::Now() > give_up) {
      ADD_FAILURE() << "pstrain-local did not exit";
      exit.status = StopProcess(*pid, absl::Seconds(5));
      break;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  std::ifstream in(spawn.log_path);
  std::stringstream text;
  text << in.rdbuf();
  exit.output = text.str();
  return exit;
}

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
    Exit exit = RunLocal(dir, {"--job", path});
    EXPECT_TRUE(WIFEXITED(exit.status) && WEXITSTATUS(exit.status) == 2)
        << DescribeWaitStatus(exit.status) << "\n" << exit.output;
    EXPECT_TRUE(absl::StrContains(exit.output, field)) << exit.output;
    const std::vector<std::string> lines =
        absl::StrSplit(exit.output, '\n', absl::SkipEmpty());
    EXPECT_EQ(lines.size(), 1u) << exit.output;
  }
  Exit missing = RunLocal(dir, {"--job", dir.path() + "/nope.yaml"});
  EXPECT_TRUE(WIFEXITED(missing.status) && WEXITSTATUS(missing.status) == 2) << missing.output;
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
