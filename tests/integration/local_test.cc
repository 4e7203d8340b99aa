// pstrain-local as a user runs it: bad job files, and signals.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/cpu_affinity.h"
#include "common/files.h"
#include "common/process.h"
#include "common/rpc.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

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

// The last line of pstrain-local's stdout, its JSON result, as fields.
std::map<std::string, std::string> ResultFields(const std::string& out) {
  std::vector<std::string> lines = absl::StrSplit(out, '\n', absl::SkipEmpty());
  std::map<std::string, std::string> fields;
  if (lines.empty()) return fields;
  std::string json = lines.back();
  for (char c : std::string("{}\"")) json.erase(std::remove(json.begin(), json.end(), c), json.end());
  for (absl::string_view item : absl::StrSplit(json, ',')) {
    const std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits(':', 1));
    fields[kv.first] = kv.second;
  }
  return fields;
}

// How a pstrain-local run with kills ended.
struct KilledRun {
  int status = -1;
  std::string out, err;
};

// Runs pstrain-local on `job`, killing with SIGKILL, in turn, the child
// whose argv has victims[i].first once the job is at step victims[i].second.
void RunWithKills(const TempDir& dir, const std::string& job,
                  const std::vector<std::pair<std::string, int64_t>>& victims, KilledRun* run,
                  const std::vector<std::string>& more_args = {}) {
  SpawnOptions spawn;
  const std::string run_dir = dir.path() + "/run-" + std::to_string(victims.size());
  spawn.argv = {BinDir() + "/pstrain-local", "--job", job, "--run_dir", run_dir};
  spawn.argv.insert(spawn.argv.end(), more_args.begin(), more_args.end());
  spawn.log_path = run_dir + ".out";
  spawn.stderr_path = run_dir + ".err";
  absl::StatusOr<pid_t> local = Spawn(spawn);
  PSTRAIN_ASSERT_OK(local);
  // Kill when the job has made progress: the coordinator's address is in
  // the run directory.
  const absl::Time give_up = absl::Now() + absl::Minutes(3);
  std::unique_ptr<v1::Control::Stub> control;
  auto progress = [&]() -> v1::Job {
    if (control == nullptr) {
      absl::StatusOr<std::string> address = ReadFile(run_dir + "/coordinator.address");
      if (!address.ok()) return v1::Job();
      control = v1::Control::NewStub(MakeChannel(std::string(absl::StripAsciiWhitespace(*address))));
    }
    v1::GetJobRequest get;
    get.set_job_id("job-000001");
    v1::Job j;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(5));
    control->GetJob(&context, get, &j);
    return j;
  };
  for (const auto& [victim, step] : victims) {
    while (progress().progress().step() < step) {
      ASSERT_LT(absl::Now(), give_up) << "the job did not get to step " << step;
      ASSERT_FALSE(TryReap(*local).has_value()) << "pstrain-local exited early";
      absl::SleepFor(absl::Milliseconds(20));
    }
    const pid_t pid = ChildWithArg(*local, victim);
    ASSERT_GT(pid, 0) << victim;
    ASSERT_EQ(kill(pid, SIGKILL), 0);
  }
  const std::optional<int> reaped = ReapBefore(*local, give_up);
  ASSERT_TRUE(reaped.has_value()) << "pstrain-local did not finish";
  run->status = *reaped;
  run->out = ReadFile(run_dir + ".out").value_or("");
  run->err = ReadFile(run_dir + ".err").value_or("");
}

// A server and then a worker killed with SIGKILL in the middle of a
// pstrain-local run: restarted under their ids, and the run ends as a clean
// one does, down to the last digit of its final loss.
TEST(LocalTest, KilledProcessesAreRestartedAndTheResultDoesNotChange) {
  TempDir dir;
  std::string yaml = kJob;
  // 1874 steps: the kills (steps 100 and 250 in the coordinator's view,
  // which lags the workers by up to a report interval) fall inside the job.
  yaml.replace(yaml.find("epochs: 100"), 11, "epochs: 2");
  const std::string job = dir.Write("job.yaml", yaml);
  ProcessResult clean = RunProcess({BinDir() + "/pstrain-local", "--job", job}, absl::Minutes(5));
  ASSERT_EQ(clean.exit_code(), 0) << clean.err;
  const auto expected = ResultFields(clean.out);
  ASSERT_EQ(expected.at("recoveries"), "0");
  // The last checkpoint (every 100 steps, pstrain-local's default), written
  // after the job's last step: the result waits for it.
  int64_t steps = 0;
  ASSERT_TRUE(absl::SimpleAtoi(expected.at("steps"), &steps));
  EXPECT_EQ(expected.at("last_checkpoint_step"), absl::StrCat(steps / 100 * 100));

  KilledRun run;
  ASSERT_NO_FATAL_FAILURE(
      RunWithKills(dir, job, {{"--node_id=server-1", 100}, {"--node_id=worker-0", 250}}, &run));
  ASSERT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 0)
      << DescribeWaitStatus(run.status) << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "server-1 exited (killed by signal 9), restarting"))
      << run.err;
  EXPECT_TRUE(absl::StrContains(run.err, "worker-0 exited (killed by signal 9), restarting"))
      << run.err;
  const auto fields = ResultFields(run.out);
  EXPECT_EQ(fields.at("final_loss"), expected.at("final_loss"));
  EXPECT_EQ(fields.at("test_accuracy"), expected.at("test_accuracy"));
  EXPECT_EQ(fields.at("recoveries"), "2");
  EXPECT_NE(fields.at("last_checkpoint_step"), "0");
}

// The click example as a user runs it: a model with embedding tables on
// generated click logs reaches, on the test split, an AUC within 0.01 of
// the data's oracle (the planted model's), and the result line carries
// both.
// The click example trains to within 0.01 of its data's oracle AUC; its
// export (the model file and the tables, read from the servers'
// checkpoints of the last step) evaluates to exactly the job's AUC.
TEST(LocalTest, TheClickExampleComesWithin001OfItsDatasOracleAuc) {
  TempDir dir;
  const std::string exported = dir.path() + "/ctr-small";
  ProcessResult r = RunProcess({BinDir() + "/pstrain-local", "--job",
                                std::string(PSTRAIN_SOURCE_DIR) + "/examples/ctr_small.yaml",
                                "--export", exported},
                               absl::Minutes(10));
  ASSERT_EQ(r.exit_code(), 0) << r.err;
  const auto fields = ResultFields(r.out);
  ASSERT_TRUE(fields.contains("test_auc")) << r.out;
  ASSERT_TRUE(fields.contains("oracle_auc")) << r.out;
  const double test_auc = std::stod(fields.at("test_auc"));
  const double oracle_auc = std::stod(fields.at("oracle_auc"));
  RecordProperty("test_auc", fields.at("test_auc"));
  RecordProperty("oracle_auc", fields.at("oracle_auc"));
  EXPECT_GT(oracle_auc, 0.75);
  EXPECT_LE(oracle_auc - test_auc, 0.01) << r.out;
  EXPECT_LE(test_auc, oracle_auc + 0.005) << r.out;  // no model ranks better than the truth

  ProcessResult eval = RunProcess({BinDir() + "/pstrain-local", "--eval", exported});
  ASSERT_EQ(eval.exit_code(), 0) << eval.err;
  const auto evaluated = ResultFields(eval.out);
  ASSERT_TRUE(evaluated.contains("test_auc")) << eval.out;
  EXPECT_NEAR(std::stod(evaluated.at("test_auc")), test_auc, 1e-6) << eval.out;
  EXPECT_NEAR(std::stod(evaluated.at("test_log_loss")), std::stod(fields.at("test_log_loss")),
              1e-6);
  // The model file alone is not the model: the message says what is.
  ProcessResult alone = RunProcess({BinDir() + "/pstrain-local", "--eval", exported + "/model.pstrain"});
  EXPECT_EQ(alone.exit_code(), 2);
  EXPECT_TRUE(absl::StrContains(alone.err, "evaluate the directory")) << alone.err;
}

// Click logs are files the user names: pstrain-local's workers read them
// wherever they are (no data root confines them).
TEST(LocalTest, AClickJobReadsItsFilesWhereverTheyAre) {
  TempDir dir;
  ProcessResult gen = RunProcess({BinDir() + "/pstrain-clickgen", "--out", dir.path() + "/clicks",
                                  "--train_rows", "4096", "--test_rows", "512", "--dense", "2",
                                  "--fields", "2", "--vocabulary", "50"});
  ASSERT_EQ(gen.exit_code(), 0) << gen.err;
  const std::string job = dir.path() + "/job.yaml";
  std::ofstream(job) << "name: click-files\n"
                        "model: {type: click, click: {bottom: [8], top: [8]}}\n"
                        "data: {clicks: {dense: 2, fields: 2, train_files: ["
                     << dir.path() << "/clicks/train.txt], test_files: [" << dir.path()
                     << "/clicks/test.txt]}}\n"
                        "tables: [{name: a, dim: 4, fields: [1]}, {name: b, dim: 4, fields: [2]}]\n"
                        "optimizer: {type: adam, learning_rate: 0.01}\n"
                        "batch_size: 64\nsteps: 16\nnum_workers: 2\nnum_servers: 1\n";
  ProcessResult r = RunProcess({BinDir() + "/pstrain-local", "--job", job}, absl::Minutes(5));
  ASSERT_EQ(r.exit_code(), 0) << r.err;
  EXPECT_TRUE(ResultFields(r.out).contains("test_auc")) << r.out;
}

// The click example with a server and a worker killed: their tables'
// rows, optimizer states and admission filters come back from the
// checkpoints, and the run ends bitwise as a clean one.
TEST(LocalTest, AKilledClickJobRecoversItsTablesBitwise) {
  TempDir dir;
  const std::string job = std::string(PSTRAIN_SOURCE_DIR) + "/examples/ctr_small.yaml";
  ProcessResult clean = RunProcess(
      {BinDir() + "/pstrain-local", "--job", job, "--export", dir.path() + "/clean"},
      absl::Minutes(10));
  ASSERT_EQ(clean.exit_code(), 0) << clean.err;
  const auto expected = ResultFields(clean.out);
  KilledRun run;
  ASSERT_NO_FATAL_FAILURE(RunWithKills(dir, job,
                                       {{"--node_id=server-1", 1000}, {"--node_id=worker-0", 2000}},
                                       &run, {"--export", dir.path() + "/killed"}));
  ASSERT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 0)
      << DescribeWaitStatus(run.status) << run.err;
  const auto fields = ResultFields(run.out);
  EXPECT_EQ(fields.at("recoveries"), "2");
  EXPECT_NE(fields.at("last_checkpoint_step"), "0");
  EXPECT_EQ(fields.at("final_loss"), expected.at("final_loss"));
  EXPECT_EQ(fields.at("test_auc"), expected.at("test_auc"));
  // Every row of every table, as exported (from the last generation's
  // checkpoints of the last step): bitwise the clean run's.
  for (int t = 1; t <= 8; ++t) {
    const std::string table = absl::StrCat("/tables/c", t, ".rows");
    absl::StatusOr<std::string> a = ReadFile(dir.path() + "/clean" + table);
    absl::StatusOr<std::string> b = ReadFile(dir.path() + "/killed" + table);
    PSTRAIN_ASSERT_OK(a);
    PSTRAIN_ASSERT_OK(b);
    EXPECT_TRUE(*a == *b) << table;
  }
}

// --export keeps what was trained: the model file a user loads again
// (pstrain-local --eval) evaluates to the job's accuracy; a path that cannot
// be written is refused before anything runs.
TEST(LocalTest, TheTrainedModelIsExported) {
  TempDir dir;
  std::string yaml = kJob;
  yaml.replace(yaml.find("epochs: 100"), 11, "epochs: 1");
  const std::string job = dir.Write("job.yaml", yaml);
  const std::string model = dir.path() + "/model.pstm";
  ProcessResult trained = RunProcess(
      {BinDir() + "/pstrain-local", "--job", job, "--export", model}, absl::Minutes(5));
  ASSERT_EQ(trained.exit_code(), 0) << trained.err;
  EXPECT_TRUE(absl::StrContains(trained.out, "wrote " + model + ": ")) << trained.out;
  const auto result = ResultFields(trained.out);
  ProcessResult evaluated =
      RunProcess({BinDir() + "/pstrain-local", "--eval", model}, absl::Minutes(2));
  ASSERT_EQ(evaluated.exit_code(), 0) << evaluated.err;
  EXPECT_TRUE(absl::StrContains(
      evaluated.out, absl::StrCat("\"test_accuracy\":", result.at("test_accuracy"), ",")))
      << evaluated.out << "\n" << trained.out;

  ProcessResult refused = RunProcess(
      {BinDir() + "/pstrain-local", "--job", job, "--export", dir.path() + "/no/such/dir/m.pstm"},
      absl::Minutes(1));
  EXPECT_EQ(refused.exit_code(), 2) << refused.err;
  EXPECT_TRUE(absl::StrContains(refused.err, "--export")) << refused.err;
}

// colocated_servers: no server processes, the shards in the workers'; the
// same result bitwise as with servers of their own, also after a worker's
// process (and with it a shard) is killed and restarted.
TEST(LocalTest, ColocatedServersGiveTheResultOfServersOfTheirOwn) {
  TempDir dir;
  std::string yaml = kJob;
  // 3748 steps: the kill at step 150 in the coordinator's view (which lags
  // the workers by up to a report interval) falls well inside the job.
  yaml.replace(yaml.find("epochs: 100"), 11, "epochs: 4");
  const std::string separate = dir.Write("job.yaml", yaml);
  yaml.replace(yaml.find("num_servers: 2"), 14, "colocated_servers: true");
  const std::string colocated = dir.Write("colocated.yaml", yaml);
  // With nothing pinned; the colocated runs below pin each worker (the
  // default) where the machine has a CPU for each.
  ProcessResult clean = RunProcess(
      {BinDir() + "/pstrain-local", "--job", separate, "--nopin_cpus"}, absl::Minutes(5));
  ASSERT_EQ(clean.exit_code(), 0) << clean.err;
  const auto expected = ResultFields(clean.out);

  KilledRun run;
  ASSERT_NO_FATAL_FAILURE(RunWithKills(dir, colocated, {}, &run));
  ASSERT_TRUE(WIFEXITED(run.status) && WEXITSTATUS(run.status) == 0)
      << DescribeWaitStatus(run.status) << run.err;
  const std::vector<std::vector<int>> groups = SplitCpus(AllowedCpus(), 2);
  for (size_t w = 0; w < groups.size(); ++w) {
    const std::string log =
        ReadFile(absl::StrCat(dir.path(), "/run-0/worker-", w, ".log")).value_or("");
    EXPECT_TRUE(absl::StrContains(log, "running on CPUs " + FormatCpuList(groups[w]) + "\n"))
        << "worker-" << w << ":\n"
        << log;
  }
  EXPECT_TRUE(absl::StrContains(run.out, "2 server(s) in the workers' processes")) << run.out;
  auto fields = ResultFields(run.out);
  EXPECT_EQ(fields.at("servers"), "2");
  EXPECT_EQ(fields.at("final_loss"), expected.at("final_loss"));
  EXPECT_EQ(fields.at("test_accuracy"), expected.at("test_accuracy"));

  KilledRun killed;
  ASSERT_NO_FATAL_FAILURE(RunWithKills(dir, colocated, {{"--node_id=worker-1", 150}}, &killed));
  ASSERT_TRUE(WIFEXITED(killed.status) && WEXITSTATUS(killed.status) == 0)
      << DescribeWaitStatus(killed.status) << killed.err;
  EXPECT_TRUE(absl::StrContains(killed.err, "worker-1 exited (killed by signal 9), restarting"))
      << killed.err;
  fields = ResultFields(killed.out);
  EXPECT_EQ(fields.at("final_loss"), expected.at("final_loss"));
  EXPECT_EQ(fields.at("test_accuracy"), expected.at("test_accuracy"));
  EXPECT_EQ(fields.at("recoveries"), "1");
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
  PSTRAIN_ASSERT_OK(local);

  // Coordinator, 2 servers and 2 workers.
  std::vector<pid_t> children;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while ((children = ChildrenOf(*local)).size() < 5) {
    ASSERT_LT(absl::Now(), give_up) << "the cluster did not start";
    ASSERT_FALSE(TryReap(*local).has_value()) << "pstrain-local exited early";
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_EQ(kill(*local, signo), 0);

  const std::optional<int> reaped = ReapBefore(*local, absl::Now() + absl::Seconds(60));
  ASSERT_TRUE(reaped.has_value()) << "pstrain-local did not exit after the signal";
  const int status = *reaped;
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
