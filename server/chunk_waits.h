// The waits for a chunk's values, and the one predicate that answers them
// in every mode. A chunk keeps a clock per worker: the worker's steps
// applied to it (sync applies a step of every worker at once, so each is
// the chunk's version; async and SSP, one past the worker's last step
// applied). A push of step t waits for the values step t+1 is computed
// from: every worker's steps up to t - staleness applied, and in async and
// SSP the push itself. Sync is staleness 0, async staleness infinite: one
// rule, three modes (common/job_spec.h, StalenessOf). A pull waits for a
// version and a number of every worker's steps.
#ifndef PSTRAIN_SERVER_CHUNK_WAITS_H_
#define PSTRAIN_SERVER_CHUNK_WAITS_H_

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "pstrain/v1/job.pb.h"
#include "pstrain/v1/parameters.pb.h"

namespace pstrain::server {

// One version of a chunk's values as replies carry them: in the job's wire
// dtype, immutable, kept alive by `owner` for as long as any reply holds it.
struct ChunkValues {
  int64_t version = 0;
  v1::DType dtype = v1::DTYPE_FP32;
  const void* data = nullptr;
  int64_t num_values = 0;
  std::shared_ptr<const void> owner;
};

// Receives the values a push or pull asked for. Implemented by each stream.
class ChunkWaiter {
 public:
  virtual ~ChunkWaiter() = default;
  // The values of chunk `request.chunk()`. Called with the chunk's lock
  // held, from whichever thread completed the step: reference the values
  // (they do not change), do not block, do not call back into the store.
  virtual void OnValues(const v1::ChunkHeader& request, const ChunkValues& values) = 0;
  // The wait can never be answered (job removed, server shutting down).
  virtual void OnAbort(const absl::Status& status) = 0;
  // True once the stream is gone; lets the store drop its waits early.
  virtual bool Abandoned() const = 0;
};

// A push or pull waiting for its values: answered once the chunk is at
// min_version, every worker's clock at min_clock, and the request's
// worker's own at own_clock.
struct ChunkWait {
  v1::ChunkHeader request;
  std::shared_ptr<ChunkWaiter> waiter;
  int64_t min_version = 0;
  int64_t min_clock = 0;
  int64_t own_clock = 0;
  // Since when only other workers' clocks hold it back (InfiniteFuture:
  // not yet): the wait for the slowest worker.
  absl::Time held_since = absl::InfiniteFuture();
};

// The wait of a push of step request.step() in a job of `mode` and
// `staleness` (StalenessOf).
ChunkWait PushWait(v1::Mode mode, int64_t staleness, const v1::ChunkHeader& request,
                   std::shared_ptr<ChunkWaiter> waiter);
// The wait of a pull: request.version() and request.pushed_steps() of
// every worker.
ChunkWait PullWait(const v1::ChunkHeader& request, std::shared_ptr<ChunkWaiter> waiter);

enum class WaitState {
  kWaiting,         // the chunk's version or the worker's own clock is behind
  kHeldBySlowest,   // only other workers' clocks hold it back
  kAnswerable,
};
// Where a wait stands with a chunk at `version` whose clock of the
// request's worker is `own_clock` and whose slowest worker's is
// `slowest_clock`.
WaitState StateOf(const ChunkWait& wait, int64_t version, int64_t own_clock,
                  int64_t slowest_clock);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_CHUNK_WAITS_H_
