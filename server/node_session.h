// A node's Session stream, open for as long as its process lives: the
// coordinator learns at once that a process is gone (the stream is
// cancelled), and asks a node to heartbeat now (Nudge) when one of its jobs
// changed. Deletes itself when done.
#ifndef PSTRAIN_SERVER_NODE_SESSION_H_
#define PSTRAIN_SERVER_NODE_SESSION_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "pstrain/v1/membership.pb.h"

namespace pstrain::server {

class NodeSession final : public grpc::ServerWriteReactor<v1::SessionEvent> {
 public:
  // What the stream tells the membership service. Called without the
  // session's lock; must outlive every session.
  class Owner {
   public:
    virtual ~Owner() = default;
    // The stream was cancelled: the node's process is gone, or going.
    virtual void SessionClosed(NodeSession* session) = 0;
    // The stream is done; the session is deleted when this returns.
    virtual void SessionDone(NodeSession* session) = 0;
  };

  NodeSession(Owner* owner, const v1::SessionRequest& request)
      : owner_(owner), node_id_(request.node_id()), incarnation_(request.incarnation()) {}
  const std::string& node_id() const { return node_id_; }
  uint64_t incarnation() const { return incarnation_; }

  // Asks the node to heartbeat now. Thread-safe; nudges that come while
  // one is being written are folded into one more.
  void Nudge() ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the stream with `status` (once the write in flight, if any, is
  // done). Thread-safe.
  void End(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // gRPC is called outside the lock (a reaction may run on the calling
  // thread), and never Finish while a write is in flight: that write's
  // completion finishes instead.
  Owner* const owner_;
  const std::string node_id_;
  const uint64_t incarnation_;
  const v1::SessionEvent event_;
  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool again_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);  // set once ending
};

}  // namespace pstrain::server

#endif  // PSTRAIN_SERVER_NODE_SESSION_H_
