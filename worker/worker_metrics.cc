#include "worker/worker_metrics.h"

#include "common/status.h"

namespace pstrain::worker {

absl::StatusOr<std::unique_ptr<WorkerMetrics>> WorkerMetrics::Create(
    prometheus::Registry& r, absl::Duration grace) {
  std::unique_ptr<WorkerMetrics> m(new WorkerMetrics(grace));
  PSTRAIN_RETURN_IF_ERROR(BuildMetrics([&] { PSTRAIN_REGISTER_METRICS(PSTRAIN_WORKER_METRICS) }));
  return m;
}

WorkerMetrics::Job WorkerMetrics::BindJob(const std::string& job_id) {
  const prometheus::Labels labels = {{"job_id", job_id}};
  Job j;
  PSTRAIN_BIND_JOB_METRICS(PSTRAIN_WORKER_METRICS)
  for (size_t p = 0; p < kStepPhaseNames.size(); ++p) {
    j.phase_seconds[p] = &phase_seconds->Add({{"job_id", job_id}, {"phase", kStepPhaseNames[p]}});
  }
  expiring.Add(job_id, [this, j] {
    PSTRAIN_REMOVE_JOB_METRICS(PSTRAIN_WORKER_METRICS)
    for (prometheus::Counter* c : j.phase_seconds) phase_seconds->Remove(c);
  });
  return j;
}

}  // namespace pstrain::worker
