#include "server/shard_store.h"

#include <algorithm>
#include <atomic>
#include <optional>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/status.h"
#include "kernels/cpu/cpu_kernels.h"
#include "server/apply.h"

namespace pstrain::server {

namespace {

struct Waiting {
  v1::ChunkHeader request;
  int64_t min_version = 0;
  std::shared_ptr<ChunkWaiter> waiter;
};

}  // namespace

struct ShardStore::Chunk {
  absl::Mutex mu;
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
  // Sync: the pushes of step `version` as they arrived, by worker (their
  // received slices, not copies).
  std::vector<std::optional<Frame>> pushed ABSL_GUARDED_BY(mu);
  int received_count ABSL_GUARDED_BY(mu) = 0;
  // Async: the last step applied per worker (-1: none), for retries.
  std::vector<int64_t> last_step ABSL_GUARDED_BY(mu);
  std::vector<Waiting> waiting ABSL_GUARDED_BY(mu);
  // Not OK once the job is removed or the server shuts down: later requests
  // that found the chunk before that get this error instead of waiting.
  absl::Status closed ABSL_GUARDED_BY(mu);
};

struct ShardStore::Job {
  std::string id;
  int64_t bytes = 0;  // BytesNeeded
  ServerMetrics::Job metrics{};  // bound if the store is measured
  v1::Mode mode = v1::MODE_SYNC;
  v1::DType wire_dtype = v1::DTYPE_FP32;
  uint32_t num_workers = 0;
  std::unique_ptr<kernels::Optimizer> optimizer;
  // By chunk id; null for chunks owned by other servers.
  std::vector<std::unique_ptr<Chunk>> chunks;
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

// Answers every wait the chunk's version satisfies; drops abandoned ones.
void AnswerWaits(ShardStore::Chunk& chunk, v1::DType wire_dtype)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  std::vector<Waiting> still;
  const ChunkValues values = Published(chunk, wire_dtype);
  for (Waiting& w : chunk.waiting) {
    if (w.waiter->Abandoned()) continue;
    if (chunk.version >= w.min_version) {
      w.waiter->OnValues(w.request, values);
      if (chunk.metrics != nullptr) {
        chunk.metrics->sent_bytes->Increment(static_cast<double>(chunk.size) *
                                             DTypeBytes(wire_dtype));
      }
    } else {
      still.push_back(std::move(w));
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

// Applies the sum of `grads` as update version+1 and publishes it: in place
// when no reply holds the current values, else into the spare buffer.
absl::Status Update(const ShardStore::Job& job, ShardStore::Chunk& chunk,
                    absl::Span<const Frame* const> grads, ApplyPool* pool)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  std::shared_ptr<std::vector<float>> next =
      Unshared(chunk.values) ? chunk.values : TakeSpare(chunk.spare, chunk.size);
  kernels::OptimizerSpan span;
  span.params = chunk.values->data();
  span.new_params = next->data();
  span.state = chunk.optimizer_state.data();
  span.state_stride = chunk.size;
  span.n = chunk.size;
  PSTRAIN_RETURN_IF_ERROR(SumAndApply(*job.optimizer, grads, span, chunk.version + 1, pool));
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
  return absl::OkStatus();
}

// Adds a wait (if any) and answers every wait the version now satisfies.
void WaitAndAnswer(ShardStore::Chunk& chunk, v1::DType wire_dtype, const v1::ChunkHeader& request,
                   int64_t min_version, std::shared_ptr<ChunkWaiter> waiter)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu) {
  if (waiter != nullptr) {
    chunk.waiting.push_back(Waiting{request, min_version, std::move(waiter)});
  }
  AnswerWaits(chunk, wire_dtype);
}

// Ends the chunk's waits with `status` and refuses later requests.
void Close(ShardStore::Chunk& chunk, const absl::Status& status) {
  absl::MutexLock lock(&chunk.mu);
  chunk.closed = status;
  for (Waiting& w : chunk.waiting) w.waiter->OnAbort(status);
  chunk.waiting.clear();
}

}  // namespace

ShardStore::ShardStore(Options options)
    : options_(options),
      apply_pool_(std::make_unique<ApplyPool>(std::max(1, options.apply_threads))) {}

ShardStore::~ShardStore() { Shutdown(); }

int64_t ShardStore::BytesNeeded(const v1::JobSpec& spec, const v1::PartitionPlan& plan,
                                uint32_t server) {
  absl::StatusOr<std::unique_ptr<kernels::Optimizer>> optimizer =
      kernels::CreateCpuOptimizer(OptimizerConfigOf(spec.optimizer()));
  const int64_t state = optimizer.ok() ? (*optimizer)->StateFloatsPerParam() : 2;
  // fp32 values (two buffers for an fp32 wire; one, and two 16-bit casts,
  // for a 16-bit one) and the optimizer state; sync keeps each worker's
  // gradient of the open step too, as received.
  const bool wire16 = DTypeBytes(spec.wire_dtype()) == 2;  // unspecified: fp32
  const int64_t value_bytes = wire16 ? 2 : 4;
  const int64_t bytes_per_param =
      4 * ((wire16 ? 1 : 2) + state) + (wire16 ? 2 * 2 : 0) +
      (spec.mode() == v1::MODE_SYNC ? spec.num_workers() * value_bytes : 0);
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
  const kernels::ModelShape shape = ModelShapeOf(spec);
  PSTRAIN_RETURN_IF_ERROR(ValidatePartitionPlan(plan, kernels::NumParams(shape)));
  if (a.server_index() >= plan.num_servers()) {
    return absl::InvalidArgumentError("server_index outside the plan");
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
  job->wire_dtype = spec.wire_dtype();
  job->num_workers = spec.num_workers();
  job->chunks.resize(plan.chunks_size());
  if (options_.metrics != nullptr) job->metrics = options_.metrics->BindJob(job->id);
  for (const v1::ChunkInfo& info : plan.chunks()) {
    if (info.server() != a.server_index()) continue;
    auto chunk = std::make_unique<Chunk>();
    absl::MutexLock lock(&chunk->mu);
    chunk->size = info.size();
    if (options_.metrics != nullptr) chunk->metrics = &job->metrics;
    chunk->values = std::make_shared<std::vector<float>>(info.size());
    // A 16-bit wire's replies hold the casts, so fp32 updates are always
    // in place and need no spare.
    if (DTypeBytes(spec.wire_dtype()) == 4) {
      chunk->spare = std::make_shared<std::vector<float>>(info.size());
    }
    kernels::InitParams(shape, spec.seed(), info.offset(), info.offset() + info.size(),
                        chunk->values->data());
    if (DTypeBytes(job->wire_dtype) == 2) {
      chunk->wire_values = std::make_shared<std::vector<uint16_t>>(info.size());
      chunk->wire_spare = std::make_shared<std::vector<uint16_t>>(info.size());
      CastForTheWire(*chunk, job->wire_dtype);
    }
    chunk->optimizer_state.assign(
        static_cast<size_t>(optimizer->StateFloatsPerParam()) * info.size(), 0.0f);
    if (job->mode == v1::MODE_SYNC) {
      chunk->pushed.resize(job->num_workers);
    } else {
      chunk->last_step.assign(job->num_workers, -1);
    }
    job->chunks[info.id()] = std::move(chunk);
  }
  job->optimizer = std::move(optimizer);

  absl::MutexLock lock(&mu_);
  absl::Status status;
  if (shut_down_) {
    status = absl::UnavailableError("server is shutting down");
  } else if (!jobs_.emplace(job->id, job).second) {
    status = absl::AlreadyExistsError(absl::StrCat("job ", job->id, " is already held"));
  }
  if (!status.ok()) {
    if (options_.metrics != nullptr) options_.metrics->expiring.JobEnded(job->id);
    return status;
  }
  UpdateGauges();
  return absl::OkStatus();
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

absl::Status ShardStore::Push(Frame frame, std::shared_ptr<ChunkWaiter> waiter) {
  const v1::ChunkHeader& h = frame.header();
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(h.job_id()));
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*job, h));
  if (DTypeBytes(h.dtype()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), ": unsupported dtype ",
                                                   static_cast<int>(h.dtype())));
  }
  if (static_cast<int64_t>(h.num_elements()) != chunk->size) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), " has ", chunk->size,
                                                   " values, push has ", h.num_elements()));
  }
  if (h.worker() >= job->num_workers) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker ", h.worker(), " outside [0, ", job->num_workers, ")"));
  }
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
      chunk->pushed[request.worker()] = std::move(frame);
      if (chunk->received_count == 0) chunk->step_started = absl::Now();
      if (++chunk->received_count == static_cast<int>(job->num_workers)) {
        const absl::Time apply_start = absl::Now();
        // Summed in worker order, so that every run adds the same floats the
        // same way.
        absl::InlinedVector<const Frame*, 16> grads;
        for (uint32_t w = 0; w < job->num_workers; ++w) {
          if (static_cast<int>(w) == options_.ignore_worker_for_testing) continue;
          grads.push_back(&*chunk->pushed[w]);
        }
        PSTRAIN_RETURN_IF_ERROR(Update(*job, *chunk, grads, apply_pool_.get()));
        // The received gradients go back to gRPC.
        for (std::optional<Frame>& f : chunk->pushed) f.reset();
        chunk->received_count = 0;
        if (metrics != nullptr) {
          const absl::Time now = absl::Now();
          metrics->barrier_wait->Observe(absl::ToDoubleSeconds(apply_start - chunk->step_started));
          metrics->apply->Observe(absl::ToDoubleSeconds(now - apply_start));
          metrics->updates->Increment();
        }
      }
    }
    // Older steps are retries of pushes already applied: answered, not summed.
    WaitAndAnswer(*chunk, job->wire_dtype, request, request.step() + 1, std::move(waiter));
    return absl::OkStatus();
  }

  // Async.
  if (h.version() > chunk->version) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), ": push based on version ",
                                                   h.version(), " is ahead of version ",
                                                   chunk->version));
  }
  if (h.step() > chunk->last_step[h.worker()]) {
    const absl::Time apply_start = absl::Now();
    if (metrics != nullptr) {
      metrics->staleness->Observe(static_cast<double>(chunk->version - h.version()));
    }
    const Frame* grad = &frame;
    PSTRAIN_RETURN_IF_ERROR(Update(*job, *chunk, absl::MakeConstSpan(&grad, 1), apply_pool_.get()));
    chunk->last_step[h.worker()] = h.step();
    if (metrics != nullptr) {
      metrics->apply->Observe(absl::ToDoubleSeconds(absl::Now() - apply_start));
      metrics->updates->Increment();
    }
  }
  WaitAndAnswer(*chunk, job->wire_dtype, h, /*min_version=*/0, std::move(waiter));
  return absl::OkStatus();
}

absl::Status ShardStore::Pull(const v1::ChunkHeader& h, std::shared_ptr<ChunkWaiter> waiter) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(h.job_id()));
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*job, h));
  if (h.version() < 0) return absl::InvalidArgumentError("negative version");
  absl::MutexLock lock(&chunk->mu);
  if (!chunk->closed.ok()) return chunk->closed;
  WaitAndAnswer(*chunk, job->wire_dtype, h, h.version(), std::move(waiter));
  return absl::OkStatus();
}

absl::StatusOr<ShardStore::ChunkSnapshot> ShardStore::ReadChunk(const std::string& job_id,
                                                                uint32_t chunk_id) const {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, FindJob(job_id));
  v1::ChunkHeader h;
  h.set_chunk(chunk_id);
  PSTRAIN_ASSIGN_OR_RETURN(Chunk * chunk, FindChunk(*job, h));
  absl::MutexLock lock(&chunk->mu);
  return ChunkSnapshot{chunk->version, *chunk->values};
}

}  // namespace pstrain::server
