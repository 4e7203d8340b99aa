#include "server/grpc_streams.h"

#include <deque>
#include <memory>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"

namespace pstrain::server {
namespace {

// A stream stops reading requests while it owes this many replies, or has
// this many reply bytes queued, and reads on once half of that is left: a
// client that sends without reading cannot make the server buffer without
// bound.
constexpr int64_t kMaxRepliesOwed = 1024;
constexpr int64_t kMaxQueuedReplyBytes = 64 << 20;

class ChunkStream;

// The part of a gRPC stream that the store may call into after the
// reactor is gone: owned jointly by the reactor and by the store's waits.
class StreamState final : public ReplyingStream {
 public:
  StreamState(ChunkStream* reactor, ClientLoad* load, std::string client)
      : reactor_(reactor), owed_(load, std::move(client)) {}

  bool Abandoned() const override {
    absl::MutexLock lock(&mu_);
    return reactor_ == nullptr || !error_.ok();
  }
  absl::Status ExpectReply() override {
    absl::MutexLock lock(&mu_);
    return owed_.Owe();
  }
  void Reply(grpc::ByteBuffer frame) override;
  void Fail(const absl::Status& status) override;
  void ReadsDone();
  // Returns true if reading, paused by back-pressure, should resume now;
  // the caller then starts the read and calls ReadStarted.
  bool WriteDone(bool ok);
  // True if the stream should read the next request now; false if it
  // failed, or if it pauses for back-pressure (WriteDone resumes it). On true
  // the caller starts the read and then calls ReadStarted: until then the
  // stream is not finished, so no read ever starts after Finish.
  bool BeginRead() {
    absl::MutexLock lock(&mu_);
    if (!error_.ok() || finishing_) return false;
    read_paused_ = Congested(1);
    read_starting_ = !read_paused_;
    return read_starting_;
  }
  void ReadStarted();
  void Detach() {
    absl::MutexLock lock(&mu_);
    reactor_ = nullptr;
  }

 private:
  // Decides, under mu_, whether to finish now; the caller finishes outside.
  bool ShouldFinish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finishing_ || writing_ || read_starting_ || reactor_ == nullptr) return false;
    if (!error_.ok() || (reads_done_ && owed_.count() == 0)) {
      finishing_ = true;
      return true;
    }
    return false;
  }
  void FinishNow();
  // Over the limits (divided by `slack`)?
  bool Congested(int slack) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return owed_.count() > kMaxRepliesOwed / slack ||
           queued_bytes_ > kMaxQueuedReplyBytes / slack;
  }

  mutable absl::Mutex mu_;
  ChunkStream* reactor_ ABSL_GUARDED_BY(mu_);
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);  // front is being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool read_starting_ ABSL_GUARDED_BY(mu_) = false;
  // The replies still owed are released once the store holds no wait of
  // the stream any more (it is destroyed).
  OwedReplies owed_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

class ChunkStream final : public grpc::ServerGenericBidiReactor {
 public:
  // `caller`: the node id of the client's certificate, checked against
  // `roster` for every frame; nullopt: plaintext, not checked.
  // `client`: whose budget of ClientLoad the stream counts against (it has
  // opened the stream in it).
  ChunkStream(ShardStore* store, Method method, const WorkerRoster* roster,
              std::optional<std::string> caller, ClientLoad* load, std::string client)
      : requests_(store, method, roster, std::move(caller)),
        load_(load),
        client_(client),
        state_(std::make_shared<StreamState>(this, load, std::move(client))) {
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      state_->ReadsDone();
      return;
    }
    if (absl::Status s = requests_.Handle(request_, state_); !s.ok()) {
      state_->Fail(s);
      return;
    }
    if (state_->BeginRead()) ReadNext();
  }

  void OnWriteDone(bool ok) override {
    if (state_->WriteDone(ok)) ReadNext();
  }

  void OnCancel() override { state_->Fail(absl::CancelledError("stream cancelled")); }

  void OnDone() override {
    state_->Detach();
    requests_.DropWaits();
    load_->CloseStream(client_);
    delete this;
  }

 private:
  void ReadNext() {
    StartRead(&request_);
    state_->ReadStarted();
  }

  StreamRequests requests_;
  ClientLoad* const load_;
  const std::string client_;
  const std::shared_ptr<StreamState> state_;
  grpc::ByteBuffer request_;
  friend class StreamState;
};

void StreamState::Reply(grpc::ByteBuffer frame) {
  ChunkStream* reactor = nullptr;
  const grpc::ByteBuffer* next = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (reactor_ == nullptr || finishing_) return;
    owed_.Pay();
    queued_bytes_ += static_cast<int64_t>(frame.Length());
    queue_.push_back(std::move(frame));
    if (writing_) return;
    writing_ = true;
    reactor = reactor_;
    next = &queue_.front();  // deque keeps element addresses on push_back
  }
  reactor->StartWrite(next);
}

bool StreamState::WriteDone(bool ok) {
  ChunkStream* reactor = nullptr;
  const grpc::ByteBuffer* next = nullptr;
  bool finish = false;
  bool resume_reading = false;
  {
    absl::MutexLock lock(&mu_);
    queued_bytes_ -= static_cast<int64_t>(queue_.front().Length());
    queue_.pop_front();
    if (!ok && error_.ok()) error_ = absl::CancelledError("write failed: stream broken");
    if (ok && !queue_.empty() && error_.ok()) {
      reactor = reactor_;
      next = &queue_.front();
    } else {
      writing_ = false;
      finish = ShouldFinish();
    }
    if (read_paused_ && error_.ok() && !finishing_ && !Congested(2)) {
      read_paused_ = false;
      read_starting_ = true;
      resume_reading = true;
    }
  }
  if (next != nullptr) {
    reactor->StartWrite(next);
  } else if (finish) {
    FinishNow();
  }
  return resume_reading;
}

void StreamState::Fail(const absl::Status& status) {
  bool finish;
  {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = status;
    finish = ShouldFinish();
  }
  if (finish) FinishNow();
}

void StreamState::ReadsDone() {
  bool finish;
  {
    absl::MutexLock lock(&mu_);
    reads_done_ = true;
    finish = ShouldFinish();
  }
  if (finish) FinishNow();
}

void StreamState::ReadStarted() {
  bool finish;
  {
    absl::MutexLock lock(&mu_);
    read_starting_ = false;
    finish = ShouldFinish();
  }
  if (finish) FinishNow();
}

void StreamState::FinishNow() {
  ChunkStream* reactor;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    reactor = reactor_;
    status = error_;
  }
  // finishing_ is set: the reactor cannot be finished twice, and OnDone, which
  // clears reactor_, cannot run before this Finish.
  reactor->Finish(ToGrpcStatus(status));
}

// Hello: reads the request, answers `reply`.
class HelloCall final : public grpc::ServerGenericBidiReactor {
 public:
  explicit HelloCall(const std::string& reply) {
    grpc::Slice slice(reply);
    reply_ = grpc::ByteBuffer(&slice, 1);
    StartRead(&request_);
  }
  void OnReadDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "Hello without a request"));
      return;
    }
    StartWriteAndFinish(&reply_, grpc::WriteOptions(), grpc::Status::OK);
  }
  void OnDone() override { delete this; }

 private:
  grpc::ByteBuffer request_, reply_;
};

// A stream ended at once with `status`.
class Refused final : public grpc::ServerGenericBidiReactor {
 public:
  explicit Refused(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

// "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7" (gRPC's peer strings).
std::string PeerHost(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos || colon < peer.find(':') + 1 ? peer : peer.substr(0, colon);
}

}  // namespace

grpc::ServerGenericBidiReactor* NewParameterReactor(grpc::GenericCallbackServerContext* ctx,
                                                    const StreamContext& context,
                                                    const std::string& hello) {
  if (ctx->method() == kHelloMethod) return new HelloCall(hello);
  Method method;
  if (ctx->method() == kPushPullMethod) {
    method = Method::kPushPull;
  } else if (ctx->method() == kPushMethod) {
    method = Method::kPush;
  } else if (ctx->method() == kPullMethod) {
    method = Method::kPull;
  } else {
    return new Refused(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                                    absl::StrCat("unknown method ", ctx->method())));
  }
  std::optional<std::string> caller;
  if (std::optional<PeerIdentity> identity = CallerIdentity(*ctx)) caller = identity->name;
  std::string client = caller.has_value() ? *caller : PeerHost(ctx->peer());
  if (absl::Status s = context.load->OpenStream(client); !s.ok()) {
    return new Refused(ToGrpcStatus(s));
  }
  return new ChunkStream(context.store, method, context.roster, std::move(caller), context.load,
                         std::move(client));
}

}  // namespace pstrain::server
