// Nothing is lost when a process dies: real processes killed with SIGKILL
// at a step drawn from a logged seed, restarted under their node ids (as a
// container runtime would) or replaced by a spare, with checkpoints damaged
// or cut short and the coordinator killed in the middle of a recovery. In
// sync mode the final parameters are bitwise those of a run without the
// fault: each test runs the same job without and with it and compares.
#include <signal.h>
#include <sys/wait.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/file_system.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/process.h"
#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

class RecoveryTest : public ClusterFixture {
 protected:
  // A cluster whose children are restarted when they die, with a lease
  // short enough for a lost node to be noticed within a test (and long
  // enough that a loaded 2-core machine does not lose healthy ones). Every
  // exchange of its workers starts `exchange_delay` late, so a step takes
  // at least twice that, whatever the speed of the machine, and they report
  // their progress every 50 ms: a fault made once the reports show a step
  // in a job's first half finds the job still running.
  void StartSupervised(int servers, int workers, cli::LocalCluster::Options options = {},
                       absl::Duration exchange_delay = absl::Milliseconds(2)) {
    const int64_t delay_ms = absl::ToInt64Milliseconds(exchange_delay);
    for (int w = 0; w < workers; ++w) {
      if (delay_ms > 0) {
        options.worker_flags[w].push_back(absl::StrCat(
            "--fault_injection=delay=1,min_delay_ms=", delay_ms, ",max_delay_ms=", delay_ms));
      }
      options.worker_flags[w].push_back("--report_interval_ms=50");
    }
    options.restart_exited_children = true;
    options.state_dir = dir_.path() + "/state";
    options.lease = absl::Seconds(4);
    StartCluster(servers, workers, options);
  }

  // A sync job of 2 workers and 2 servers, checkpointing every 50 steps.
  v1::JobSpec Job(v1::OptimizerType optimizer = v1::OPTIMIZER_TYPE_ADAM, float momentum = 0,
                  int64_t steps = 200) {
    v1::JobSpec spec = MlpSpec(optimizer, optimizer == v1::OPTIMIZER_TYPE_ADAM ? 1e-3f : 0.05f,
                               2, 32, 2, steps);
    spec.mutable_optimizer()->set_momentum(momentum);
    spec.mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints");
    spec.mutable_checkpoint()->set_every_steps(50);
    spec.mutable_checkpoint()->set_keep(3);
    return spec;
  }

  // A step in [1, total/2] from a seed that the test's output shows.
  int64_t RandomStep(int64_t total) {
    const uint64_t seed = std::random_device{}();
    std::mt19937_64 rng(seed);
    const int64_t step = std::uniform_int_distribution<int64_t>(1, total / 2)(rng);
    std::cerr << "fault at step " << step << " (seed " << seed << ")\n";
    RecordProperty("fault_step", std::to_string(step));
    RecordProperty("seed", std::to_string(seed));
    return step;
  }

  v1::Job WaitForStep(const std::string& id, int64_t step) {
    return WaitFor(id, [step](const v1::Job& job) { return job.progress().step() >= step; });
  }

  std::string Log(const std::string& child) {
    std::ifstream in(absl::StrCat(dir_.path(), "/", child, ".log"));
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  }

  static bool HistorySays(const v1::Job& job, const std::string& what) {
    for (const v1::MembershipChange& change : job.history()) {
      if (absl::StrContains(change.reason(), what)) return true;
    }
    return false;
  }
};

struct OptimizerCase {
  const char* name;
  v1::OptimizerType type;
  float momentum;
  // The workers reach the servers over direct TCP connections (no shared
  // memory, no Unix sockets): the fault ends those connections.
  bool direct_tcp = false;
};

class ServerRestartTest : public RecoveryTest,
                          public ::testing::WithParamInterface<OptimizerCase> {};

// kill -9 of a server, which comes back under its id: the job rolls back to
// its latest checkpoint and ends with the parameters of a clean run.
TEST_P(ServerRestartTest, AKilledServerRestartedUnderItsIdChangesNothing) {
  cli::LocalCluster::Options options;
  if (GetParam().direct_tcp) {
    for (int w = 0; w < 2; ++w) {
      options.worker_flags[w] = {"--noshared_memory", "--nosame_machine_sockets"};
    }
  }
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2, options));
  const v1::JobSpec spec = Job(GetParam().type, GetParam().momentum);
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const v1::Job running = WaitForStep(id, RandomStep(spec.steps()));
  ASSERT_TRUE(cluster_->Kill(running.server_nodes(1), SIGKILL));
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  EXPECT_GE(ended.recoveries(), 1);
  EXPECT_TRUE(HistorySays(ended, "was restarted")) << ended.DebugString();
  if (GetParam().direct_tcp) {
    for (const char* worker : {"worker-0", "worker-1"}) {
      EXPECT_TRUE(absl::StrContains(Log(worker), "reached over a direct TCP connection"))
          << Log(worker);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, ServerRestartTest,
    ::testing::Values(OptimizerCase{"adam", v1::OPTIMIZER_TYPE_ADAM, 0},
                      OptimizerCase{"momentum", v1::OPTIMIZER_TYPE_SGD, 0.9f},
                      OptimizerCase{"adam_direct_tcp", v1::OPTIMIZER_TYPE_ADAM, 0, true}),
                         [](const auto& info) { return std::string(info.param.name); });

// The dead server stays dead: once its lease has lapsed, the spare server
// takes its place from the checkpoint.
TEST_F(RecoveryTest, ASpareServerTakesThePlaceOfALostOne) {
  ASSERT_NO_FATAL_FAILURE(StartSupervised(3, 2));
  v1::JobSpec spec = Job();
  spec.mutable_recovery()->set_replace_after_seconds(1);
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const v1::Job running = WaitForStep(id, RandomStep(spec.steps()));
  const std::string lost = running.server_nodes(1);
  ASSERT_TRUE(cluster_->Kill(lost, SIGKILL, /*restart=*/false));
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  EXPECT_NE(ended.server_nodes(1), lost);
  EXPECT_TRUE(HistorySays(ended, "takes its place")) << ended.DebugString();
}

// Before the first checkpoint a recovery starts over from the seed.
TEST_F(RecoveryTest, ALossBeforeTheFirstCheckpointStartsOverFromStepZero) {
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2));
  v1::JobSpec spec = Job();
  spec.mutable_checkpoint()->set_every_steps(100000);
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const v1::Job running = WaitForStep(id, RandomStep(spec.steps()));
  ASSERT_TRUE(cluster_->Kill(running.server_nodes(0), SIGKILL));
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  ASSERT_GE(ended.history_size(), 2);
  EXPECT_EQ(ended.history(1).step(), 0);
}

enum class Damage { kFlippedByte, kTruncated };

class DamagedCheckpointTest : public RecoveryTest,
                              public ::testing::WithParamInterface<Damage> {};

// The server dies; while it is down its checkpoints are damaged (the one
// the job would resume from and any newer); it comes back: the damage is found and named, and the job
// goes back to an older checkpoint, with the same result.
TEST_P(DamagedCheckpointTest, IsDetectedAndAnOlderCheckpointUsed) {
  // A step takes at least 10 ms: the job of 400 steps is still running when
  // the coordinator has recorded two checkpoints and the server is killed,
  // whatever the speed of the machine.
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2, {}, absl::Milliseconds(5)));
  const v1::JobSpec spec = Job(v1::OPTIMIZER_TYPE_ADAM, 0, 400);
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const v1::Job running = WaitFor(id, [](const v1::Job& job) { return job.checkpoints_size() >= 2; });
  const std::string server = running.server_nodes(1);
  ASSERT_TRUE(cluster_->Kill(server, SIGKILL, /*restart=*/false));
  PSTRAIN_ASSERT_OK(cluster_->WaitForExit(server, absl::Seconds(30)));
  // The checkpoint the job would resume from and every newer file of the
  // server (it may have written some the coordinator has not recorded):
  // damaged; an older one left whole.
  const v1::Job after_kill = Get(id);
  ASSERT_GE(after_kill.checkpoints_size(), 2);
  const v1::CheckpointRecord resume = *after_kill.checkpoints().rbegin();
  auto at_or_after_resume = [&](const v1::CheckpointRecord& r) {
    return std::make_pair(r.step(), r.generation()) >=
           std::make_pair(resume.step(), resume.generation());
  };
  const std::vector<v1::CheckpointRecord> files = server::ListCheckpoints(
      PosixFileSystem(), spec.checkpoint().dir(), id, 1, false);
  ASSERT_GE(files.size(), 2u);
  ASSERT_FALSE(at_or_after_resume(files[0])) << "no checkpoint older than the resume one";
  for (size_t i = 1; i < files.size(); ++i) {
    if (!at_or_after_resume(files[i])) continue;
    const std::string path = server::CheckpointPath(spec.checkpoint().dir(), id, 1,
                                                    files[i].step(), files[i].generation());
    absl::StatusOr<std::string> bytes = ReadFile(path);
    PSTRAIN_ASSERT_OK(bytes);
    if (GetParam() == Damage::kFlippedByte) {
      (*bytes)[bytes->size() / 2] ^= 0x01;
    } else {
      bytes->resize(bytes->size() / 3);
    }
    std::ofstream(path, std::ios::binary | std::ios::trunc) << *bytes;
  }
  PSTRAIN_ASSERT_OK(cluster_->RestartChild(server, {}));
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  EXPECT_TRUE(HistorySays(ended, "could not load")) << ended.DebugString();
  EXPECT_TRUE(absl::StrContains(Log(server), "is damaged")) << Log(server);
}

INSTANTIATE_TEST_SUITE_P(Damages, DamagedCheckpointTest,
                         ::testing::Values(Damage::kFlippedByte, Damage::kTruncated),
                         [](const auto& info) {
                           return std::string(info.param == Damage::kFlippedByte ? "flipped_byte"
                                                                                 : "truncated");
                         });

// A server that dies in the middle of writing a checkpoint (a test switch
// of its file system aborts it after so many bytes) leaves a partial file:
// removed when it comes back, and the previous checkpoint is used.
TEST_F(RecoveryTest, AServerThatDiesWhileWritingACheckpointLosesNothing) {
  const v1::JobSpec spec = Job();
  // Server 1's file: its floats with Adam's two state arrays, and a header.
  const v1::PartitionPlan plan = PlanFor(spec);
  int64_t floats = 0;
  for (const v1::ChunkInfo& c : plan.chunks()) floats += c.server() == 1 ? c.size() : 0;
  const int64_t file_bytes = floats * 3 * 4;
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2));
  const std::vector<float> clean = FinalParams(Submit(spec));
  // The crash comes in the second checkpoint of the next job (the first
  // job's files do not count: the switch counts from the start).
  ASSERT_TRUE(cluster_->Kill("server-1", SIGKILL, /*restart=*/false));
  PSTRAIN_ASSERT_OK(cluster_->WaitForExit("server-1", absl::Seconds(30)));
  PSTRAIN_ASSERT_OK(cluster_->RestartChild(
      "server-1",
      {absl::StrCat("--fs_fault_injection=crash:.ckpt:", file_bytes + file_bytes / 2)}));
  const std::string id = Submit(spec);
  absl::StatusOr<int> status = cluster_->WaitForExit("server-1", absl::Minutes(2));
  PSTRAIN_ASSERT_OK(status);
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 134) << DescribeWaitStatus(*status);
  PSTRAIN_ASSERT_OK(cluster_->RestartChild("server-1", {}));
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  EXPECT_GE(ended.recoveries(), 1);
  EXPECT_TRUE(absl::StrContains(Log("server-1"), "a partial checkpoint")) << Log("server-1");
}

// kill -9 of a worker, which comes back under its id (on_worker_loss:
// wait): it takes its index, data and step again.
TEST_F(RecoveryTest, AKilledWorkerRestartedUnderItsIdChangesNothing) {
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2));
  const v1::JobSpec spec = Job();
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const v1::Job running = WaitForStep(id, RandomStep(spec.steps()));
  ASSERT_TRUE(cluster_->Kill(running.worker_nodes(1), SIGKILL));
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  EXPECT_GE(ended.recoveries(), 1);
}

// SIGTERM, as a pod's deletion sends it: a server and then a worker end
// cleanly (exit 0) well within a pod's 30 s grace period, handing back their
// open waits and leaving the job, and their replacements under the same ids
// change nothing.
TEST_F(RecoveryTest, ASigtermedServerAndWorkerLeaveCleanlyAndChangeNothing) {
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2));
  const v1::JobSpec spec = Job();
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const int64_t first = RandomStep(spec.steps());
  const v1::Job running = WaitForStep(id, first);
  for (const std::string& node : {running.server_nodes(1), running.worker_nodes(1)}) {
    SCOPED_TRACE(node);
    ASSERT_TRUE(cluster_->Kill(node, SIGTERM, /*restart=*/false));
    absl::StatusOr<int> status = cluster_->WaitForExit(node, absl::Seconds(20));
    PSTRAIN_ASSERT_OK(status);
    EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << DescribeWaitStatus(*status);
    PSTRAIN_ASSERT_OK(cluster_->RestartChild(node, {}));
  }
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  EXPECT_GE(ended.recoveries(), 1);
}

// on_worker_loss: fail: the job fails, naming the node.
TEST_F(RecoveryTest, ALostWorkerFailsAJobThatSaysSo) {
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2));
  v1::JobSpec spec = Job(v1::OPTIMIZER_TYPE_ADAM, 0, 100000000);
  spec.mutable_recovery()->set_on_worker_loss(v1::WORKER_LOSS_POLICY_FAIL);
  const std::string id = Submit(spec);
  const v1::Job running = WaitForStep(id, 10);
  ASSERT_TRUE(cluster_->Kill(running.worker_nodes(1), SIGKILL, /*restart=*/false));
  const v1::Job ended = WaitForEnd(id);
  EXPECT_EQ(ended.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(ended.reason(), running.worker_nodes(1))) << ended.reason();
}

// on_worker_loss: elastic: the job goes on with the worker it has left (the
// global batch cut over it) and still trains the quick-start model.
TEST_F(RecoveryTest, AnElasticJobGoesOnWithoutALostWorker) {
  // No delay: the fault comes in the first half of 1404 steps, and the
  // reports every 50 ms lag the job by a few steps.
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2, {}, absl::ZeroDuration()));
  absl::StatusOr<v1::JobSpec> spec =
      LoadJobSpecFile(std::string(PSTRAIN_SOURCE_DIR) + "/examples/fashion_mlp.yaml");
  PSTRAIN_ASSERT_OK(spec);
  spec->mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints");
  spec->mutable_recovery()->set_on_worker_loss(v1::WORKER_LOSS_POLICY_ELASTIC);
  spec = NormalizeJobSpec(*spec);
  PSTRAIN_ASSERT_OK(spec);
  const std::string id = Submit(*spec);
  const v1::Job running = WaitForStep(id, RandomStep(TotalSteps(*spec)));
  ASSERT_TRUE(cluster_->Kill(running.worker_nodes(1), SIGKILL, /*restart=*/false));
  const v1::Job ended = WaitForEnd(id, absl::Minutes(5));
  ASSERT_EQ(ended.state(), v1::JOB_STATE_SUCCEEDED) << ended.reason();
  EXPECT_EQ(ended.worker_nodes_size(), 1);
  EXPECT_TRUE(HistorySays(ended, "goes on without it")) << ended.DebugString();
  EXPECT_GE(ended.result().test_accuracy(), 0.85f);
  RecordProperty("test_accuracy", std::to_string(ended.result().test_accuracy()));
}

// The coordinator is killed while a server's recovery is under way (the new
// generation recorded, its nodes loading it); after its restart the job
// finishes the recovery and ends as a clean run does.
TEST_F(RecoveryTest, TheCoordinatorKilledDuringARecoveryFinishesIt) {
  ASSERT_NO_FATAL_FAILURE(StartSupervised(2, 2));
  const v1::JobSpec spec = Job();
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const v1::Job running = WaitForStep(id, RandomStep(spec.steps()));
  ASSERT_TRUE(cluster_->Kill(running.server_nodes(1), SIGKILL));
  WaitFor(id, [](const v1::Job& job) { return job.generation() >= 2; });
  PSTRAIN_ASSERT_OK(cluster_->RestartCoordinator());
  v1::Job ended;
  ExpectBitwiseEqual(FinalParams(id, &ended), clean);
  EXPECT_GE(ended.recoveries(), 1);
}

}  // namespace
}  // namespace pstrain::testing
