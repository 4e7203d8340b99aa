// The gRPC carrier (carrier.h): generic bidi streams of the parameter
// service over a pool of channels per server, each its own connection,
// each stream with a window of requests ahead of their replies. It reaches
// every server: the carrier of last resort.
#ifndef PSTRAIN_WORKER_GRPC_CARRIER_H_
#define PSTRAIN_WORKER_GRPC_CARRIER_H_

#include <deque>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/generic/generic_stub.h"
#include "worker/carrier.h"

namespace pstrain::worker {

class ExchangeCall;

class GrpcCarrier final : public Carrier {
 public:
  // Server s is dialled at dial_addresses[s], over
  // options.channels_per_server channels (with options' window, TLS and
  // metrics).
  GrpcCarrier(const std::vector<std::string>& dial_addresses, const GrpcTransportOptions& options);
  // Cancels every call and waits until each is gone.
  ~GrpcCarrier() override;

  // Always true.
  bool StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer>& requests, absl::Time deadline,
                     SentFn& on_sent, ReplyFn& on_reply, DoneFn& on_done) override;
  void CancelAll() override;

  // A call that is ending: no longer cancelled by CancelAll, but the
  // carrier stays until Release.
  void Forget(ExchangeCall* call);
  // The call is gone, its context included: the carrier may go.
  void Release();

 private:
  struct ToStart {
    ExchangeCall* call;
    grpc::GenericStub* stub;
    const char* method;
  };

  // Starts the queued calls. Starting a call writes its first request, and
  // gRPC may do that write, socket included, on the thread that starts it:
  // here, so that a worker's training thread goes straight back to its
  // backward pass.
  void StartLoop();

  const int channels_per_server_;
  const int window_;
  const int64_t window_bytes_;
  // Server s, channel c: stubs_[s * channels_per_server_ + c].
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  absl::Mutex mu_;
  std::set<ExchangeCall*> calls_ ABSL_GUARDED_BY(mu_);  // cancellable
  int calls_open_ ABSL_GUARDED_BY(mu_) = 0;             // not yet Released
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<ToStart> to_start_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread starter_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_GRPC_CARRIER_H_
