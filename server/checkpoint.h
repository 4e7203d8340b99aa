// A parameter server's checkpoints: for one job, the values, optimizer
// state and version of every chunk the server owns, and the rows of its
// embedding tables with their admission filters, at one step, in one file
// per (job, server index, step, generation):
//
//   DIR/JOB_ID/server-I/step-SSSSSSSSSSSS.gG.ckpt
//
// A full checkpoint holds every row; an incremental one (base_step not 0)
// only the rows changed since its base — the server's checkpoint before it
// in the same generation — and the keys evicted since, so that the base's
// rows with these changes are the tables at its step. Its chain (it, its
// base, the base's base... down to a full one) reads back as one
// checkpoint (ReadCheckpointChain), and pruning keeps the chain of every
// checkpoint it keeps.
//
// laid out as CheckpointHeader in proto/pstrain/v1/job.proto says, with a
// CRC-32 of the whole file at its end. A file is written to a temporary
// name, synced and renamed: under its final name it is whole, and a file
// that does not read back whole (torn, truncated, a byte flipped) is
// detected and named with the reason. Everything goes through the file
// system seam (common/file_system.h), so that tests can fill or break the
// disk, or crash the writer half-way.
#ifndef PSTRAIN_SERVER_CHECKPOINT_H_
#define PSTRAIN_SERVER_CHECKPOINT_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"
#include "pstrain/v1/job.pb.h"
#include "server/sparse_table.h"

namespace pstrain::server {

struct ChunkCheckpoint {
  uint32_t id = 0;
  int64_t version = 0;
  std::vector<float> values;
  std::vector<float> state;  // optimizer state
};

// A table's rows and admission filter at the checkpoint's step.
struct TableCheckpoint {
  uint32_t index = 0;
  int dim = 0;
  int state_floats = 0;
  int64_t version = 0;
  std::vector<SparseTable::Row> rows;  // by key
  std::vector<uint64_t> deleted;       // incremental: keys evicted since the base, by key
  AdmissionFilter filter;
  // Instead of `rows`, rows read from the table as the file is written (a
  // snapshot, copied on write: no copy of a table that may be most of the
  // server's memory): `count` rows, which `read` hands to `each` in key
  // order, or an error if a recovery reloaded the table meanwhile.
  struct LiveRows {
    using EachRow = std::function<absl::Status(const SparseTable::Row&)>;
    using Reader = std::function<absl::Status(const EachRow& each)>;
    int64_t count = 0;
    Reader read;
  };
  std::optional<LiveRows> live;

  int64_t row_count() const {
    return live.has_value() ? live->count : static_cast<int64_t>(rows.size());
  }
};

struct ServerCheckpoint {
  std::string job_id;
  uint32_t server_index = 0;
  uint32_t num_servers = 0;
  int64_t step = 0;
  int64_t generation = 0;
  int64_t total_floats = 0;
  std::vector<ChunkCheckpoint> chunks;  // in id order
  std::vector<TableCheckpoint> tables;  // in table order
  // Incremental: the checkpoint whose rows the tables change (0: full).
  int64_t base_step = 0;
  int64_t base_generation = 0;
};

// A checkpoint being gathered: a copy of each chunk, and of the tables, as
// they pass the step.
struct GatheredCheckpoint {
  ServerCheckpoint checkpoint;
  std::map<uint32_t, ChunkCheckpoint> chunks;
  std::optional<std::vector<TableCheckpoint>> tables;
  double copy_seconds = 0;  // the copies' time, which the step waited for
};

// DIR/JOB_ID/server-I, and the file of one checkpoint in it.
std::string CheckpointDirOf(const std::string& dir, const std::string& job_id, uint32_t server);
std::string CheckpointPath(const std::string& dir, const std::string& job_id, uint32_t server,
                           int64_t step, int64_t generation);

// Writes the checkpoint under its final name, atomically; returns the bytes
// written. The file system's error otherwise (the final name untouched);
// FAILED_PRECONDITION for an incremental checkpoint whose base is not on
// disk (its write failed: the chain would be broken).
absl::StatusOr<int64_t> WriteCheckpoint(FileSystem* fs, const std::string& dir,
                                        const ServerCheckpoint& checkpoint);

// Reads and checks a checkpoint file. NOT_FOUND if it is missing;
// DATA_LOSS naming the file and what is wrong with it otherwise.
absl::StatusOr<ServerCheckpoint> ReadCheckpoint(FileSystem* fs, const std::string& path);

// Reads a checkpoint and, if it is incremental, its chain, merged into one
// full checkpoint (the newest file's chunks and filters, the rows as the
// chain leaves them). NOT_FOUND or DATA_LOSS naming the file at fault,
// also for a chain that does not hold together (a base of another job,
// server or generation, or of another set of tables).
absl::StatusOr<ServerCheckpoint> ReadCheckpointChain(FileSystem* fs, const std::string& dir,
                                                     const std::string& job_id, uint32_t server,
                                                     int64_t step, int64_t generation);

// A checkpoint file's tables read row by row, for files too large to hold
// in memory (an export of large tables): Open first reads the whole file
// once to check its CRC, then NextRow hands out the rows, table after
// table, a megabyte read at a time.
class CheckpointRowReader {
 public:
  // NOT_FOUND if the file is missing; DATA_LOSS naming it and what is wrong
  // otherwise.
  static absl::StatusOr<std::unique_ptr<CheckpointRowReader>> Open(FileSystem* fs,
                                                                   const std::string& path);
  const v1::CheckpointHeader& header() const { return header_; }
  // The next row of table `t` into `row`; false after its last. Tables are
  // read in order: asking for a later one skips the rest of the current.
  absl::StatusOr<bool> NextRow(int t, SparseTable::Row& row);

 private:
  CheckpointRowReader(std::string path, std::unique_ptr<ReadableFile> file)
      : path_(std::move(path)), file_(std::move(file)) {}
  // The next n bytes of the file.
  absl::StatusOr<absl::string_view> Take(size_t n);
  absl::Status Skip(uint64_t n);
  absl::Status Damaged(absl::string_view why) const;

  const std::string path_;
  std::unique_ptr<ReadableFile> file_;
  v1::CheckpointHeader header_;
  std::string buffer_;
  size_t at_ = 0;     // in buffer_
  int table_ = -1;    // the table being read
  int64_t left_ = 0;  // its rows not read yet
};

// The checkpoints of a job's server index on disk (by their names), oldest
// first. With `remove_partial`, temporary files that a crash left behind
// are removed, each with a log line.
std::vector<v1::CheckpointRecord> ListCheckpoints(FileSystem* fs, const std::string& dir,
                                                  const std::string& job_id, uint32_t server,
                                                  bool remove_partial);

// Deletes the server's checkpoints of the job except the newest `keep`,
// those in `retained` (what the coordinator keeps, as it last said), and
// those newer than the newest of `retained`: the coordinator may have just
// recorded one of them as complete, which this server learns only with its
// next heartbeat. (Of those, only the newest keep + kUnrecordedSlack stay:
// a coordinator that long silent has not recorded the older ones.) The
// chain of every checkpoint kept stays too.
inline constexpr int kUnrecordedSlack = 8;
void PruneCheckpoints(FileSystem* fs, const std::string& dir, const std::string& job_id,
                      uint32_t server, int keep, const std::vector<v1::CheckpointRecord>& retained);

// Writes checkpoints on a thread of its own, in the order they are queued,
// so that training never waits for the disk.
class CheckpointWriter {
 public:
  // Called on the writer's thread once a checkpoint is written (bytes and
  // seconds) or has failed.
  using DoneFn = std::function<void(const absl::StatusOr<int64_t>& bytes, double seconds)>;

  explicit CheckpointWriter(FileSystem* fs);
  ~CheckpointWriter();  // writes what is queued, then stops

  void Enqueue(std::string dir, ServerCheckpoint checkpoint, DoneFn done);
  // Checkpoints queued or being written.
  int backlog() const;

 private:
  struct Task {
    std::string dir;
    ServerCheckpoint checkpoint;
    DoneFn done;
  };
  void Loop();

  FileSystem* const fs_;
  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  int writing_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_CHECKPOINT_H_
