// ShardStore's embedding tables (shard_store.h): the sparse frames, and
// the rows read for a checkpoint's reader.
#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/chunk_waits.h"
#include "server/shard_checkpoints.h"
#include "server/shard_checks.h"
#include "server/shard_job.h"
#include "server/shard_store.h"
#include "server/sparse_shard.h"

namespace pstrain::server {

absl::StatusOr<std::vector<SparseSection>> ShardStore::CheckSparseFrame(
    const ShardJob& job, const Frame& frame) const {
  const v1::ChunkHeader& h = frame.header();
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(job, h));
  PSTRAIN_RETURN_IF_ERROR(CheckInitialized(job));
  PSTRAIN_RETURN_IF_ERROR(CheckWorker(job, h));
  if (job.sparse == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("job ", job.id, " has no embedding tables"));
  }
  if (h.step() < 0 || h.version() < 0 || h.pushed_steps() < 0) {
    return absl::InvalidArgumentError("negative step, version or pushed_steps");
  }
  return DecodeSparseFrame(frame, job.sparse->dims, job.server_index, job.num_servers);
}

absl::Status ShardStore::SparsePush(const Frame& frame) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(frame.header().job_id()));
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<SparseSection> sections, CheckSparseFrame(*job, frame));
  SparseShard& sparse = *job->sparse;
  absl::MutexLock lock(&sparse.mu);
  PSTRAIN_RETURN_IF_ERROR(
      AddSparsePush(*job, sparse, frame.header(), std::move(sections), [&] {
        sparse.mu.AssertHeld();
        SnapshotTables(fs_, writer_.get(), job, sparse);
      }));
  WaitAndAnswerSparse(sparse, std::nullopt);
  return absl::OkStatus();
}

absl::Status ShardStore::SparseInit(const Frame& frame) {
  const v1::ChunkHeader& h = frame.header();
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(h.job_id()));
  PSTRAIN_RETURN_IF_ERROR(CheckGeneration(*job, h));
  if (!job->external || job->sparse == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("job ", job->id, " takes no initial rows: its tables are not an external "
                                      "model's"));
  }
  if (h.worker() != 0) return absl::InvalidArgumentError("only worker 0 sends initial rows");
  PSTRAIN_ASSIGN_OR_RETURN(
      std::vector<SparseSection> sections,
      DecodeSparseFrame(frame, job->sparse->dims, job->server_index, job->num_servers));
  SparseShard& sparse = *job->sparse;
  absl::MutexLock lock(&sparse.mu);
  if (!sparse.closed.ok()) return sparse.closed;
  PSTRAIN_ASSIGN_OR_RETURN(const int64_t added, AddInitialRows(sparse, sections));
  if (added > 0 && (job->rows_awaiting_init -= added) == 0) {
    LOG(INFO) << "job " << job->id << ": the tables' initial rows are in";
  }
  return absl::OkStatus();
}

absl::Status ShardStore::SparsePull(const Frame& frame, std::shared_ptr<ChunkWaiter> waiter) {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(frame.header().job_id()));
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<SparseSection> sections, CheckSparseFrame(*job, frame));
  SparseShard& sparse = *job->sparse;
  absl::MutexLock lock(&sparse.mu);
  if (!sparse.closed.ok()) return sparse.closed;
  ChunkWait wait = PullWait(frame.header(), std::move(waiter));
  if (job->mode != v1::MODE_SYNC) wait.own_clock = frame.header().step();
  WaitAndAnswerSparse(sparse, SparseShard::Wait{std::move(sections), std::move(wait)});
  return absl::OkStatus();
}

absl::StatusOr<std::vector<SparseTable::Row>> ShardStore::ReadTable(const std::string& job_id,
                                                                  uint32_t table) const {
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<ShardJob> job, FindJob(job_id));
  if (job->sparse == nullptr || table >= job->sparse->dims.size()) {
    return absl::InvalidArgumentError(absl::StrCat("job ", job_id, " has no table ", table));
  }
  absl::MutexLock lock(&job->sparse->mu);
  return job->sparse->tables[table]->Rows();
}

}  // namespace pstrain::server
