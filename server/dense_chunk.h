// The update of one dense chunk (shard_job.h): the workers' gradients
// summed in worker order and applied by the optimizer, in place or into a
// spare buffer while replies still hold the published values; sync updates
// staged ahead of the step ends and published or dropped by them; updates
// skipped for gradients with a NaN or an infinity; the 16-bit casts for the
// wire; and the waits for the chunk's values answered (chunk_waits.h).
// Every function but Close is called with the chunk's lock held.
#ifndef PSTRAIN_SERVER_DENSE_CHUNK_H_
#define PSTRAIN_SERVER_DENSE_CHUNK_H_

#include <limits>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/chunk_codec.h"
#include "server/apply.h"
#include "server/chunk_waits.h"
#include "server/shard_job.h"

namespace pstrain::server {

// A gradient (sync: the sum over the workers) whose values could reach this
// magnitude is not applied, as one with a NaN or an infinity: fp32 ends at
// 3.4e38, and the margin covers the rounding of the sum.
inline constexpr double kMaxGradientBound = std::numeric_limits<float>::max() / 2;

// Answers every wait the chunk's version and clocks satisfy; drops
// abandoned ones.
void AnswerWaits(DenseChunk& chunk, v1::DType wire_dtype)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Writes the chunk's values in the 16-bit wire dtype into wire_values.
void CastForTheWire(DenseChunk& chunk, v1::DType wire_dtype)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Publishes version+1 with the values of version: the update whose
// gradients had a NaN or an infinity (`why`), which none of them reaches.
// Fails the job once the chunk has skipped max_skipped steps in a row.
void SkipUpdate(ShardJob& job, DenseChunk& chunk, absl::string_view why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Sync: why the update of the chunk's open step must be skipped, or empty
// if it may be applied; the workers' step ends of that step are all in.
// Every server decides the same from the same step ends; the chunk's own
// pushes are checked too, in case a worker's step end understated them.
std::string SyncSkipReason(const ShardJob& job, const DenseChunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu, job.step_end_mu);

// Applies the sum of `grads`, the gradient of `step`, as update version+1
// and publishes it: in place when no reply holds the current values, else
// into the spare buffer.
absl::Status Update(const ShardJob& job, DenseChunk& chunk,
                    absl::Span<const Frame* const> grads, int64_t step, ApplyPool* pool)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Sync: computes the update of step `version` from `grads` into the staged
// buffers, leaving the published values and state as they are (a pull may
// still read them, and a skipped step keeps them). When a push's payload is
// borrowed (used now or never) the sum is checked, and a failure (a sum
// that is not finite, or any other) marks the step to be skipped
// (*skip_reason says why) instead.
absl::Status StageOrSkip(const ShardJob& job, DenseChunk& chunk,
                         absl::Span<const Frame* const> grads, ApplyPool* pool,
                         bool payload_borrowed, std::string* skip_reason)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Publishes the staged update as version+1.
void CommitStaged(const ShardJob& job, DenseChunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Forgets a staged update (its buffer becomes the spare).
void DropStaged(DenseChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Adds a wait (if any) and answers every wait the chunk now satisfies.
void WaitAndAnswer(DenseChunk& chunk, v1::DType wire_dtype, ChunkWait wait)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Ends the chunk's open waits with `status`, keeping the chunk open.
void AbortWaits(DenseChunk& chunk, const absl::Status& status)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// Ends the chunk's waits with `status` and refuses later requests.
void Close(DenseChunk& chunk, const absl::Status& status);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_DENSE_CHUNK_H_
