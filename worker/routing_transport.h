// The routing piece of a worker's transport: an exchange goes to the
// first carrier (carrier.h) that takes it. CreateGrpcTransport
// (transport.h) makes one with the carriers that reach the job's servers:
// the server of this process (in-process), direct connections, gRPC.
#ifndef PSTRAIN_WORKER_ROUTING_TRANSPORT_H_
#define PSTRAIN_WORKER_ROUTING_TRANSPORT_H_

#include <memory>
#include <vector>

#include "worker/carrier.h"
#include "worker/transport.h"

namespace pstrain::worker {

class RoutingTransport final : public ParameterTransport {
 public:
  // `carriers` in the order they are asked; in_process[s]: whether server s
  // is this process's (its exchanges run on the starting thread).
  RoutingTransport(std::vector<std::unique_ptr<Carrier>> carriers, std::vector<bool> in_process,
                   int channels_per_server);
  // Cancels every exchange; the carriers go in order, each waiting for its
  // own exchanges to end.
  ~RoutingTransport() override;

  int num_servers() const override { return static_cast<int>(in_process_.size()); }
  int channels_per_server() const override { return channels_per_server_; }
  bool in_process(int server) const override { return in_process_[server]; }

  // On the first carrier that takes it; UNAVAILABLE (on_done, at once) if
  // none does.
  void StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer> requests, absl::Time deadline,
                     SentFn on_sent, ReplyFn on_reply, DoneFn on_done) override;
  void CancelAll() override;

 private:
  const int channels_per_server_;
  const std::vector<bool> in_process_;
  std::vector<std::unique_ptr<Carrier>> carriers_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_ROUTING_TRANSPORT_H_
