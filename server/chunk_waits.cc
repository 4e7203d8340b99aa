#include "server/chunk_waits.h"

#include <utility>

#include "common/job_spec.h"

namespace pstrain::server {

ChunkWait PushWait(v1::Mode mode, int64_t staleness, const v1::ChunkHeader& request,
                   std::shared_ptr<ChunkWaiter> waiter) {
  const int64_t next = request.step() + 1;
  ChunkWait w{request, std::move(waiter)};
  w.min_clock = StepsAppliedBefore(next, staleness);
  w.own_clock = mode == v1::MODE_SYNC ? 0 : next;
  return w;
}

ChunkWait PullWait(const v1::ChunkHeader& request, std::shared_ptr<ChunkWaiter> waiter) {
  ChunkWait w{request, std::move(waiter)};
  w.min_version = request.version();
  w.min_clock = request.pushed_steps();
  return w;
}

WaitState StateOf(const ChunkWait& wait, int64_t version, int64_t own_clock,
                  int64_t slowest_clock) {
  if (version < wait.min_version || own_clock < wait.own_clock) return WaitState::kWaiting;
  return slowest_clock < wait.min_clock ? WaitState::kHeldBySlowest : WaitState::kAnswerable;
}

}  // namespace pstrain::server
