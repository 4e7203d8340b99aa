#include "server/recovery.h"

#include "gtest/gtest.h"

namespace pstrain::server {
namespace {

v1::Job SyncJob(int servers, int workers) {
  v1::Job job;
  job.set_id("job-000001");
  job.mutable_spec()->set_mode(v1::MODE_SYNC);
  job.mutable_spec()->set_num_workers(workers);
  job.mutable_spec()->mutable_checkpoint()->set_dir("/ckpt");
  job.mutable_spec()->mutable_checkpoint()->set_keep(2);
  for (int s = 0; s < servers; ++s) {
    job.add_server_nodes("server-" + std::to_string(s));
    job.add_server_incarnations(100 + s);
  }
  for (int w = 0; w < workers; ++w) {
    job.add_worker_nodes("worker-" + std::to_string(w));
    job.add_worker_incarnations(200 + w);
  }
  StartGeneration(&job, "placed", 1);
  return job;
}

v1::CheckpointRecord Record(int64_t step, int64_t generation) {
  v1::CheckpointRecord r;
  r.set_step(step);
  r.set_generation(generation);
  return r;
}

v1::WorkerResumeState State(uint32_t worker, int64_t step, int64_t generation, float loss) {
  v1::WorkerResumeState s;
  s.set_worker(worker);
  s.set_step(step);
  s.set_generation(generation);
  s.add_recent_losses(loss);
  return s;
}

TEST(RecoveryTest, TheFirstGenerationStartsAtStepZero) {
  const v1::Job job = SyncJob(2, 2);
  EXPECT_EQ(job.generation(), 1);
  EXPECT_EQ(job.recoveries(), 0);
  EXPECT_EQ(job.resume_step(), 0);
  ASSERT_EQ(job.workers_size(), 2);
  EXPECT_EQ(job.workers(1).node_id(), "worker-1");
  ASSERT_EQ(job.history_size(), 1);
  EXPECT_EQ(job.history(0).reason(), "placed");
  EXPECT_EQ(job.history(0).servers_size(), 2);
  EXPECT_FALSE(ResumeCheckpoint(job).has_value());
}

// A checkpoint is complete once every server wrote it in this generation
// and every worker gave its state; the next generation starts from it.
TEST(RecoveryTest, ACompleteCheckpointIsWhereTheNextGenerationStarts) {
  v1::Job job = SyncJob(2, 2);
  CheckpointReports reports;
  reports.by_server = {{Record(100, 1), Record(200, 1)}, {Record(100, 1)}};
  EXPECT_FALSE(NewlyComplete(job, reports).has_value()) << "no worker states yet";
  reports.states[{100, 1}][0] = State(0, 100, 1, 0.5f);
  EXPECT_FALSE(NewlyComplete(job, reports).has_value()) << "worker 1's state is missing";
  reports.states[{100, 1}][1] = State(1, 100, 1, 0.7f);
  reports.states[{200, 1}][0] = State(0, 200, 1, 0.4f);
  reports.states[{200, 1}][1] = State(1, 200, 1, 0.6f);
  std::optional<v1::CheckpointRecord> complete = NewlyComplete(job, reports);
  ASSERT_TRUE(complete.has_value());
  EXPECT_EQ(complete->step(), 100) << "server 1 has not written 200";
  RecordCheckpoint(&job, *complete, reports);
  EXPECT_EQ(job.last_checkpoint_step(), 100);
  EXPECT_FALSE(NewlyComplete(job, reports).has_value()) << "nothing newer";

  job.mutable_workers(0)->set_step(150);
  job.mutable_workers(0)->set_finished(true);
  StartGeneration(&job, "server 1 was restarted", 2);
  EXPECT_EQ(job.generation(), 2);
  EXPECT_EQ(job.recoveries(), 1);
  EXPECT_EQ(job.resume_step(), 100);
  EXPECT_EQ(job.workers(0).step(), 100);
  EXPECT_FALSE(job.workers(0).finished());
  EXPECT_EQ(job.progress().step(), 100);
  EXPECT_EQ(job.history(1).step(), 100);
  EXPECT_FLOAT_EQ(ResumeStateOf(job, 1).recent_losses(0), 0.7f);
  // Reports of the old generation do not complete checkpoints of the new.
  reports.by_server = {{Record(300, 1)}, {Record(300, 1)}};
  reports.states[{300, 1}][0] = State(0, 300, 1, 0.1f);
  reports.states[{300, 1}][1] = State(1, 300, 1, 0.1f);
  EXPECT_FALSE(NewlyComplete(job, reports).has_value());
}

TEST(RecoveryTest, OnlyKeepCheckpointsAreKeptAndADamagedOneIsDropped) {
  v1::Job job = SyncJob(1, 1);
  CheckpointReports reports;
  for (int64_t step : {100, 200, 300}) {
    reports.states[{step, 1}][0] = State(0, step, 1, step);
    RecordCheckpoint(&job, Record(step, 1), reports);
  }
  ASSERT_EQ(job.checkpoints_size(), 2);
  EXPECT_EQ(job.checkpoints(0).step(), 200);
  EXPECT_EQ(job.worker_states_size(), 2) << "the states of dropped checkpoints go with them";
  DropCheckpoint(&job, 300, 1);  // a server could not load it
  EXPECT_EQ(job.last_checkpoint_step(), 200);
  StartGeneration(&job, "retry", 3);
  EXPECT_EQ(job.resume_step(), 200);
  EXPECT_FLOAT_EQ(ResumeStateOf(job, 0).recent_losses(0), 200.0f);
}

TEST(RecoveryTest, ElasticWorkersStartWithoutTheStatesOfAnotherCut) {
  v1::Job job = SyncJob(1, 2);
  CheckpointReports reports;
  reports.states[{100, 1}][0] = State(0, 100, 1, 0.5f);
  reports.states[{100, 1}][1] = State(1, 100, 1, 0.7f);
  RecordCheckpoint(&job, Record(100, 1), reports);
  job.mutable_worker_nodes()->RemoveLast();
  job.mutable_worker_incarnations()->RemoveLast();
  StartGeneration(&job, "worker 1 lost", 2);
  EXPECT_EQ(job.workers_size(), 1);
  EXPECT_EQ(job.resume_step(), 100);
  EXPECT_EQ(ResumeStateOf(job, 0).recent_losses_size(), 0);
}

TEST(RecoveryTest, AsyncServersKeepTheirValuesUnlessReplaced) {
  v1::Job job = SyncJob(2, 2);
  job.mutable_spec()->set_mode(v1::MODE_ASYNC);
  job.mutable_workers(0)->set_step(40);
  job.mutable_workers(1)->set_step(55);
  job.set_server_incarnations(1, 999);  // server 1's process is new
  StartGeneration(&job, "server 1 was restarted", 2);
  EXPECT_EQ(job.resume_step(), 0);
  EXPECT_EQ(job.workers(0).step(), 40) << "async workers keep their steps";
  EXPECT_EQ(job.workers(1).step(), 55);
  EXPECT_TRUE(KeepsValues(job, 0));
  EXPECT_FALSE(KeepsValues(job, 1));
}

}  // namespace
}  // namespace pstrain::server
