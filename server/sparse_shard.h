// A job's embedding tables as one parameter server holds them: the rows
// whose RowServer (common/sparse_frames.h) is this server, in one
// SparseTable per table, and the step state the tables share. Each worker
// sends one SPARSE_PUSH a step to each server (all tables at once, maybe
// none), so the tables move as one: sync, a step's pushes wait for every
// worker's push and step end and are then applied together, table by
// table, summed in worker order; async and SSP, each worker's push is
// applied alone once its step end is in. SPARSE_PULLs wait for a version
// and clocks as chunks' pulls do (chunk_waits.h). A step whose step ends
// bound a gradient at a NaN or an infinity is skipped here as on every
// chunk. Every function but Close is called with the shard's lock held.
#ifndef PSTRAIN_SERVER_SPARSE_SHARD_H_
#define PSTRAIN_SERVER_SPARSE_SHARD_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/sparse_frames.h"
#include "pstrain/v1/job.pb.h"
#include "server/chunk_waits.h"
#include "server/hot_keys.h"
#include "server/server_metrics.h"
#include "server/shard_job.h"
#include "server/sparse_table.h"

namespace pstrain::server {

class ApplyPool;

// The chunk id that sparse frames and a table-only server's step ends
// carry: no chunk.
inline constexpr uint32_t kNoChunk = 0xffffffffu;

// The config of the job's table `t` (its cap is each server's).
SparseTableConfig SparseTableConfigOf(const v1::JobSpec& spec, int t);

struct SparseShard {
  absl::Mutex mu;
  // The server's apply threads, which a step's tables share (null: the
  // calling thread alone). Fixed once set.
  ApplyPool* pool = nullptr;
  std::vector<int> dims;  // the tables', fixed
  std::vector<int64_t> initial_rows;  // the tables' (EmbeddingTableSpec), fixed
  std::vector<std::unique_ptr<SparseTable>> tables ABSL_GUARDED_BY(mu);
  int64_t version ABSL_GUARDED_BY(mu) = 0;  // steps applied (async: pushes)
  // Each worker's clock, as a chunk's (chunk_waits.h).
  std::vector<int64_t> clock ABSL_GUARDED_BY(mu);
  // Sync: each worker's push of step `version`; async: the push held for
  // its step end.
  struct Held {
    int64_t step = 0;
    std::vector<SparseSection> sections;
    float max_abs = 0;  // of its gradients; +inf for a NaN
  };
  std::vector<std::optional<Held>> pushed ABSL_GUARDED_BY(mu);
  int received_count ABSL_GUARDED_BY(mu) = 0;
  struct Wait {
    std::vector<SparseSection> sections;  // the keys asked for
    ChunkWait wait;
  };
  std::vector<Wait> waiting ABSL_GUARDED_BY(mu);
  SparseStepStats totals ABSL_GUARDED_BY(mu);
  int64_t skipped ABSL_GUARDED_BY(mu) = 0;
  // Each table's series and hot-key sketch, if the server is measured.
  std::vector<ServerMetrics::Table> metrics ABSL_GUARDED_BY(mu);
  std::vector<HotKeys> hot_keys ABSL_GUARDED_BY(mu);
  absl::Status closed ABSL_GUARDED_BY(mu);
};

// The shard of a job with tables, for num_workers workers.
absl::StatusOr<std::unique_ptr<SparseShard>> NewSparseShard(const v1::JobSpec& spec,
                                                            uint32_t num_workers);

// Measures the shard's tables from now on (labels job_id and the tables'
// names).
void MeasureTables(SparseShard& shard, ServerMetrics& metrics, const std::string& job_id)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

// A worker's decoded SPARSE_PUSH of step h.step(). A push of a step
// already applied, or repeated, changes nothing. INVALID_ARGUMENT for a
// step ahead of the shard (sync) or other than the one held (async).
absl::Status AddSparsePush(ShardJob& job, SparseShard& shard, const v1::ChunkHeader& h,
                           std::vector<SparseSection> sections,
                           const std::function<void()>& stepped)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

// Sync: applies (or skips) step `version` if every worker's push and step
// end are in. Async: worker `worker`'s held push, if its step end is in.
// A table that cannot take the step (its cap) fails the job (job.error)
// and closes the shard with the reason.
// `stepped` runs (with the lock held) each time the version advances.
absl::Status CompleteSparseStep(ShardJob& job, SparseShard& shard, uint32_t worker,
                                const std::function<void()>& stepped)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

// The keys of [0, initial_rows) of the job's tables that `server` holds:
// the rows a generation that starts from the initial values waits for.
int64_t InitialRowsHeld(const v1::JobSpec& spec, uint32_t server, uint32_t num_servers);

// Worker 0's initial rows (a SPARSE_INIT's sections, the rows in place of
// gradients): each key gets its row unless it has one (a repeat changes
// nothing). Returns the rows added. INVALID_ARGUMENT, with nothing
// changed, for a table without initial_rows, a key outside them, or a
// value that is not finite.
absl::StatusOr<int64_t> AddInitialRows(SparseShard& shard,
                                       const std::vector<SparseSection>& sections)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

// Adds a SPARSE_PULL's wait and answers every wait the shard satisfies.
void WaitAndAnswerSparse(SparseShard& shard, std::optional<SparseShard::Wait> wait)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

// Ends the waits with `status`; Close also refuses later requests.
void AbortSparseWaits(SparseShard& shard, const absl::Status& status)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);
void Close(SparseShard& shard, const absl::Status& status);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SPARSE_SHARD_H_
