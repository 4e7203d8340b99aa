// The coordinator's durable record of its jobs: the latest snapshot of each.
//
// An append-only log in STATE_DIR/jobs.log of job snapshots, the latest per
// id winning. Each record is [u32 LE length][u32 LE crc32][v1::Job bytes].
// Write() appends one record per job and syncs once before it returns, so a
// job whose id was acknowledged survives a crash of the process or of the
// machine. When the log has grown to many times the number of jobs, it is
// rewritten as one record per job into a temporary file, synced and renamed
// over the log.
//
// Nothing the store acknowledged is lost, and nothing it cannot read back is
// acknowledged: a record larger than replay accepts is refused before it is
// written, and a failed write leaves no part of itself behind. At replay a
// damaged record costs only itself: it is logged and skipped, and the
// records after it are read; a torn or damaged tail (a crash in the middle
// of an append) is cut off.
//
// Not thread-safe: the coordinator serializes its writes, and holds no
// other lock while one syncs, so that its reads never wait on the disk.
#ifndef PSTRAIN_SERVER_JOB_STORE_H_
#define PSTRAIN_SERVER_JOB_STORE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/file_system.h"
#include "pstrain/v1/control.pb.h"

namespace pstrain::server {

class JobStore {
 public:
  // The largest record replay accepts (and Write writes).
  static constexpr uint32_t kMaxRecordBytes = 64 << 20;

  // Opens or creates the log in `dir` (created if missing) and returns the
  // jobs it holds, in the order of their first record. The file system's
  // error if the log cannot be read or opened for appending.
  static absl::StatusOr<std::unique_ptr<JobStore>> Open(FileSystem* fs, const std::string& dir,
                                                        std::vector<v1::Job>* jobs);
  ~JobStore();

  // Appends the jobs' snapshots durably, in one sync. INVALID_ARGUMENT if a
  // snapshot is larger than kMaxRecordBytes; the file system's error if the
  // disk refuses (full, failing); FAILED_PRECONDITION once a failed write
  // could not be cut off again (until the store is opened again, which cuts
  // it off). On error nothing of this write is recorded.
  absl::Status Write(const std::vector<const v1::Job*>& jobs);
  absl::Status Write(const v1::Job& job) { return Write(std::vector<const v1::Job*>{&job}); }

  // Rewrites the log as one record per job now (Write does it by itself
  // once the log has grown).
  absl::Status Compact();

  // Leaves the job out of the log from the next compaction on (until then a
  // replay still returns it: the caller forgets it again).
  void Forget(const std::string& job_id);

  // Records appended since the log was opened or compacted.
  int64_t appended() const { return appended_; }
  // Damaged records skipped when the log was opened.
  int skipped_records() const { return skipped_; }

 private:
  JobStore(FileSystem* fs, std::string dir) : fs_(fs), dir_(std::move(dir)) {}
  std::string path() const { return dir_ + "/jobs.log"; }

  FileSystem* const fs_;
  const std::string dir_;
  std::unique_ptr<WritableFile> file_;
  // The latest record of each job (for compaction), and their order.
  std::map<std::string, std::string> latest_;
  std::vector<std::string> order_;
  int64_t appended_ = 0;
  int skipped_ = 0;
  bool broken_ = false;  // a failed append could not be cut off
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_JOB_STORE_H_
