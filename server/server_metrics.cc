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
    m->skipped = &prometheus::BuildCounter()
                      .Name("pstrain_server_skipped_updates_total")
                      .Help("Updates of a chunk skipped because a worker's gradient of the step "
                            "had a NaN or an infinity somewhere (sync: the step, on every chunk; "
                            "async: that worker's push).")
                      .Register(r);
    m->learning_rate = &prometheus::BuildGauge()
                            .Name("pstrain_server_learning_rate")
                            .Help("The learning rate of the last update applied (the job's "
                                  "schedule at its step).")
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
                        .Help("Async and ssp: updates applied to a chunk since the values a "
                              "gradient was computed from.")
                        .Register(r);
    m->step_staleness = &prometheus::BuildHistogram()
                             .Name("pstrain_server_step_staleness")
                             .Help("Steps of the slowest worker missing from the values a "
                                   "worker's next step is computed from, per worker and step "
                                   "(sync: 0; ssp: at most the job's staleness).")
                             .Register(r);
    m->slowest_wait = &prometheus::BuildHistogram()
                           .Name("pstrain_server_slowest_worker_wait_seconds")
                           .Help("How long a worker's push waited for other workers' steps "
                                 "before its reply, per worker and step (sync: the barrier; "
                                 "ssp: the staleness bound; async: 0).")
                           .Register(r);
    m->checkpoint = &prometheus::BuildHistogram()
                         .Name("pstrain_server_checkpoint_seconds")
                         .Help("Writing one checkpoint of a job's chunks (in the background).")
                         .Register(r);
    m->checkpoint_copy = &prometheus::BuildHistogram()
                              .Name("pstrain_server_checkpoint_copy_seconds")
                              .Help("Copying a chunk's values and optimizer state at a "
                                    "checkpoint step (what training waits for).")
                              .Register(r);
    m->checkpoint_bytes = &prometheus::BuildCounter()
                               .Name("pstrain_server_checkpoint_bytes_total")
                               .Help("Bytes of checkpoint files written.")
                               .Register(r);
    m->last_checkpoint = &prometheus::BuildGauge()
                              .Name("pstrain_server_last_checkpoint_step")
                              .Help("The step of the server's newest checkpoint of a job.")
                              .Register(r);
    m->stragglers = &prometheus::BuildGauge()
                         .Name("pstrain_server_straggler")
                         .Help("1 while a worker's pushes reach the barrier more than 3x the "
                               "median lag of the others, 10 steps in a row.")
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
  j.skipped = &skipped->Add(labels);
  j.learning_rate = &learning_rate->Add(labels);
  j.barrier_wait = &barrier_wait->Add(labels, LatencyBuckets());
  j.apply = &apply->Add(labels, LatencyBuckets());
  j.staleness = &staleness->Add(
      labels, prometheus::Histogram::BucketBoundaries{0, 1, 2, 4, 8, 16, 32, 64, 128, 256});
  j.step_staleness = &step_staleness->Add(
      labels, prometheus::Histogram::BucketBoundaries{0, 1, 2, 4, 8, 16, 32, 64, 128, 256});
  j.slowest_wait = &slowest_wait->Add(labels, LatencyBuckets());
  j.checkpoint = &checkpoint->Add(labels, LatencyBuckets());
  j.checkpoint_copy = &checkpoint_copy->Add(labels, LatencyBuckets());
  j.checkpoint_bytes = &checkpoint_bytes->Add(labels);
  j.last_checkpoint = &last_checkpoint->Add(labels);
  expiring.Add(job_id, [this, j] {
    checkpoint->Remove(j.checkpoint);
    checkpoint_copy->Remove(j.checkpoint_copy);
    checkpoint_bytes->Remove(j.checkpoint_bytes);
    last_checkpoint->Remove(j.last_checkpoint);
    pushes->Remove(j.pushes);
    received_bytes->Remove(j.received_bytes);
    sent_bytes->Remove(j.sent_bytes);
    updates->Remove(j.updates);
    skipped->Remove(j.skipped);
    learning_rate->Remove(j.learning_rate);
    barrier_wait->Remove(j.barrier_wait);
    apply->Remove(j.apply);
    staleness->Remove(j.staleness);
    step_staleness->Remove(j.step_staleness);
    slowest_wait->Remove(j.slowest_wait);
  });
  return j;
}

prometheus::Gauge* ServerMetrics::BindStraggler(const std::string& job_id, uint32_t worker) {
  prometheus::Gauge* g = &stragglers->Add({{"job_id", job_id}, {"worker", std::to_string(worker)}});
  expiring.Add(job_id, [this, g] { stragglers->Remove(g); });
  expiring.JobEnded(job_id);  // a removal, not a binding: the job's own ends it
  return g;
}

}  // namespace pstrain::server
