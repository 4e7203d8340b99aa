#include "server/server_metrics.h"

#include "common/status.h"

namespace pstrain::server {

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Create(
    prometheus::Registry& r, absl::Duration grace) {
  std::unique_ptr<ServerMetrics> m(new ServerMetrics(grace));
  PSTRAIN_RETURN_IF_ERROR(BuildMetrics([&] { PSTRAIN_REGISTER_METRICS(PSTRAIN_SERVER_METRICS) }));
  return m;
}

ServerMetrics::Job ServerMetrics::BindJob(const std::string& job_id) {
  const prometheus::Labels labels = {{"job_id", job_id}};
  Job j;
  PSTRAIN_BIND_JOB_METRICS(PSTRAIN_SERVER_METRICS)
  expiring.Add(job_id, [this, j] { PSTRAIN_REMOVE_JOB_METRICS(PSTRAIN_SERVER_METRICS) });
  return j;
}

prometheus::Gauge* ServerMetrics::BindStraggler(const std::string& job_id, uint32_t worker) {
  prometheus::Gauge* g = &stragglers->Add({{"job_id", job_id}, {"worker", std::to_string(worker)}});
  expiring.Add(job_id, [this, g] { stragglers->Remove(g); });
  expiring.JobEnded(job_id);  // a removal, not a binding: the job's own ends it
  return g;
}

}  // namespace pstrain::server
