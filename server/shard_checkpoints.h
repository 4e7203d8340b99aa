// A shard's checkpoints (checkpoint.h has the files): at the job's
// checkpoint steps every chunk's values and optimizer state are copied as
// the chunk passes the step (and the tables' rows as they pass it), and
// once every part of the server has its copy the checkpoint is written in
// the background; a generation that
// starts from a checkpoint loads it back.
#ifndef PSTRAIN_SERVER_SHARD_CHECKPOINTS_H_
#define PSTRAIN_SERVER_SHARD_CHECKPOINTS_H_

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "common/file_system.h"
#include "pstrain/v1/membership.pb.h"
#include "server/checkpoint.h"
#include "server/shard_job.h"
#include "server/sparse_shard.h"

namespace pstrain::server {

// The step a checkpoint taken at the chunk's current version belongs to,
// if the version is a checkpoint step of the job; else -1. Sync: versions
// are steps. Async: every worker's push is a version; a checkpoint every
// every_steps steps of all workers. A job with embedding tables also
// checkpoints its last step, which exports read (table_export.h).
int64_t CheckpointStepOf(const ShardJob& job, int64_t version);

// Loads the chunks of a restoring assignment (restore_step: a step, or -1
// for this server's newest checkpoint that reads back whole, or the
// initial values if none does) into a job not yet shared. NOT_FOUND or
// DATA_LOSS, naming the file and the reason, for a checkpoint that cannot
// be loaded or is not this job's and server's; FAILED_PRECONDITION for a
// job without a checkpoint.dir.
absl::Status RestoreShard(FileSystem* fs, const v1::ServerAssignment& a, ShardJob& job);

// At a checkpoint step: copies the chunk, and hands the checkpoint to
// `writer` once every chunk of the server has its copy (a disk that falls
// behind loses checkpoints, never training speed).
void SnapshotChunk(FileSystem* fs, CheckpointWriter* writer, const std::shared_ptr<ShardJob>& job,
                   DenseChunk& chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk.mu);

// At a checkpoint step of the job's tables (their version): copies every
// row and admission filter, as SnapshotChunk does a chunk.
void SnapshotTables(FileSystem* fs, CheckpointWriter* writer,
                    const std::shared_ptr<ShardJob>& job, SparseShard& shard)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(shard.mu);

// The rows of the shard's table t that `snapshot` (its BeginSnapshot's)
// holds, for a checkpoint written from the table while training goes on: a
// batch at a time under the shard's lock, in key order; ABORTED if a
// recovery reloaded the table meanwhile. Read once; the snapshot ends when
// the reading does (or the reader goes).
TableCheckpoint::LiveRows::Reader SnapshotRowsOf(std::shared_ptr<SparseShard> sparse, uint32_t t,
                                                 SparseTable::Snapshot snapshot);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SHARD_CHECKPOINTS_H_
