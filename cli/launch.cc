#include "cli/launch.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/clock.h"
#include "common/enum_names.h"
#include "common/files.h"
#include "common/rpc.h"
#include "common/status.h"

namespace pstrain::cli {

absl::StatusOr<v1::Job> JobFollower::Follow(const std::string& job_id, ProgressDisplay& display,
                                            absl::Duration patience, bool retry_every_error) {
  absl::StatusOr<v1::Job> job = absl::CancelledError("not followed");
  absl::Time unreachable_since = absl::InfiniteFuture();
  while (true) {
    grpc::ClientContext context;
    if (authorize_) authorize_(context);
    {
      absl::MutexLock lock(&mu_);
      if (!stopped_.empty()) break;
      watching_ = &context;
    }
    job = FollowJob(*stub_, job_id, context, [&](const v1::JobEvent& event, const v1::Job& now) {
      display.OnEvent(event, now);
    });
    {
      absl::MutexLock lock(&mu_);
      watching_ = nullptr;
      if (!stopped_.empty()) break;
    }
    if (job.ok() && job->state() >= v1::JOB_STATE_SUCCEEDED) break;
    const absl::Time now = MonotonicNow();
    if (job.ok() || retry_every_error || job.status().code() == absl::StatusCode::kUnavailable) {
      unreachable_since = std::min(unreachable_since, now);
      if (now - unreachable_since < patience) {
        absl::SleepFor(absl::Milliseconds(200));
        continue;
      }
    }
    break;
  }
  if (job.ok()) {
    // The job as the coordinator has it (its recoveries, checkpoints).
    if (absl::StatusOr<v1::Job> full = Get(job->id()); full.ok()) job = *std::move(full);
    job = WithLastCheckpoint(*std::move(job));
  }
  return job;
}

absl::StatusOr<v1::Job> JobFollower::Get(const std::string& job_id) {
  v1::GetJobRequest get;
  get.set_job_id(job_id);
  v1::Job job;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  context.set_wait_for_ready(true);
  if (authorize_) authorize_(context);
  PSTRAIN_RETURN_IF_ERROR(FromGrpcStatus(stub_->GetJob(&context, get, &job)));
  return job;
}

v1::Job JobFollower::WithLastCheckpoint(v1::Job job) {
  const v1::CheckpointSpec& checkpoint = job.spec().checkpoint();
  if (job.state() != v1::JOB_STATE_SUCCEEDED || checkpoint.dir().empty() ||
      checkpoint.every_steps() <= 0) {
    return job;
  }
  // The servers report the checkpoints of the job's last steps as they are
  // written, after its end: the last one a few seconds at most.
  const int64_t last = job.result().steps() / checkpoint.every_steps() * checkpoint.every_steps();
  const absl::Time give_up = MonotonicNow() + absl::Seconds(10);
  while (job.last_checkpoint_step() < last && MonotonicNow() < give_up) {
    absl::SleepFor(absl::Milliseconds(100));
    if (absl::StatusOr<v1::Job> now = Get(job.id()); now.ok()) job = *std::move(now);
  }
  return job;
}

void JobFollower::Stop(const std::string& why) {
  absl::MutexLock lock(&mu_);
  if (stopped_.empty()) stopped_ = why;
  if (watching_ != nullptr) watching_->TryCancel();
}

std::string JobFollower::stopped() const {
  absl::MutexLock lock(&mu_);
  return stopped_;
}

absl::Status CheckExportPath(const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  const std::string dir = std::filesystem::path(path).parent_path().string();
  if (access(dir.empty() ? "." : dir.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--export ", path, ": cannot write in ", dir.empty() ? "." : dir, ": ",
                     std::strerror(errno)));
  }
  return absl::OkStatus();
}

int EndLaunch(const LaunchEnd& end, v1::Control::Stub& stub, const Authorize& authorize,
              const absl::StatusOr<v1::Job>& job, const std::string& failure) {
  std::string why = failure;
  if (job.ok() && job->state() == v1::JOB_STATE_SUCCEEDED) {
    if (end.export_path.empty()) {
      const int code = end.stop(0);
      PrintResult(*job);
      return code;
    }
    grpc::ClientContext context;
    SetTimeout(context, absl::Minutes(5));
    if (authorize) authorize(context);
    absl::StatusOr<std::string> written =
        WriteJobExport(stub, context, *job, end.export_path, absl::Minutes(5));
    if (written.ok()) {
      const int code = end.stop(0);
      std::printf("%s\n", written->c_str());
      PrintResult(*job);
      return code;
    }
    why = absl::StrCat("--export ", end.export_path, ": ", written.status().message());
  } else if (job.ok()) {
    why = absl::StrCat("job ", job->id(), " ", EnumName(job->state()), ": ", job->reason());
  } else if (why.empty()) {
    why = absl::StrCat("watching the job: ", job.status().message());
  }
  std::cerr << end.program << ": " << why << " (logs in " << end.run_dir << ")\n";
  return end.stop(1);
}

}  // namespace pstrain::cli
