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

struct WorkerMetrics {
  // Per-job series stay this long after the job ends here.
  static absl::StatusOr<std::unique_ptr<WorkerMetrics>> Create(prometheus::Registry& registry,
                                                               absl::Duration grace);

  // name                                                 labels        type
  prometheus::Family<prometheus::Counter>* steps;            // job_id        pstrain_worker_steps_total
  prometheus::Family<prometheus::Counter>* samples;          // job_id        pstrain_worker_samples_total
  prometheus::Family<prometheus::Gauge>* samples_per_second; // job_id        pstrain_worker_samples_per_second
  prometheus::Family<prometheus::Histogram>* step_seconds;   // job_id        pstrain_worker_step_seconds
  prometheus::Family<prometheus::Counter>* phase_seconds;    // job_id,phase  pstrain_worker_step_phase_seconds_total
  prometheus::Family<prometheus::Counter>* pushed_bytes;     // job_id        pstrain_worker_pushed_bytes_total
  prometheus::Family<prometheus::Counter>* pulled_bytes;     // job_id        pstrain_worker_pulled_bytes_total
  prometheus::Family<prometheus::Counter>* retries;          // job_id        pstrain_worker_retries_total
  prometheus::Family<prometheus::Gauge>* loss;               // job_id        pstrain_worker_loss
  prometheus::Family<prometheus::Gauge>* loss_ema;           // job_id        pstrain_worker_loss_ema
  prometheus::Family<prometheus::Gauge>* loss_scale;         // job_id        pstrain_worker_loss_scale
  prometheus::Family<prometheus::Counter>* overflows;        // job_id        pstrain_worker_loss_scale_overflows_total

  // One job's series, bound once when the job starts here.
  struct Job {
    prometheus::Counter* steps;
    prometheus::Counter* samples;
    prometheus::Gauge* samples_per_second;
    prometheus::Histogram* step_seconds;
    std::array<prometheus::Counter*, kStepPhaseNames.size()> phase_seconds;
    prometheus::Counter* pushed_bytes;
    prometheus::Counter* pulled_bytes;
    prometheus::Counter* retries;
    prometheus::Gauge* loss;
    prometheus::Gauge* loss_ema;
    prometheus::Gauge* loss_scale;
    prometheus::Counter* overflows;
  };
  // The job's series; they expire `grace` after JobEnded.
  Job BindJob(const std::string& job_id);

  ExpiringSeries expiring;

 private:
  explicit WorkerMetrics(absl::Duration grace) : expiring(grace) {}
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_WORKER_METRICS_H_
