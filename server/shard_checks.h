// The checks every frame a shard store takes goes through: its chunk, its
// generation, the job's initial values, its worker (shard_store.cc and
// shard_store_tables.cc).
#ifndef PSTRAIN_SERVER_SHARD_CHECKS_H_
#define PSTRAIN_SERVER_SHARD_CHECKS_H_

#include "absl/status/statusor.h"
#include "pstrain/v1/parameters.pb.h"
#include "server/dense_chunk.h"
#include "server/shard_job.h"

namespace pstrain::server {

// The chunk a frame names; INVALID_ARGUMENT if this server holds no such chunk.
absl::StatusOr<DenseChunk*> FindChunk(const ShardJob& job, const v1::ChunkHeader& h);

// A request of another generation than the job's on this server: one that
// is over is refused for good (ABORTED), a newer one is not loaded here
// yet (UNAVAILABLE).
absl::Status CheckGeneration(const ShardJob& job, const v1::ChunkHeader& h);

// External models: UNAVAILABLE until the initial values are in.
absl::Status CheckInitialized(const ShardJob& job);

// INVALID_ARGUMENT unless the frame's worker is one of the job's: every
// kind of frame indexes the job's and the chunk's per-worker state by it.
absl::Status CheckWorker(const ShardJob& job, const v1::ChunkHeader& h);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_SHARD_CHECKS_H_
