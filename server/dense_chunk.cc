#include "server/dense_chunk.h"

#include <algorithm>
#include <atomic>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "kernels/cpu/cpu_kernels.h"

namespace pstrain::server {
namespace {

// The published values of the chunk, as replies carry them.
ChunkValues Published(const DenseChunk& chunk, v1::DType wire_dtype)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (chunk.wire_values == nullptr) {
    return ChunkValues{chunk.version, v1::DTYPE_FP32, chunk.values->data(), chunk.size,
                       chunk.values};
  }
  return ChunkValues{chunk.version, wire_dtype, chunk.wire_values->data(), chunk.size,
                     chunk.wire_values};
}

// A buffer for the next version: `spare` if no reply holds it any more,
// else a new one (replies of two versions still in flight).
template <typename T>
std::shared_ptr<std::vector<T>> TakeSpare(std::shared_ptr<std::vector<T>>& spare, int64_t size) {
  if (spare != nullptr && spare.use_count() == 1) {
    // The last reply let go of it on another thread: see its reads first.
    std::atomic_thread_fence(std::memory_order_acquire);
    return std::move(spare);
  }
  return std::make_shared<std::vector<T>>(size);
}

// True if no reply holds `buffer` any more, so it may be written.
template <typename T>
bool Unshared(const std::shared_ptr<std::vector<T>>& buffer) {
  if (buffer.use_count() != 1) return false;
  std::atomic_thread_fence(std::memory_order_acquire);  // as in TakeSpare
  return true;
}

// Writes the update of `step` (version+1) from the chunk's values to
// `new_params`, with the optimizer state at `state`: the sum of `grads` at
// the rate the job's schedule gives `step`.
absl::Status ApplySum(const ShardJob& job, DenseChunk& chunk,
                      absl::Span<const Frame* const> grads, int64_t step, float* new_params,
                      float* state, ApplyPool* pool, bool check_sum = false)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (chunk.buffer) {
    // Worker 0's values, bit for bit; another worker's push leaves them.
    const auto from_worker0 = std::find_if(grads.begin(), grads.end(), [](const Frame* f) {
      return f->header().worker() == 0;
    });
    if (from_worker0 == grads.end()) {
      if (new_params != chunk.values->data()) {
        std::copy(chunk.values->begin(), chunk.values->end(), new_params);
      }
    } else {
      (*from_worker0)->ReadValues(0, chunk.size, new_params);
    }
    return absl::OkStatus();
  }
  kernels::OptimizerSpan span;
  span.params = chunk.values->data();
  span.new_params = new_params;
  span.state = state;
  span.state_stride = chunk.size;
  span.n = chunk.size;
  span.learning_rate =
      static_cast<float>(LearningRateAt(job.optimizer_spec, step, job.total_steps));
  if (chunk.metrics != nullptr) chunk.metrics->learning_rate->Set(span.learning_rate);
  return SumAndApply(*job.optimizer, grads, span, chunk.version + 1, pool, check_sum);
}

// Makes `next` the values of version+1 (the current ones become the
// spare, unless `next` is them) and casts them for a 16-bit wire.
void Publish(const ShardJob& job, DenseChunk& chunk,
             std::shared_ptr<std::vector<float>> next) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (next != chunk.values) {
    chunk.spare = std::move(chunk.values);
    chunk.values = std::move(next);
  }
  if (chunk.wire_values != nullptr) {
    if (!Unshared(chunk.wire_values)) {
      std::shared_ptr<std::vector<uint16_t>> wire = TakeSpare(chunk.wire_spare, chunk.size);
      chunk.wire_spare = std::move(chunk.wire_values);
      chunk.wire_values = std::move(wire);
    }
    CastForTheWire(chunk, job.wire_dtype);
  }
  ++chunk.version;
}

// Sync: computes the update of step `version` from `grads` into the staged
// buffers, leaving the published values and state as they are (a pull may
// still read them, and a skipped step keeps them). With `check_sum` the
// sum is checked as it is applied (OUT_OF_RANGE if it is not finite): for
// frames borrowed from a peer's memory, read once, into the server's own
// tiles, and checked there.
absl::Status StageUpdate(const ShardJob& job, DenseChunk& chunk,
                         absl::Span<const Frame* const> grads, ApplyPool* pool, bool check_sum)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  const absl::Time start = MonotonicNow();
  std::shared_ptr<std::vector<float>> next = TakeSpare(chunk.spare, chunk.size);
  chunk.staged_state = chunk.optimizer_state;
  absl::Status s = ApplySum(job, chunk, grads, chunk.version, next->data(),
                            chunk.staged_state.data(), pool, check_sum);
  if (!s.ok()) {
    chunk.spare = std::move(next);
    return s;
  }
  chunk.staged_values = std::move(next);
  chunk.staged_seconds = absl::ToDoubleSeconds(MonotonicNow() - start);
  return absl::OkStatus();
}

}  // namespace

void AnswerWaits(DenseChunk& chunk, v1::DType wire_dtype) {
  if (chunk.waiting.empty()) return;
  std::vector<ChunkWait> still;
  const ChunkValues values = Published(chunk, wire_dtype);
  const int64_t slowest = *std::min_element(chunk.clock.begin(), chunk.clock.end());
  std::optional<absl::Time> now;
  const auto time_now = [&now] {
    if (!now.has_value()) now = MonotonicNow();
    return *now;
  };
  for (ChunkWait& w : chunk.waiting) {
    if (w.waiter->Abandoned()) continue;
    const WaitState state =
        StateOf(w, chunk.version, chunk.clock[w.request.worker()], slowest);
    if (state != WaitState::kAnswerable) {
      if (state == WaitState::kHeldBySlowest && w.held_since == absl::InfiniteFuture()) {
        w.held_since = time_now();
      }
      still.push_back(std::move(w));
      continue;
    }
    w.waiter->OnValues(w.request, values);
    const ServerMetrics::Job* metrics = chunk.metrics;
    if (metrics == nullptr) continue;
    metrics->sent_bytes->Increment(static_cast<double>(chunk.size) * DTypeBytes(values.dtype));
    if (chunk.measures_steps && w.request.kind() == v1::FRAME_KIND_PUSH) {
      // The steps of the slowest worker missing from the values the
      // worker computes its next step from, and how long it waited for them.
      metrics->step_staleness->Observe(
          static_cast<double>(std::max<int64_t>(0, w.request.step() + 1 - slowest)));
      metrics->slowest_wait->Observe(
          w.held_since == absl::InfiniteFuture()
              ? 0.0
              : absl::ToDoubleSeconds(time_now() - w.held_since));
    }
  }
  chunk.waiting = std::move(still);
}

void CastForTheWire(DenseChunk& chunk, v1::DType wire_dtype) {
  if (wire_dtype == v1::DTYPE_BF16) {
    kernels::CastToBf16(chunk.values->data(), chunk.wire_values->data(), chunk.size);
  } else {
    kernels::CastToFp16(chunk.values->data(), chunk.wire_values->data(), chunk.size);
  }
}

void SkipUpdate(ShardJob& job, DenseChunk& chunk, absl::string_view why) {
  ++chunk.version;
  if (chunk.metrics != nullptr) chunk.metrics->skipped->Increment();
  if (++chunk.skipped_in_a_row < job.max_skipped) return;
  absl::MutexLock lock(&job.error_mu);
  if (job.error.empty()) {
    job.error = absl::StrCat(chunk.skipped_in_a_row, " steps in a row were skipped ",
                             "(max_skipped_steps) because a gradient had a NaN or an infinity; ",
                             "the last, at version ", chunk.version - 1, ": ", why);
  }
}

std::string SyncSkipReason(const ShardJob& job, const DenseChunk& chunk) {
  double bound = 0;
  for (uint32_t w = 0; w < job.num_workers; ++w) {
    if (!(job.ended_max_abs[w] < kMaxGradientBound)) {
      return absl::StrCat("worker ", w, "'s gradient of step ", chunk.version,
                          " had a NaN or an infinity");
    }
    bound += job.ended_max_abs[w];
  }
  if (!(bound < kMaxGradientBound)) {
    return absl::StrCat("the workers' gradients of step ", chunk.version,
                        " could overflow fp32 when summed");
  }
  if (!(chunk.gradient_bound < kMaxGradientBound)) {
    return absl::StrCat("a push of step ", chunk.version, " to chunk ", chunk.id,
                        " exceeds its worker's step end");
  }
  return "";
}

absl::Status Update(const ShardJob& job, DenseChunk& chunk,
                    absl::Span<const Frame* const> grads, int64_t step, ApplyPool* pool) {
  std::shared_ptr<std::vector<float>> next =
      Unshared(chunk.values) ? chunk.values : TakeSpare(chunk.spare, chunk.size);
  PSTRAIN_RETURN_IF_ERROR(
      ApplySum(job, chunk, grads, step, next->data(), chunk.optimizer_state.data(), pool));
  Publish(job, chunk, std::move(next));
  return absl::OkStatus();
}

absl::Status StageOrSkip(const ShardJob& job, DenseChunk& chunk,
                         absl::Span<const Frame* const> grads, ApplyPool* pool,
                         bool payload_borrowed, std::string* skip_reason) {
  absl::Status s = StageUpdate(job, chunk, grads, pool, /*check_sum=*/payload_borrowed);
  if (s.ok() || !payload_borrowed) return s;
  chunk.gradient_bound = std::numeric_limits<double>::infinity();
  *skip_reason = absl::StrCat("the update of chunk ", chunk.id, " at step ", chunk.version,
                              " failed: ", s.message());
  return absl::OkStatus();
}

void CommitStaged(const ShardJob& job, DenseChunk& chunk) {
  chunk.optimizer_state.swap(chunk.staged_state);
  Publish(job, chunk, std::move(chunk.staged_values));
  chunk.staged_values = nullptr;
}

void DropStaged(DenseChunk& chunk) {
  if (chunk.staged_values != nullptr) chunk.spare = std::move(chunk.staged_values);
  chunk.staged_values = nullptr;
}

void WaitAndAnswer(DenseChunk& chunk, v1::DType wire_dtype, ChunkWait wait) {
  if (wait.waiter != nullptr) chunk.waiting.push_back(std::move(wait));
  AnswerWaits(chunk, wire_dtype);
}

void AbortWaits(DenseChunk& chunk, const absl::Status& status) {
  for (ChunkWait& w : chunk.waiting) w.waiter->OnAbort(status);
  chunk.waiting.clear();
}

void Close(DenseChunk& chunk, const absl::Status& status) {
  absl::MutexLock lock(&chunk.mu);
  chunk.closed = status;
  AbortWaits(chunk, status);
}

}  // namespace pstrain::server
