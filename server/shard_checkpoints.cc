#include "server/shard_checkpoints.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/sparse_shard.h"

namespace pstrain::server {

int64_t CheckpointStepOf(const ShardJob& job, int64_t version) {
  if (job.checkpoint_dir.empty() || version <= 0) return -1;
  // A job with tables checkpoints its last step too: its export reads it.
  const bool tables = job.sparse != nullptr;
  if (job.mode == v1::MODE_SYNC) {
    return version % job.checkpoint_every == 0 || version == job.requested_step ||
                   (tables && version == job.total_steps)
               ? version
               : -1;
  }
  const int64_t per_checkpoint = job.checkpoint_every * job.num_workers;
  return version % per_checkpoint == 0 || (tables && version == job.total_steps * job.num_workers)
             ? version / job.num_workers
             : -1;
}

absl::Status RestoreShard(FileSystem* fs, const v1::ServerAssignment& a, ShardJob& job) {
  if (job.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job.id, " has no checkpoint.dir to restore step ", a.restore_step(), " from"));
  }
  // The checkpoint to load: the one named, or (-1) this server's newest
  // that reads back whole, if any.
  absl::StatusOr<ServerCheckpoint> loaded;
  if (a.restore_step() > 0) {
    loaded = ReadCheckpointChain(fs, job.checkpoint_dir, job.id, job.server_index, a.restore_step(),
                                 a.restore_generation());
  } else {
    std::vector<v1::CheckpointRecord> found;
    {
      absl::MutexLock lock(&job.checkpoint_mu);
      found = job.written;
    }
    loaded = absl::NotFoundError("no checkpoint");
    for (auto it = found.rbegin(); it != found.rend() && !loaded.ok(); ++it) {
      loaded = ReadCheckpointChain(fs, job.checkpoint_dir, job.id, job.server_index, it->step(),
                                   it->generation());
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
        "checkpoint ",
        CheckpointPath(job.checkpoint_dir, job.id, job.server_index, c.step, c.generation),
        " does not belong to this job and server: ", what));
  };
  if (c.job_id != job.id || c.server_index != job.server_index ||
      c.num_servers != job.num_servers || c.total_floats != job.total_floats) {
    return mismatch("its job, server or model differs");
  }
  if (static_cast<int>(c.chunks.size()) != job.owned_chunks) return mismatch("other chunks");
  const int state_floats = job.optimizer->StateFloatsPerParam();
  for (const ChunkCheckpoint& saved : c.chunks) {
    DenseChunk* chunk = saved.id < job.chunks.size() ? job.chunks[saved.id].get() : nullptr;
    if (chunk == nullptr) {
      return mismatch(absl::StrCat("chunk ", saved.id, " is not this server's"));
    }
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
  if (c.tables.size() != (job.sparse != nullptr ? job.sparse->dims.size() : 0)) {
    return mismatch(absl::StrCat(c.tables.size(), " tables"));
  }
  if (job.sparse != nullptr) {
    SparseShard& shard = *job.sparse;
    absl::MutexLock lock(&shard.mu);
    for (uint32_t t = 0; t < c.tables.size(); ++t) {
      const TableCheckpoint& saved = c.tables[t];
      if (saved.index != t || saved.dim != shard.dims[t]) {
        return mismatch(absl::StrCat("table ", t, " has another index or dim"));
      }
      if (job.mode == v1::MODE_SYNC && saved.version != a.restore_step()) {
        return mismatch(absl::StrCat("table ", t, " is at version ", saved.version));
      }
      if (absl::Status s = shard.tables[t]->Load(saved.rows, saved.filter); !s.ok()) {
        return mismatch(s.message());
      }
      shard.version = saved.version;
    }
    if (job.mode == v1::MODE_SYNC) std::fill(shard.clock.begin(), shard.clock.end(), shard.version);
  }
  job.restored = true;
  LOG(INFO) << "job " << job.id << " restored from the checkpoint of step " << c.step
            << " (generation " << c.generation << ") as server " << job.server_index;
  return absl::OkStatus();
}

namespace {

// Makes room for the checkpoint of `step` being gathered, unless it has
// it already; false if the checkpoint is skipped: memory for at most a few
// checkpoints at once, so that a disk that falls behind loses checkpoints,
// never training speed.
bool Reserve(CheckpointWriter* writer, ShardJob& job, int64_t step) {
  absl::MutexLock lock(&job.checkpoint_mu);
  if (job.gathering.contains(step)) return true;
  if (job.gathering.size() >= 2 || writer->backlog() >= 2) {
    LOG_EVERY_N(WARNING, 10) << "job " << job.id << ": checkpoint of step " << step
                             << " skipped, the disk is behind";
    return false;
  }
  ServerCheckpoint& c = job.gathering[step].checkpoint;
  c.job_id = job.id;
  c.server_index = job.server_index;
  c.num_servers = job.num_servers;
  c.step = step;
  c.generation = job.generation;
  c.total_floats = job.total_floats;
  return true;
}

// Adds a part (`add` fills it in; its copy took copy_seconds) to the
// reserved checkpoint of `step`, and hands the checkpoint to the writer
// once it has every chunk of the server and, with tables, the tables.
void Gather(FileSystem* fs, CheckpointWriter* writer, const std::shared_ptr<ShardJob>& job,
            int64_t step, double copy_seconds,
            const std::function<void(GatheredCheckpoint&)>& add) {
  std::optional<ServerCheckpoint> complete;
  double copies = 0;
  {
    absl::MutexLock lock(&job->checkpoint_mu);
    auto it = job->gathering.find(step);
    // Reserved: only its completion, which needs this part, erases it.
    if (it == job->gathering.end()) return;
    add(it->second);
    it->second.copy_seconds += copy_seconds;
    if (static_cast<int>(it->second.chunks.size()) < job->owned_chunks) return;
    if (job->sparse != nullptr && !it->second.tables.has_value()) return;
    copies = it->second.copy_seconds;
    complete = std::move(it->second.checkpoint);
    for (auto& [id, c] : it->second.chunks) complete->chunks.push_back(std::move(c));
    if (it->second.tables.has_value()) complete->tables = std::move(*it->second.tables);
    job->gathering.erase(it);
  }
  int64_t rows = 0;
  for (const TableCheckpoint& t : complete->tables) rows += t.row_count();
  const std::string kind =
      complete->tables.empty() ? ""
      : complete->base_step == 0
          ? absl::StrCat(" (full: ", rows, " rows)")
          : absl::StrCat(" (incremental over step ", complete->base_step, ": ", rows, " rows)");
  const v1::CheckpointRecord record = [&] {
    v1::CheckpointRecord r;
    r.set_step(complete->step);
    r.set_generation(complete->generation);
    return r;
  }();
  writer->Enqueue(
      job->checkpoint_dir, *std::move(complete),
      [fs, job, record, copies, kind](const absl::StatusOr<int64_t>& bytes, double seconds) {
        if (!bytes.ok()) {
          LOG(ERROR) << "job " << job->id << ": checkpoint of step " << record.step()
                     << " not written: " << bytes.status();
          absl::MutexLock lock(&job->checkpoint_mu);
          job->table_base.reset();  // no chain goes on from it: the next is full
          return;
        }
        LOG(INFO) << absl::StrFormat(
            "job %s: checkpoint of step %d written%s: %d bytes in %.2f ms; the "
            "copies took %.3f ms",
            job->id, record.step(), kind, *bytes, seconds * 1e3, copies * 1e3);
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
        PruneCheckpoints(fs, job->checkpoint_dir, job->id, job->server_index, job->keep, retained);
        absl::MutexLock lock(&job->checkpoint_mu);
        job->written = ListCheckpoints(fs, job->checkpoint_dir, job->id, job->server_index, false);
      });
}

}  // namespace

TableCheckpoint::LiveRows::Reader SnapshotRowsOf(std::shared_ptr<SparseShard> sparse, uint32_t t,
                                                 SparseTable::Snapshot snapshot) {
  auto open = std::make_shared<SparseTable::Snapshot>(std::move(snapshot));
  return [sparse = std::move(sparse), t, open](const TableCheckpoint::LiveRows::EachRow& each) {
    if (open->token == nullptr) return absl::FailedPreconditionError("the snapshot was read");
    // The keys in order, sorted here rather than under the lock.
    std::sort(open->keys.begin(), open->keys.end());
    constexpr size_t kBatch = 1 << 16;
    std::vector<SparseTable::Row> rows;
    absl::Status status;
    for (size_t at = 0; at < open->keys.size() && status.ok(); at += kBatch) {
      {
        absl::MutexLock lock(&sparse->mu);
        status = sparse->tables[t]->ReadSnapshot(
            open->token, absl::MakeConstSpan(open->keys).subspan(at, kBatch), rows);
      }
      for (size_t i = 0; i < rows.size() && status.ok(); ++i) status = each(rows[i]);
    }
    open->token.reset();  // ends the snapshot: its rows are copied no more
    return status;
  };
}

void SnapshotChunk(FileSystem* fs, CheckpointWriter* writer, const std::shared_ptr<ShardJob>& job,
                   DenseChunk& chunk) {
  const int64_t step = CheckpointStepOf(*job, chunk.version);
  if (step < 0 || !Reserve(writer, *job, step)) return;
  const absl::Time start = MonotonicNow();
  ChunkCheckpoint copy;
  copy.id = chunk.id;
  copy.version = chunk.version;
  copy.values = *chunk.values;
  copy.state = chunk.optimizer_state;
  const double copy_seconds = absl::ToDoubleSeconds(MonotonicNow() - start);
  if (chunk.metrics != nullptr) chunk.metrics->checkpoint_copy->Observe(copy_seconds);
  Gather(fs, writer, job, step, copy_seconds,
         [&](GatheredCheckpoint& gathered) { gathered.chunks.emplace(chunk.id, std::move(copy)); });
}

void SnapshotTables(FileSystem* fs, CheckpointWriter* writer, const std::shared_ptr<ShardJob>& job,
                    SparseShard& shard) {
  const int64_t step = CheckpointStepOf(*job, shard.version);
  if (step < 0 || !Reserve(writer, *job, step)) return;
  // The last step's checkpoint is full (exports read it).
  const bool last_step = step == job->total_steps;
  // Full, or the rows changed since the last checkpoint whose tables were
  // copied (of this generation).
  std::optional<ShardJob::TableBase> base;
  {
    absl::MutexLock lock(&job->checkpoint_mu);
    // A copy: clang's thread-safety analysis does not follow a reference.
    const std::optional<ShardJob::TableBase> last = job->table_base;
    const bool full = last_step || !last.has_value() || last->generation != job->generation ||
                      last->since_full + 1 >= job->full_every;
    if (!full) base = last;
    job->table_base = ShardJob::TableBase{.step = step,
                                          .generation = job->generation,
                                          .version = shard.version,
                                          .since_full = full ? 0 : last->since_full + 1};
  }
  const absl::Time start = MonotonicNow();
  std::vector<TableCheckpoint> tables;
  for (uint32_t t = 0; t < shard.tables.size(); ++t) {
    SparseTable& table = *shard.tables[t];
    TableCheckpoint& copy = tables.emplace_back();
    copy.index = t;
    copy.dim = table.config().dim;
    copy.state_floats = StateFloatsPerRow(table.config());
    copy.version = shard.version;
    copy.deleted = table.TakeEvicted();
    if (!base.has_value()) copy.deleted.clear();  // every row is in: nothing to delete
    // The rows changed since the base (or all), read from the table while
    // training goes on: a snapshot, copied on write. While the last
    // checkpoint's snapshot is still being read, a copy.
    const int64_t since = base.has_value() ? base->version : std::numeric_limits<int64_t>::min();
    if (std::optional<SparseTable::Snapshot> snapshot = table.BeginSnapshot(since)) {
      const auto count = static_cast<int64_t>(snapshot->keys.size());
      copy.live = TableCheckpoint::LiveRows{
          .count = count, .read = SnapshotRowsOf(job->sparse, t, *std::move(snapshot))};
    } else {
      copy.rows = table.Rows(since);
    }
    copy.filter = table.filter();
  }
  const double copy_seconds = absl::ToDoubleSeconds(MonotonicNow() - start);
  if (job->metrics.checkpoint_copy != nullptr) job->metrics.checkpoint_copy->Observe(copy_seconds);
  Gather(fs, writer, job, step, copy_seconds, [&](GatheredCheckpoint& gathered) {
    gathered.tables = std::move(tables);
    if (base.has_value()) {
      gathered.checkpoint.base_step = base->step;
      gathered.checkpoint.base_generation = base->generation;
    }
  });
}

}  // namespace pstrain::server
