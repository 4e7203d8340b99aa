// The direct carrier (carrier.h): the parameter streams to each server
// that takes direct connections, over shared_memory connections to a
// process of this machine or one TCP connection to another
// (direct_streams.h). It declines a server it has no connection to, and
// one whose connections have ended (the server went away): gRPC then.
#ifndef PSTRAIN_WORKER_DIRECT_CARRIER_H_
#define PSTRAIN_WORKER_DIRECT_CARRIER_H_

#include <memory>
#include <vector>

#include "common/direct_connection.h"
#include "worker/carrier.h"
#include "worker/direct_streams.h"

namespace pstrain::worker {

class DirectCarrier final : public Carrier {
 public:
  // by_server[s]: the connections to server s (none: not reached).
  explicit DirectCarrier(std::vector<std::vector<std::unique_ptr<DirectConnection>>> by_server);
  // Ends every connection; every stream's on_done has run when it returns.
  ~DirectCarrier() override = default;

  bool StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer>& requests, absl::Time deadline,
                     SentFn& on_sent, ReplyFn& on_reply, DoneFn& on_done) override;
  void CancelAll() override;

 private:
  // By server: its connections' streams.
  std::vector<std::vector<std::unique_ptr<DirectStreams>>> streams_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_DIRECT_CARRIER_H_
