// The soak: 3 servers and 4 workers run 2,000 sync steps while every
// worker's traffic to the servers is dropped, duplicated, delayed and
// reordered (the fault-injecting transport) and three processes, servers
// and workers drawn at random, are killed with SIGKILL at random steps (all
// from a logged seed) and restarted under their ids. The final parameters
// are bitwise those of a run of the same job on a cluster without faults.
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"

namespace pstrain::testing {
namespace {

class SoakTest : public ClusterFixture {};

TEST_F(SoakTest, FaultyNetworkAndThreeKillsChangeNothing) {
  constexpr int kSteps = 2000;
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 4, 16, 3, kSteps);
  spec.mutable_model()->clear_hidden();
  spec.mutable_model()->add_hidden(64);
  spec.mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints");
  spec.mutable_checkpoint()->set_every_steps(100);
  cli::LocalCluster::Options options;
  options.state_dir = dir_.path() + "/state";
  options.lease = absl::Seconds(4);
  ASSERT_NO_FATAL_FAILURE(StartCluster(3, 4, options));
  const std::vector<float> clean = FinalParams(Submit(spec), nullptr, absl::Minutes(8));
  cluster_->Stop();

  // PSTRAIN_SOAK_SEED replays a run (its seed is printed and recorded).
  const char* replay = std::getenv("PSTRAIN_SOAK_SEED");
  const uint64_t seed = replay != nullptr ? std::strtoull(replay, nullptr, 10)
                                          : std::random_device{}();
  std::mt19937_64 rng(seed);
  std::cerr << "soak seed " << seed << "\n";
  RecordProperty("seed", std::to_string(seed));
  options.restart_exited_children = true;
  options.state_dir = dir_.path() + "/state-faulty";
  // A directory of its own: the new coordinator numbers the job job-000001
  // again, and the clean run's files under that name (steps to 2000) would
  // count as the newest in the servers' pruning, which could remove this
  // run's step 100 before its first recovery loads it.
  spec.mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints-faulty");
  for (int w = 0; w < 4; ++w) {
    options.worker_flags[w] = {absl::StrCat(
        "--fault_injection=drop_request=0.005,duplicate_request=0.02,drop_reply=0.005,"
        "duplicate_reply=0.02,reorder_reply=0.05,delay=0.02,max_delay_ms=5,seed=",
        rng() % 1000000 + 1)};
  }
  ASSERT_NO_FATAL_FAILURE(StartCluster(3, 4, options));
  const std::string id = Submit(spec);
  std::vector<int64_t> steps;
  for (int i = 0; i < 3; ++i) {
    steps.push_back(std::uniform_int_distribution<int64_t>(50, kSteps - 200)(rng));
  }
  std::sort(steps.begin(), steps.end());
  const std::vector<std::string> nodes = {"server-0", "server-1", "server-2", "worker-0",
                                          "worker-1", "worker-2", "worker-3"};
  // Each kill waits for the recovery from the one before it: the progress
  // of a generation that a kill ended can still pass the next kill's step
  // (a report the dead process sent last), and a second kill before the
  // recovery would be absorbed by the same one.
  int64_t generation = 0;
  for (int64_t step : steps) {
    const std::string victim = nodes[rng() % nodes.size()];
    std::cerr << "killing " << victim << " at step " << step << "\n";
    const v1::Job job = WaitFor(
        id,
        [step, generation](const v1::Job& j) {
          return j.generation() > generation && j.progress().step() >= step;
        },
        absl::Minutes(5));
    ASSERT_EQ(job.state(), v1::JOB_STATE_RUNNING) << job.reason();
    generation = job.generation();
    ASSERT_TRUE(cluster_->Kill(victim, SIGKILL));
  }
  ExpectBitwiseEqual(FinalParams(id, nullptr, absl::Minutes(8)), clean);
  EXPECT_GE(Get(id).recoveries(), 3);
  RecordProperty("recoveries", std::to_string(Get(id).recoveries()));
}

}  // namespace
}  // namespace pstrain::testing
