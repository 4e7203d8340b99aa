// Bounded staleness over real gRPC, as a property: three workers with
// random delays, one of them slow. Each worker w's gradient moves value w of
// every chunk by exactly 1 per step applied, so the values a worker receives
// count how many steps of each worker they contain.
#include <atomic>
#include <cmath>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"
#include "worker/parameter_client.h"

namespace pstrain::testing {
namespace {

constexpr int kWorkers = 3;
constexpr int kSlow = 2;
constexpr int64_t kSteps = 24;

// What the workers saw in the replies of their pushes.
struct Observed {
  int64_t max_lead = 0;                 // most steps of the slowest worker missing from a reply
  std::vector<std::string> violations;  // replies staler than the bound allowed
  absl::Status status;                  // first failure, or OK
  std::vector<float> final_values;
  std::vector<float> initial_values;
  v1::PartitionPlan plan;
};

// Runs the three workers in `mode` (with staleness `bound` if ssp) and
// checks every reply against `bound`. Before its push of step t the slow
// worker waits until both others have started their pushes of step
// t + lead: a bound of `lead` lets them get that far, so a wait that times
// out means they were held back by more than it.
Observed RunThreeWorkers(v1::Mode mode, int64_t bound, int64_t lead) {
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 1.0f, kWorkers, 8, 2, kSteps);
  spec.set_mode(mode);
  if (mode == v1::MODE_SSP) spec.set_staleness(bound);
  const v1::PartitionPlan plan = PlanFor(spec);
  InProcessServers servers(2);
  Observed seen;
  seen.status = servers.AddJob("job-ssp", spec, plan);
  if (!seen.status.ok()) return seen;
  seen.initial_values = servers.Gather("job-ssp", plan);

  absl::Mutex mu;
  std::array<std::atomic<int64_t>, kWorkers> started;
  for (auto& s : started) s = -1;
  const auto run_worker = [&](uint32_t w) {
    worker::ParameterClient::Options options;
    options.job_id = "job-ssp";
    options.worker = w;
    options.mode = mode;
    options.plan = plan;
    std::unique_ptr<worker::ParameterTransport> transport =
        *worker::CreateGrpcTransport(servers.addresses());
    worker::ParameterClient client(options, transport.get());
    auto grad = std::make_shared<std::vector<float>>(plan.total_floats(), 0.0f);
    for (const v1::ChunkInfo& c : plan.chunks()) (*grad)[c.offset() + w] = -1.0f;
    std::vector<float> values(plan.total_floats());
    std::mt19937 random(w + 1);
    for (int64_t t = 0; t < kSteps; ++t) {
      absl::SleepFor(absl::Microseconds(std::uniform_int_distribution<>(0, 2000)(random)));
      if (w == kSlow) {
        const int64_t ahead = std::min(t + lead, kSteps - 1);
        const absl::Time give_up = absl::Now() + absl::Seconds(60);
        while (started[0] < ahead || started[1] < ahead) {
          if (absl::Now() > give_up) {
            absl::MutexLock lock(&mu);
            seen.violations.push_back(absl::StrCat("the fast workers never started step ", ahead,
                                                   " while the slow one was at ", t,
                                                   ": held back by more than ", lead, " steps"));
            return;
          }
          absl::SleepFor(absl::Milliseconds(1));
        }
      }
      started[w] = t;
      const absl::Status status = client.PushPull(t, grad, values.data());
      absl::MutexLock lock(&mu);
      if (!status.ok()) {
        if (seen.status.ok()) seen.status = status;
        return;
      }
      // The values step t+1 is computed from: the worker's own step t
      // applied, and every worker's steps up to t - bound.
      for (const v1::ChunkInfo& c : plan.chunks()) {
        int64_t slowest = kSteps;
        for (uint32_t v = 0; v < kWorkers; ++v) {
          const int64_t applied =
              std::lround(values[c.offset() + v] - seen.initial_values[c.offset() + v]);
          slowest = std::min(slowest, applied);
          if (v == w && applied < t + 1) {
            seen.violations.push_back(absl::StrCat("worker ", w, " step ", t, " chunk ", c.id(),
                                                   ": its own push not applied"));
          }
        }
        const int64_t missing = t + 1 - slowest;
        seen.max_lead = std::max(seen.max_lead, missing);
        if (bound >= 0 && missing > bound) {
          seen.violations.push_back(absl::StrCat("worker ", w, " step ", t, " chunk ", c.id(), ": ",
                                                 missing, " steps of a worker missing"));
        }
      }
    }
  };
  std::vector<std::thread> threads;
  for (uint32_t w = 0; w < kWorkers; ++w) threads.emplace_back(run_worker, w);
  for (std::thread& t : threads) t.join();
  seen.final_values = servers.Gather("job-ssp", plan);
  seen.plan = plan;
  return seen;
}

class StalenessTest : public ::testing::TestWithParam<int64_t> {};

TEST_P(StalenessTest, NoWorkerComputesOnValuesStalerThanTheBound) {
  const int64_t s = GetParam();
  const Observed seen = RunThreeWorkers(v1::MODE_SSP, s, /*lead=*/s);
  PSTRAIN_ASSERT_OK(seen.status);
  EXPECT_TRUE(seen.violations.empty()) << seen.violations.front();
  // The fast workers did run s steps ahead of the slow one (not in
  // lockstep), and never more.
  EXPECT_EQ(seen.max_lead, s);
  // Every push of every worker applied, once.
  for (const v1::ChunkInfo& c : seen.plan.chunks()) {
    for (int v = 0; v < kWorkers; ++v) {
      EXPECT_EQ(
          std::lround(seen.final_values[c.offset() + v] - seen.initial_values[c.offset() + v]),
          kSteps)
          << "chunk " << c.id() << ", worker " << v;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Bounds, StalenessTest, ::testing::Values(0, 1, 3));

// The check can fail: async bounds nothing, so the fast workers run two
// steps ahead of a slow one where a bound of 1 would hold them.
TEST(StalenessCheckTest, AsyncBreaksABoundOfOne) {
  const Observed seen = RunThreeWorkers(v1::MODE_ASYNC, /*bound=*/1, /*lead=*/2);
  PSTRAIN_ASSERT_OK(seen.status);
  EXPECT_FALSE(seen.violations.empty());
  EXPECT_GE(seen.max_lead, 2);
}

}  // namespace
}  // namespace pstrain::testing
