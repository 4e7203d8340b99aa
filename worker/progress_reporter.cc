#include "worker/progress_reporter.h"

#include <utility>

#include "glog/logging.h"

namespace pstrain::worker {

ProgressReporter::ProgressReporter(
    MembershipClient* membership,
    std::function<void(const v1::ReportProgressRequest&)> on_inactive)
    : membership_(membership), on_inactive_(std::move(on_inactive)) {
  thread_ = std::thread([this] { Loop(); });
}

ProgressReporter::~ProgressReporter() { Stop(); }

void ProgressReporter::Enqueue(const v1::ReportProgressRequest& r) {
  absl::MutexLock lock(&mu_);
  v1::ReportProgressRequest next = r;
  if (pending_.has_value() && pending_->job_id() == r.job_id() &&
      pending_->generation() == r.generation()) {
    for (v1::WorkerResumeState& state : *pending_->mutable_checkpoint_states()) {
      *next.add_checkpoint_states() = std::move(state);
    }
    if (pending_->evaluated() && !next.evaluated()) {
      next.set_evaluated(true);
      next.set_evaluated_step(pending_->evaluated_step());
      next.set_test_accuracy(pending_->test_accuracy());
      if (pending_->has_test_loss()) next.set_test_loss(pending_->test_loss());
    }
  }
  pending_ = std::move(next);
}

void ProgressReporter::Flush() {
  absl::MutexLock lock(&mu_);
  auto sent = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || (!pending_.has_value() && !sending_);
  };
  mu_.Await(absl::Condition(&sent));
}

void ProgressReporter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void ProgressReporter::Loop() {
  while (true) {
    v1::ReportProgressRequest r;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return pending_.has_value() || stopping_;
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      r = std::move(*pending_);
      pending_.reset();
      sending_ = true;
    }
    absl::StatusOr<bool> active = membership_->ReportProgress(r, absl::Seconds(5));
    {
      absl::MutexLock lock(&mu_);
      sending_ = false;
    }
    if (!active.ok()) {
      LOG(WARNING) << "progress report for " << r.job_id() << " not delivered: "
                   << active.status();
    } else if (!*active && on_inactive_) {
      on_inactive_(r);
    }
  }
}

}  // namespace pstrain::worker
