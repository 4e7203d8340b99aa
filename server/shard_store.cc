#include "server/shard_store.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/files.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "server/apply.h"
#include "server/checkpoint.h"
#include "server/dense_chunk.h"
#include "server/shard_checkpoints.h"
#include "server/shard_checks.h"
#include "server/shard_job.h"
#include "server/sparse_shard.h"

namespace pstrain::server {

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
  auto job = std::make_shared<ShardJob>();
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
  job->full_every = std::max(1, spec.checkpoint().full_every());
  job->requested_step = a.checkpoint_request_step();
  job->chunks.resize(plan.chunks_size());
  for (const v1::ChunkInfo& info : plan.chunks()) {
    if (info.server() != a.server_index()) continue;
    if (job->owned_chunks++ == 0) job->first_chunk = info.id();
    auto chunk = std::make_unique<DenseChunk>();
    absl::MutexLock lock(&chunk->mu);
    chunk->id = info.id();
    chunk->size = info.size();
    chunk->buffer = plan.tensors(static_cast<int>(info.tensor())).buffer();
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
  if (spec.tables_size() > 0) {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<SparseShard> sparse,
                             NewSparseShard(spec, job->num_workers));
    sparse->pool = apply_pool_.get();
    job->sparse = std::move(sparse);
  }
  job->optimizer = std::move(optimizer);
  job->optimizer_spec = spec.optimizer();
  job->total_steps = TotalSteps(spec);
  {
    absl::MutexLock lock(&job->step_end_mu);  // not shared yet: for the analysis
    job->ended_step.assign(job->num_workers, -1);
    job->ended_max_abs.assign(job->num_workers, 0);
  }
  job->stragglers.Start(job->id, static_cast<int>(job->num_workers));
  if (!job->checkpoint_dir.empty()) {
    absl::MutexLock lock(&job->checkpoint_mu);
    job->written = ListCheckpoints(fs_, job->checkpoint_dir, job->id, job->server_index,
                                   /*remove_partial=*/true);
    job->retained.assign(a.retained_checkpoints().begin(), a.retained_checkpoints().end());
  }
  if (a.restore_step() != 0) PSTRAIN_RETURN_IF_ERROR(RestoreShard(fs_, a, *job));
  job->external = spec.model().type() == v1::MODEL_TYPE_EXTERNAL;
  for (auto& chunk : job->chunks) {
    if (chunk == nullptr) continue;
    absl::MutexLock lock(&chunk->mu);
    if (job->external && !job->restored) {
      chunk->awaiting_init = true;
      ++job->chunks_awaiting_init;
    }
    if (DTypeBytes(job->wire_dtype) == 2 && !chunk->buffer) {
      chunk->wire_values = std::make_shared<std::vector<uint16_t>>(chunk->size);
      chunk->wire_spare = std::make_shared<std::vector<uint16_t>>(chunk->size);
      CastForTheWire(*chunk, job->wire_dtype);
    }
  }

  if (job->external && !job->restored && job->sparse != nullptr) {
    job->rows_awaiting_init = InitialRowsHeld(spec, job->server_index, job->num_servers);
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
      std::vector<prometheus::Gauge*> gauges;
      for (uint32_t w = 0; w < job->num_workers; ++w) {
        gauges.push_back(options_.metrics->BindStraggler(job->id, w));
      }
      job->stragglers.SetGauges(std::move(gauges));
    }
    if (job->sparse != nullptr) {
      absl::MutexLock sparse_lock(&job->sparse->mu);
      MeasureTables(*job->sparse, *options_.metrics, job->id);
    }
  }
  UpdateGauges();
  return absl::OkStatus();
}

absl::Status ShardStore::KeepAtGeneration(const std::string& job_id, int64_t generation) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(job_id));
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
  if (job->sparse != nullptr) {
    SparseShard& sparse = *job->sparse;
    absl::MutexLock lock(&sparse.mu);
    AbortSparseWaits(sparse, over);
    if (job->mode != v1::MODE_SYNC) std::fill(sparse.clock.begin(), sparse.clock.end(), 0);
    for (auto& held : sparse.pushed) held.reset();
    sparse.received_count = 0;
  }
  absl::MutexLock lock(&job->step_end_mu);
  std::fill(job->ended_step.begin(), job->ended_step.end(), -1);
  return absl::OkStatus();
}

void ShardStore::SetCheckpointPlan(const std::string& job_id, int64_t request_step,
                                   std::vector<v1::CheckpointRecord> retained) {
  absl::StatusOr<std::shared_ptr<ShardJob>> job = FindJob(job_id);
  if (!job.ok()) return;
  (*job)->requested_step = request_step;
  absl::MutexLock lock(&(*job)->checkpoint_mu);
  (*job)->retained = std::move(retained);
}

std::vector<v1::HeldJob> ShardStore::Held() const {
  std::vector<std::shared_ptr<ShardJob>> jobs;
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

void ShardStore::RemoveJob(const std::string& job_id) {
  std::shared_ptr<ShardJob> job;
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
  if (job->sparse != nullptr) {
    SparseShard& sparse = *job->sparse;
    Close(sparse, aborted);
    absl::MutexLock lock(&sparse.mu);
    int64_t rows = 0, bytes = 0;
    for (const auto& table : sparse.tables) {
      rows += table->rows();
      bytes += table->bytes();
    }
    const SparseStepStats t = sparse.totals;
    LOG(INFO) << "job " << job_id << ": its tables held " << rows << " rows (" << bytes
              << " bytes) here; admitted " << t.admitted << ", evicted " << t.evicted
              << ", gradients dropped " << t.gradients_dropped << ", row updates "
              << t.rows_updated;
  }
}

std::vector<std::string> ShardStore::JobIds() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> ids;
  for (const auto& [id, job] : jobs_) ids.push_back(id);
  return ids;
}

int64_t ShardStore::OpenWaits() const {
  std::vector<std::shared_ptr<ShardJob>> jobs;
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
    if (job->sparse != nullptr) {
      absl::MutexLock lock(&job->sparse->mu);
      n += static_cast<int64_t>(job->sparse->waiting.size());
    }
  }
  return n;
}

void ShardStore::Shutdown() {
  std::map<std::string, std::shared_ptr<ShardJob>> jobs;
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
    if (job->sparse != nullptr) Close(*job->sparse, unavailable);
  }
}

absl::StatusOr<std::shared_ptr<ShardJob>> ShardStore::FindJob(
    const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return absl::UnavailableError("parameter server is shutting down");
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job '", job_id, "' is not held by this server"));
  }
  return it->second;
}


absl::Status ShardStore::Init(const Frame& frame) {
  const v1::ChunkHeader& h = frame.header();
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_ASSIGN_OR_RETURN(DenseChunk * chunk, FindChunk(*job, h));
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
  if (!chunk->buffer && !std::isfinite(frame.MaxAbs())) {
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

absl::Status ShardStore::Push(Frame frame, std::shared_ptr<ChunkWaiter> waiter,
                              bool payload_borrowed) {
  const v1::ChunkHeader& h = frame.header();
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckInitialized(*job));
  PSTRAIN_ASSIGN_OR_RETURN(DenseChunk * chunk, FindChunk(*job, h));
  if (DTypeBytes(h.dtype()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), ": unsupported dtype ",
                                                   static_cast<int>(h.dtype())));
  }
  if (static_cast<int64_t>(h.num_elements()) != chunk->size) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", h.chunk(), " has ", chunk->size,
                                                   " values, push has ", h.num_elements()));
  }
  if (chunk->buffer && h.dtype() != v1::DTYPE_FP32) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", h.chunk(), " holds a buffer: its pushes are fp32 words"));
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
      if (!read_in_place && !chunk->buffer) chunk->gradient_bound += frame.MaxAbs();
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
    WaitAndAnswer(*chunk, job->wire_dtype, PushWait(job->mode, job->staleness, request, std::move(waiter)));
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
  WaitAndAnswer(*chunk, job->wire_dtype, PushWait(job->mode, job->staleness, request, std::move(waiter)));
  return absl::OkStatus();
}

absl::Status ShardStore::CompleteSyncStep(const std::shared_ptr<ShardJob>& job, DenseChunk& chunk,
                                          bool payload_borrowed) {
  chunk.mu.AssertHeld();
  if (chunk.received_count < static_cast<int>(job->num_workers)) return absl::OkStatus();
  // Summed in worker order, so that every run adds the same floats the
  // same way.
  absl::InlinedVector<const Frame*, 16> grads;
  for (uint32_t w = 0; w < job->num_workers; ++w) {
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
  if (chunk.id == job->first_chunk) job->stragglers.Observe(chunk.opened, chunk.arrived);
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
  SnapshotChunk(fs_, writer_.get(), job, chunk);
  return absl::OkStatus();
}

absl::Status ShardStore::ApplyHeldAsync(const std::shared_ptr<ShardJob>& job, DenseChunk& chunk,
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
  if (!(ended_max_abs < kMaxGradientBound) ||
      (!chunk.buffer && !(held->MaxAbs() < kMaxGradientBound))) {
    SkipUpdate(*job, chunk,
               absl::StrCat("worker ", worker, "'s gradient of step ", step,
                            " had a NaN or an infinity"));
  } else {
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
  SnapshotChunk(fs_, writer_.get(), job, chunk);
  return absl::OkStatus();
}

absl::Status ShardStore::EndStep(const v1::ChunkHeader& h) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckInitialized(*job));
  // A server that holds tables takes step ends that name no chunk.
  if (h.chunk() != kNoChunk || job->sparse == nullptr) {
    PSTRAIN_RETURN_IF_ERROR(FindChunk(*job, h).status());
  }
  PSTRAIN_RETURN_IF_ERROR(CheckWorker(*job, h));
  if (h.step() < 0) return absl::InvalidArgumentError("negative step");
  if (h.num_elements() != 0) return absl::InvalidArgumentError("a step end carries no values");
  const bool sync = job->mode == v1::MODE_SYNC;
  if (sync && job->sparse != nullptr) {
    absl::MutexLock lock(&job->sparse->mu);
    if (!job->sparse->closed.ok()) return job->sparse->closed;
    if (h.step() > job->sparse->version) {
      return absl::InvalidArgumentError(absl::StrCat("step end of step ", h.step(),
                                                     " is ahead of the tables at step ",
                                                     job->sparse->version));
    }
  }
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
  if (job->sparse != nullptr) {
    SparseShard& sparse = *job->sparse;
    absl::MutexLock lock(&sparse.mu);
    if (!sync || sparse.version == h.step()) {
      PSTRAIN_RETURN_IF_ERROR(CompleteSparseStep(*job, sparse, h.worker(), [&] {
        sparse.mu.AssertHeld();
        SnapshotTables(fs_, writer_.get(), job, sparse);
      }));
    }
    WaitAndAnswerSparse(sparse, std::nullopt);
  }
  return absl::OkStatus();
}

absl::Status ShardStore::Pull(const v1::ChunkHeader& h, std::shared_ptr<ChunkWaiter> waiter) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckInitialized(*job));
  PSTRAIN_ASSIGN_OR_RETURN(DenseChunk * chunk, FindChunk(*job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckWorker(*job, h));
  if (h.version() < 0) return absl::InvalidArgumentError("negative version");
  if (h.pushed_steps() < 0) return absl::InvalidArgumentError("negative pushed_steps");
  absl::MutexLock lock(&chunk->mu);
  if (!chunk->closed.ok()) return chunk->closed;
  WaitAndAnswer(*chunk, job->wire_dtype, PullWait(h, std::move(waiter)));
  return absl::OkStatus();
}

void ShardStore::DropAbandonedWaits(const std::string& job_id, uint32_t chunk_id) {
  absl::StatusOr<std::shared_ptr<ShardJob>> job = FindJob(job_id);
  if (!job.ok()) return;
  if (chunk_id == kNoChunk && (*job)->sparse != nullptr) {
    SparseShard& sparse = *(*job)->sparse;
    absl::MutexLock lock(&sparse.mu);
    std::erase_if(sparse.waiting,
                  [](const SparseShard::Wait& w) { return w.wait.waiter->Abandoned(); });
    return;
  }
  v1::ChunkHeader h;
  h.set_chunk(chunk_id);
  absl::StatusOr<DenseChunk*> chunk = FindChunk(**job, h);
  if (!chunk.ok()) return;
  absl::MutexLock lock(&(*chunk)->mu);
  std::erase_if((*chunk)->waiting, [](const ChunkWait& w) { return w.waiter->Abandoned(); });
}

absl::StatusOr<ShardStore::ChunkSnapshot> ShardStore::ReadChunk(const std::string& job_id,
                                                                uint32_t chunk_id) const {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(job_id));
  v1::ChunkHeader h;
  h.set_chunk(chunk_id);
  PSTRAIN_ASSIGN_OR_RETURN(DenseChunk * chunk, FindChunk(*job, h));
  absl::MutexLock lock(&chunk->mu);
  return ChunkSnapshot{chunk->version, *chunk->values, chunk->staged_values != nullptr};
}

}  // namespace pstrain::server
