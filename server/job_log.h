// The coordinator's durable record of its jobs.
//
// An append-only log in STATE_DIR/jobs.log of job snapshots, the latest per
// id winning. Each record is [u32 LE length][u32 LE crc32][v1::Job bytes]
// and is fdatasync'ed before Append returns, so a job whose id was
// acknowledged survives a crash of the process or the machine. Compact()
// rewrites the log as one record per job into a temporary file, fsyncs it
// and renames it over the log.
#ifndef PSTRAIN_SERVER_JOB_LOG_H_
#define PSTRAIN_SERVER_JOB_LOG_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "pstrain/v1/control.pb.h"

namespace pstrain::server {

class JobLog {
 public:
  // Opens or creates the log in `dir` (created if missing) and returns the
  // jobs it holds, in the order of their first record. A record torn by a
  // crash at the end of the log is cut off; a bad record followed by good
  // ones is DATA_LOSS.
  static absl::StatusOr<std::unique_ptr<JobLog>> Open(const std::string& dir,
                                                      std::vector<v1::Job>* jobs);
  ~JobLog();

  // Appends the job's current snapshot, durably.
  absl::Status Append(const v1::Job& job);

  // Replaces the log by one record per job in `jobs`.
  absl::Status Compact(const std::vector<const v1::Job*>& jobs);

  // Records appended since the log was opened or compacted.
  int64_t appended() const { return appended_; }

 private:
  JobLog(std::string dir, int fd) : dir_(std::move(dir)), fd_(fd) {}

  const std::string dir_;
  int fd_;
  int64_t appended_ = 0;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_JOB_LOG_H_
