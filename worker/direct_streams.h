// A worker's parameter streams to one server over a direct connection
// (common/direct_connection.h): what a gRPC stream of the parameter service
// does, with the same frames, replies and final status, but through memory
// both processes map, or over a TCP socket without HTTP/2.
#ifndef PSTRAIN_WORKER_DIRECT_STREAMS_H_
#define PSTRAIN_WORKER_DIRECT_STREAMS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/direct_connection.h"
#include "worker/transport.h"

namespace pstrain::worker {

// Thread-safe. Every callback of a stream runs on the connection's thread:
// on_reply never after on_done. (on_sent may run on the starting thread.)
class DirectStreams {
 public:
  explicit DirectStreams(std::unique_ptr<DirectConnection> connection);
  // Ends the connection; every open stream's on_done has run (CANCELLED)
  // when it returns.
  ~DirectStreams();

  // Starts one stream as ParameterTransport::StartExchange does, moving
  // from the callbacks (the requests are read, not kept). False, with
  // nothing started and the arguments as they were, once the connection
  // has ended (the server went away): the caller takes another way.
  bool StartExchange(ParameterMethod method, const std::vector<grpc::ByteBuffer>& requests,
                     absl::Time deadline, ParameterTransport::SentFn& on_sent,
                     ParameterTransport::ReplyFn& on_reply, ParameterTransport::DoneFn& on_done);

  // Streams started and not ended yet.
  int open_streams() const;

  // Ends every stream open now, and every one started later, with
  // CANCELLED (on the connection's thread, soon).
  void CancelAll();

 private:
  struct Stream {
    ParameterTransport::ReplyFn on_reply;
    ParameterTransport::DoneFn on_done;
    absl::Time deadline;
  };

  void OnMessage(DirectMessage message);
  void OnClosed(const absl::Status& status);
  // Streams cancelled or past their deadline end (connection's thread).
  void EndExpired();
  // Removes a stream and tells the server it is abandoned; null if it
  // has ended already.
  std::shared_ptr<Stream> Abandon(uint32_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::unique_ptr<DirectConnection> connection_;
  mutable absl::Mutex mu_;
  std::map<uint32_t, std::shared_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
  uint32_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_DIRECT_STREAMS_H_
