// What a parameter server holds of one job: the job's settings, its dense
// chunks (the flat parameter space cut by the partition plan, the chunks
// this server owns), each worker's step end, the checkpoints being
// gathered and written, and the straggler watch. The shard store
// (shard_store.h) owns them and feeds them frames; dense_chunk.h updates a
// chunk, chunk_waits.h answers the waits for its values,
// shard_checkpoints.h copies and restores them.
//
// Beside the chunks, a job with embedding tables has its SparseShard
// (sparse_shard.h): the rows by 64-bit key that this server holds.
#ifndef PSTRAIN_SERVER_SHARD_JOB_H_
#define PSTRAIN_SERVER_SHARD_JOB_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/chunk_codec.h"
#include "kernels/model.h"
#include "pstrain/v1/job.pb.h"
#include "server/checkpoint.h"
#include "server/chunk_waits.h"
#include "server/server_metrics.h"
#include "server/straggler_watch.h"

namespace pstrain::server {

// One chunk of a job's flat parameter space: its values by version, its
// optimizer state, the pushes not applied yet, each worker's clock and the
// waits for its values.
struct DenseChunk {
  absl::Mutex mu;
  uint32_t id = 0;
  int64_t size = 0;  // floats
  // A piece of an external model's buffer: an update keeps worker 0's push
  // as it is (fp32 words that may hold any dtype's bytes), with no
  // optimizer and no check that the values are finite.
  bool buffer = false;
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
  std::vector<ChunkWait> waiting ABSL_GUARDED_BY(mu);
  // External models: the chunk waits for its initial values (INIT).
  bool awaiting_init ABSL_GUARDED_BY(mu) = false;
  // Not OK once the job is removed or the server shuts down: later requests
  // that found the chunk before that get this error instead of waiting.
  absl::Status closed ABSL_GUARDED_BY(mu);
};

// One job as this server holds it.
struct SparseShard;

struct ShardJob {
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
  std::vector<std::unique_ptr<DenseChunk>> chunks;
  int owned_chunks = 0;
  // The job's embedding tables here; null without tables.
  std::shared_ptr<SparseShard> sparse;
  uint32_t first_chunk = 0;  // the lowest owned: where stragglers are watched
  // External models: the initial values come from worker 0 (INIT frames);
  // until every owned chunk has them, the job's requests are UNAVAILABLE.
  bool external = false;
  bool restored = false;  // RestoreShard loaded a checkpoint
  std::atomic<int> chunks_awaiting_init{0};
  // Tables with initial_rows: the rows of them held here not given yet
  // (SPARSE_INIT frames).
  std::atomic<int64_t> rows_awaiting_init{0};

  // Checkpoints; dir empty: none.
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  int keep = 0;
  std::atomic<int64_t> requested_step{0};
  absl::Mutex checkpoint_mu;
  std::map<int64_t, GatheredCheckpoint> gathering ABSL_GUARDED_BY(checkpoint_mu);  // by step
  std::vector<v1::CheckpointRecord> written ABSL_GUARDED_BY(checkpoint_mu);  // oldest first
  std::vector<v1::CheckpointRecord> retained ABSL_GUARDED_BY(checkpoint_mu);
  // Tables: every full_every-th checkpoint is full, those between are
  // incremental over the one before (table_base: the last checkpoint whose
  // tables were copied; none: the next is full).
  int full_every = 1;
  struct TableBase {
    int64_t step = 0;
    int64_t generation = 0;
    int64_t version = 0;  // of the tables: the rows changed since have last_step >= it
    int since_full = 0;   // incremental checkpoints since the full one
  };
  std::optional<TableBase> table_base ABSL_GUARDED_BY(checkpoint_mu);

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
  StragglerWatch stragglers;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SHARD_JOB_H_
