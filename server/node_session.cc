#include "server/node_session.h"

namespace pstrain::server {

void NodeSession::Nudge() {
  {
    absl::MutexLock lock(&mu_);
    if (finish_.has_value()) return;
    if (writing_) {
      again_ = true;
      return;
    }
    writing_ = true;
  }
  StartWrite(&event_);
}

void NodeSession::End(const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (finish_.has_value()) return;
    finish_ = status;
    if (writing_) return;
  }
  Finish(status);
}

void NodeSession::OnWriteDone(bool ok) {
  std::optional<grpc::Status> finish;
  bool write_again = false;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok && !finish_.has_value()) finish_ = grpc::Status::CANCELLED;
    if (finish_.has_value()) {
      finish = finish_;
    } else if (again_) {
      again_ = false;
      writing_ = write_again = true;
    }
  }
  if (finish.has_value()) {
    Finish(*finish);
  } else if (write_again) {
    StartWrite(&event_);
  }
}

void NodeSession::OnCancel() {
  owner_->SessionClosed(this);
  End(grpc::Status::CANCELLED);
}

void NodeSession::OnDone() {
  owner_->SessionDone(this);
  delete this;
}

}  // namespace pstrain::server
