// What a worker measures, declared in one place and built once.
#ifndef PSTRAIN_WORKER_WORKER_METRICS_H_
#define PSTRAIN_WORKER_WORKER_METRICS_H_

#include <array>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/metrics.h"

namespace pstrain::worker {

// The parts of a training step, in order.
enum class StepPhase { kCompute, kReduce, kPush, kWait, kPull };
inline constexpr std::array<const char*, 5> kStepPhaseNames = {"compute", "reduce", "push",
                                                               "wait", "pull"};

#define PSTRAIN_WORKER_METRICS(JOB_COUNTER, JOB_GAUGE, JOB_HISTOGRAM, COUNTER, GAUGE,          \
                               HISTOGRAM, FAMILY_COUNTER, FAMILY_GAUGE)                        \
  JOB_COUNTER(steps, "pstrain_worker_steps_total", "Training steps completed.")                \
  JOB_COUNTER(samples, "pstrain_worker_samples_total", "Training samples processed.")          \
  JOB_GAUGE(samples_per_second, "pstrain_worker_samples_per_second",                          \
            "Training throughput over the last report interval.")                             \
  JOB_HISTOGRAM(step_seconds, "pstrain_worker_step_seconds", "Duration of a whole training step.", \
                LatencyBuckets())                                                             \
  FAMILY_COUNTER(phase_seconds, "pstrain_worker_step_phase_seconds_total",                    \
                 "Time spent in each part of the steps: compute (forward and backward), "     \
                 "reduce (across local devices), push, wait (for the servers' barrier), pull.") \
  JOB_COUNTER(pushed_bytes, "pstrain_worker_pushed_bytes_total", "Gradient payload bytes pushed.") \
  JOB_COUNTER(pulled_bytes, "pstrain_worker_pulled_bytes_total",                              \
              "Parameter payload bytes received and used.")                                   \
  JOB_COUNTER(retries, "pstrain_worker_retries_total",                                        \
              "Exchanges with the servers repeated for lost or failed replies.")              \
  JOB_GAUGE(loss, "pstrain_worker_loss", "Mean training loss of the last step.")              \
  JOB_GAUGE(loss_ema, "pstrain_worker_loss_ema",                                              \
            "Training loss, exponential moving average (weight 0.02 per step).")              \
  JOB_GAUGE(loss_scale, "pstrain_worker_loss_scale",                                          \
            "Precision fp16: the dynamic loss scale of the next step.")                       \
  JOB_COUNTER(overflows, "pstrain_worker_loss_scale_overflows_total",                         \
              "Precision fp16: steps whose scaled gradient overflowed (skipped on every "     \
              "server; the scale halved).")

// What a worker measures, declared once in the table above (common/metrics.h).
struct WorkerMetrics {
  // Per-job series stay this long after the job ends here.
  static absl::StatusOr<std::unique_ptr<WorkerMetrics>> Create(prometheus::Registry& registry,
                                                               absl::Duration grace);

  PSTRAIN_METRIC_FIELDS(PSTRAIN_WORKER_METRICS)

  // One job's series, bound once when the job starts here.
  struct Job {
    PSTRAIN_JOB_METRIC_FIELDS(PSTRAIN_WORKER_METRICS)
    // By StepPhase (the phase label).
    std::array<prometheus::Counter*, kStepPhaseNames.size()> phase_seconds;
  };
  // The job's series; they expire `grace` after JobEnded.
  Job BindJob(const std::string& job_id);

  ExpiringSeries expiring;

 private:
  explicit WorkerMetrics(absl::Duration grace) : expiring(grace) {}
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_WORKER_METRICS_H_
