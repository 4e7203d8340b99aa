// Retries are safe: with requests and replies dropped, duplicated, delayed
// and reordered on the way (the fault-injecting transport), the final
// parameters are bitwise those of a clean run.
#include <cstring>

#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "worker/fault_injecting_transport.h"

namespace pstrain::testing {
namespace {

struct Case {
  const char* name;
  worker::FaultInjection faults;
};

class IdempotenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(IdempotenceTest, FaultsOnTheWayChangeNothing) {
  DatasetCache data;
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 40);
  const v1::PartitionPlan plan = PlanFor(spec);

  InProcessServers clean_servers(2);
  PSTRAIN_ASSERT_OK(clean_servers.AddJob("job-clean", spec, plan));
  WorkersResult clean = RunWorkers("job-clean", spec, plan, clean_servers.addresses(), &data);
  PSTRAIN_ASSERT_OK(clean.status);

  InProcessServers faulty_servers(2);
  PSTRAIN_ASSERT_OK(faulty_servers.AddJob("job-faulty", spec, plan));
  std::vector<std::unique_ptr<worker::FaultInjectingTransport>> transports;
  for (int w = 0; w < 2; ++w) {
    worker::FaultInjection faults = GetParam().faults;
    faults.seed = 100 + w;
    absl::StatusOr<std::unique_ptr<worker::FaultInjectingTransport>> t =
        worker::FaultInjectingTransport::Create(
            *worker::CreateGrpcTransport(faulty_servers.addresses()), faults);
    PSTRAIN_ASSERT_OK(t.status());
    transports.push_back(std::move(*t));
  }
  RunOptions run;
  run.make_transport = [&](int w) { return transports[w].get(); };
  WorkersResult faulty =
      RunWorkers("job-faulty", spec, plan, faulty_servers.addresses(), &data, run);
  PSTRAIN_ASSERT_OK(faulty.status);

  // The faults really happened and the client really retried.
  worker::FaultCounts total;
  int64_t retries = 0;
  for (int w = 0; w < 2; ++w) {
    const worker::FaultCounts c = transports[w]->counts();
    total.requests_dropped += c.requests_dropped;
    total.requests_duplicated += c.requests_duplicated;
    total.replies_dropped += c.replies_dropped;
    total.replies_duplicated += c.replies_duplicated;
    total.replies_reordered += c.replies_reordered;
    total.delays += c.delays;
    retries += faulty.stats[w].retries;
  }
  const worker::FaultInjection& f = GetParam().faults;
  EXPECT_EQ(f.drop_request > 0, total.requests_dropped > 10);
  EXPECT_EQ(f.duplicate_request > 0, total.requests_duplicated > 10);
  EXPECT_EQ(f.drop_reply > 0, total.replies_dropped > 10);
  EXPECT_EQ(f.duplicate_reply > 0, total.replies_duplicated > 10);
  EXPECT_EQ(f.reorder_reply > 0, total.replies_reordered > 10);
  EXPECT_EQ(f.delay > 0, total.delays > 10);
  if (f.drop_request > 0 || f.drop_reply > 0) {
    EXPECT_GT(retries, 0);
  }

  ASSERT_EQ(faulty.params.size(), clean.params.size());
  EXPECT_EQ(0, std::memcmp(faulty.params.data(), clean.params.data(),
                           clean.params.size() * sizeof(float)))
      << "final parameters differ from the clean run";
  EXPECT_EQ(faulty_servers.Gather("job-faulty", plan), clean_servers.Gather("job-clean", plan));
}

worker::FaultInjection Faults(const char* spec) { return *worker::ParseFaultInjection(spec); }

INSTANTIATE_TEST_SUITE_P(
    Faults, IdempotenceTest,
    ::testing::Values(
        Case{"duplicated_pushes_lost_replies", Faults("duplicate_request=0.1,drop_reply=0.05")},
        Case{"lost_pushes_duplicated_reordered_replies",
             Faults("drop_request=0.05,duplicate_reply=0.1,reorder_reply=0.2")},
        Case{"everything_with_delays",
             Faults("drop_request=0.03,duplicate_request=0.05,drop_reply=0.03,"
                    "duplicate_reply=0.05,reorder_reply=0.1,delay=0.2,max_delay_ms=5")}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

TEST(FaultInjectionTest, ParsesAndRejects) {
  absl::StatusOr<worker::FaultInjection> f =
      worker::ParseFaultInjection("drop_reply=0.5, delay=1,min_delay_ms=3,max_delay_ms=9,seed=42");
  PSTRAIN_ASSERT_OK(f.status());
  EXPECT_EQ(f->drop_reply, 0.5);
  EXPECT_EQ(f->delay, 1.0);
  EXPECT_EQ(f->min_delay, absl::Milliseconds(3));
  EXPECT_EQ(f->max_delay, absl::Milliseconds(9));
  EXPECT_EQ(f->seed, 42u);
  EXPECT_TRUE(f->any());
  EXPECT_FALSE(worker::ParseFaultInjection("")->any());
  for (const char* bad : {"drop_reply=2", "drop_reply=-0.1", "explode=0.1", "delay=x",
                          "min_delay_ms=10,max_delay_ms=5", "seed=-1"}) {
    absl::StatusOr<worker::FaultInjection> r = worker::ParseFaultInjection(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace pstrain::testing
