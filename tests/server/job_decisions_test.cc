// The coordinator's decisions on their own: scheduling and recovery as
// functions of the jobs (a JobTable and a Txn) and the nodes (a
// NodeRegistry on a fake clock), without gRPC, threads or a wall clock.
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "server/job_table.h"
#include "server/node_registry.h"
#include "server/recovery.h"
#include "server/scheduler.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

constexpr int64_t kNowMs = 1'700'000'000'000;

class JobDecisionsTest : public ::testing::Test {
 protected:
  JobDecisionsTest() : registry_({.lease = absl::Seconds(10)}, &clock_, [] { return 1u; }) {}

  void AddNode(const std::string& id, v1::NodeRole role, uint64_t incarnation) {
    v1::RegisterRequest r;
    r.set_role(role);
    r.set_node_id(id);
    r.set_incarnation(incarnation);
    if (role == v1::NODE_ROLE_SERVER) r.set_address(absl::StrCat(id, ":1"));
    PSTRAIN_ASSERT_OK(registry_.Register(r).status());
  }

  // Submits a job of `workers` workers and `servers` servers and schedules
  // it; returns its id.
  absl::StatusOr<std::string> Submit(int workers, int servers, const std::string& extra = "") {
    PSTRAIN_ASSIGN_OR_RETURN(
        const v1::JobSpec spec,
        ParseJobSpecYaml(absl::StrCat(
            "model: {type: mlp, hidden: [32]}\noptimizer: {type: sgd, learning_rate: 0.1}\n"
            "batch_size: 8\nsteps: 10\nnum_workers: ",
            workers, "\nnum_servers: ", servers, "\n", extra)));
    PSTRAIN_ASSIGN_OR_RETURN(const v1::JobSpec normalized, NormalizeJobSpec(spec));
    PSTRAIN_ASSIGN_OR_RETURN(const v1::PartitionPlan plan, PlanFor(normalized));
    const std::string id = table_.NextId("job-");
    v1::Job job;
    job.set_id(id);
    *job.mutable_spec() = normalized;
    job.set_state(v1::JOB_STATE_PENDING);
    Txn txn(&table_, kNowMs);
    txn.Add(std::move(job), plan);
    ScheduleJobs(txn, registry_);
    table_.Install(txn);
    return id;
  }

  // The node's process (incarnation) heartbeats.
  void Beat(const std::string& id, uint64_t incarnation) {
    v1::HeartbeatRequest beat;
    beat.set_node_id(id);
    beat.set_incarnation(incarnation);
    PSTRAIN_ASSERT_OK(registry_.Heartbeat(beat));
  }

  // One pass of the control loop's recovery, installed; the jobs that
  // start a new generation.
  std::vector<std::string> Recover() {
    Txn txn(&table_, kNowMs);
    std::vector<std::string> restarted = RecoverJobs(txn, registry_, clock_.Now());
    table_.Install(txn);
    return restarted;
  }

  const v1::Job& Job(const std::string& id) { return table_.at(id).job; }

  FakeClock clock_;
  NodeRegistry registry_;
  JobTable table_{nullptr};
};

TEST_F(JobDecisionsTest, APendingJobStartsOnceItsNodesAreThere) {
  AddNode("server-0", v1::NODE_ROLE_SERVER, 10);
  AddNode("worker-0", v1::NODE_ROLE_WORKER, 20);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(const std::string id, Submit(2, 1));
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(Job(id).reason(), "waiting for 2 free workers (1 free)");

  AddNode("worker-1", v1::NODE_ROLE_WORKER, 21);
  Txn txn(&table_, kNowMs);
  ScheduleJobs(txn, registry_);
  ASSERT_EQ(txn.Durable().size(), 1u) << "starting a job is written to the job store";
  table_.Install(txn);
  const v1::Job& job = Job(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(job.start_time_ms(), kNowMs);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.server_nodes(0), "server-0");
  EXPECT_EQ(job.server_incarnations(0), 10u);
  EXPECT_EQ(job.worker_nodes(0), "worker-0");
  EXPECT_EQ(job.worker_nodes(1), "worker-1");
  EXPECT_EQ(table_.running(), std::vector<std::string>{id});

  // The workers are busy: the next job waits, and only its reason changes,
  // in memory.
  PSTRAIN_ASSERT_OK_AND_ASSIGN(const std::string second, Submit(1, 1));
  EXPECT_EQ(Job(second).state(), v1::JOB_STATE_PENDING);
  Txn again(&table_, kNowMs);
  ScheduleJobs(again, registry_);
  EXPECT_TRUE(again.Durable().empty());
}

TEST_F(JobDecisionsTest, ARestartedServerStartsANewGenerationAndALostWorkerFailsTheJob) {
  AddNode("server-0", v1::NODE_ROLE_SERVER, 10);
  AddNode("worker-0", v1::NODE_ROLE_WORKER, 20);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(const std::string id,
                               Submit(1, 1, "recovery: {on_worker_loss: fail}\n"));
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  EXPECT_TRUE(Recover().empty()) << "nothing happened";

  // server-0's process is gone (its lease lapsed); a new one takes its id.
  clock_.Advance(absl::Seconds(11));
  Beat("worker-0", 20);
  registry_.ExpireLeases();
  AddNode("server-0", v1::NODE_ROLE_SERVER, 11);
  EXPECT_EQ(Recover(), std::vector<std::string>{id});
  EXPECT_EQ(Job(id).generation(), 2);
  EXPECT_EQ(Job(id).server_incarnations(0), 11u);
  EXPECT_EQ(Job(id).history(1).reason(), "server 0 (node server-0) was restarted");

  // worker-0 stops heartbeating: its lease lapses and the job fails.
  clock_.Advance(absl::Seconds(11));
  Beat("server-0", 11);
  registry_.ExpireLeases();
  EXPECT_TRUE(Recover().empty());
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Job(id).end_time_ms(), kNowMs);
  EXPECT_TRUE(absl::StartsWith(Job(id).reason(), "worker 0 (node worker-0): "))
      << Job(id).reason();
}

TEST_F(JobDecisionsTest, AnElasticJobGoesOnWithoutALostWorkerAndTakesAnIdleOne) {
  AddNode("server-0", v1::NODE_ROLE_SERVER, 10);
  AddNode("worker-0", v1::NODE_ROLE_WORKER, 20);
  AddNode("worker-1", v1::NODE_ROLE_WORKER, 21);
  PSTRAIN_ASSERT_OK_AND_ASSIGN(const std::string id,
                               Submit(2, 1, "recovery: {on_worker_loss: elastic}\n"));
  ASSERT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);

  // worker-1 is lost; the others go on heartbeating.
  clock_.Advance(absl::Seconds(11));
  Beat("server-0", 10);
  Beat("worker-0", 20);
  registry_.ExpireLeases();
  EXPECT_EQ(Recover(), std::vector<std::string>{id});
  EXPECT_EQ(Job(id).state(), v1::JOB_STATE_RUNNING);
  ASSERT_EQ(Job(id).worker_nodes_size(), 1);
  EXPECT_EQ(Job(id).worker_nodes(0), "worker-0");
  EXPECT_EQ(Job(id).history(1).reason(),
            "worker 1 (node worker-1) lost; the job goes on without it");

  // An idle worker joins the next generation.
  AddNode("worker-2", v1::NODE_ROLE_WORKER, 22);
  EXPECT_EQ(Recover(), std::vector<std::string>{id});
  EXPECT_EQ(Job(id).generation(), 3);
  ASSERT_EQ(Job(id).worker_nodes_size(), 2);
  EXPECT_EQ(Job(id).worker_nodes(1), "worker-2");
}

}  // namespace
}  // namespace pstrain::server
