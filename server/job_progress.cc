#include "server/job_progress.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string>
#include <utility>

#include "common/job_spec.h"

namespace pstrain::server {

void ApplyProgressReport(const v1::ReportProgressRequest& r, v1::Job* job) {
  v1::WorkerStatus& worker = *job->mutable_workers(r.worker());
  // Progress sent before the final report may arrive after it.
  if (worker.finished()) return;
  worker.set_step(std::max(worker.step(), r.step()));
  worker.set_loss(r.loss());
  for (const auto& [name, value] : r.metrics()) (*worker.mutable_metrics())[name] = value;
  if (r.seconds() > 0) worker.set_samples_per_second(r.samples() / r.seconds());
  if (r.finished()) {
    worker.set_finished(true);
    worker.set_train_seconds(r.train_seconds());
    *worker.mutable_step_times() = r.step_times();
  }

  v1::Progress& p = *job->mutable_progress();
  int64_t min_step = std::numeric_limits<int64_t>::max();
  double loss_sum = 0, rate = 0;
  int reported = 0;
  for (const v1::WorkerStatus& w : job->workers()) {
    min_step = std::min(min_step, w.step());
    if (w.step() > 0) {
      loss_sum += w.loss();
      ++reported;
    }
    if (!w.finished()) rate += w.samples_per_second();
  }
  p.set_step(min_step);
  p.set_epoch(static_cast<int32_t>(
      std::min<int64_t>(min_step, std::max<int64_t>(p.total_steps() - 1, 0)) /
      StepsPerEpoch(job->spec())));
  p.set_loss(reported > 0 ? static_cast<float>(loss_sum / reported) : 0.0f);
  if (!r.finished()) p.set_samples_per_second(rate);
  if (!r.metrics().empty()) *p.mutable_metrics() = MeanScriptMetrics(*job);

  if (r.evaluated()) {
    v1::Evaluation eval;
    eval.set_step(r.evaluated_step() > 0 ? r.evaluated_step() : r.step());
    eval.set_test_accuracy(r.test_accuracy());
    if (r.has_test_loss()) eval.set_test_loss(r.test_loss());
    // The best so far: the first of equal accuracies.
    if (!job->has_best_evaluation() ||
        eval.test_accuracy() > job->best_evaluation().test_accuracy()) {
      *job->mutable_best_evaluation() = eval;
    }
    *job->mutable_last_evaluation() = std::move(eval);
    if (r.finished()) {  // the final model's
      job->mutable_result()->set_evaluated(true);
      job->mutable_result()->set_test_accuracy(r.test_accuracy());
      if (r.has_test_loss()) job->mutable_result()->set_test_loss(r.test_loss());
    }
  }
  if (r.finished() && !r.stopped_early().empty() && job->reason().empty()) {
    job->set_reason(r.stopped_early());
  }
}

google::protobuf::Map<std::string, double> MeanScriptMetrics(const v1::Job& job) {
  std::map<std::string, std::pair<double, int>> sums;  // sum, workers
  for (const v1::WorkerStatus& w : job.workers()) {
    for (const auto& [name, value] : w.metrics()) {
      auto& [sum, n] = sums[name];
      sum += value;
      ++n;
    }
  }
  google::protobuf::Map<std::string, double> mean;
  for (const auto& [name, sum_n] : sums) mean[name] = sum_n.first / sum_n.second;
  return mean;
}

bool AllWorkersFinished(const v1::Job& job) {
  return std::all_of(job.workers().begin(), job.workers().end(),
                     [](const v1::WorkerStatus& w) { return w.finished(); });
}

v1::JobResult CompletedResult(const v1::Job& job) {
  v1::JobResult result = job.result();
  double seconds = 0, loss = 0;
  v1::StepTimes& times = *result.mutable_step_times();
  times.Clear();
  const double n = job.workers_size();
  for (const v1::WorkerStatus& w : job.workers()) {
    seconds = std::max(seconds, w.train_seconds());
    loss += w.loss();
    times.set_compute_seconds(times.compute_seconds() + w.step_times().compute_seconds() / n);
    times.set_reduce_seconds(times.reduce_seconds() + w.step_times().reduce_seconds() / n);
    times.set_push_seconds(times.push_seconds() + w.step_times().push_seconds() / n);
    times.set_wait_seconds(times.wait_seconds() + w.step_times().wait_seconds() / n);
    times.set_pull_seconds(times.pull_seconds() + w.step_times().pull_seconds() / n);
  }
  // The steps the workers did: the job's, or fewer if early stopping ended it.
  int64_t steps = 0;
  double samples = 0;
  for (const v1::WorkerStatus& w : job.workers()) {
    steps = std::max(steps, w.step());
    samples += static_cast<double>(w.step()) * GlobalBatch(job.spec()) / job.spec().num_workers();
  }
  result.set_steps(steps);
  result.set_train_seconds(seconds);
  result.set_samples_per_second(seconds > 0 ? samples / seconds : 0);
  result.set_final_loss(static_cast<float>(loss / n));
  *result.mutable_metrics() = MeanScriptMetrics(job);
  return result;
}

}  // namespace pstrain::server
