// A job's embedding tables exported (docs/sparse-tables.md, "Export"):
// gigabytes of rows do not travel as a model file does (one message that
// worker 0 uploads); the servers write them, as the checkpoint of the
// job's last step (a job with tables always takes it, full), and an export
// reads those files row by row, merging the servers' rows by key (tables
// may be larger than the memory of the machine it runs on), and writes an
// export directory (common/export_dir.h, which reads it back).
//
// The checkpoint directory must be reachable where the export runs (the
// machine of pstrain-local, or a volume psctl's machine mounts).
#ifndef PSTRAIN_SERVER_TABLE_EXPORT_H_
#define PSTRAIN_SERVER_TABLE_EXPORT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/export_dir.h"
#include "common/file_system.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::server {

// Where a finished job's tables are: its spec (normalized, with its
// checkpoint.dir), the step of its end and its last generation.
struct TableExportSource {
  std::string job_id;
  v1::JobSpec spec;
  int64_t step = 0;
  int64_t generation = 0;
};

// Writes DIR/tables/ and, with `model_file` (the dense part's bytes),
// DIR/model.pstrain, then DIR/export.json. Waits up to `wait` for every
// server's checkpoint of the step (written in the background as the job
// ends). FAILED_PRECONDITION for a job without tables or checkpoint.dir;
// DEADLINE_EXCEEDED naming a server's file that did not come; the read's
// error naming the file otherwise.
absl::Status ExportTables(FileSystem* fs, const TableExportSource& source,
                          const std::string& model_file, const std::string& dir,
                          absl::Duration wait);

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_TABLE_EXPORT_H_
