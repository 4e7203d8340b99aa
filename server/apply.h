// The server's update of one chunk: the workers' gradients summed straight
// from the frames they arrived in, tile by tile, each tile applied by the
// optimizer while it is still in cache; large chunks split over threads.
#ifndef PSTRAIN_SERVER_APPLY_H_
#define PSTRAIN_SERVER_APPLY_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/chunk_codec.h"
#include "kernels/model.h"

namespace pstrain::server {

// Threads that share the update of large chunks.
class ApplyPool {
 public:
  // No thread gets fewer floats than this (1 MiB): below it, handing work
  // over costs more than it saves.
  static constexpr int64_t kMinFloatsPerThread = 1 << 18;

  // `threads` in all, the calling thread included (threads - 1 are started).
  explicit ApplyPool(int threads);
  ~ApplyPool();

  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

  // Runs fn(0) .. fn(parts - 1), part 0 on the calling thread, and returns
  // when all have. Thread-safe.
  void Run(int parts, const std::function<void(int)>& fn);

 private:
  void HelperLoop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> helpers_;
};

// One update of span.n parameters: the gradient is the sum, in the order
// given, of values [0, span.n) of each frame (none: zero); span.grad is
// ignored. Per element the same floats are added in the same order however
// the work is split, so the result does not depend on `pool` (may be null).
// With `check_sum`, each tile of the sum is checked, in this process's own
// memory, before the optimizer reads it: OUT_OF_RANGE if it holds a NaN or
// an infinity (span.new_params then partly written; for updates out of
// place, from frames whose memory a peer could change after a check of
// its own).
absl::Status SumAndApply(const kernels::Optimizer& optimizer, absl::Span<const Frame* const> grads,
                         const kernels::OptimizerSpan& span, int64_t update_count,
                         ApplyPool* pool, bool check_sum = false);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_APPLY_H_
