#include "worker/step_log.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"

namespace pstrain::worker {

StepPhases SplitStepTime(double compute, double reduce, double exposed,
                         const ParameterClient::Stats& exchanges) {
  StepPhases phases{};
  phases[static_cast<int>(StepPhase::kCompute)] = compute;
  phases[static_cast<int>(StepPhase::kReduce)] = reduce;
  const double push = exchanges.push_seconds, wait = exchanges.wait_seconds,
               pull = exchanges.pull_seconds;
  const double total = push + wait + pull;
  if (total > 0) {
    phases[static_cast<int>(StepPhase::kPush)] = exposed * push / total;
    phases[static_cast<int>(StepPhase::kWait)] = exposed * wait / total;
    phases[static_cast<int>(StepPhase::kPull)] = exposed * pull / total;
  } else {
    phases[static_cast<int>(StepPhase::kWait)] = exposed;
  }
  return phases;
}

ParameterClient::Stats StatsSince(const ParameterClient::Stats& before,
                                  const ParameterClient::Stats& after) {
  ParameterClient::Stats d;
  d.retries = after.retries - before.retries;
  d.bytes_pushed = after.bytes_pushed - before.bytes_pushed;
  d.bytes_pulled = after.bytes_pulled - before.bytes_pulled;
  d.push_seconds = after.push_seconds - before.push_seconds;
  d.wait_seconds = after.wait_seconds - before.wait_seconds;
  d.pull_seconds = after.pull_seconds - before.pull_seconds;
  return d;
}

StepLog::StepLog(const v1::WorkerResumeState& resume, int64_t first_step, int64_t total_steps)
    : recent_losses_(std::min<int64_t>(kFinalLossSteps, total_steps)),
      loss_ema_(resume.loss_ema()),
      seconds_before_(resume.train_seconds()) {
  for (int i = 0; i < resume.recent_losses_size(); ++i) {
    const int64_t step = first_step - resume.recent_losses_size() + i;
    if (step >= 0) recent_losses_[step % recent_losses_.size()] = resume.recent_losses(i);
  }
}

void StepLog::Start(absl::Time now) {
  start_ = now;
  window_start_ = now;
}

void StepLog::Add(int64_t step, double loss, int64_t samples, const StepPhases& phases) {
  recent_losses_[step % recent_losses_.size()] = loss;
  loss_ema_ = step == 0 ? loss : loss_ema_ + kLossEmaWeight * (loss - loss_ema_);
  window_loss_ += loss;
  ++window_steps_;
  window_samples_ += samples;
  for (size_t p = 0; p < phases.size(); ++p) phase_totals_[p] += phases[p];
}

double StepLog::FinalLoss() const {
  double sum = 0;
  for (double loss : recent_losses_) sum += loss;
  return sum / static_cast<double>(recent_losses_.size());
}

double StepLog::TrainSeconds(absl::Time now) const {
  return seconds_before_ + absl::ToDoubleSeconds(now - start_);
}

v1::StepTimes StepLog::MeanStepTimes(int64_t steps) const {
  const double n = static_cast<double>(std::max<int64_t>(steps, 1));
  v1::StepTimes times;
  times.set_compute_seconds(phase_totals_[static_cast<int>(StepPhase::kCompute)] / n);
  times.set_reduce_seconds(phase_totals_[static_cast<int>(StepPhase::kReduce)] / n);
  times.set_push_seconds(phase_totals_[static_cast<int>(StepPhase::kPush)] / n);
  times.set_wait_seconds(phase_totals_[static_cast<int>(StepPhase::kWait)] / n);
  times.set_pull_seconds(phase_totals_[static_cast<int>(StepPhase::kPull)] / n);
  return times;
}

double StepLog::TakeWindow(absl::Time now, v1::ReportProgressRequest* report) {
  const double seconds = absl::ToDoubleSeconds(now - window_start_);
  report->set_loss(static_cast<float>(window_loss_ / window_steps_));
  report->set_samples(window_samples_);
  report->set_seconds(seconds);
  const double rate = seconds > 0 ? static_cast<double>(window_samples_) / seconds : 0;
  window_loss_ = 0;
  window_steps_ = 0;
  window_samples_ = 0;
  window_start_ = now;
  return rate;
}

v1::WorkerResumeState StepLog::ResumeState(uint32_t worker, int64_t done, int64_t generation,
                                           absl::Time now) const {
  v1::WorkerResumeState state;
  state.set_worker(worker);
  state.set_step(done);
  state.set_generation(generation);
  const int64_t kept = std::min<int64_t>(done, recent_losses_.size());
  for (int64_t s = done - kept; s < done; ++s) {
    state.add_recent_losses(static_cast<float>(recent_losses_[s % recent_losses_.size()]));
  }
  state.set_loss_ema(loss_ema_);
  state.set_train_seconds(TrainSeconds(now));
  return state;
}

EarlyStopper::EarlyStopper(const v1::EarlyStopping& spec, const v1::WorkerResumeState& resume)
    : spec_(spec),
      best_accuracy_(resume.best_test_accuracy()),
      best_step_(resume.best_step()),
      without_improvement_(resume.evaluations_without_improvement()) {}

std::string EarlyStopper::Evaluated(float accuracy, int64_t done) {
  if (best_step_ == 0 || accuracy > best_accuracy_ + spec_.min_delta()) {
    best_accuracy_ = accuracy;
    best_step_ = done;
    without_improvement_ = 0;
  } else {
    ++without_improvement_;
  }
  if (spec_.patience() == 0 || without_improvement_ < spec_.patience()) return "";
  return absl::StrCat("early stopping at step ", done, ": the test accuracy did not improve on ",
                      best_accuracy_, " (step ", best_step_, ") by more than ", spec_.min_delta(),
                      " in ", spec_.patience(), " evaluations");
}

void EarlyStopper::SaveTo(v1::WorkerResumeState* state) const {
  state->set_best_test_accuracy(best_accuracy_);
  state->set_best_step(best_step_);
  state->set_evaluations_without_improvement(without_improvement_);
}

void ClearSentOnce(v1::ReportProgressRequest* report) {
  report->clear_checkpoint_states();
  report->clear_evaluated();
  report->clear_evaluated_step();
  report->clear_test_accuracy();
  report->clear_test_loss();
  report->clear_metrics();
}

}  // namespace pstrain::worker
