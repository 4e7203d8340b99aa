#include <set>

#include "absl/synchronization/mutex.h"
#include "common/rpc.h"
#include "grpcpp/generic/generic_stub.h"
#include "common/chunk_codec.h"
#include "worker/transport.h"

namespace pstrain::worker {
namespace {

const char* MethodName(ParameterMethod method) {
  switch (method) {
    case ParameterMethod::kPush:
      return kPushMethod;
    case ParameterMethod::kPull:
      return kPullMethod;
    case ParameterMethod::kPushPull:
      return kPushPullMethod;
  }
  return "";
}

class GrpcTransport;

class ExchangeCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ExchangeCall(GrpcTransport* transport, std::vector<grpc::ByteBuffer> requests,
               ParameterTransport::SentFn on_sent, ParameterTransport::ReplyFn on_reply,
               ParameterTransport::DoneFn on_done)
      : transport_(transport),
        requests_(std::move(requests)),
        on_sent_(std::move(on_sent)),
        on_reply_(std::move(on_reply)),
        on_done_(std::move(on_done)) {}

  grpc::ClientContext* context() { return &context_; }

  void Start(grpc::GenericStub* stub, const char* method) {
    stub->PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
    StartRead(&reply_);
    if (requests_.empty()) {
      StartWritesDone();
    } else {
      StartWrite(&requests_[0]);
    }
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call is failing; OnDone reports why
    if (++next_ < requests_.size()) {
      StartWrite(&requests_[next_]);
    } else {
      if (on_sent_) on_sent_();
      StartWritesDone();
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    on_reply_(reply_);
    StartRead(&reply_);
  }

  void OnDone(const grpc::Status& status) override;

 private:
  GrpcTransport* const transport_;
  grpc::ClientContext context_;
  std::vector<grpc::ByteBuffer> requests_;
  size_t next_ = 0;
  grpc::ByteBuffer reply_;
  ParameterTransport::SentFn on_sent_;
  ParameterTransport::ReplyFn on_reply_;
  ParameterTransport::DoneFn on_done_;
};

class GrpcTransport final : public ParameterTransport {
 public:
  GrpcTransport(const std::vector<std::string>& addresses, RpcMetrics* metrics) {
    for (const std::string& address : addresses) {
      stubs_.push_back(std::make_unique<grpc::GenericStub>(MakeChannel(address, 0, metrics)));
    }
  }

  ~GrpcTransport() override {
    CancelAll();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* open) { return *open == 0; }, &calls_open_));
  }

  int num_servers() const override { return static_cast<int>(stubs_.size()); }

  void StartExchange(int server, ParameterMethod method, std::vector<grpc::ByteBuffer> requests,
                     absl::Time deadline, SentFn on_sent, ReplyFn on_reply,
                     DoneFn on_done) override {
    auto* call = new ExchangeCall(this, std::move(requests), std::move(on_sent),
                                  std::move(on_reply), std::move(on_done));
    call->context()->set_deadline(absl::ToChronoTime(deadline));
    {
      absl::MutexLock lock(&mu_);
      calls_.insert(call);
      ++calls_open_;
      if (cancelled_) call->context()->TryCancel();
    }
    call->Start(stubs_[server].get(), MethodName(method));
  }

  void CancelAll() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (ExchangeCall* call : calls_) call->context()->TryCancel();
  }

  // A call that is ending: no longer cancelled by CancelAll, but the
  // transport stays until Release.
  void Forget(ExchangeCall* call) {
    absl::MutexLock lock(&mu_);
    calls_.erase(call);
  }
  // The call is gone, its context included: the transport may go.
  void Release() {
    absl::MutexLock lock(&mu_);
    --calls_open_;
  }

 private:
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  absl::Mutex mu_;
  std::set<ExchangeCall*> calls_ ABSL_GUARDED_BY(mu_);  // cancellable
  int calls_open_ ABSL_GUARDED_BY(mu_) = 0;             // not yet Released
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

void ExchangeCall::OnDone(const grpc::Status& status) {
  on_done_(FromGrpcStatus(status));
  // The context holds a reference to the channel. Were it the last one, the
  // channel would be destroyed here, on one of gRPC's callback threads, and
  // if it were the process's last callback user that thread would tear
  // down the very queue it is polling. So the context goes first, while the
  // transport still holds its channels; then the transport may be
  // destroyed, on the application's thread, and drops them there.
  GrpcTransport* transport = transport_;
  transport->Forget(this);
  delete this;
  transport->Release();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ParameterTransport>> CreateGrpcTransport(
    const std::vector<std::string>& server_addresses, RpcMetrics* metrics) {
  if (server_addresses.empty()) return absl::InvalidArgumentError("no server addresses");
  return std::make_unique<GrpcTransport>(server_addresses, metrics);
}

}  // namespace pstrain::worker
