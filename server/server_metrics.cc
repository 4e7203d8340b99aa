#include "server/server_metrics.h"

namespace pstrain::server {

absl::StatusOr<std::unique_ptr<ServerMetrics>> ServerMetrics::Create(
    prometheus::Registry& r, absl::Duration grace) {
  std::unique_ptr<ServerMetrics> m(new ServerMetrics(grace));
  absl::Status s = BuildMetrics([&] {
    m->pushes = &prometheus::BuildCounter()
                     .Name("pstrain_server_pushes_total")
                     .Help("Gradient pushes received, retries included.")
                     .Register(r);
    m->received_bytes = &prometheus::BuildCounter()
                             .Name("pstrain_server_received_bytes_total")
                             .Help("Gradient payload bytes received.")
                             .Register(r);
    m->sent_bytes = &prometheus::BuildCounter()
                         .Name("pstrain_server_sent_bytes_total")
                         .Help("Parameter payload bytes sent.")
                         .Register(r);
    m->updates = &prometheus::BuildCounter()
                      .Name("pstrain_server_updates_total")
                      .Help("Optimizer updates applied to chunks.")
                      .Register(r);
    m->barrier_wait = &prometheus::BuildHistogram()
                           .Name("pstrain_server_barrier_wait_seconds")
                           .Help("Sync mode: from a chunk's first push of a step to its last.")
                           .Register(r);
    m->apply = &prometheus::BuildHistogram()
                    .Name("pstrain_server_apply_seconds")
                    .Help("Summing a chunk's gradients and applying the optimizer.")
                    .Register(r);
    m->staleness = &prometheus::BuildHistogram()
                        .Name("pstrain_server_gradient_staleness")
                        .Help("Async mode: updates applied to a chunk since the values a "
                              "gradient was computed from.")
                        .Register(r);
    m->held_bytes = &prometheus::BuildGauge()
                         .Name("pstrain_server_held_bytes")
                         .Help("Bytes of job state held.")
                         .Register(r)
                         .Add({});
    m->jobs = &prometheus::BuildGauge()
                   .Name("pstrain_server_jobs")
                   .Help("Jobs held.")
                   .Register(r)
                   .Add({});
    m->open_waits = &prometheus::BuildGauge()
                         .Name("pstrain_server_open_waits")
                         .Help("Pushes and pulls waiting for a version (at the barrier).")
                         .Register(r)
                         .Add({});
  });
  if (!s.ok()) return s;
  return m;
}

ServerMetrics::Job ServerMetrics::BindJob(const std::string& job_id) {
  const prometheus::Labels labels = {{"job_id", job_id}};
  Job j;
  j.pushes = &pushes->Add(labels);
  j.received_bytes = &received_bytes->Add(labels);
  j.sent_bytes = &sent_bytes->Add(labels);
  j.updates = &updates->Add(labels);
  j.barrier_wait = &barrier_wait->Add(labels, LatencyBuckets());
  j.apply = &apply->Add(labels, LatencyBuckets());
  j.staleness = &staleness->Add(
      labels, prometheus::Histogram::BucketBoundaries{0, 1, 2, 4, 8, 16, 32, 64, 128, 256});
  expiring.Add(job_id, [this, j] {
    pushes->Remove(j.pushes);
    received_bytes->Remove(j.received_bytes);
    sent_bytes->Remove(j.sent_bytes);
    updates->Remove(j.updates);
    barrier_wait->Remove(j.barrier_wait);
    apply->Remove(j.apply);
    staleness->Remove(j.staleness);
  });
  return j;
}

}  // namespace pstrain::server
