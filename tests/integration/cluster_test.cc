// The real binaries on loopback: pstrain-coordinator, pstrain-server and
// pstrain-worker as separate processes.
#include <sys/wait.h>

#include "cli/local_cluster.h"
#include "common/process.h"
#include "common/rpc.h"
#include "gtest/gtest.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"

namespace pstrain::testing {
namespace {

class ClusterTest : public ClusterFixture {};

TEST_F(ClusterTest, SyncTrainsToAccuracy) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2));
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 64, 2, 200);
  const v1::Job job = WaitForEnd(Submit(spec));
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_EQ(job.result().steps(), 200);
  EXPECT_GE(job.result().test_accuracy(), 0.70f);
  EXPECT_GT(job.result().samples_per_second(), 0);
  EXPECT_LT(job.result().final_loss(), 1.0f);
  RecordProperty("test_accuracy", std::to_string(job.result().test_accuracy()));

  // SIGTERM is a clean shutdown for every process: exit status 0.
  cluster_->Stop();
  const std::map<std::string, int> statuses = cluster_->ExitStatuses();
  EXPECT_EQ(statuses.size(), 5u);
  for (const auto& [name, status] : statuses) {
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << name << ": " << DescribeWaitStatus(status);
  }
}

TEST_F(ClusterTest, AsyncSlowWorkerDoesNotHoldTheOtherBack) {
  // One worker process gets every exchange with the servers and every reply
  // 30 ms late (the fault-injecting transport), so each of its steps takes
  // at least 60 ms; the other runs free. Both report often, so that the
  // coordinator's view of their steps is close to the truth. Which job index
  // the slow process gets is the coordinator's choice: the test finds out by
  // who finishes first.
  cli::LocalCluster::Options options;
  options.worker_flags = {
      {0, {"--fault_injection=delay=1,min_delay_ms=30,max_delay_ms=30", "--report_interval_ms=100"}},
      {1, {"--report_interval_ms=100"}}};
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, options));
  constexpr int kSteps = 200;
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 64, 2, kSteps);
  spec.set_mode(v1::MODE_ASYNC);
  const std::string id = Submit(spec);
  const absl::Time give_up = absl::Now() + absl::Minutes(3);
  int64_t other_step = -1;
  while (other_step < 0) {
    ASSERT_LT(absl::Now(), give_up) << "no worker finished its steps";
    const v1::Job job = Get(id);
    ASSERT_LT(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
    if (job.workers_size() == 2) {
      for (int w = 0; w < 2; ++w) {
        if (job.workers(w).step() == kSteps) other_step = job.workers(1 - w).step();
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_LE(other_step * 2, kSteps)
      << "the slow worker was at step " << other_step << " when the fast one finished";
  const v1::Job job = WaitForEnd(id);
  ASSERT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  EXPECT_GE(job.result().test_accuracy(), 0.70f);
  RecordProperty("slow_worker_step", std::to_string(other_step));
}

}  // namespace
}  // namespace pstrain::testing
