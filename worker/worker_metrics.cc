#include "worker/worker_metrics.h"

namespace pstrain::worker {

absl::StatusOr<std::unique_ptr<WorkerMetrics>> WorkerMetrics::Create(
    prometheus::Registry& r, absl::Duration grace) {
  std::unique_ptr<WorkerMetrics> m(new WorkerMetrics(grace));
  absl::Status s = BuildMetrics([&] {
    m->steps = &prometheus::BuildCounter()
                    .Name("pstrain_worker_steps_total")
                    .Help("Training steps completed.")
                    .Register(r);
    m->samples = &prometheus::BuildCounter()
                      .Name("pstrain_worker_samples_total")
                      .Help("Training samples processed.")
                      .Register(r);
    m->samples_per_second = &prometheus::BuildGauge()
                                 .Name("pstrain_worker_samples_per_second")
                                 .Help("Training throughput over the last report interval.")
                                 .Register(r);
    m->step_seconds = &prometheus::BuildHistogram()
                           .Name("pstrain_worker_step_seconds")
                           .Help("Duration of a whole training step.")
                           .Register(r);
    m->phase_seconds = &prometheus::BuildCounter()
                            .Name("pstrain_worker_step_phase_seconds_total")
                            .Help("Time spent in each part of the steps: compute (forward and "
                                  "backward), reduce (across local devices), push, wait (for "
                                  "the servers' barrier), pull.")
                            .Register(r);
    m->pushed_bytes = &prometheus::BuildCounter()
                           .Name("pstrain_worker_pushed_bytes_total")
                           .Help("Gradient payload bytes pushed.")
                           .Register(r);
    m->pulled_bytes = &prometheus::BuildCounter()
                           .Name("pstrain_worker_pulled_bytes_total")
                           .Help("Parameter payload bytes received and used.")
                           .Register(r);
    m->retries = &prometheus::BuildCounter()
                      .Name("pstrain_worker_retries_total")
                      .Help("Exchanges with the servers repeated for lost or failed replies.")
                      .Register(r);
    m->loss = &prometheus::BuildGauge()
                   .Name("pstrain_worker_loss")
                   .Help("Mean training loss of the last step.")
                   .Register(r);
    m->loss_ema = &prometheus::BuildGauge()
                       .Name("pstrain_worker_loss_ema")
                       .Help("Training loss, exponential moving average (weight 0.02 per step).")
                       .Register(r);
    m->loss_scale = &prometheus::BuildGauge()
                         .Name("pstrain_worker_loss_scale")
                         .Help("Precision fp16: the dynamic loss scale of the next step.")
                         .Register(r);
    m->overflows = &prometheus::BuildCounter()
                        .Name("pstrain_worker_loss_scale_overflows_total")
                        .Help("Precision fp16: steps whose scaled gradient overflowed (skipped on "
                              "every server; the scale halved).")
                        .Register(r);
  });
  if (!s.ok()) return s;
  return m;
}

WorkerMetrics::Job WorkerMetrics::BindJob(const std::string& job_id) {
  const prometheus::Labels labels = {{"job_id", job_id}};
  Job j;
  j.steps = &steps->Add(labels);
  j.samples = &samples->Add(labels);
  j.samples_per_second = &samples_per_second->Add(labels);
  j.step_seconds = &step_seconds->Add(labels, LatencyBuckets());
  for (size_t p = 0; p < kStepPhaseNames.size(); ++p) {
    j.phase_seconds[p] = &phase_seconds->Add({{"job_id", job_id}, {"phase", kStepPhaseNames[p]}});
  }
  j.pushed_bytes = &pushed_bytes->Add(labels);
  j.pulled_bytes = &pulled_bytes->Add(labels);
  j.retries = &retries->Add(labels);
  j.loss = &loss->Add(labels);
  j.loss_ema = &loss_ema->Add(labels);
  j.loss_scale = &loss_scale->Add(labels);
  j.overflows = &overflows->Add(labels);
  expiring.Add(job_id, [this, j] {
    steps->Remove(j.steps);
    samples->Remove(j.samples);
    samples_per_second->Remove(j.samples_per_second);
    step_seconds->Remove(j.step_seconds);
    for (prometheus::Counter* c : j.phase_seconds) phase_seconds->Remove(c);
    pushed_bytes->Remove(j.pushed_bytes);
    pulled_bytes->Remove(j.pulled_bytes);
    retries->Remove(j.retries);
    loss->Remove(j.loss);
    loss_ema->Remove(j.loss_ema);
    loss_scale->Remove(j.loss_scale);
    overflows->Remove(j.overflows);
  });
  return j;
}

}  // namespace pstrain::worker
