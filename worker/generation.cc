#include "worker/generation.h"

#include <algorithm>

#include "common/job_spec.h"

namespace pstrain::worker {

std::vector<v1::HeldJob> HeldJobs(const std::string& job_id, int64_t generation) {
  std::vector<v1::HeldJob> held;
  if (job_id.empty() || generation == 0) return held;
  v1::HeldJob& h = held.emplace_back();
  h.set_job_id(job_id);
  h.set_generation(generation);
  return held;
}

const v1::WorkerAssignment* AssignmentOf(const v1::HeartbeatResponse& response,
                                         const std::string& job_id) {
  const v1::WorkerAssignment* mine = nullptr;
  for (const v1::WorkerAssignment& a : response.worker_jobs()) {
    if (a.job_id() == job_id) mine = &a;
  }
  return mine;
}

absl::StatusOr<BatchShare> BatchShareOf(const v1::JobSpec& spec, const v1::WorkerAssignment& a) {
  const int workers = a.num_workers() > 0 ? static_cast<int>(a.num_workers()) : spec.num_workers();
  if (workers > spec.num_workers() || a.worker_index() >= static_cast<uint32_t>(workers)) {
    return absl::InvalidArgumentError("worker_index outside num_workers");
  }
  const int global = static_cast<int>(GlobalBatch(spec));
  const int w = static_cast<int>(a.worker_index());
  return BatchShare{.num_workers = workers,
                    .batch = global / workers + (w < global % workers ? 1 : 0),
                    .offset = w * (global / workers) + std::min(w, global % workers)};
}

std::optional<DynamicLossScale> LossScaleOf(const v1::JobSpec& spec,
                                            const v1::WorkerResumeState& resume) {
  if (spec.precision() != v1::PRECISION_FP16) return std::nullopt;
  const v1::LossScaleSpec& scale = spec.loss_scale();
  return DynamicLossScale(resume.loss_scale() > 0 ? resume.loss_scale() : scale.initial(),
                          scale.growth_steps(), resume.loss_scale_good_steps());
}

void SaveLossScale(const std::optional<DynamicLossScale>& scale, v1::WorkerResumeState* state) {
  if (!scale.has_value()) return;
  state->set_loss_scale(scale->scale());
  state->set_loss_scale_good_steps(scale->good_steps());
}

}  // namespace pstrain::worker
