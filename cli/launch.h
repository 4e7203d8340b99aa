// What pstrain-local and pstrain-run share once their job is submitted:
// following it to its end (JobFollower), and the end itself (EndLaunch):
// the model file written where --export says, the result on stdout, or the
// reason the job failed on stderr.
#ifndef PSTRAIN_CLI_LAUNCH_H_
#define PSTRAIN_CLI_LAUNCH_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "cli/job_output.h"
#include "pstrain/v1/control.grpc.pb.h"

namespace pstrain::cli {

// Adds a call's credentials (a bearer token); may be null.
using Authorize = std::function<void(grpc::ClientContext&)>;

class JobFollower {
 public:
  // `stub` must outlive the follower.
  JobFollower(v1::Control::Stub* stub, Authorize authorize)
      : stub_(stub), authorize_(std::move(authorize)) {}

  // Follows the job's events (shown by `display`) until it ends, Stop is
  // called, or the coordinator has been unreachable for `patience` (a
  // coordinator that restarts ends a watch; the next starts with the job as
  // it is then). With `retry_every_error` any failed watch is tried again
  // (within `patience`), not only one that found the coordinator
  // unreachable. Returns the job as the coordinator has it at the end.
  absl::StatusOr<v1::Job> Follow(const std::string& job_id, ProgressDisplay& display,
                                 absl::Duration patience, bool retry_every_error)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Ends Follow soon, for `why` (the first reason stays). Thread-safe.
  void Stop(const std::string& why) ABSL_LOCKS_EXCLUDED(mu_);
  // Why Stop was called; empty if it was not.
  std::string stopped() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // A succeeded job once the coordinator has the checkpoint of its last
  // multiple of checkpoint.every_steps (written after its end; 10 s at
  // most), so that last_checkpoint_step is the last one written.
  v1::Job WithLastCheckpoint(v1::Job job);
  // The job as the coordinator has it now.
  absl::StatusOr<v1::Job> Get(const std::string& job_id);

  v1::Control::Stub* const stub_;
  const Authorize authorize_;
  mutable absl::Mutex mu_;
  grpc::ClientContext* watching_ ABSL_GUARDED_BY(mu_) = nullptr;  // the watch in progress
  std::string stopped_ ABSL_GUARDED_BY(mu_);
};

// Whether a model file can be written to `path` (--export): its directory
// exists and may be written; INVALID_ARGUMENT naming --export otherwise.
// Checked before training, so that a typo does not cost a run.
absl::Status CheckExportPath(const std::string& path);

struct LaunchEnd {
  absl::string_view program;  // "pstrain-local"
  std::string run_dir;        // where the logs are
  std::string export_path;    // --export; empty: none
  // Stops what the launch started (after the export, before the result is
  // printed) and returns the exit status it is given.
  std::function<int(int)> stop;
};

// The end of a launch whose job Follow returned: 0 once it succeeded and
// its model file, with export_path, is written there (a line says so),
// the result printed last (PrintResult); else 1, with a line on stderr
// naming the program, why (`failure` if the launch gave up on its own) and
// the logs.
int EndLaunch(const LaunchEnd& end, v1::Control::Stub& stub, const Authorize& authorize,
              const absl::StatusOr<v1::Job>& job, const std::string& failure);

}  // namespace pstrain::cli

#endif  // PSTRAIN_CLI_LAUNCH_H_
