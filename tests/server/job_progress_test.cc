#include "server/job_progress.h"

#include <algorithm>
#include <limits>
#include <string>

#include "common/script_metrics.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

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

// A script's metrics: each worker's latest value of each name; the job's
// (progress, then result) the mean over the workers that gave the name.
TEST(JobProgressTest, ScriptMetricsAreTheMeanOfTheWorkersLatestValues) {
  v1::Job job = RunningJob(2);
  v1::ReportProgressRequest r0 = Report(0, 10, 1.0f);
  (*r0.mutable_metrics())["mse"] = 1.0;
  (*r0.mutable_metrics())["auc"] = 0.5;
  ApplyProgressReport(r0, &job);
  v1::ReportProgressRequest r1 = Report(1, 10, 1.0f);
  (*r1.mutable_metrics())["mse"] = 3.0;
  ApplyProgressReport(r1, &job);
  EXPECT_DOUBLE_EQ(job.progress().metrics().at("mse"), 2.0);
  EXPECT_DOUBLE_EQ(job.progress().metrics().at("auc"), 0.5) << "worker 0 alone gave it";
  v1::ReportProgressRequest last0 = Report(0, 100, 1.0f);
  last0.set_finished(true);
  (*last0.mutable_metrics())["mse"] = 5.0;  // auc stays 0.5
  ApplyProgressReport(last0, &job);
  v1::ReportProgressRequest last1 = Report(1, 100, 1.0f);
  last1.set_finished(true);
  ApplyProgressReport(last1, &job);
  EXPECT_EQ(job.workers(0).metrics().at("auc"), 0.5);
  const v1::JobResult result = CompletedResult(job);
  EXPECT_DOUBLE_EQ(result.metrics().at("mse"), 4.0);
  EXPECT_DOUBLE_EQ(result.metrics().at("auc"), 0.5);
  EXPECT_FALSE(result.evaluated()) << "no test accuracy was reported";
}

TEST(JobProgressTest, ScriptMetricsWithBadNamesOrValuesAreRefused) {
  google::protobuf::Map<std::string, double> metrics;
  metrics["mse"] = 0.5;
  metrics["_top_1"] = 0.9;
  PSTRAIN_EXPECT_OK(CheckScriptMetrics(metrics));
  for (const std::string& bad : {std::string(""), std::string("1st"), std::string("a-b"),
                                 std::string("a b"), std::string(65, 'a'), std::string("\n")}) {
    google::protobuf::Map<std::string, double> one;
    one[bad] = 1;
    EXPECT_EQ(CheckScriptMetrics(one).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  for (const double bad : {std::numeric_limits<double>::quiet_NaN(),
                           std::numeric_limits<double>::infinity()}) {
    google::protobuf::Map<std::string, double> one;
    one["mse"] = bad;
    const absl::Status s = CheckScriptMetrics(one);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("mse"), absl::string_view::npos) << s;
  }
  google::protobuf::Map<std::string, double> many;
  for (int i = 0; i <= kMaxScriptMetrics; ++i) many["m" + std::to_string(i)] = i;
  EXPECT_EQ(CheckScriptMetrics(many).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pstrain::server
