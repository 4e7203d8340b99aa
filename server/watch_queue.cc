#include "server/watch_queue.h"

namespace pstrain::server {

void WatchQueue::Publish(const v1::JobEvent& event, bool last) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_ || reactor_ == nullptr) return;
    if (queue_.size() >= max_queued_ && event.has_progress()) return;
    queue_.push_back(event);
    if (last) {
      ended_ = true;
      status_ = grpc::Status::OK;
    }
  }
  Next();
}

void WatchQueue::End(const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    ended_ = true;
    status_ = status;
    if (!status.ok()) DropQueued();
  }
  Next();
}

bool WatchQueue::Gone() const {
  absl::MutexLock lock(&mu_);
  return reactor_ == nullptr || ended_;
}

void WatchQueue::WriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    queue_.pop_front();
    if (!ok) {
      ended_ = true;
      status_ = grpc::Status::CANCELLED;
      DropQueued();
    }
  }
  Next();
}

void WatchQueue::Detach() {
  absl::MutexLock lock(&mu_);
  reactor_ = nullptr;
}

void WatchQueue::DropQueued() {
  queue_.erase(writing_ ? queue_.begin() + 1 : queue_.begin(), queue_.end());
}

void WatchQueue::Next() {
  JobWatch* reactor;
  const v1::JobEvent* event = nullptr;
  grpc::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (writing_ || finished_ || reactor_ == nullptr) return;
    reactor = reactor_;
    if (!queue_.empty()) {
      writing_ = true;
      event = &queue_.front();
    } else if (ended_) {
      finished_ = true;
      status = status_;
    } else {
      return;
    }
  }
  // writing_ or finished_ is set: the reactor cannot reach OnDone before
  // this call, and the event stays in the queue until its write completes.
  if (event != nullptr) {
    reactor->StartWrite(event);
  } else {
    reactor->Finish(status);
  }
}

}  // namespace pstrain::server
