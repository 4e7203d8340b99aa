#include "worker/grpc_carrier.h"

#include <algorithm>
#include <atomic>
#include <utility>

#include "common/chunk_codec.h"
#include "common/rpc.h"
#include "common/tls.h"

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

}  // namespace

// One exchange: a bidi call that writes its requests as the window allows
// and hands on every reply. Deletes itself when done.
class ExchangeCall final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ExchangeCall(GrpcCarrier* carrier, std::vector<grpc::ByteBuffer> requests, int window,
               int64_t window_bytes, Carrier::SentFn on_sent,
               Carrier::ReplyFn on_reply, Carrier::DoneFn on_done)
      : carrier_(carrier),
        requests_(std::move(requests)),
        window_(WindowOf(requests_, window, window_bytes)),
        on_sent_(std::move(on_sent)),
        on_reply_(std::move(on_reply)),
        on_done_(std::move(on_done)) {}

  grpc::ClientContext* context() { return &context_; }

  void Start(grpc::GenericStub* stub, const char* method) {
    stub->PrepareBidiStreamingCall(&context_, method, grpc::StubOptions(), this);
    StartRead(&reply_);
    const grpc::ByteBuffer* first = nullptr;
    {
      absl::MutexLock lock(&mu_);
      first = NextWrite();
    }
    if (first != nullptr) {
      StartWrite(first);
    } else {
      StartWritesDone();  // nothing to send
    }
    StartCall();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return;  // the call is failing; OnDone reports why
    const grpc::ByteBuffer* next = nullptr;
    bool all_written = false;
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      all_written = ++written_ == requests_.size();
      if (!all_written) next = NextWrite();
    }
    if (all_written) {
      if (on_sent_) on_sent_();
      StartWritesDone();
    } else if (next != nullptr) {
      StartWrite(next);
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;
    // The window moves on before the reply is decoded: writes do not touch
    // reply_.
    const grpc::ByteBuffer* next = nullptr;
    {
      absl::MutexLock lock(&mu_);
      ++replies_;
      next = NextWrite();
    }
    if (next != nullptr) StartWrite(next);
    on_reply_(reply_);
    StartRead(&reply_);
  }

  void OnDone(const grpc::Status& status) override;

 private:
  // `window` requests, or as many of the largest as fit `window_bytes`.
  static int WindowOf(const std::vector<grpc::ByteBuffer>& requests, int window,
                      int64_t window_bytes) {
    size_t largest = 1;
    for (const grpc::ByteBuffer& r : requests) largest = std::max(largest, r.Length());
    return static_cast<int>(std::clamp<int64_t>(window_bytes / static_cast<int64_t>(largest),
                                                window, std::max<int64_t>(window, requests.size())));
  }

  // The request to write now, if the window allows one and no write is in
  // progress (gRPC allows one at a time); marks it in progress.
  const grpc::ByteBuffer* NextWrite() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_ || written_ >= requests_.size() ||
        written_ - replies_ >= static_cast<size_t>(window_)) {
      return nullptr;
    }
    writing_ = true;
    return &requests_[written_];
  }

  GrpcCarrier* const carrier_;
  grpc::ClientContext context_;
  const std::vector<grpc::ByteBuffer> requests_;
  const int window_;
  absl::Mutex mu_;
  size_t written_ ABSL_GUARDED_BY(mu_) = 0;  // requests whose write completed
  size_t replies_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer reply_;
  Carrier::SentFn on_sent_;
  Carrier::ReplyFn on_reply_;
  Carrier::DoneFn on_done_;
};

void ExchangeCall::OnDone(const grpc::Status& status) {
  on_done_(FromGrpcStatus(status));
  // The context holds a reference to the channel. Were it the last one, the
  // channel would be destroyed here, on one of gRPC's callback threads, and
  // if it were the process's last callback user that thread would tear
  // down the very queue it is polling. So the context goes first, while the
  // carrier still holds its channels; then the carrier may be destroyed,
  // on the application's thread, and drops them there.
  GrpcCarrier* carrier = carrier_;
  carrier->Forget(this);
  delete this;
  carrier->Release();
}

GrpcCarrier::GrpcCarrier(const std::vector<std::string>& dial_addresses,
                         const GrpcTransportOptions& options)
    : channels_per_server_(options.channels_per_server),
      window_(options.window),
      window_bytes_(options.window_bytes) {
  // gRPC shares one connection between all channels of a process with
  // equal arguments, whichever carrier made them: every channel gets a
  // pool index of its own, process-wide.
  static std::atomic<int> next_pool_index{0};
  for (const std::string& address : dial_addresses) {
    for (int c = 0; c < channels_per_server_; ++c) {
      stubs_.push_back(std::make_unique<grpc::GenericStub>(
          MakeChannel(address, {.security = options.security,
                                .peer_roles = {PeerRole::kServer},
                                .pool_index = next_pool_index++,
                                .metrics = options.metrics})));
    }
  }
  starter_ = std::thread([this] { StartLoop(); });
}

GrpcCarrier::~GrpcCarrier() {
  CancelAll();
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  starter_.join();  // after starting (cancelled) whatever was queued
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(+[](int* open) { return *open == 0; }, &calls_open_));
}

bool GrpcCarrier::StartExchange(int server, int channel, ParameterMethod method,
                                std::vector<grpc::ByteBuffer>& requests, absl::Time deadline,
                                SentFn& on_sent, ReplyFn& on_reply, DoneFn& on_done) {
  auto* call = new ExchangeCall(this, std::move(requests), window_, window_bytes_,
                                std::move(on_sent), std::move(on_reply), std::move(on_done));
  call->context()->set_deadline(absl::ToChronoTime(deadline));
  absl::MutexLock lock(&mu_);
  calls_.insert(call);
  ++calls_open_;
  if (cancelled_) call->context()->TryCancel();
  to_start_.push_back(
      {call, stubs_[server * channels_per_server_ + channel].get(), MethodName(method)});
  return true;
}

void GrpcCarrier::CancelAll() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  for (ExchangeCall* call : calls_) call->context()->TryCancel();
}

void GrpcCarrier::Forget(ExchangeCall* call) {
  absl::MutexLock lock(&mu_);
  calls_.erase(call);
}

void GrpcCarrier::Release() {
  absl::MutexLock lock(&mu_);
  --calls_open_;
}

void GrpcCarrier::StartLoop() {
  while (true) {
    ToStart next;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](GrpcCarrier* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return t->stopping_ || !t->to_start_.empty();
          },
          this));
      if (to_start_.empty()) return;  // stopping, nothing left
      next = to_start_.front();
      to_start_.pop_front();
    }
    next.call->Start(next.stub, next.method);
  }
}

}  // namespace pstrain::worker
