// One way a worker's transport reaches the parameter servers: gRPC streams
// (grpc_carrier.h), direct connections through shared memory or over TCP
// (direct_carrier.h), or calls into the server of this very process
// (in_process_carrier.h). The transport that CreateGrpcTransport makes
// (routing_transport.cc) finds out, per server, which carriers reach it,
// and starts each exchange on the first of them that takes it: a carrier
// that does not reach a server, or no longer does (a direct connection
// that ended), declines and the next one carries the exchange.
#ifndef PSTRAIN_WORKER_CARRIER_H_
#define PSTRAIN_WORKER_CARRIER_H_

#include <vector>

#include "absl/time/time.h"
#include "grpcpp/support/byte_buffer.h"
#include "worker/transport.h"

namespace pstrain::worker {

// Thread-safe.
class Carrier {
 public:
  using SentFn = ParameterTransport::SentFn;
  using ReplyFn = ParameterTransport::ReplyFn;
  using DoneFn = ParameterTransport::DoneFn;

  virtual ~Carrier() = default;

  // Starts the exchange as ParameterTransport::StartExchange does, moving
  // from the arguments, if this carrier reaches server `server` now. Else
  // returns false with nothing started and the arguments as they were.
  virtual bool StartExchange(int server, int channel, ParameterMethod method,
                             std::vector<grpc::ByteBuffer>& requests, absl::Time deadline,
                             SentFn& on_sent, ReplyFn& on_reply, DoneFn& on_done) = 0;

  // Cancels every exchange in flight (they end with CANCELLED).
  virtual void CancelAll() = 0;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_CARRIER_H_
