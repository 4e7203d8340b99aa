// The job lifecycle through the control API, with real processes: queueing,
// jobs side by side, cancellation, coordinator crashes, model export.
#include <atomic>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/rpc.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

class ControlPlaneTest : public ClusterFixture {
 protected:
  // A small job of one worker and one server.
  static v1::JobSpec SmallJob(int64_t steps) {
    return MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 1, 64, 1, steps);
  }
};

bool Running(const v1::Job& job) { return job.state() == v1::JOB_STATE_RUNNING; }

TEST_F(ControlPlaneTest, AJobQueuesForAFullPoolAndRunsOnceItFrees) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1));
  // The first job runs until it is cancelled, so the second waits however
  // fast the machine is.
  const std::string first = Submit(SmallJob(100000000));
  const std::string second = Submit(SmallJob(300));
  WaitFor(first, [](const v1::Job& job) { return job.progress().step() > 20; });
  // One worker: the second job waits while the first runs.
  const v1::Job waiting = Get(second);
  EXPECT_EQ(waiting.state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(waiting.reason(), "waiting for 1 free workers")) << waiting.reason();
  EXPECT_EQ(Cancel(first).state(), v1::JOB_STATE_CANCELLED);

  const v1::Job a = Get(first);
  const v1::Job b = WaitForEnd(second);
  ASSERT_EQ(b.state(), v1::JOB_STATE_SUCCEEDED) << b.reason();
  EXPECT_GE(b.start_time_ms(), a.end_time_ms());
  // The results stay retrievable.
  const v1::Job job = Get(second);
  EXPECT_GT(job.result().test_accuracy(), 0.6f);
  EXPECT_EQ(job.result().steps(), 300);
  EXPECT_TRUE(job.has_model());
  EXPECT_FALSE(Get(first).has_model());
}

TEST_F(ControlPlaneTest, JobsRunSideBySideWhenThePoolAllows) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 2));
  const std::string a = Submit(SmallJob(100000));
  const std::string b = Submit(SmallJob(100000));
  WaitFor(a, Running);
  const v1::Job job_b = WaitFor(b, Running);
  ASSERT_EQ(Get(a).state(), v1::JOB_STATE_RUNNING);
  EXPECT_NE(Get(a).worker_nodes(0), job_b.worker_nodes(0));
  // Both make progress at the same time.
  WaitFor(a, [](const v1::Job& job) { return job.progress().step() > 20; });
  WaitFor(b, [](const v1::Job& job) { return job.progress().step() > 20; });
  EXPECT_EQ(Cancel(a).state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(Cancel(b).state(), v1::JOB_STATE_CANCELLED);
}

TEST_F(ControlPlaneTest, ACancelledJobFreesEveryNodeForTheNext) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 2));
  const std::string long_job = Submit(MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 64, 1, 100000));
  WaitFor(long_job, [](const v1::Job& job) { return job.progress().step() > 20; });
  EXPECT_EQ(Cancel(long_job).state(), v1::JOB_STATE_CANCELLED);

  // Every node reports that it holds nothing: the server dropped the job's
  // chunks, the workers stopped training.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (true) {
    bool all_free = true;
    for (const v1::Node& node : Nodes()) all_free &= node.jobs().empty();
    if (all_free) break;
    ASSERT_LT(absl::Now(), give_up) << "nodes still hold the cancelled job";
    absl::SleepFor(absl::Milliseconds(50));
  }
  const v1::Job next = WaitForEnd(Submit(MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 64, 1, 100)));
  EXPECT_EQ(next.state(), v1::JOB_STATE_SUCCEEDED) << next.reason();
}

// kill -9 of the coordinator at five points while 50 jobs are submitted:
// every acknowledged job is there after each restart.
TEST_F(ControlPlaneTest, AcknowledgedJobsSurviveCoordinatorCrashes) {
  cli::LocalCluster::Options options;
  options.state_dir = dir_.path() + "/state";
  ASSERT_NO_FATAL_FAILURE(StartCluster(0, 0, options));
  constexpr int kJobs = 50;
  absl::Mutex mu;
  std::vector<std::pair<std::string, std::string>> acked;  // id, name
  std::atomic<bool> done{false};
  std::thread submitter([&] {
    auto stub = v1::Control::NewStub(MakeChannel(cluster_->coordinator_address()));
    for (int n = 0; n < kJobs;) {
      v1::JobSpec spec = SmallJob(10);
      spec.set_name("crash-" + std::to_string(n));
      v1::SubmitJobRequest request;
      *request.mutable_spec() = spec;
      v1::SubmitJobResponse response;
      grpc::ClientContext context;
      SetTimeout(context, absl::Seconds(5));
      if (stub->SubmitJob(&context, request, &response).ok()) {
        absl::MutexLock lock(&mu);
        acked.emplace_back(response.job_id(), spec.name());
        ++n;
      } else {
        absl::SleepFor(absl::Milliseconds(20));  // the coordinator is down
      }
    }
    done = true;
  });
  auto check_all_acked = [&] {
    std::vector<std::pair<std::string, std::string>> snapshot;
    {
      absl::MutexLock lock(&mu);
      snapshot = acked;
    }
    for (const auto& [id, name] : snapshot) {
      const v1::Job job = Get(id);
      EXPECT_EQ(job.id(), id);
      EXPECT_EQ(job.spec().name(), name) << id;
      EXPECT_EQ(job.state(), v1::JOB_STATE_PENDING) << id;
    }
    return snapshot.size();
  };
  for (size_t kill_after : {3, 12, 22, 33, 45}) {
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    while (true) {
      {
        absl::MutexLock lock(&mu);
        if (acked.size() >= kill_after) break;
      }
      ASSERT_LT(absl::Now(), give_up) << "submissions stalled";
      absl::SleepFor(absl::Milliseconds(1));
    }
    PSTRAIN_ASSERT_OK(cluster_->RestartCoordinator());
    EXPECT_GE(check_all_acked(), kill_after);
  }
  submitter.join();
  ASSERT_TRUE(done);
  EXPECT_EQ(check_all_acked(), static_cast<size_t>(kJobs));
  std::set<std::string> ids;
  for (const auto& [id, name] : acked) ids.insert(id);
  EXPECT_EQ(ids.size(), static_cast<size_t>(kJobs));
}

TEST_F(ControlPlaneTest, ARunningJobSurvivesACoordinatorCrash) {
  cli::LocalCluster::Options options;
  options.state_dir = dir_.path() + "/state";
  options.worker_flags = {{0, {"--fault_injection=delay=1,min_delay_ms=3,max_delay_ms=3"}}};
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1, options));
  const std::string id = Submit(SmallJob(1200));
  WaitFor(id, [](const v1::Job& job) { return job.progress().step() >= 100; });
  PSTRAIN_ASSERT_OK(cluster_->RestartCoordinator());
  // Running again after the restart, with its nodes back, then done.
  const v1::Job after = Get(id);
  EXPECT_EQ(after.state(), v1::JOB_STATE_RUNNING) << after.reason();
  WaitFor(id, [](const v1::Job& job) { return job.progress().step() > 0; });
  const v1::Job done = WaitForEnd(id);
  ASSERT_EQ(done.state(), v1::JOB_STATE_SUCCEEDED) << done.reason();
  EXPECT_GE(done.result().test_accuracy(), 0.70f);
  for (const v1::Node& node : Nodes()) EXPECT_EQ(node.state(), v1::NODE_STATE_ALIVE) << node.id();
}

// The workers finish while the coordinator is down; once it is back it
// learns how the job ended, model file included.
TEST_F(ControlPlaneTest, AJobThatEndsWhileTheCoordinatorIsDownSucceedsWhenItReturns) {
  cli::LocalCluster::Options options;
  options.state_dir = dir_.path() + "/state";
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1, options));
  const std::string id = Submit(SmallJob(300));
  WaitFor(id, [](const v1::Job& job) { return job.progress().step() >= 20; });
  cluster_->KillCoordinator();
  // Wait for the worker to say it finished (its log is in the run directory).
  const absl::Time give_up = absl::Now() + absl::Minutes(2);
  while (true) {
    std::ifstream log(dir_.path() + "/worker-0.log");
    std::stringstream text;
    text << log.rdbuf();
    if (absl::StrContains(text.str(), "job " + id + " finished")) break;
    ASSERT_LT(absl::Now(), give_up) << "the worker did not finish without the coordinator";
    absl::SleepFor(absl::Milliseconds(50));
  }
  PSTRAIN_ASSERT_OK(cluster_->StartCoordinatorAgain());
  const v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_GT(job.result().test_accuracy(), 0.6f);
  EXPECT_TRUE(job.has_model());
}

TEST_F(ControlPlaneTest, AnExportedModelEvaluatesToTheReportedAccuracy) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2));
  const v1::Job job = WaitForEnd(Submit(MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 200)));
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  const std::string file = dir_.path() + "/model.pstm";
  ProcessResult exported = Psctl({"export", job.id(), file});
  ASSERT_EQ(exported.exit_code(), 0) << exported.err;
  ProcessResult eval = RunProcess({BinDir() + "/pstrain-local", "--eval", file});
  ASSERT_EQ(eval.exit_code(), 0) << eval.err;
  const std::string expected = absl::StrFormat("\"test_accuracy\":%.4f", job.result().test_accuracy());
  EXPECT_TRUE(absl::StrContains(eval.out, expected)) << eval.out << " vs " << expected;
}

}  // namespace
}  // namespace pstrain::testing
