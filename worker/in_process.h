// Training in one process with no parameter server: the reference that the
// distributed sync mode must equal, and the baseline of the benchmarks.
#ifndef PSTRAIN_WORKER_IN_PROCESS_H_
#define PSTRAIN_WORKER_IN_PROCESS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/dataset.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::worker {

// Runs `steps` steps of `spec` as one process whose batch is the job's global
// batch (num_workers * batch_size), with the same sharding, initialisation
// and optimizer as the distributed job, and returns the parameters.
absl::StatusOr<std::vector<float>> TrainInProcess(const v1::JobSpec& spec, int64_t steps,
                                                  const Dataset& train);

struct Evaluation {
  double accuracy = 0;
  double loss = 0;  // mean cross-entropy
};

// Evaluates parameters of `spec`'s model (normalized) on `data`, exactly as
// worker 0 does at the end of a job.
absl::StatusOr<Evaluation> Evaluate(const v1::JobSpec& spec, const std::vector<float>& params,
                                    const Dataset& data);

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_IN_PROCESS_H_
