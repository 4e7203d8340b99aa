// What the command-line tools show of jobs: following a job's events, a
// live progress display, and short summaries.
#ifndef PSTRAIN_CLI_JOB_OUTPUT_H_
#define PSTRAIN_CLI_JOB_OUTPUT_H_

#include <cstdio>
#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/enum_names.h"
#include "common/json.h"
#include "pstrain/v1/control.grpc.pb.h"

namespace pstrain::cli {

// Follows the job through WatchJob until it ends (or `context` is
// cancelled), calling on_event with each event and the job as known after
// it. Returns the job as last known.
absl::StatusOr<v1::Job> FollowJob(
    v1::Control::Stub& stub, const std::string& job_id, grpc::ClientContext& context,
    const std::function<void(const v1::JobEvent&, const v1::Job&)>& on_event);

// Writes a succeeded job's export to `path` (--export, psctl export): its
// model file; for a job with embedding tables, a directory of the model
// file and the tables (server/table_export.h), whose rows are read from the
// servers' checkpoints of the last step (waiting up to `wait` for them).
// Returns what was written, as a line.
absl::StatusOr<std::string> WriteJobExport(v1::Control::Stub& stub, grpc::ClientContext& context,
                                           const v1::Job& job, const std::string& path,
                                           absl::Duration wait);


// A succeeded job's model file (ExportModel, on `context`), whole; the
// coordinator's error (FAILED_PRECONDITION for a job without one).
absl::StatusOr<std::string> FetchModelFile(v1::Control::Stub& stub, grpc::ClientContext& context,
                                           const std::string& job_id);

// Shows a job's progress: on a terminal, one line redrawn in place with a
// bar; elsewhere, a line every `interval`.
class ProgressDisplay {
 public:
  ProgressDisplay(std::FILE* out, bool terminal, absl::Duration interval)
      : out_(out), terminal_(terminal), interval_(interval) {}
  // Call with every event of FollowJob.
  void OnEvent(const v1::JobEvent& event, const v1::Job& job);

 private:
  void EndLine();

  std::FILE* const out_;
  const bool terminal_;
  const absl::Duration interval_;
  absl::Time last_ = absl::InfinitePast();
  bool line_open_ = false;
};

// "mlp 784-256-128-10".
std::string ModelSummary(const v1::JobSpec& spec);
// A worker's step: "batch 64", or "4 x batch 64 accumulated".
std::string WorkerBatchSummary(const v1::JobSpec& spec);
// "sync", "async", or "ssp (staleness 2)".
std::string ModeSummary(const v1::JobSpec& spec);
// "job-000001 succeeded: test accuracy 0.8602, final loss 0.3217, 1404
// steps in 16.9 s (10623 samples/s)": the test accuracy if the final model
// was evaluated, the script's own metrics if it gave any ("..., mse
// 0.0123, final loss ...").
std::string ResultSummary(const v1::Job& job);
// A job's script metrics: "auc 0.791, mse 0.0123" (by name).
std::string MetricsText(const google::protobuf::Map<std::string, double>& metrics);
// "compute 2.10 ms, reduce 0.00 ms, push 0.31 ms, wait 1.20 ms, pull 0.42 ms
// (4.03 ms per step)".
std::string StepTimesSummary(const v1::StepTimes& times);
// `s` with every control character (below 0x20, and 0x7f: newlines, tabs,
// the escape that starts a terminal's control sequences) written as \xNN,
// and backslashes doubled: what a peer sent cannot move the cursor, clear
// the screen or forge a line.
std::string Printable(absl::string_view s);
// The one-line JSON result of a job that ended (pstrain-local, pstrain-run);
// "metrics" holds the script's own, by name.
std::string ResultJson(const v1::Job& job);

// What the launchers print on stdout at the end of a job that succeeded:
// the step-time line, ResultSummary, and ResultJson last.
void PrintResult(const v1::Job& job);

}  // namespace pstrain::cli

#endif  // PSTRAIN_CLI_JOB_OUTPUT_H_
