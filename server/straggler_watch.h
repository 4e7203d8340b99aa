// Sync, at the barrier of a job's first chunk on a server: how late each
// worker's push came after the step's values were out. A worker more than
// 3x the median of the others, 10 steps in a row, is a straggler: named
// once in the log, and in a gauge while it lasts.
#ifndef PSTRAIN_SERVER_STRAGGLER_WATCH_H_
#define PSTRAIN_SERVER_STRAGGLER_WATCH_H_

#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "prometheus/gauge.h"

namespace pstrain::server {

// Thread-safe.
class StragglerWatch {
 public:
  // Watches `num_workers` workers of job `job_id`.
  void Start(const std::string& job_id, int num_workers) ABSL_LOCKS_EXCLUDED(mu_);
  // Gauges by worker, set to 1 while the worker is a straggler.
  void SetGauges(std::vector<prometheus::Gauge*> gauges) ABSL_LOCKS_EXCLUDED(mu_);

  // One step: when its values were out (`opened`) and when each worker's
  // push arrived (by worker).
  void Observe(absl::Time opened, const std::vector<absl::Time>& arrived)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  std::string job_id_ ABSL_GUARDED_BY(mu_);
  std::vector<int> late_steps_ ABSL_GUARDED_BY(mu_);  // by worker, in a row
  std::vector<prometheus::Gauge*> gauges_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_STRAGGLER_WATCH_H_
