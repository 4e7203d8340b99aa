// The state of one parameter server: for every job it holds, the chunks it
// owns, their optimizer state, and the pushes of the open step. No gRPC here:
// the parameter service (parameter_service.h) feeds it frames. Its parts:
// shard_job.h (what is held of a job), dense_chunk.h (a chunk's update),
// chunk_waits.h (the waits for values: sync, SSP and async as one
// predicate), shard_checkpoints.h (copies and restores), straggler_watch.h.
#ifndef PSTRAIN_SERVER_SHARD_STORE_H_
#define PSTRAIN_SERVER_SHARD_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/chunk_codec.h"
#include "common/file_system.h"
#include "common/sparse_frames.h"
#include "kernels/model.h"
#include "pstrain/v1/membership.pb.h"
#include "pstrain/v1/parameters.pb.h"
#include "server/chunk_waits.h"
#include "server/server_metrics.h"
#include "server/sparse_table.h"

namespace pstrain::server {

class ApplyPool;
class CheckpointWriter;
struct DenseChunk;  // shard_job.h
struct ShardJob;

class ShardStore {
 public:
  struct Options {
    // Bytes of job state this server may hold; 0 = unlimited. AddJob
    // refuses a job that would exceed it.
    int64_t max_memory_bytes = 0;
    // Where to count pushes, bytes, barrier waits...; null: nowhere. Must
    // outlive the store.
    ServerMetrics* metrics = nullptr;
    // Threads that share the sum and update of one large chunk (at least
    // ApplyPool::kMinFloatsPerThread floats each); 1: the pushing thread
    // alone.
    int apply_threads = 1;
    // Where checkpoints are written and read; null: the machine's file
    // system. Must outlive the store.
    FileSystem* fs = nullptr;
    // A job's checkpoint.dir must lie in this directory (symbolic links
    // resolved): AddJob refuses it otherwise. Empty: anywhere.
    std::string checkpoint_root;
  };

  explicit ShardStore(Options options);
  ~ShardStore();

  // Bytes a server needs to hold the chunks of `plan` it owns as server
  // `server`: the fp32 values (the published version and the next, or, with
  // a 16-bit wire, one fp32 buffer and two 16-bit casts), optimizer state,
  // and in sync mode the received gradient of every worker. The coordinator
  // schedules with the same figure.
  static int64_t BytesNeeded(const v1::JobSpec& spec, const v1::PartitionPlan& plan,
                             uint32_t server);

  // Starts holding `assignment.job_id` at assignment.generation: allocates
  // the chunks of the plan owned by assignment.server_index and fills them
  // as the assignment says (restore_step): from the seed, from the
  // checkpoint of that step, or (-1) from this server's newest good
  // checkpoint. ALREADY_EXISTS if held; INVALID_ARGUMENT on an inconsistent
  // spec or plan; RESOURCE_EXHAUSTED if it would exceed max_memory_bytes;
  // DATA_LOSS or NOT_FOUND, naming the file and the reason, for a
  // checkpoint that cannot be loaded.
  absl::Status AddJob(const v1::ServerAssignment& assignment);

  // Async: goes on with the job's values at a new generation (its open
  // waits end ABORTED; every worker may push its next step). NOT_FOUND if
  // not held.
  absl::Status KeepAtGeneration(const std::string& job_id, int64_t generation);

  // What the coordinator says about the job's checkpoints: the step asked
  // for now (0: none) and the checkpoints it keeps (this server deletes its
  // others beyond the spec's keep).
  void SetCheckpointPlan(const std::string& job_id, int64_t request_step,
                         std::vector<v1::CheckpointRecord> retained);

  // The jobs held, with their generations and the checkpoints on disk.
  std::vector<v1::HeldJob> Held() const;

  // Bytes of job state held now.
  int64_t HeldBytes() const;

  // Drops a job and its memory; its open waits end with ABORTED.
  void RemoveJob(const std::string& job_id);

  std::vector<std::string> JobIds() const;

  // Pushes and pulls waiting for a version, over every job.
  int64_t OpenWaits() const;

  // A PUSH frame (fp32, bf16 or fp16 values), held as received; a worker's
  // push of a step is applied only once its STEP_END of that step is in
  // (EndStep). Sync: the frame joins step `step` of the chunk (a repeated
  // push of the same worker and step is not summed again); when all
  // workers have pushed and ended the step, their gradients are summed in
  // worker order straight from the received slices and the optimizer runs
  // once, or, if a worker's step end bounds its gradient at a NaN or an
  // infinity, the update is skipped (on every chunk of every server: the
  // same step ends reach each). Async: each worker's push is applied (or
  // skipped) alone, once its step end is in (a repeated push is applied
  // once). If waiter is set it gets the values of version step+1 (sync) or
  // the values right after this push (async), in the job's wire dtype. At
  // the job's checkpoint steps the chunk's values and optimizer state are
  // copied, and once every chunk has its copy the checkpoint is written in
  // the background.
  // Errors, with nothing changed: NOT_FOUND for a job not held; ABORTED for
  // a generation that is over; UNAVAILABLE for a generation not loaded yet;
  // INVALID_ARGUMENT for a chunk not held, a wrong size or dtype, a worker
  // out of range, a step (version) ahead of the chunk, or (async) a step
  // other than the one the worker's held push waits with.
  // `payload_borrowed`: the frame's payload is memory this process may
  // read only during the call (a peer's, which it may change meanwhile):
  // it is either read once, by the update this push completes, or copied.
  absl::Status Push(Frame frame, std::shared_ptr<ChunkWaiter> waiter,
                    bool payload_borrowed = false);

  // An INIT frame (external models): the chunk's initial values, if it
  // still waits for them (a repeat is acknowledged and changes nothing).
  // A generation that starts from the initial values (no checkpoint)
  // answers its pushes, pulls and step ends UNAVAILABLE until every chunk
  // of the server has them. INVALID_ARGUMENT for a built-in model's job, a
  // worker other than 0, a dtype other than fp32, a wrong size or a value
  // that is not finite; NOT_FOUND, ABORTED, UNAVAILABLE as for Push.
  absl::Status Init(const Frame& frame);

  // A STEP_END: worker `worker` has pushed all of `step`, with values of
  // magnitude at most gradient_max_abs. Applies what waited for it. A
  // repeated step end is ignored. Errors as for Push, and (sync)
  // INVALID_ARGUMENT for a step some chunk here has not reached.
  absl::Status EndStep(const v1::ChunkHeader& header);

  // A PULL: the waiter gets the chunk's values once its version reaches
  // header.version() (and, async, once every worker has had
  // header.pushed_steps() steps applied). Errors as for Push.
  absl::Status Pull(const v1::ChunkHeader& header, std::shared_ptr<ChunkWaiter> waiter);

  // A SPARSE_PUSH: a worker's rows of a step for the job's tables here
  // (sparse_shard.h); the same errors as Push, and INVALID_ARGUMENT for a
  // job without tables or a payload DecodeSparseFrame refuses — with
  // nothing changed.
  absl::Status SparsePush(const Frame& frame);

  // A SPARSE_INIT from worker 0 of an external model: initial rows of the
  // tables with initial_rows (sparse_shard.h, AddInitialRows). A
  // generation that starts from the initial values answers the job's
  // requests UNAVAILABLE until every key of [0, initial_rows) held here has
  // its row; a row already there is kept. INVALID_ARGUMENT for a built-in
  // model's job, a worker other than 0, or a payload AddInitialRows
  // refuses; NOT_FOUND, ABORTED, UNAVAILABLE as for Push.
  absl::Status SparseInit(const Frame& frame);

  // A SPARSE_PULL: the waiter gets the rows once the tables here have
  // had h.version() steps applied, every worker h.pushed_steps() of them,
  // and (async, SSP) the asking worker h.step(). Errors as for SparsePush.
  absl::Status SparsePull(const Frame& frame, std::shared_ptr<ChunkWaiter> waiter);

  // Drops the abandoned waits of a chunk (kNoChunk: of the tables) now (a
  // stream that parked there is gone) rather than when next answered.
  void DropAbandonedWaits(const std::string& job_id, uint32_t chunk);

  // Ends every open wait with UNAVAILABLE and rejects later requests.
  void Shutdown();

  // A copy of a chunk's version and values (tests, export).
  struct ChunkSnapshot {
    int64_t version = 0;
    std::vector<float> values;
    // Sync: the update to version+1 is computed and waits for the step ends.
    bool update_staged = false;
  };
  absl::StatusOr<ChunkSnapshot> ReadChunk(const std::string& job_id, uint32_t chunk) const;
  // A copy of table `table`'s rows held here, by key (tests, export).
  // NOT_FOUND for a job not held; INVALID_ARGUMENT for a table it has not.
  absl::StatusOr<std::vector<SparseTable::Row>> ReadTable(const std::string& job_id,
                                                           uint32_t table) const;

 private:
  absl::StatusOr<std::shared_ptr<ShardJob>> FindJob(const std::string& job_id) const;
  // The checks of a sparse frame, and its sections.
  absl::StatusOr<std::vector<SparseSection>> CheckSparseFrame(const ShardJob& job,
                                                               const Frame& frame) const;
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Sync: applies (or skips) the chunk's open step if every worker has
  // pushed it and ended it. Async: the worker's held push, if its step end
  // is in. Called with chunk.mu held (asserted: DenseChunk is incomplete
  // here, so the lock cannot be named in an annotation).
  // `payload_borrowed`: the push just added is borrowed (Push): read now,
  // by a checked update, or never.
  absl::Status CompleteSyncStep(const std::shared_ptr<ShardJob>& job, DenseChunk& chunk,
                                bool payload_borrowed = false);
  absl::Status ApplyHeldAsync(const std::shared_ptr<ShardJob>& job, DenseChunk& chunk,
                              uint32_t worker);

  const Options options_;
  FileSystem* const fs_;
  std::unique_ptr<ApplyPool> apply_pool_;
  std::unique_ptr<CheckpointWriter> writer_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<ShardJob>> jobs_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SHARD_STORE_H_
