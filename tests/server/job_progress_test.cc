#include "server/job_progress.h"

#include <algorithm>

#include "gtest/gtest.h"

namespace pstrain::server {
namespace {

v1::Job RunningJob(int workers) {
  v1::Job job;
  job.mutable_spec()->set_num_workers(workers);
  job.mutable_spec()->set_batch_size(10);
  job.mutable_spec()->set_steps(100);
  job.mutable_progress()->set_total_steps(100);
  for (int w = 0; w < workers; ++w) job.add_workers()->set_worker(w);
  return job;
}

v1::ReportProgressRequest Report(int worker, int64_t step, float loss) {
  v1::ReportProgressRequest r;
  r.set_worker(worker);
  r.set_step(step);
  r.set_loss(loss);
  r.set_samples(100);
  r.set_seconds(0.5);
  return r;
}

TEST(JobProgressTest, TheJobIsAsFarAsItsSlowestWorker) {
  v1::Job job = RunningJob(2);
  ApplyProgressReport(Report(0, 30, 1.0f), &job);
  ApplyProgressReport(Report(1, 20, 3.0f), &job);
  EXPECT_EQ(job.progress().step(), 20);
  EXPECT_FLOAT_EQ(job.progress().loss(), 2.0f);
  EXPECT_DOUBLE_EQ(job.progress().samples_per_second(), 400);
  ApplyProgressReport(Report(1, 10, 3.0f), &job);  // a late report
  EXPECT_EQ(job.workers(1).step(), 20) << "a worker's step never goes back";
}

TEST(JobProgressTest, FinalReportsMakeTheResult) {
  v1::Job job = RunningJob(2);
  v1::ReportProgressRequest a = Report(0, 100, 0.5f), b = Report(1, 100, 0.7f);
  a.set_finished(true);
  a.set_train_seconds(10);
  a.set_evaluated(true);
  a.set_test_accuracy(0.8f);
  b.set_finished(true);
  b.set_train_seconds(20);
  ApplyProgressReport(a, &job);
  EXPECT_FALSE(AllWorkersFinished(job));
  ApplyProgressReport(b, &job);
  ASSERT_TRUE(AllWorkersFinished(job));
  ApplyProgressReport(Report(1, 50, 9.0f), &job);  // after the end: ignored
  EXPECT_FLOAT_EQ(job.workers(1).loss(), 0.7f);
  const v1::JobResult r = CompletedResult(job);
  EXPECT_EQ(r.steps(), 100);
  EXPECT_DOUBLE_EQ(r.train_seconds(), 20);
  EXPECT_DOUBLE_EQ(r.samples_per_second(), 100.0 * 2 * 10 / 20);
  EXPECT_FLOAT_EQ(r.final_loss(), 0.6f);
  EXPECT_FLOAT_EQ(r.test_accuracy(), 0.8f);
}

// Evaluations during training are the last and the best (the first of
// equal ones), not the result; early stopping's final reports set the
// steps and the reason.
TEST(JobProgressTest, EvaluationsAndAnEarlyStop) {
  v1::Job job = RunningJob(2);
  auto evaluated = [](int worker, int64_t step, float accuracy) {
    // Sent a little later, before the stop at 60.
    v1::ReportProgressRequest r = Report(worker, std::min<int64_t>(step + 3, 60), 1.0f);
    r.set_evaluated(true);
    r.set_evaluated_step(step);
    r.set_test_accuracy(accuracy);
    r.set_test_loss(1 - accuracy);
    return r;
  };
  ApplyProgressReport(evaluated(0, 20, 0.7f), &job);
  ApplyProgressReport(evaluated(0, 40, 0.8f), &job);
  ApplyProgressReport(evaluated(0, 60, 0.8f), &job);
  EXPECT_EQ(job.last_evaluation().step(), 60);
  EXPECT_EQ(job.best_evaluation().step(), 40);
  EXPECT_FLOAT_EQ(job.best_evaluation().test_loss(), 0.2f);
  EXPECT_FALSE(job.result().has_step_times()) << "no result before the end";
  EXPECT_EQ(job.result().test_accuracy(), 0);

  for (int w = 0; w < 2; ++w) {
    v1::ReportProgressRequest last = Report(w, 60, 0.5f);
    last.set_finished(true);
    last.set_train_seconds(6);
    last.set_stopped_early("early stopping at step 60: ...");
    if (w == 0) {
      last.set_evaluated(true);
      last.set_evaluated_step(60);
      last.set_test_accuracy(0.8f);
    }
    ApplyProgressReport(last, &job);
  }
  EXPECT_EQ(job.reason(), "early stopping at step 60: ...");
  const v1::JobResult r = CompletedResult(job);
  EXPECT_EQ(r.steps(), 60);
  EXPECT_DOUBLE_EQ(r.samples_per_second(), 60.0 * 2 * 10 / 6);
  EXPECT_FLOAT_EQ(r.test_accuracy(), 0.8f);
}

}  // namespace
}  // namespace pstrain::server
