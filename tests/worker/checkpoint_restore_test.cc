// Checkpoints restore exactly: servers that load the checkpoint of step C
// and workers that go on from C give bitwise the parameters of a run that
// never stopped, for SGD with momentum and Adam (whose state is in the
// checkpoint too) and for 16-bit wires.
#include <cstring>

#include "absl/strings/match.h"
#include "common/metrics.h"

#include "gtest/gtest.h"
#include "server/checkpoint.h"
#include "server/server_metrics.h"
#include "tests/cluster_util.h"
#include "tests/integration/integration_util.h"
#include "worker/fault_injecting_transport.h"

namespace pstrain::testing {
namespace {

struct Case {
  const char* name;
  v1::OptimizerType optimizer;
  float learning_rate;
  float momentum;
  v1::DType wire;
};

class CheckpointRestoreTest : public ::testing::TestWithParam<Case> {};

TEST_P(CheckpointRestoreTest, ARestoredRunEqualsOneThatNeverStopped) {
  TempDir dir;
  DatasetCache data;
  v1::JobSpec spec = MlpSpec(GetParam().optimizer, GetParam().learning_rate, 2, 32, 2, 40);
  spec.mutable_optimizer()->set_momentum(GetParam().momentum);
  spec.set_wire_dtype(GetParam().wire);
  spec.mutable_checkpoint()->set_dir(dir.path());
  spec.mutable_checkpoint()->set_every_steps(10);
  spec.mutable_checkpoint()->set_keep(10);
  const v1::PartitionPlan plan = PlanFor(spec);

  std::vector<float> uninterrupted;
  {
    InProcessServers servers(2);
    PSTRAIN_ASSERT_OK(servers.AddJob("job-1", spec, plan));
    WorkersResult clean = RunWorkers("job-1", spec, plan, servers.addresses(), &data);
    PSTRAIN_ASSERT_OK(clean.status);
    uninterrupted = servers.Gather("job-1", plan);
    // Every server's checkpoints of steps 10..40 reach the disk.
    const absl::Time give_up = absl::Now() + absl::Seconds(60);
    for (uint32_t s = 0; s < 2; ++s) {
      while (server::ListCheckpoints(PosixFileSystem(), dir.path(), "job-1", s, false).size() <
             4) {
        ASSERT_LT(absl::Now(), give_up) << "server " << s << " wrote too few checkpoints";
        absl::SleepFor(absl::Milliseconds(10));
      }
    }
  }
  // New servers load step 20 at generation 1; the workers go on from 20.
  InProcessServers restored(2);
  v1::ServerAssignment start;
  start.set_generation(1);
  start.set_restore_step(20);
  start.set_restore_generation(0);
  PSTRAIN_ASSERT_OK(restored.AddJob("job-1", spec, plan, start));
  RunOptions run;
  run.generation = 1;
  run.resume_step = 20;
  WorkersResult resumed = RunWorkers("job-1", spec, plan, restored.addresses(), &data, run);
  PSTRAIN_ASSERT_OK(resumed.status);
  const std::vector<float> after = restored.Gather("job-1", plan);
  ASSERT_EQ(after.size(), uninterrupted.size());
  EXPECT_EQ(0, std::memcmp(after.data(), uninterrupted.data(), after.size() * sizeof(float)))
      << "the restored run differs from the uninterrupted one";
}

INSTANTIATE_TEST_SUITE_P(
    Optimizers, CheckpointRestoreTest,
    ::testing::Values(Case{"adam", v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 0, v1::DTYPE_FP32},
                      Case{"momentum", v1::OPTIMIZER_TYPE_SGD, 0.05f, 0.9f, v1::DTYPE_FP32},
                      Case{"adam_bf16", v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 0, v1::DTYPE_BF16}),
    [](const ::testing::TestParamInfo<Case>& info) { return std::string(info.param.name); });

// Requests of a generation that is over are refused for good (ABORTED: the
// worker waits for its next assignment); the current one trains.
TEST(GenerationTest, AnOldGenerationIsRefusedForGood) {
  DatasetCache data;
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 1, 32, 1, 5);
  const v1::PartitionPlan plan = PlanFor(spec);
  InProcessServers servers(1);
  v1::ServerAssignment start;
  start.set_generation(2);
  PSTRAIN_ASSERT_OK(servers.AddJob("job-1", spec, plan, start));
  RunOptions old;
  old.generation = 1;
  WorkersResult refused = RunWorkers("job-1", spec, plan, servers.addresses(), &data, old);
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kAborted) << refused.status;
  RunOptions current;
  current.generation = 2;
  PSTRAIN_EXPECT_OK(RunWorkers("job-1", spec, plan, servers.addresses(), &data, current).status);
}

// A worker whose every exchange and reply come 150 ms late (far beyond what
// a loaded machine makes of a step of this small model) is named a
// straggler.
TEST(StragglerTest, ALateWorkerIsNamedInAGauge) {
  DatasetCache data;
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 8, 1, 20);
  const v1::PartitionPlan plan = PlanFor(spec);
  absl::StatusOr<std::unique_ptr<MetricsServer>> registry = MetricsServer::CreateUnserved();
  PSTRAIN_ASSERT_OK(registry.status());
  absl::StatusOr<std::unique_ptr<server::ServerMetrics>> metrics =
      server::ServerMetrics::Create((*registry)->registry(), absl::Minutes(5));
  PSTRAIN_ASSERT_OK(metrics.status());
  server::ShardStore::Options store;
  store.metrics = metrics->get();
  InProcessServers servers(1, store);
  PSTRAIN_ASSERT_OK(servers.AddJob("job-1", spec, plan));
  std::vector<std::unique_ptr<worker::ParameterTransport>> transports;
  transports.push_back(*worker::CreateGrpcTransport(servers.addresses()));
  transports.push_back(*worker::FaultInjectingTransport::Create(
      *worker::CreateGrpcTransport(servers.addresses()),
      *worker::ParseFaultInjection("delay=1,min_delay_ms=150,max_delay_ms=150")));
  RunOptions run;
  run.make_transport = [&](int w) { return transports[w].get(); };
  PSTRAIN_ASSERT_OK(RunWorkers("job-1", spec, plan, servers.addresses(), &data, run).status);
  const std::string text = (*registry)->Scrape();
  EXPECT_TRUE(absl::StrContains(text, "pstrain_server_straggler{job_id=\"job-1\",worker=\"1\"} 1"))
      << text.substr(text.find("pstrain_server_straggler"), 400);
  EXPECT_TRUE(absl::StrContains(text, "pstrain_server_straggler{job_id=\"job-1\",worker=\"0\"} 0"));
}

}  // namespace
}  // namespace pstrain::testing
