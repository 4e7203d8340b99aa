// What a worker of a job knows of its generations, the same for pool
// workers (worker_node.cc) and the client library (client.cc): what it
// tells the coordinator it holds, what a heartbeat's assignments say of the
// job it runs, its part of the global batch and its loss scale in a
// generation.
#ifndef PSTRAIN_WORKER_GENERATION_H_
#define PSTRAIN_WORKER_GENERATION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/membership.pb.h"
#include "worker/loss_scale.h"

namespace pstrain::worker {

// What a worker running `job_id` at `generation` holds (heartbeats say
// it): nothing before its first generation (0) or without a job.
std::vector<v1::HeldJob> HeldJobs(const std::string& job_id, int64_t generation);

// The assignment of `job_id` among a heartbeat's; null if there is none
// (the job ended here, or left this worker out).
const v1::WorkerAssignment* AssignmentOf(const v1::HeartbeatResponse& response,
                                         const std::string& job_id);

// This worker's part of the global batch in a generation: the global
// batch cut over the generation's workers, the first (global % workers)
// getting one sample more.
struct BatchShare {
  int num_workers = 0;
  int batch = 0;   // samples per step
  int offset = 0;  // where they start in the global batch
};
// INVALID_ARGUMENT if the assignment's worker is outside its workers, or
// it has more workers than the spec.
absl::StatusOr<BatchShare> BatchShareOf(const v1::JobSpec& spec, const v1::WorkerAssignment& a);

// precision fp16: the loss scale a generation starts from, where its first
// step left it (the resume state's) or the job's initial one; none for
// another precision.
std::optional<DynamicLossScale> LossScaleOf(const v1::JobSpec& spec,
                                            const v1::WorkerResumeState& resume);
// Keeps `scale`, if any, in a checkpoint's resume state.
void SaveLossScale(const std::optional<DynamicLossScale>& scale, v1::WorkerResumeState* state);

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_GENERATION_H_
