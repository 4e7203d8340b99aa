#include "server/shard_store.h"

#include <algorithm>
#include <cmath>
#include <atomic>
#include <limits>
#include <map>
#include <optional>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/files.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "server/apply.h"
#include "server/checkpoint.h"

namespace pstrain::server {

namespace {

// A push or pull waiting for its values: answered once the chunk is at
// min_version, every worker's clock (steps applied) at min_clock, and the
// request's worker's own at own_clock.
struct Waiting {
  v1::ChunkHeader request;
  std::shared_ptr<ChunkWaiter> waiter;
  int64_t min_version = 0;
  int64_t min_clock = 0;
  int64_t own_clock = 0;
  // Since when only other workers' clocks hold it back (InfiniteFuture:
  // not yet): the wait for the slowest worker.
  absl::Time held_since = absl::InfiniteFuture();
};

// A checkpoint being gathered: a copy of each chunk as it passes the step.
struct Gathering {
  ServerCheckpoint checkpoint;
  std::map<uint32_t, ChunkCheckpoint> chunks;
  double copy_seconds = 0;  // the copies' time, which the step waited for
};

}  // namespace

// A gradient (sync: the sum over the workers) whose values could reach this
// magnitude is not applied, as one with a NaN or an infinity: fp32 ends at
// 3.4e38, and the margin covers the rounding of the sum.
constexpr double kMaxGradientBound = std::numeric_limits<float>::max() / 2;

struct ShardStore::Chunk {
  absl::Mutex mu;
  uint32_t id = 0;
  int64_t size = 0;  // floats
  const ServerMetrics::Job* metrics = nullptr;  // the job's series, if measured
  absl::Time step_started ABSL_GUARDED_BY(mu);  // sync: first push of the open step
  int64_t version ABSL_GUARDED_BY(mu) = 0;  // updates applied
  // The values of `version`. Replies reference the buffer instead of
  // copying it, so it is never written while one holds it: the update goes
  // to `spare` then, and the two swap.
  std::shared_ptr<std::vector<float>> values ABSL_GUARDED_BY(mu);
  std::shared_ptr<std::vector<float>> spare ABSL_GUARDED_BY(mu);
  // The values cast to the job's 16-bit wire dtype, and its spare; null
  // when the wire carries fp32.
  std::shared_ptr<std::vector<uint16_t>> wire_values ABSL_GUARDED_BY(mu);
  std::shared_ptr<std::vector<uint16_t>> wire_spare ABSL_GUARDED_BY(mu);
  std::vector<float> optimizer_state ABSL_GUARDED_BY(mu);
  // Sync: the update of step `version`, computed as soon as every worker's
  // push of it is in, ahead of their step ends — version+1's values and
  // optimizer state (staged_values null: none). The step ends publish it,
  // or drop it when the step is skipped: the update is the one they would
  // compute, from the same pushes, so results do not change.
  std::shared_ptr<std::vector<float>> staged_values ABSL_GUARDED_BY(mu);
  std::vector<float> staged_state ABSL_GUARDED_BY(mu);
  double staged_seconds ABSL_GUARDED_BY(mu) = 0;  // the staging's apply time
  // The received pushes not applied yet, by worker (their received slices,
  // not copies). Sync: those of step `version`. Async: each worker's push
  // of a step whose step end has not arrived.
  std::vector<std::optional<Frame>> pushed ABSL_GUARDED_BY(mu);
  int received_count ABSL_GUARDED_BY(mu) = 0;  // sync
  // Sync: the sum over the pushes of step `version` of their largest
  // magnitude, which bounds every summed value: a second check beside the
  // workers' step ends. Both modes: updates skipped in a row.
  double gradient_bound ABSL_GUARDED_BY(mu) = 0;
  int skipped_in_a_row ABSL_GUARDED_BY(mu) = 0;
  // Each worker's clock: its steps applied to the chunk (sync applies a
  // step of every worker at once: each is `version`; async and ssp: one
  // past the worker's last step applied in this generation, 0 for none).
  // The waits for values are conditions on them.
  std::vector<int64_t> clock ABSL_GUARDED_BY(mu);
  // The server's lowest chunk measures the staleness and waits of the
  // workers' steps (once per worker and step).
  bool measures_steps = false;
  // Sync: when the open step's values were published, and when each
  // worker's push of it arrived (stragglers).
  absl::Time opened ABSL_GUARDED_BY(mu);
  std::vector<absl::Time> arrived ABSL_GUARDED_BY(mu);
  std::vector<Waiting> waiting ABSL_GUARDED_BY(mu);
  // External models: the chunk waits for its initial values (INIT).
  bool awaiting_init ABSL_GUARDED_BY(mu) = false;
  // Not OK once the job is removed or the server shuts down: later requests
  // that found the chunk before that get this error instead of waiting.
  absl::Status closed ABSL_GUARDED_BY(mu);
};

struct ShardStore::Job {
  std::string id;
  int64_t bytes = 0;  // BytesNeeded
  ServerMetrics::Job metrics{};  // bound if the store is measured
  v1::Mode mode = v1::MODE_SYNC;
  int64_t staleness = 0;  // StalenessOf: how far a push's reply waits for the others
  v1::DType wire_dtype = v1::DTYPE_FP32;
  uint32_t num_workers = 0;  // of the generation
  uint32_t server_index = 0;
  uint32_t num_servers = 0;
  int64_t total_floats = 0;
  std::atomic<int64_t> generation{0};
  std::unique_ptr<kernels::Optimizer> optimizer;
  v1::OptimizerSpec optimizer_spec;  // its rate by step: LearningRateAt
  int64_t total_steps = 0;
  // By chunk id; null for chunks owned by other servers.
  std::vector<std::unique_ptr<Chunk>> chunks;
  int owned_chunks = 0;
  uint32_t first_chunk = 0;  // the lowest owned: where stragglers are watched
  // External models: the initial values come from worker 0 (INIT frames);
  // until every owned chunk has them, the job's requests are UNAVAILABLE.
  bool external = false;
  bool restored = false;  // Restore loaded a checkpoint
  std::atomic<int> chunks_awaiting_init{0};

  // Checkpoints; dir empty: none.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int keep = 0;
  std::atomic<int64_t> requested_step{0};
  absl::Mutex checkpoint_mu;
  std::map<int64_t, Gathering> gathering ABSL_GUARDED_BY(checkpoint_mu);  // by step
  std::vector<v1::CheckpointRecord> written ABSL_GUARDED_BY(checkpoint_mu);  // oldest first
  std::vector<v1::CheckpointRecord> retained ABSL_GUARDED_BY(checkpoint_mu);

  // Each worker's last step end (-1: none) and the bound it gave for its
  // gradient (STEP_END). Sync: a step end is accepted only once every chunk
  // here has applied the step before, so while a chunk waits at version v
  // the entries are those of step v.
  absl::Mutex step_end_mu;
  std::vector<int64_t> ended_step ABSL_GUARDED_BY(step_end_mu);
  std::vector<float> ended_max_abs ABSL_GUARDED_BY(step_end_mu);

  // A chunk that skips this many steps in a row fails the job, with
  // `error` (reported to the coordinator).
  int max_skipped = 10;
  absl::Mutex error_mu;
  std::string error ABSL_GUARDED_BY(error_mu);

  // Sync: workers that reach the barrier late, step after step.
  absl::Mutex straggler_mu;
  std::vector<int> late_steps ABSL_GUARDED_BY(straggler_mu);  // by worker, in a row
  std::vector<prometheus::Gauge*> straggler_gauges ABSL_GUARDED_BY(straggler_mu);
};

namespace {

// The published values of the chunk, as replies carry them.
ChunkValues Published(const ShardStore::Chunk& chunk, v1::DType wire_dtype)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (chunk.wire_values == nullptr) {
    return ChunkValues{chunk.version, v1::DTYPE_FP32, chunk.values->data(), chunk.size,
                       chunk.values};
  }
  return ChunkValues{chunk.version, wire_dtype, chunk.wire_values->data(), chunk.size,
                     chunk.wire_values};
}

// Answers every wait the chunk's version and clocks satisfy; drops
// abandoned ones.
void AnswerWaits(ShardStore::Chunk& chunk, v1::DType wire_dtype)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (chunk.waiting.empty()) return;
  std::vector<Waiting> still;
  const ChunkValues values = Published(chunk, wire_dtype);
  const int64_t slowest = *std::min_element(chunk.clock.begin(), chunk.clock.end());
  std::optional<absl::Time> now;
  const auto time_now = [&now] {
    if (!now.has_value()) now = MonotonicNow();
    return *now;
  };
  for (Waiting& w : chunk.waiting) {
    if (w.waiter->Abandoned()) continue;
    const bool own =
        chunk.version >= w.min_version && chunk.clock[w.request.worker()] >= w.own_clock;
    if (!own || slowest < w.min_clock) {
      if (own && w.held_since == absl::InfiniteFuture()) w.held_since = time_now();
      still.push_back(std::move(w));
      continue;
    }
    w.waiter->OnValues(w.request, values);
    const ServerMetrics::Job* metrics = chunk.metrics;
    if (metrics == nullptr) continue;
    metrics->sent_bytes->Increment(static_cast<double>(chunk.size) * DTypeBytes(wire_dtype));
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

// Writes the chunk's values in the 16-bit wire dtype into wire_values.
void CastForTheWire(ShardStore::Chunk& chunk, v1::DType wire_dtype)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (wire_dtype == v1::DTYPE_BF16) {
    kernels::CastToBf16(chunk.values->data(), chunk.wire_values->data(), chunk.size);
  } else {
    kernels::CastToFp16(chunk.values->data(), chunk.wire_values->data(), chunk.size);
  }
}

// Publishes version+1 with the values of version: the update whose
// gradients had a NaN or an infinity (`why`), which none of them reaches.
// Fails the job once the chunk has skipped max_skipped steps in a row.
void SkipUpdate(ShardStore::Job& job, ShardStore::Chunk& chunk, absl::string_view why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
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

// Sync: why the update of the chunk's open step must be skipped, or empty
// if it may be applied; the workers' step ends of that step are all in.
// Every server decides the same from the same step ends; the chunk's own
// pushes are checked too, in case a worker's step end understated them.
std::string SyncSkipReason(const ShardStore::Job& job, const ShardStore::Chunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu, job.step_end_mu) {
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

// Writes the update of `step` (version+1) from the chunk's values to
// `new_params`, with the optimizer state at `state`: the sum of `grads` at
// the rate the job's schedule gives `step`.
absl::Status ApplySum(const ShardStore::Job& job, ShardStore::Chunk& chunk,
                      absl::Span<const Frame* const> grads, int64_t step, float* new_params,
                      float* state, ApplyPool* pool, bool check_sum = false)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
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
void Publish(const ShardStore::Job& job, ShardStore::Chunk& chunk,
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

// Applies the sum of `grads`, the gradient of `step`, as update version+1
// and publishes it: in place when no reply holds the current values, else
// into the spare buffer.
absl::Status Update(const ShardStore::Job& job, ShardStore::Chunk& chunk,
                    absl::Span<const Frame* const> grads, int64_t step, ApplyPool* pool)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  std::shared_ptr<std::vector<float>> next =
      Unshared(chunk.values) ? chunk.values : TakeSpare(chunk.spare, chunk.size);
  PSTRAIN_RETURN_IF_ERROR(
      ApplySum(job, chunk, grads, step, next->data(), chunk.optimizer_state.data(), pool));
  Publish(job, chunk, std::move(next));
  return absl::OkStatus();
}

// Sync: computes the update of step `version` from `grads` into the staged
// buffers, leaving the published values and state as they are (a pull may
// still read them, and a skipped step keeps them). With `check_sum` the
// sum is checked as it is applied (OUT_OF_RANGE if it is not finite): for
// frames borrowed from a peer's memory, read once, into the server's own
// tiles, and checked there.
absl::Status StageUpdate(const ShardStore::Job& job, ShardStore::Chunk& chunk,
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

// StageUpdate; when a push's payload is borrowed (used now or never), the
// sum is checked, and a failure (a sum that is not finite, or any other)
// marks the step to be skipped (*skip_reason says why) instead.
absl::Status StageOrSkip(const ShardStore::Job& job, ShardStore::Chunk& chunk,
                         absl::Span<const Frame* const> grads, ApplyPool* pool,
                         bool payload_borrowed, std::string* skip_reason)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  absl::Status s = StageUpdate(job, chunk, grads, pool, /*check_sum=*/payload_borrowed);
  if (s.ok() || !payload_borrowed) return s;
  chunk.gradient_bound = std::numeric_limits<double>::infinity();
  *skip_reason = absl::StrCat("the update of chunk ", chunk.id, " at step ", chunk.version,
                              " failed: ", s.message());
  return absl::OkStatus();
}

// Publishes the staged update as version+1.
void CommitStaged(const ShardStore::Job& job, ShardStore::Chunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  chunk.optimizer_state.swap(chunk.staged_state);
  Publish(job, chunk, std::move(chunk.staged_values));
  chunk.staged_values = nullptr;
}

// Forgets a staged update (its buffer becomes the spare).
void DropStaged(ShardStore::Chunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (chunk.staged_values != nullptr) chunk.spare = std::move(chunk.staged_values);
  chunk.staged_values = nullptr;
}

// Adds a wait (if any) and answers every wait the chunk now satisfies.
void WaitAndAnswer(ShardStore::Chunk& chunk, v1::DType wire_dtype, Waiting wait)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (wait.waiter != nullptr) chunk.waiting.push_back(std::move(wait));
  AnswerWaits(chunk, wire_dtype);
}

// The wait of a push of step t: for the values step t+1 is computed from.
// Every worker's steps <= t - staleness applied (sync: staleness 0, and the
// step is applied for all workers at once), and async and ssp, the push.
Waiting PushWait(const ShardStore::Job& job, const v1::ChunkHeader& request,
                 std::shared_ptr<ChunkWaiter> waiter) {
  const int64_t next = request.step() + 1;
  Waiting w{request, std::move(waiter)};
  w.min_clock = StepsAppliedBefore(next, job.staleness);
  w.own_clock = job.mode == v1::MODE_SYNC ? 0 : next;
  return w;
}

// Ends the chunk's open waits with `status`, keeping the chunk open.
void AbortWaits(ShardStore::Chunk& chunk, const absl::Status& status)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  for (Waiting& w : chunk.waiting) w.waiter->OnAbort(status);
  chunk.waiting.clear();
}

// Ends the chunk's waits with `status` and refuses later requests.
void Close(ShardStore::Chunk& chunk, const absl::Status& status) {
  absl::MutexLock lock(&chunk.mu);
  chunk.closed = status;
  AbortWaits(chunk, status);
}

// The step a checkpoint taken at the chunk's current version belongs to,
// if the version is a checkpoint step of the job; else -1. Sync: versions
// are steps. Async: every worker's push is a version; a checkpoint every
// every_steps steps of all workers.
int64_t CheckpointStepOf(const ShardStore::Job& job, int64_t version) {
  if (job.checkpoint_dir.empty() || version <= 0) return -1;
  if (job.mode == v1::MODE_SYNC) {
    return version % job.checkpoint_every == 0 || version == job.requested_step ? version : -1;
  }
  const int64_t per_checkpoint = job.checkpoint_every * job.num_workers;
  return version % per_checkpoint == 0 ? version / job.num_workers : -1;
}

}  // namespace

ShardStore::ShardStore(Options options)
    : options_(options),
      fs_(options.fs != nullptr ? options.fs : PosixFileSystem()),
      apply_pool_(std::make_unique<ApplyPool>(std::max(1, options.apply_threads))),
      writer_(std::make_unique<CheckpointWriter>(fs_)) {}

ShardStore::~ShardStore() {
  Shutdown();
  writer_.reset();  // writes what is queued: its callbacks use the jobs, not the store
}

int64_t ShardStore::BytesNeeded(const v1::JobSpec& spec, const v1::PartitionPlan& plan,
                                uint32_t server) {
  absl::StatusOr<std::unique_ptr<kernels::Optimizer>> optimizer =
      kernels::CreateCpuOptimizer(OptimizerConfigOf(spec.optimizer()));
  const int64_t state = optimizer.ok() ? (*optimizer)->StateFloatsPerParam() : 2;
  // fp32 values (two buffers for an fp32 wire; one, and two 16-bit casts,
  // for a 16-bit one), the optimizer state (sync: twice, with the staged
  // update's), and a push of each worker as received (sync: of the open
  // step; async: waiting for its step end).
  const bool wire16 = DTypeBytes(spec.wire_dtype()) == 2;  // unspecified: fp32
  const int64_t value_bytes = wire16 ? 2 : 4;
  const int64_t states = spec.mode() == v1::MODE_SYNC ? 2 : 1;
  const int64_t bytes_per_param = 4 * ((wire16 ? 1 : 2) + states * state) +
                                  (wire16 ? 2 * 2 : 0) + spec.num_workers() * value_bytes;
  int64_t floats = 0;
  for (const v1::ChunkInfo& c : plan.chunks()) {
    if (c.server() == server) floats += c.size();
  }
  return floats * bytes_per_param;
}

void ShardStore::UpdateGauges() {
  if (options_.metrics == nullptr) return;
  int64_t bytes = 0;
  for (const auto& [id, job] : jobs_) bytes += job->bytes;
  options_.metrics->held_bytes->Set(static_cast<double>(bytes));
  options_.metrics->jobs->Set(static_cast<double>(jobs_.size()));
}

int64_t ShardStore::HeldBytes() const {
  absl::MutexLock lock(&mu_);
  int64_t bytes = 0;
  for (const auto& [id, job] : jobs_) bytes += job->bytes;
  return bytes;
}

absl::Status ShardStore::AddJob(const v1::ServerAssignment& a) {
  {
    absl::MutexLock lock(&mu_);
    if (jobs_.contains(a.job_id())) {
      return absl::AlreadyExistsError(absl::StrCat("job ", a.job_id(), " is already held"));
    }
  }
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, NormalizeJobSpec(a.spec()));
  const v1::PartitionPlan& plan = a.plan();
  PSTRAIN_RETURN_IF_ERROR(ValidatePartitionPlan(plan, NumParamsOf(spec)));
  if (a.server_index() >= plan.num_servers()) {
    return absl::InvalidArgumentError("server_index outside the plan");
  }
  if (a.num_workers() > static_cast<uint32_t>(spec.num_workers())) {
    return absl::InvalidArgumentError("num_workers above the spec's");
  }
  if (!spec.checkpoint().dir().empty()) {
    PSTRAIN_RETURN_IF_ERROR(CheckPathWithin("checkpoint.dir", spec.checkpoint().dir(),
                                            "--checkpoint_root", options_.checkpoint_root));
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<kernels::Optimizer> optimizer,
                           kernels::CreateCpuOptimizer(OptimizerConfigOf(spec.optimizer())));

  const int64_t bytes = BytesNeeded(spec, plan, a.server_index());
  if (options_.max_memory_bytes > 0 && HeldBytes() + bytes > options_.max_memory_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job ", a.job_id(), " needs ", bytes, " bytes; ", HeldBytes(), " of ",
                     options_.max_memory_bytes, " are in use"));
  }
  auto job = std::make_shared<Job>();
  job->id = a.job_id();
  job->bytes = bytes;
  job->mode = spec.mode();
  job->staleness = StalenessOf(spec);
  job->wire_dtype = spec.wire_dtype();
  job->num_workers = a.num_workers() > 0 ? a.num_workers() : spec.num_workers();
  job->server_index = a.server_index();
  job->num_servers = plan.num_servers();
  job->total_floats = plan.total_floats();
  job->generation = a.generation();
  job->checkpoint_dir = spec.checkpoint().dir();
  job->max_skipped = spec.max_skipped_steps() > 0 ? spec.max_skipped_steps() : 10;
  job->checkpoint_every = spec.checkpoint().every_steps();
  job->keep = spec.checkpoint().keep();
  job->requested_step = a.checkpoint_request_step();
  job->chunks.resize(plan.chunks_size());
  for (const v1::ChunkInfo& info : plan.chunks()) {
    if (info.server() != a.server_index()) continue;
    if (job->owned_chunks++ == 0) job->first_chunk = info.id();
    auto chunk = std::make_unique<Chunk>();
    absl::MutexLock lock(&chunk->mu);
    chunk->id = info.id();
    chunk->size = info.size();
    chunk->values = std::make_shared<std::vector<float>>(info.size());
    // A 16-bit wire's replies hold the casts, so fp32 updates are always
    // in place and need no spare.
    if (DTypeBytes(spec.wire_dtype()) == 4) {
      chunk->spare = std::make_shared<std::vector<float>>(info.size());
    }
    if (spec.model().type() != v1::MODEL_TYPE_EXTERNAL) {
      kernels::InitParams(ModelShapeOf(spec), spec.seed(), info.offset(),
                          info.offset() + info.size(), chunk->values->data());
    }
    chunk->optimizer_state.assign(
        static_cast<size_t>(optimizer->StateFloatsPerParam()) * info.size(), 0.0f);
    chunk->pushed.resize(job->num_workers);
    chunk->clock.assign(job->num_workers, 0);
    chunk->measures_steps = info.id() == job->first_chunk;
    if (job->mode == v1::MODE_SYNC) {
      chunk->arrived.resize(job->num_workers);
      chunk->opened = MonotonicNow();
    }
    job->chunks[info.id()] = std::move(chunk);
  }
  job->optimizer = std::move(optimizer);
  job->optimizer_spec = spec.optimizer();
  job->total_steps = TotalSteps(spec);
  {
    absl::MutexLock lock(&job->step_end_mu);  // not shared yet: for the analysis
    job->ended_step.assign(job->num_workers, -1);
    job->ended_max_abs.assign(job->num_workers, 0);
  }
  {
    absl::MutexLock lock(&job->straggler_mu);
    job->late_steps.assign(job->num_workers, 0);
    job->straggler_gauges.assign(job->num_workers, nullptr);
  }
  if (!job->checkpoint_dir.empty()) {
    absl::MutexLock lock(&job->checkpoint_mu);
    job->written = ListCheckpoints(fs_, job->checkpoint_dir, job->id, job->server_index,
                                   /*remove_partial=*/true);
    job->retained.assign(a.retained_checkpoints().begin(), a.retained_checkpoints().end());
  }
  if (a.restore_step() != 0) PSTRAIN_RETURN_IF_ERROR(Restore(a, *job));
  job->external = spec.model().type() == v1::MODEL_TYPE_EXTERNAL;
  for (auto& chunk : job->chunks) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    if (job->external && !job->restored) {
      chunk->awaiting_init = true;
      ++job->chunks_awaiting_init;
    }
    if (DTypeBytes(job->wire_dtype) == 2) {
      chunk->wire_values = std::make_shared<std::vector<uint16_t>>(chunk->size);
      chunk->wire_spare = std::make_shared<std::vector<uint16_t>>(chunk->size);
      CastForTheWire(*chunk, job->wire_dtype);
    }
  }

  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("server is shutting down");
  if (!jobs_.emplace(job->id, job).second) {
    return absl::AlreadyExistsError(absl::StrCat("job ", job->id, " is already held"));
  }
  if (options_.metrics != nullptr) {
    job->metrics = options_.metrics->BindJob(job->id);
    for (auto& chunk : job->chunks) {
      if (chunk != nullptr) chunk->metrics = &job->metrics;
    }
    if (job->mode == v1::MODE_SYNC && job->num_workers > 1) {
      absl::MutexLock straggler_lock(&job->straggler_mu);
      for (uint32_t w = 0; w < job->num_workers; ++w) {
        job->straggler_gauges[w] = options_.metrics->BindStraggler(job->id, w);
      }
    }
  }
  UpdateGauges();
  return absl::OkStatus();
}

absl::Status ShardStore::Restore(const v1::ServerAssignment& a, Job& job) const {
  if (job.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job.id, " has no checkpoint.dir to restore step ", a.restore_step(),
                     " from"));
  }
  // The checkpoint to load: the one named, or (-1) this server's newest
  // that reads back whole, if any.
  absl::StatusOr<ServerCheckpoint> loaded;
  if (a.restore_step() > 0) {
    loaded = ReadCheckpoint(fs_, CheckpointPath(job.checkpoint_dir, job.id, job.server_index,
                                                a.restore_step(), a.restore_generation()));
  } else {
    std::vector<v1::CheckpointRecord> found;
    {
      absl::MutexLock lock(&job.checkpoint_mu);
      found = job.written;
    }
    loaded = absl::NotFoundError("no checkpoint");
    for (auto it = found.rbegin(); it != found.rend() && !loaded.ok(); ++it) {
      loaded = ReadCheckpoint(fs_, CheckpointPath(job.checkpoint_dir, job.id, job.server_index,
                                                  it->step(), it->generation()));
      if (!loaded.ok()) LOG(ERROR) << loaded.status() << "; trying an older one";
    }
    if (!loaded.ok()) {
      LOG(WARNING) << "job " << job.id << ": no good checkpoint of server " << job.server_index
                   << "; starting from the initial values";
      return absl::OkStatus();
    }
  }
  if (!loaded.ok()) {
    LOG(ERROR) << "job " << job.id << " cannot be restored at step " << a.restore_step() << ": "
               << loaded.status();
    return loaded.status();
  }
  const ServerCheckpoint& c = *loaded;
  auto mismatch = [&](absl::string_view what) {
    return absl::DataLossError(absl::StrCat(
        "checkpoint ", CheckpointPath(job.checkpoint_dir, job.id, job.server_index, c.step,
                                      c.generation),
        " does not belong to this job and server: ", what));
  };
  if (c.job_id != job.id || c.server_index != job.server_index ||
      c.num_servers != job.num_servers || c.total_floats != job.total_floats) {
    return mismatch("its job, server or model differs");
  }
  if (static_cast<int>(c.chunks.size()) != job.owned_chunks) return mismatch("other chunks");
  const int state_floats = job.optimizer->StateFloatsPerParam();
  for (const ChunkCheckpoint& saved : c.chunks) {
    Chunk* chunk = saved.id < job.chunks.size() ? job.chunks[saved.id].get() : nullptr;
    if (chunk == nullptr) return mismatch(absl::StrCat("chunk ", saved.id, " is not this server's"));
    absl::MutexLock lock(&chunk->mu);
    if (static_cast<int64_t>(saved.values.size()) != chunk->size ||
        saved.state.size() != static_cast<size_t>(state_floats) * chunk->size) {
      return mismatch(absl::StrCat("chunk ", saved.id, " has another size"));
    }
    if (job.mode == v1::MODE_SYNC && saved.version != a.restore_step()) {
      return mismatch(absl::StrCat("chunk ", saved.id, " is at version ", saved.version));
    }
    std::copy(saved.values.begin(), saved.values.end(), chunk->values->begin());
    chunk->optimizer_state = saved.state;
    chunk->version = saved.version;
    if (job.mode == v1::MODE_SYNC) {
      std::fill(chunk->clock.begin(), chunk->clock.end(), saved.version);
    }
  }
  job.restored = true;
  LOG(INFO) << "job " << job.id << " restored from the checkpoint of step " << c.step
            << " (generation " << c.generation << ") as server " << job.server_index;
  return absl::OkStatus();
}

absl::Status ShardStore::KeepAtGeneration(const std::string& job_id, int64_t generation) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  job->generation = generation;
  const absl::Status over = absl::AbortedError(
      absl::StrCat("job ", job_id, " went on to generation ", generation));
  for (auto& chunk : job->chunks) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    AbortWaits(*chunk, over);
    // Async and ssp: every worker's pushes are taken again from the step
    // it resumes at. (Sync keeps its clocks: they are the version.)
    if (job->mode != v1::MODE_SYNC) std::fill(chunk->clock.begin(), chunk->clock.end(), 0);
    for (std::optional<Frame>& held : chunk->pushed) held.reset();
    DropStaged(*chunk);
  }
  absl::MutexLock lock(&job->step_end_mu);
  std::fill(job->ended_step.begin(), job->ended_step.end(), -1);
  return absl::OkStatus();
}

void ShardStore::SetCheckpointPlan(const std::string& job_id, int64_t request_step,
                                   std::vector<v1::CheckpointRecord> retained) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(job_id);
  if (!job.ok()) return;
  (*job)->requested_step = request_step;
  absl::MutexLock lock(&(*job)->checkpoint_mu);
  (*job)->retained = std::move(retained);
}

std::vector<v1::HeldJob> ShardStore::Held() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  std::vector<v1::HeldJob> held;
  for (const auto& job : jobs) {
    v1::HeldJob& h = held.emplace_back();
    h.set_job_id(job->id);
    h.set_generation(job->generation);
    {
      absl::MutexLock lock(&job->error_mu);
      h.set_error(job->error);
    }
    absl::MutexLock lock(&job->checkpoint_mu);
    for (const v1::CheckpointRecord& r : job->written) *h.add_checkpoints() = r;
  }
  return held;
}

void ShardStore::Snapshot(const std::shared_ptr<Job>& job, Chunk& chunk) {
  chunk.mu.AssertHeld();
  const int64_t step = CheckpointStepOf(*job, chunk.version);
  if (step < 0) return;
  const absl::Time start = MonotonicNow();
  ChunkCheckpoint copy;
  copy.id = chunk.id;
  copy.version = chunk.version;
  copy.values = *chunk.values;
  copy.state = chunk.optimizer_state;
  const double copy_seconds = absl::ToDoubleSeconds(MonotonicNow() - start);
  if (chunk.metrics != nullptr) chunk.metrics->checkpoint_copy->Observe(copy_seconds);
  std::optional<ServerCheckpoint> complete;
  double copies = 0;
  {
    absl::MutexLock lock(&job->checkpoint_mu);
    auto it = job->gathering.find(step);
    if (it == job->gathering.end()) {
      // Memory for at most a few checkpoints at once: a disk that falls
      // behind loses checkpoints, never training speed.
      if (job->gathering.size() >= 2 || writer_->backlog() >= 2) {
        LOG_EVERY_N(WARNING, 10) << "job " << job->id << ": checkpoint of step " << step
                                 << " skipped, the disk is behind";
        return;
      }
      it = job->gathering.emplace(step, Gathering{}).first;
      ServerCheckpoint& c = it->second.checkpoint;
      c.job_id = job->id;
      c.server_index = job->server_index;
      c.num_servers = job->num_servers;
      c.step = step;
      c.generation = job->generation;
      c.total_floats = job->total_floats;
    }
    it->second.chunks.emplace(chunk.id, std::move(copy));
    it->second.copy_seconds += copy_seconds;
    if (static_cast<int>(it->second.chunks.size()) < job->owned_chunks) return;
    copies = it->second.copy_seconds;
    complete = std::move(it->second.checkpoint);
    for (auto& [id, c] : it->second.chunks) complete->chunks.push_back(std::move(c));
    job->gathering.erase(it);
  }
  const v1::CheckpointRecord record = [&] {
    v1::CheckpointRecord r;
    r.set_step(complete->step);
    r.set_generation(complete->generation);
    return r;
  }();
  writer_->Enqueue(job->checkpoint_dir, *std::move(complete),
                   [this, job, record, copies](const absl::StatusOr<int64_t>& bytes,
                                               double seconds) {
                     if (!bytes.ok()) {
                       LOG(ERROR) << "job " << job->id << ": checkpoint of step "
                                  << record.step() << " not written: " << bytes.status();
                       return;
                     }
                     LOG(INFO) << absl::StrFormat(
                         "job %s: checkpoint of step %d written: %d bytes in %.2f ms; the "
                         "copies took %.3f ms",
                         job->id, record.step(), *bytes, seconds * 1e3, copies * 1e3);
                     if (const ServerMetrics::Job& m = job->metrics; m.checkpoint != nullptr) {
                       m.checkpoint->Observe(seconds);
                       m.checkpoint_bytes->Increment(static_cast<double>(*bytes));
                       m.last_checkpoint->Set(static_cast<double>(record.step()));
                     }
                     std::vector<v1::CheckpointRecord> retained;
                     {
                       absl::MutexLock lock(&job->checkpoint_mu);
                       job->written.push_back(record);
                       retained = job->retained;
                     }
                     PruneCheckpoints(fs_, job->checkpoint_dir, job->id, job->server_index,
                                      job->keep, retained);
                     absl::MutexLock lock(&job->checkpoint_mu);
                     job->written = ListCheckpoints(fs_, job->checkpoint_dir, job->id,
                                                    job->server_index, false);
                   });
}

void ShardStore::RemoveJob(const std::string& job_id) {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return;
    job = std::move(it->second);
    jobs_.erase(it);
    UpdateGauges();
  }
  if (options_.metrics != nullptr) options_.metrics->expiring.JobEnded(job_id);
  const absl::Status aborted = absl::AbortedError(absl::StrCat("job ", job_id, " was removed"));
  for (auto& chunk : job->chunks) {
    if (chunk != nullptr) Close(*chunk, aborted);
  }
}

std::vector<std::string> ShardStore::JobIds() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  return ids;
}

int64_t ShardStore::OpenWaits() const {
  std::vector<std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) jobs.push_back(job);
  }
  int64_t n = 0;
  for (const auto& job : jobs) {
    for (const auto& chunk : job->chunks) {
      if (chunk == nullptr) continue;
      absl::MutexLock lock(&chunk->mu);
      n += static_cast<int64_t>(chunk->waiting.size());
    }
  }
  return n;
}

void ShardStore::Shutdown() {
  std::map<std::string, std::shared_ptr<Job>> jobs;
  {
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
    jobs.swap(jobs_);
  }
  const absl::Status unavailable = absl::UnavailableError("parameter server is shutting down");
  for (auto& [id, job] : jobs) {
    for (auto& chunk : job->chunks) {
      if (chunk != nullptr) Close(*chunk, unavailable);
    }
  }
}

absl::StatusOr<std::shared_ptr<ShardStore::Job>> ShardStore::FindJob(
    const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("parameter server is shutting down");
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job '", job_id, "' is not held by this server"));
  }
  return it->second;
}

absl::StatusOr<ShardStore::Chunk*> ShardStore::FindChunk(const Job& job,
                                                         const v1::ChunkHeader& h) const {
  if (h.chunk() >= job.chunks.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown chunk ", h.chunk(), " (the plan has ",
                                                   job.chunks.size(), ")"));
  }
  Chunk* chunk = job.chunks[h.chunk()].get();
  if (chunk == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", h.chunk(), " is not held by this server"));
  }
  return chunk;
}

namespace {

// A request of another generation than the job's on this server: one that
// is over is refused for good, a newer one is not loaded here yet.
absl::Status CheckGeneration(const ShardStore::Job& job, const v1::ChunkHeader& h) {
  const int64_t here = job.generation;
  if (h.generation() == here) return absl::OkStatus();
  if (h.generation() < here) {
    return absl::AbortedError(absl::StrCat("generation ", h.generation(), " of job ", job.id,
                                           " is over (the job is at generation ", here, ")"));
  }
  return absl::UnavailableError(absl::StrCat("job ", job.id, " is at generation ", here,
                                             " on this server; ", h.generation(),
                                             " is not loaded yet"));
}

// Sync, at the barrier of the server's first chunk: how late each worker's
// push came after the step's values were out. A worker more than 3x the
// median of the others, 10 steps in a row, is a straggler: named once in
// the log, and in a gauge while it lasts.
void WatchStragglers(ShardStore::Job& job, const ShardStore::Chunk& chunk)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  constexpr int kSteps = 10;
  const int n = static_cast<int>(job.num_workers);
  if (n < 2) return;
  std::vector<double> lag(n);
  for (int w = 0; w < n; ++w) lag[w] = absl::ToDoubleSeconds(chunk.arrived[w] - chunk.opened);
  absl::MutexLock lock(&job.straggler_mu);
  for (int w = 0; w < n; ++w) {
    std::vector<double> others;
    for (int o = 0; o < n; ++o) {
      if (o != w) others.push_back(lag[o]);
    }
    std::nth_element(others.begin(), others.begin() + others.size() / 2, others.end());
    const double median = others[others.size() / 2];
    int& late = job.late_steps[w];
    if (lag[w] > 3 * median) {
      if (++late == kSteps) {
        LOG(WARNING) << "job " << job.id << ": worker " << w << " is a straggler: its pushes "
                     << "reach the barrier " << lag[w] * 1e3 << " ms after the step opens, the "
                     << "others' median " << median * 1e3 << " ms, " << kSteps
                     << " steps in a row";
        if (job.straggler_gauges[w] != nullptr) job.straggler_gauges[w]->Set(1);
      }
    } else {
      if (late >= kSteps) {
        LOG(INFO) << "job " << job.id << ": worker " << w << " keeps up again";
        if (job.straggler_gauges[w] != nullptr) job.straggler_gauges[w]->Set(0);
      }
      late = 0;
    }
  }
}

}  // namespace

absl::Status ShardStore::Init(const Frame& frame) {
  const v1::ChunkHeader& h = frame.header();
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*job, h));
  if (!job->external) {
    return absl::InvalidArgumentError(
        absl::StrCat("job ", job->id, " has a built-in model: its initial values come from its seed"));
  }
  if (h.worker() != 0) return absl::InvalidArgumentError("only worker 0 sends initial values");
  if (h.dtype() != v1::DTYPE_FP32) return absl::InvalidArgumentError("initial values are fp32");
  if (static_cast<int64_t>(h.num_elements()) != chunk->size) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), " has ", chunk->size,
                                                   " values, the initial ones ", h.num_elements()));
  }
  if (!std::isfinite(frame.MaxAbs())) {
    return absl::InvalidArgumentError(
        absl::StrCat("the initial values of chunk ", h.chunk(), " are not all finite"));
  }
  absl::MutexLock lock(&chunk->mu);
  if (!chunk->closed.ok()) return chunk->closed;
  if (!chunk->awaiting_init) return absl::OkStatus();  // a repeat: the first one holds
  frame.ReadValues(0, chunk->size, chunk->values->data());
  if (chunk->wire_values != nullptr) CastForTheWire(*chunk, job->wire_dtype);
  chunk->awaiting_init = false;
  if (--job->chunks_awaiting_init == 0) {
    LOG(INFO) << "job " << job->id << ": the initial values are in";
  }
  return absl::OkStatus();
}

namespace {

// External models: nothing but the initial values until they are in.
absl::Status CheckInitialized(const ShardStore::Job& job) {
  if (job.chunks_awaiting_init.load() == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("job ", job.id, " waits for the initial values of ",
                                             job.chunks_awaiting_init.load(),
                                             " chunks from worker 0"));
}

// INVALID_ARGUMENT unless the frame's worker is one of the job's: every
// kind of frame indexes the job's and the chunk's per-worker state by it.
absl::Status CheckWorker(const ShardStore::Job& job, const v1::ChunkHeader& h) {
  if (h.worker() < job.num_workers) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", h.worker(), " outside [0, ", job.num_workers, ")"));
}

}  // namespace

absl::Status ShardStore::Push(Frame frame, std::shared_ptr<ChunkWaiter> waiter,
                              bool payload_borrowed) {
  const v1::ChunkHeader& h = frame.header();
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckInitialized(*job));
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*job, h));
  if (DTypeBytes(h.dtype()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), ": unsupported dtype ",
                                                   static_cast<int>(h.dtype())));
  }
  if (static_cast<int64_t>(h.num_elements()) != chunk->size) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), " has ", chunk->size,
                                                   " values, push has ", h.num_elements()));
  }
  PSTRAIN_RETURN_IF_ERROR(CheckWorker(*job, h));
  if (h.step() < 0) return absl::InvalidArgumentError("negative step");

  absl::MutexLock lock(&chunk->mu);
  // After the closed check: a removed job's series may be gone already.
  if (!chunk->closed.ok()) return chunk->closed;
  const ServerMetrics::Job* metrics = chunk->metrics;
  if (metrics != nullptr) {
    metrics->pushes->Increment();
    metrics->received_bytes->Increment(static_cast<double>(frame.payload_bytes()));
  }
  if (job->mode == v1::MODE_SYNC) {
    if (h.step() > chunk->version) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), ": push for step ",
                                                     h.step(), " is ahead of version ",
                                                     chunk->version));
    }
    const v1::ChunkHeader request = h;
    if (request.step() == chunk->version && !chunk->pushed[request.worker()].has_value()) {
      // A borrowed payload is read in place by the update this push
      // completes (checked there, in the server's own memory); one that
      // must wait for other pushes is copied.
      const bool read_in_place = payload_borrowed &&
                                 chunk->received_count + 1 == static_cast<int>(job->num_workers) &&
                                 chunk->staged_values == nullptr;
      if (payload_borrowed && !read_in_place) frame = frame.OwnedCopy();
      if (!read_in_place) chunk->gradient_bound += frame.MaxAbs();
      chunk->pushed[request.worker()] = std::move(frame);
      const absl::Time now = MonotonicNow();
      chunk->arrived[request.worker()] = now;
      if (chunk->received_count++ == 0) chunk->step_started = now;
      const absl::Status completed = CompleteSyncStep(job, *chunk, read_in_place);
      // Its memory goes back to the peer: the push counts as in, its
      // values are used (or the step is skipped).
      std::optional<Frame>& pushed = chunk->pushed[request.worker()];
      if (read_in_place && pushed.has_value()) pushed->DropPayload();
      PSTRAIN_RETURN_IF_ERROR(completed);
    }
    // Older steps are retries of pushes already applied: answered, not summed.
    WaitAndAnswer(*chunk, job->wire_dtype, PushWait(*job, request, std::move(waiter)));
    return absl::OkStatus();
  }

  // Async, ssp: a worker's push waits for its step end (held), unless that
  // is in.
  if (h.version() > chunk->version) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), ": push based on version ",
                                                   h.version(), " is ahead of version ",
                                                   chunk->version));
  }
  const v1::ChunkHeader request = h;
  if (request.step() >= chunk->clock[request.worker()]) {
    std::optional<Frame>& held = chunk->pushed[request.worker()];
    if (held.has_value() && held->header().step() != request.step()) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk ", request.chunk(), ": push for step ", request.step(),
                       " while worker ", request.worker(), "'s push of step ",
                       held->header().step(), " waits for its step end"));
    }
    // Held until its step end: a borrowed payload is copied. Else a retry
    // of the held push.
    if (!held.has_value()) held = payload_borrowed ? frame.OwnedCopy() : std::move(frame);
    PSTRAIN_RETURN_IF_ERROR(ApplyHeldAsync(job, *chunk, request.worker()));
  }
  WaitAndAnswer(*chunk, job->wire_dtype, PushWait(*job, request, std::move(waiter)));
  return absl::OkStatus();
}

absl::Status ShardStore::CompleteSyncStep(const std::shared_ptr<Job>& job, Chunk& chunk,
                                          bool payload_borrowed) {
  chunk.mu.AssertHeld();
  if (chunk.received_count < static_cast<int>(job->num_workers)) return absl::OkStatus();
  // Summed in worker order, so that every run adds the same floats the
  // same way.
  absl::InlinedVector<const Frame*, 16> grads;
  for (uint32_t w = 0; w < job->num_workers; ++w) {
    if (static_cast<int>(w) == options_.ignore_worker_for_testing) continue;
    grads.push_back(&*chunk.pushed[w]);
  }
  std::string skip_reason;
  bool ended = true;
  {
    absl::MutexLock lock(&job->step_end_mu);
    for (int64_t e : job->ended_step) ended &= e >= chunk.version;
    if (ended) skip_reason = SyncSkipReason(*job, chunk);
  }
  if (!ended) {
    // A step end still to come: the update is computed now, off the step's
    // tail (unless a push already shows the step will be skipped).
    if (chunk.staged_values != nullptr || !(chunk.gradient_bound < kMaxGradientBound)) {
      return absl::OkStatus();
    }
    return StageOrSkip(*job, chunk, grads, apply_pool_.get(), payload_borrowed, &skip_reason);
  }
  if (payload_borrowed && skip_reason.empty() && chunk.staged_values == nullptr) {
    // Read once, checked, then published below.
    PSTRAIN_RETURN_IF_ERROR(
        StageOrSkip(*job, chunk, grads, apply_pool_.get(), payload_borrowed, &skip_reason));
  }
  const ServerMetrics::Job* metrics = chunk.metrics;
  if (chunk.id == job->first_chunk) WatchStragglers(*job, chunk);
  const absl::Time apply_start = MonotonicNow();
  double staged_seconds = 0;
  if (!skip_reason.empty()) {
    DropStaged(chunk);
    SkipUpdate(*job, chunk, skip_reason);
  } else {
    if (chunk.staged_values != nullptr) {
      staged_seconds = chunk.staged_seconds;
      CommitStaged(*job, chunk);
    } else {
      PSTRAIN_RETURN_IF_ERROR(Update(*job, chunk, grads, chunk.version, apply_pool_.get()));
    }
    chunk.skipped_in_a_row = 0;
    if (metrics != nullptr) metrics->updates->Increment();
  }
  chunk.gradient_bound = 0;
  std::fill(chunk.clock.begin(), chunk.clock.end(), chunk.version);
  // The received gradients go back to gRPC.
  for (std::optional<Frame>& f : chunk.pushed) f.reset();
  chunk.received_count = 0;
  const absl::Time applied = MonotonicNow();
  chunk.opened = applied;
  if (metrics != nullptr) {
    metrics->barrier_wait->Observe(absl::ToDoubleSeconds(apply_start - chunk.step_started));
    metrics->apply->Observe(staged_seconds + absl::ToDoubleSeconds(applied - apply_start));
  }
  Snapshot(job, chunk);
  return absl::OkStatus();
}

absl::Status ShardStore::ApplyHeldAsync(const std::shared_ptr<Job>& job, Chunk& chunk,
                                        uint32_t worker) {
  chunk.mu.AssertHeld();
  std::optional<Frame>& held = chunk.pushed[worker];
  if (!held.has_value()) return absl::OkStatus();
  const int64_t step = held->header().step();
  float ended_max_abs;
  {
    absl::MutexLock lock(&job->step_end_mu);
    if (job->ended_step[worker] < step) return absl::OkStatus();  // its step end is to come
    ended_max_abs = job->ended_max_abs[worker];
  }
  const ServerMetrics::Job* metrics = chunk.metrics;
  const absl::Time apply_start = MonotonicNow();
  if (metrics != nullptr) {
    metrics->staleness->Observe(static_cast<double>(chunk.version - held->header().version()));
  }
  if (!(ended_max_abs < kMaxGradientBound) || !(held->MaxAbs() < kMaxGradientBound)) {
    SkipUpdate(*job, chunk,
               absl::StrCat("worker ", worker, "'s gradient of step ", step,
                            " had a NaN or an infinity"));
  } else if (static_cast<int>(worker) != options_.ignore_worker_for_testing) {
    const Frame* grad = &*held;
    PSTRAIN_RETURN_IF_ERROR(
        Update(*job, chunk, absl::MakeConstSpan(&grad, 1), step, apply_pool_.get()));
    chunk.skipped_in_a_row = 0;
    if (metrics != nullptr) metrics->updates->Increment();
  }
  held.reset();
  chunk.clock[worker] = step + 1;
  if (metrics != nullptr) {
    metrics->apply->Observe(absl::ToDoubleSeconds(MonotonicNow() - apply_start));
  }
  Snapshot(job, chunk);
  return absl::OkStatus();
}

absl::Status ShardStore::EndStep(const v1::ChunkHeader& h) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckInitialized(*job));
  PSTRAIN_RETURN_IF_ERROR(FindChunk(*job, h).status());
  PSTRAIN_RETURN_IF_ERROR(CheckWorker(*job, h));
  if (h.step() < 0) return absl::InvalidArgumentError("negative step");
  if (h.num_elements() != 0) return absl::InvalidArgumentError("a step end carries no values");
  const bool sync = job->mode == v1::MODE_SYNC;
  if (sync) {
    // Every chunk here must have applied the step before: else the step
    // ends of the step they wait for would be overwritten.
    for (const auto& chunk : job->chunks) {
      if (chunk == nullptr) continue;
      absl::MutexLock lock(&chunk->mu);
      if (!chunk->closed.ok()) return chunk->closed;
      if (h.step() > chunk->version) {
        return absl::InvalidArgumentError(absl::StrCat("step end of step ", h.step(),
                                                       " is ahead of chunk ", chunk->id,
                                                       " at version ", chunk->version));
      }
    }
  }
  {
    absl::MutexLock lock(&job->step_end_mu);
    if (h.step() <= job->ended_step[h.worker()]) return absl::OkStatus();  // a retry
    job->ended_step[h.worker()] = h.step();
    job->ended_max_abs[h.worker()] = h.gradient_max_abs();
  }
  for (const auto& chunk : job->chunks) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    if (!chunk->closed.ok()) return chunk->closed;
    if (sync) {
      if (chunk->version != h.step()) continue;
      PSTRAIN_RETURN_IF_ERROR(CompleteSyncStep(job, *chunk));
    } else {
      PSTRAIN_RETURN_IF_ERROR(ApplyHeldAsync(job, *chunk, h.worker()));
    }
    AnswerWaits(*chunk, job->wire_dtype);
  }
  return absl::OkStatus();
}

absl::Status ShardStore::Pull(const v1::ChunkHeader& h, std::shared_ptr<ChunkWaiter> waiter) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckInitialized(*job));
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckWorker(*job, h));
  if (h.version() < 0) return absl::InvalidArgumentError("negative version");
  if (h.pushed_steps() < 0) return absl::InvalidArgumentError("negative pushed_steps");
  absl::MutexLock lock(&chunk->mu);
  if (!chunk->closed.ok()) return chunk->closed;
  Waiting wait{h, std::move(waiter)};
  wait.min_version = h.version();
  wait.min_clock = h.pushed_steps();
  WaitAndAnswer(*chunk, job->wire_dtype, std::move(wait));
  return absl::OkStatus();
}

void ShardStore::DropAbandonedWaits(const std::string& job_id, uint32_t chunk_id) {
  absl::StatusOr<std::shared_ptr<Job>> job = FindJob(job_id);
  if (!job.ok()) return;
  v1::ChunkHeader h;
  h.set_chunk(chunk_id);
  absl::StatusOr<Chunk*> chunk = FindChunk(**job, h);
  if (!chunk.ok()) return;
  absl::MutexLock lock(&(*chunk)->mu);
  std::erase_if((*chunk)->waiting, [](const Waiting& w) { return w.waiter->Abandoned(); });
}

absl::StatusOr<ShardStore::ChunkSnapshot> ShardStore::ReadChunk(const std::string& job_id,
                                                                uint32_t chunk_id) const {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  v1::ChunkHeader h;
  h.set_chunk(chunk_id);
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*job, h));
  absl::MutexLock lock(&chunk->mu);
  return ChunkSnapshot{chunk->version, *chunk->values, chunk->staged_values != nullptr};
}

}  // namespace pstrain::server
