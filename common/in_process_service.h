// The parameter service of a server in this very process (a worker's
// colocated server, pstrain-worker --colocated_server), which that worker
// calls directly: its own shard's pushes are handed to the server's store
// as they lie in the worker's memory, on the worker's thread, and the
// values come back on the thread that has them. No copy of a push, no
// thread hop, no socket. Implemented by the parameter service
// (server/parameter_service.h), used by the worker's transport.
#ifndef PSTRAIN_COMMON_IN_PROCESS_SERVICE_H_
#define PSTRAIN_COMMON_IN_PROCESS_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/chunk_codec.h"
#include "grpcpp/support/byte_buffer.h"

namespace pstrain {

class InProcessService {
 public:
  using SentFn = std::function<void()>;
  using ReplyFn = std::function<void(const grpc::ByteBuffer& reply)>;
  using DoneFn = std::function<void(absl::Status status)>;

  // One client's streams (a transport's). Thread-safe.
  class Session {
   public:
    // CancelAll().
    virtual ~Session() = default;
    // One stream, as a gRPC stream of `method` with these requests: each
    // request is handled on this thread before Exchange returns (on_sent
    // then runs); every reply goes to on_reply on the thread that has it
    // (this one, or the one that completes a barrier); on_done runs once,
    // last, with the stream's status (the same errors as over gRPC). The
    // requests' payloads must stay unchanged while the server holds them:
    // until their replies, as for any transport.
    virtual void Exchange(ParameterMethod method, std::vector<grpc::ByteBuffer> requests,
                          SentFn on_sent, ReplyFn on_reply, DoneFn on_done) = 0;
    // Ends every stream open now with CANCELLED: when it returns, none of
    // them calls anything any more.
    virtual void CancelAll() = 0;
  };

  virtual ~InProcessService() = default;
  // What the server's Hello names as its instance: a transport that gets
  // it from a server's address reaches this one.
  virtual uint64_t instance() const = 0;
  virtual std::unique_ptr<Session> OpenSession() = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_IN_PROCESS_SERVICE_H_
