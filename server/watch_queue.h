// The server side of one WatchJob stream: a queue of events written one at a
// time, shared between the reactor and the job that publishes to it.
#ifndef PSTRAIN_SERVER_WATCH_QUEUE_H_
#define PSTRAIN_SERVER_WATCH_QUEUE_H_

#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "pstrain/v1/control.pb.h"

namespace pstrain::server {

class JobWatch;

// Thread-safe. Outlives the reactor: publishing to a queue whose stream is
// gone does nothing.
class WatchQueue {
 public:
  WatchQueue(JobWatch* reactor, size_t max_queued) : reactor_(reactor), max_queued_(max_queued) {}

  // Queues an event; `last` ends the stream OK once it is written. A watcher
  // that falls max_queued events behind loses progress events, never others.
  void Publish(const v1::JobEvent& event, bool last);
  // Ends the stream with `status`: after the queued events if OK, at once
  // otherwise.
  void End(const grpc::Status& status);
  // True once the stream has ended or is ending.
  bool Gone() const;

 private:
  friend class JobWatch;
  void WriteDone(bool ok);
  void Detach();
  // Starts the next write or the finish, outside the lock.
  void Next();
  // Drops the events not yet written; the one being written stays until its
  // write completes.
  void DropQueued() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  JobWatch* reactor_ ABSL_GUARDED_BY(mu_);
  const size_t max_queued_;
  std::deque<v1::JobEvent> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;  // no more events accepted
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

// The reactor; deletes itself when done.
class JobWatch final : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  explicit JobWatch(size_t max_queued)
      : queue_(std::make_shared<WatchQueue>(this, max_queued)) {}
  const std::shared_ptr<WatchQueue>& queue() const { return queue_; }

  void OnWriteDone(bool ok) override { queue_->WriteDone(ok); }
  void OnCancel() override { queue_->End(grpc::Status::CANCELLED); }
  void OnDone() override {
    queue_->Detach();
    delete this;
  }

 private:
  const std::shared_ptr<WatchQueue> queue_;
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_WATCH_QUEUE_H_
