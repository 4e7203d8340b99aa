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
  expiring.AddRemoval(job_id, [this, g] { stragglers->Remove(g); });
  return g;
}

ServerMetrics::Table ServerMetrics::BindTable(const std::string& job_id,
                                              const std::string& table) {
  const prometheus::Labels labels = {{"job_id", job_id}, {"table", table}};
  Table t{&table_rows->Add(labels),
          &table_bytes->Add(labels),
          &table_max_bytes->Add(labels),
          &table_admitted->Add(labels),
          &table_evicted->Add(labels),
          &table_dropped_gradients->Add(labels),
          &table_rows_pulled->Add(labels),
          &table_rows_pushed->Add(labels),
          &table_hot_key_share->Add(labels)};
  expiring.AddRemoval(job_id, [this, t] {
    table_rows->Remove(t.rows);
    table_bytes->Remove(t.bytes);
    table_max_bytes->Remove(t.max_bytes);
    table_admitted->Remove(t.admitted);
    table_evicted->Remove(t.evicted);
    table_dropped_gradients->Remove(t.dropped_gradients);
    table_rows_pulled->Remove(t.rows_pulled);
    table_rows_pushed->Remove(t.rows_pushed);
    table_hot_key_share->Remove(t.hot_key_share);
  });
  return t;
}

}  // namespace pstrain::server
