// What a worker keeps of its steps in a generation, the same for pool
// workers (trainer.h) and the client library (client.cc): the losses
// (their mean over the last steps is the final loss), the report window,
// where each step's time went, early stopping, and the resume state a
// checkpoint carries of them.
#ifndef PSTRAIN_WORKER_STEP_LOG_H_
#define PSTRAIN_WORKER_STEP_LOG_H_

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "pstrain/v1/control.pb.h"
#include "pstrain/v1/membership.pb.h"
#include "worker/parameter_client.h"
#include "worker/worker_metrics.h"

namespace pstrain::worker {

// The final loss of a worker is its mean training loss over this many steps.
inline constexpr int64_t kFinalLossSteps = 50;
// Weight of each step's loss in the exported moving average.
inline constexpr double kLossEmaWeight = 0.02;

// Seconds of a step (or of many) by StepPhase.
using StepPhases = std::array<double, kStepPhaseNames.size()>;

// Where a step's time went, adding up to compute + reduce + exposed: the
// compute and reduce measured, and the exchanges' time not hidden behind
// them (`exposed`) split in proportion to the exchanges' own push, wait
// and pull times over the step (`exchanges`: the client's stats' growth),
// which overlap each other and the compute.
StepPhases SplitStepTime(double compute, double reduce, double exposed,
                         const ParameterClient::Stats& exchanges);
// The growth of the stats from `before` to `after`.
ParameterClient::Stats StatsSince(const ParameterClient::Stats& before,
                                  const ParameterClient::Stats& after);

// Not thread-safe.
class StepLog {
 public:
  // A generation that starts at `first_step` of a job of `total_steps`
  // steps, with what `resume` carries: the losses before it, their
  // average, the training time.
  StepLog(const v1::WorkerResumeState& resume, int64_t first_step, int64_t total_steps);

  // Training (re)starts now: the generation's time and the first report
  // window start.
  void Start(absl::Time now);
  // A step done: its loss, samples and time.
  void Add(int64_t step, double loss, int64_t samples, const StepPhases& phases);

  double loss_ema() const { return loss_ema_; }
  // The mean loss of the last kFinalLossSteps steps.
  double FinalLoss() const;
  // The job's training time: the generations before this one and this
  // one's up to `now`.
  double TrainSeconds(absl::Time now) const;
  // The mean time per step of each phase over `steps` steps.
  v1::StepTimes MeanStepTimes(int64_t steps) const;

  // Whether `interval` has passed since the report window began.
  bool WindowDue(absl::Time now, absl::Duration interval) const {
    return now - window_start_ >= interval;
  }
  // The window into the report (its mean loss, samples, seconds), and the
  // next begins at `now`. Returns its samples per second (0 if no time).
  double TakeWindow(absl::Time now, v1::ReportProgressRequest* report);

  // The resume state after `done` steps, at `now`: the losses, their
  // average, the training time (the caller adds what else it carries).
  v1::WorkerResumeState ResumeState(uint32_t worker, int64_t done, int64_t generation,
                                    absl::Time now) const;

 private:
  std::vector<double> recent_losses_;  // by step, a ring
  double loss_ema_ = 0;
  double seconds_before_ = 0;  // training time before this generation
  absl::Time start_;
  StepPhases phase_totals_{};
  absl::Time window_start_;
  double window_loss_ = 0;
  int64_t window_steps_ = 0;
  int64_t window_samples_ = 0;
};

// Clears what a progress report carries once, after it went out: the
// checkpoint states, an evaluation and its metrics.
void ClearSentOnce(v1::ReportProgressRequest* report);

// Early stopping (spec.early_stopping) over the evaluations during
// training, resumed from the generation's state: the best accuracy, its
// step, and the evaluations since without an improvement of more than
// min_delta.
class EarlyStopper {
 public:
  EarlyStopper(const v1::EarlyStopping& spec, const v1::WorkerResumeState& resume);

  // An evaluation after `done` steps: why the training stops now (patience
  // evaluations without an improvement), or empty if it goes on.
  std::string Evaluated(float accuracy, int64_t done);
  // Its part of a resume state.
  void SaveTo(v1::WorkerResumeState* state) const;

 private:
  const v1::EarlyStopping spec_;
  float best_accuracy_;
  int64_t best_step_;
  int32_t without_improvement_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_STEP_LOG_H_
