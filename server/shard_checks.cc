#include "server/shard_checks.h"

#include "absl/strings/str_cat.h"

namespace pstrain::server {

absl::StatusOr<DenseChunk*> FindChunk(const ShardJob& job, const v1::ChunkHeader& h) {
  if (h.chunk() >= job.chunks.size()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown chunk ", h.chunk(), " (the plan has ",
                                                   job.chunks.size(), ")"));
  }
  DenseChunk* chunk = job.chunks[h.chunk()].get();
  if (chunk == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", h.chunk(), " is not held by this server"));
  }
  return chunk;
}

absl::Status CheckGeneration(const ShardJob& job, const v1::ChunkHeader& h) {
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

absl::Status CheckInitialized(const ShardJob& job) {
  const int chunks = job.chunks_awaiting_init.load();
  const int64_t rows = job.rows_awaiting_init.load();
  if (chunks == 0 && rows == 0) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("job ", job.id, " waits for the initial values of ",
                                             chunks, " chunks and ", rows,
                                             " table rows from worker 0"));
}

absl::Status CheckWorker(const ShardJob& job, const v1::ChunkHeader& h) {
  if (h.worker() < job.num_workers) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("worker ", h.worker(), " outside [0, ", job.num_workers, ")"));
}

}  // namespace pstrain::server
