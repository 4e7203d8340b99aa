#include "server/parameter_service.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/direct_connection.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"
#include "glog/logging.h"

namespace pstrain::server {
namespace {

using Method = ParameterMethod;

// A stream stops reading requests while it owes this many replies, or has
// this many reply bytes queued, and reads on once half of that is left: a
// client that sends without reading cannot make the server buffer without
// bound.
constexpr int64_t kMaxRepliesOwed = 1024;
constexpr int64_t kMaxQueuedReplyBytes = 64 << 20;

// A stream as the store and the request handling see it, whatever carries
// it: every request owes one reply, which the store's waits or an ACK pay.
class ReplyingStream : public ChunkWaiter {
 public:
  // Called for every request before it is handled: it owes one reply.
  // RESOURCE_EXHAUSTED past the client's limit.
  virtual absl::Status ExpectReply() = 0;
  virtual void Reply(grpc::ByteBuffer frame) = 0;
  // Ends the stream with `status`; later replies are dropped.
  virtual void Fail(const absl::Status& status) = 0;

  void OnValues(const v1::ChunkHeader& request, const ChunkValues& values) final {
    v1::ChunkHeader reply;
    reply.set_kind(v1::FRAME_KIND_VALUES);
    reply.set_job_id(request.job_id());
    reply.set_worker(request.worker());
    reply.set_step(request.step());
    reply.set_chunk(request.chunk());
    reply.set_version(values.version);
    reply.set_dtype(values.dtype);
    reply.set_num_elements(static_cast<uint32_t>(values.num_values));
    Reply(EncodeFrameShared(reply, values.data, values.owner));
  }
  void OnAbort(const absl::Status& status) final { Fail(status); }
};

// The requests of one stream: each frame checked and handed to the store,
// which answers through the stream. The stream's carrier calls it from one
// thread at a time.
class StreamRequests {
 public:
  // `caller`: the node id of the client's certificate, checked against
  // `roster` for every frame; nullopt: plaintext, not checked.
  StreamRequests(ShardStore* store, Method method, const WorkerRoster* roster,
                 std::optional<std::string> caller)
      : store_(store), method_(method), roster_(roster), caller_(std::move(caller)) {}

  // An error ends the stream (nothing was handed to the store).
  // `borrowed`: the request lies in memory the peer may change and that is
  // this process's only during the call (ShardStore::Push).
  absl::Status Handle(const grpc::ByteBuffer& request,
                      const std::shared_ptr<ReplyingStream>& stream, bool borrowed = false) {
    absl::StatusOr<Frame> frame = Frame::Parse(request);
    if (!frame.ok()) return frame.status();
    const v1::FrameKind kind = frame->header().kind();
    const v1::FrameKind expected = method_ == Method::kPull ? v1::FRAME_KIND_PULL
                                                            : v1::FRAME_KIND_PUSH;
    const bool step_end = method_ == Method::kPush && kind == v1::FRAME_KIND_STEP_END;
    const bool init = method_ == Method::kPush && kind == v1::FRAME_KIND_INIT;
    if (kind != expected && !step_end && !init) {
      return absl::InvalidArgumentError(
          absl::StrCat("frame kind ", v1::FrameKind_Name(kind), " not allowed on this method"));
    }
    if (caller_.has_value()) PSTRAIN_RETURN_IF_ERROR(roster_->Check(*caller_, frame->header()));
    PSTRAIN_RETURN_IF_ERROR(stream->ExpectReply());
    absl::Status status;
    switch (method_) {
      case Method::kPush: {
        v1::ChunkHeader ack = frame->header();
        status = step_end ? store_->EndStep(ack)
                 : init   ? store_->Init(borrowed ? frame->OwnedCopy() : *frame)
                          : store_->Push(*std::move(frame), nullptr, borrowed);
        if (status.ok()) {
          ack.set_kind(v1::FRAME_KIND_ACK);
          ack.set_num_elements(0);
          stream->Reply(EncodeFrame(ack, nullptr));
        }
        break;
      }
      case Method::kPushPull:
        parked_.emplace(frame->header().job_id(), frame->header().chunk());
        status = store_->Push(*std::move(frame), stream, borrowed);
        break;
      case Method::kPull:
        parked_.emplace(frame->header().job_id(), frame->header().chunk());
        status = store_->Pull(frame->header(), stream);
        break;
    }
    return status;
  }

  // The stream is gone: its waits are dropped now, which releases the
  // client's budget.
  void DropWaits() {
    for (const auto& [job_id, chunk] : parked_) store_->DropAbandonedWaits(job_id, chunk);
    parked_.clear();
  }

 private:
  ShardStore* const store_;
  const Method method_;
  const WorkerRoster* const roster_;
  const std::optional<std::string> caller_;
  // The chunks where the stream's requests may wait, by job.
  std::set<std::pair<std::string, uint32_t>> parked_;
};

class ChunkStream;

// The part of a gRPC stream that the store may call into after the
// reactor is gone: owned jointly by the reactor and by the store's waits.
class StreamState final : public ReplyingStream {
 public:
  StreamState(ChunkStream* reactor, ClientLoad* load, std::string client)
      : reactor_(reactor), load_(load), client_(std::move(client)) {}
  // The replies still owed are released once the store holds no wait of
  // the stream any more.
  ~StreamState() override { load_->Paid(client_, replies_owed_); }

  bool Abandoned() const override {
    absl::MutexLock lock(&mu_);
    return reactor_ == nullptr || !error_.ok();
  }
  absl::Status ExpectReply() override {
    PSTRAIN_RETURN_IF_ERROR(load_->Owe(client_));
    absl::MutexLock lock(&mu_);
    ++replies_owed_;
    return absl::OkStatus();
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
    if (!error_.ok() || (reads_done_ && replies_owed_ == 0)) {
      finishing_ = true;
      return true;
    }
    return false;
  }
  void FinishNow();
  // Over the limits (divided by `slack`)?
  bool Congested(int slack) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return replies_owed_ > kMaxRepliesOwed / slack ||
           queued_bytes_ > kMaxQueuedReplyBytes / slack;
  }

  mutable absl::Mutex mu_;
  ChunkStream* reactor_ ABSL_GUARDED_BY(mu_);
  ClientLoad* const load_;
  const std::string client_;
  std::deque<grpc::ByteBuffer> queue_ ABSL_GUARDED_BY(mu_);  // front is being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  bool read_starting_ ABSL_GUARDED_BY(mu_) = false;
  int64_t replies_owed_ ABSL_GUARDED_BY(mu_) = 0;
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
    --replies_owed_;
    load_->Paid(client_, 1);
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

// A direct connection's sending side as its streams see it: the
// store may hold a stream after the connection is gone.
class DirectSender {
 public:
  explicit DirectSender(DirectConnection* connection) : connection_(connection) {}
  void Send(uint8_t type, uint32_t stream, const grpc::ByteBuffer* body) {
    absl::ReaderMutexLock lock(&mu_);
    if (connection_ != nullptr) connection_->Send(type, 0, stream, body);
  }
  void SendAll(std::vector<DirectConnection::Message> messages) {
    absl::ReaderMutexLock lock(&mu_);
    if (connection_ != nullptr) connection_->SendAll(std::move(messages));
  }
  void Post(std::function<void()> fn) {
    absl::ReaderMutexLock lock(&mu_);
    if (connection_ != nullptr) connection_->Post(std::move(fn));
  }
  bool gone() const {
    absl::ReaderMutexLock lock(&mu_);
    return connection_ == nullptr;
  }
  void Detach() {
    absl::MutexLock lock(&mu_);
    connection_ = nullptr;
  }

 private:
  mutable absl::Mutex mu_;
  DirectConnection* connection_ ABSL_GUARDED_BY(mu_);
};

// kDirectDone's body.
grpc::ByteBuffer DoneBody(const absl::Status& status) {
  std::string body(4, '\0');
  const auto code = static_cast<uint32_t>(status.code());
  for (int i = 0; i < 4; ++i) body[i] = static_cast<char>(code >> (8 * i));
  body.append(status.message().data(), status.message().size());
  grpc::Slice slice(body);
  return grpc::ByteBuffer(&slice, 1);
}

// One stream of a direct connection. It ends OK once the client
// has sent its last request and every request has been answered; then (or
// on a failure) `on_end` runs, on any thread.
class DirectStream final : public ReplyingStream {
 public:
  DirectStream(std::shared_ptr<DirectSender> sender, uint32_t id, ClientLoad* load,
               std::string client, std::function<void()> on_end)
      : sender_(std::move(sender)),
        id_(id),
        load_(load),
        client_(std::move(client)),
        on_end_(std::move(on_end)) {}
  ~DirectStream() override { load_->Paid(client_, owed_); }

  absl::Status ExpectReply() override {
    PSTRAIN_RETURN_IF_ERROR(load_->Owe(client_));
    absl::MutexLock lock(&mu_);
    ++owed_;
    return absl::OkStatus();
  }
  void Reply(grpc::ByteBuffer frame) override {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    --owed_;
    load_->Paid(client_, 1);
    // The last reply goes with the stream's end.
    if (!EndIfDone(&frame)) sender_->Send(kDirectReply, id_, &frame);
  }
  void Fail(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    End(status);
  }
  bool Abandoned() const override {
    absl::MutexLock lock(&mu_);
    return ended_ || sender_->gone();
  }
  void LastRequest() {
    absl::MutexLock lock(&mu_);
    last_request_ = true;
    EndIfDone();
  }
  // The client gave up on it: no reply is sent any more.
  void Cancel() {
    absl::MutexLock lock(&mu_);
    ended_ = true;
  }

 private:
  // Ends the stream if it is done (after `last_reply`); true if it did.
  bool EndIfDone(const grpc::ByteBuffer* last_reply = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!last_request_ || owed_ != 0) return false;
    End(absl::OkStatus(), last_reply);
    return true;
  }
  // Sends the stream's end (after `last_reply`, if given).
  void End(const absl::Status& status, const grpc::ByteBuffer* last_reply = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return;
    ended_ = true;
    const grpc::ByteBuffer done = DoneBody(status);
    std::vector<DirectConnection::Message> messages;
    if (last_reply != nullptr) {
      messages.push_back(
          {.type = kDirectReply, .stream = id_, .body = last_reply, .on_written = nullptr});
    }
    messages.push_back({.type = kDirectDone, .stream = id_, .body = &done, .on_written = nullptr});
    sender_->SendAll(std::move(messages));
    on_end_();
  }

  const std::shared_ptr<DirectSender> sender_;
  const uint32_t id_;
  ClientLoad* const load_;
  const std::string client_;
  const std::function<void()> on_end_;
  mutable absl::Mutex mu_;
  int64_t owed_ ABSL_GUARDED_BY(mu_) = 0;
  bool last_request_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

// A stream of this process's own worker (InProcessService): its requests
// are handled on the worker's thread, its replies handed over on the
// thread that has them.
class InProcessStream final : public ReplyingStream {
 public:
  InProcessStream(ClientLoad* load, std::string client, InProcessService::ReplyFn on_reply,
                  InProcessService::DoneFn on_done)
      : load_(load),
        client_(std::move(client)),
        on_reply_(std::move(on_reply)),
        on_done_(std::move(on_done)) {}
  ~InProcessStream() override { load_->Paid(client_, owed_); }

  absl::Status ExpectReply() override {
    PSTRAIN_RETURN_IF_ERROR(load_->Owe(client_));
    absl::MutexLock lock(&mu_);
    ++owed_;
    return absl::OkStatus();
  }
  // Under the stream's lock: a Cancel waits for a reply being handed over,
  // and nothing is handed over after it.
  void Reply(grpc::ByteBuffer frame) override {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    --owed_;
    load_->Paid(client_, 1);
    on_reply_(frame);
    EndIfDone();
  }
  void Fail(const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    End(status);
  }
  bool Abandoned() const override {
    absl::MutexLock lock(&mu_);
    return ended_;
  }
  bool ended() const { return Abandoned(); }
  void LastRequest() {
    absl::MutexLock lock(&mu_);
    last_request_ = true;
    EndIfDone();
  }
  void Cancel() { Fail(absl::CancelledError("stream cancelled")); }

 private:
  void EndIfDone() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (last_request_ && owed_ == 0) End(absl::OkStatus());
  }
  void End(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return;
    ended_ = true;
    on_done_(status);
    // What the callbacks hold (the client's exchange) goes now.
    on_reply_ = nullptr;
    on_done_ = nullptr;
  }

  ClientLoad* const load_;
  const std::string client_;
  mutable absl::Mutex mu_;
  InProcessService::ReplyFn on_reply_ ABSL_GUARDED_BY(mu_);
  InProcessService::DoneFn on_done_ ABSL_GUARDED_BY(mu_);
  int64_t owed_ ABSL_GUARDED_BY(mu_) = 0;
  bool last_request_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

// "ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7" (gRPC's peer strings).
std::string PeerHost(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos || colon < peer.find(':') + 1 ? peer : peer.substr(0, colon);
}

}  // namespace

grpc::ServerGenericBidiReactor* ParameterService::CreateReactor(
    grpc::GenericCallbackServerContext* ctx) {
  if (ctx->method() == kHelloMethod) {
    absl::MutexLock lock(&hello_mu_);
    return new HelloCall(hello_);
  }
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
  if (absl::Status s = load_.OpenStream(client); !s.ok()) {
    return new Refused(ToGrpcStatus(s));
  }
  return new ChunkStream(store_, method, roster_, std::move(caller), &load_, std::move(client));
}

// One direct client (a worker's transport, through shared memory or over
// TCP): its streams, handled
// on the connection's thread as a gRPC stream's are on gRPC's.
class ParameterService::DirectPeer {
 public:
  DirectPeer(ParameterService* service, std::unique_ptr<DirectConnection> connection)
      : service_(service),
        connection_(std::move(connection)),
        sender_(std::make_shared<DirectSender>(connection_.get())),
        client_(connection_->peer()) {
    // Requests through shared memory are read where they lie: a push is
    // summed from the pipe by the update it completes, or copied.
    connection_->Start([this](DirectMessage m) { OnMessage(std::move(m)); },
                       [this](const absl::Status& status) { OnClosed(status); },
                       /*on_tick=*/nullptr, [](uint8_t type) { return type == kDirectRequest; });
  }
  // Ends the connection: its streams are dropped as the client's would be.
  ~DirectPeer() { connection_->Close(); }

  bool closed() const {
    absl::MutexLock lock(&mu_);
    return closed_;
  }

 private:
  struct Stream {
    std::shared_ptr<DirectStream> state;
    std::unique_ptr<StreamRequests> requests;
  };

  void OnMessage(DirectMessage m) {
    switch (m.type) {
      case kDirectOpen:
        Open(m.stream, m.flags);
        return;
      case kDirectRequest: {
        auto it = streams_.find(m.stream);
        if (it == streams_.end()) return;  // ended already: its requests go nowhere
        if (absl::Status s = it->second.requests->Handle(m.Body(), it->second.state, m.borrowed);
            !s.ok()) {
          it->second.state->Fail(s);
          return;
        }
        if (m.flags & kDirectLast) it->second.state->LastRequest();
        return;
      }
      case kDirectCancel:
        if (auto it = streams_.find(m.stream); it != streams_.end()) {
          it->second.state->Cancel();
          Erase(it);
        }
        return;
      default:
        LOG(WARNING) << "direct client " << client_ << ": unknown message type "
                     << static_cast<int>(m.type) << ", ignored";
    }
  }

  void Open(uint32_t id, uint8_t method_code) {
    auto refuse = [&](const absl::Status& status) {
      const grpc::ByteBuffer done = DoneBody(status);
      sender_->Send(kDirectDone, id, &done);
    };
    if (streams_.count(id) != 0) {
      refuse(absl::InvalidArgumentError(absl::StrCat("stream ", id, " is open already")));
      return;
    }
    if (method_code > static_cast<uint8_t>(Method::kPushPull)) {
      refuse(absl::UnimplementedError(absl::StrCat("unknown method ", method_code)));
      return;
    }
    const auto method = static_cast<Method>(method_code);
    if (absl::Status s = service_->load_.OpenStream(client_); !s.ok()) {
      refuse(s);
      return;
    }
    // Runs where the stream ends (any thread): erased on the connection's.
    auto on_end = [this, id, sender = sender_] {
      sender->Post([this, id] {
        if (auto it = streams_.find(id); it != streams_.end()) Erase(it);
      });
    };
    Stream& stream = streams_[id];
    stream.state =
        std::make_shared<DirectStream>(sender_, id, &service_->load_, client_, std::move(on_end));
    stream.requests = std::make_unique<StreamRequests>(service_->store_, method, service_->roster_,
                                                       std::nullopt);
  }

  void Erase(std::map<uint32_t, Stream>::iterator it) {
    it->second.requests->DropWaits();
    service_->load_.CloseStream(client_);
    streams_.erase(it);
  }

  void OnClosed(const absl::Status& status) {
    VLOG(1) << "direct client " << client_ << " gone: " << status;
    sender_->Detach();
    while (!streams_.empty()) {
      streams_.begin()->second.state->Cancel();
      Erase(streams_.begin());
    }
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }

  ParameterService* const service_;
  const std::unique_ptr<DirectConnection> connection_;
  const std::shared_ptr<DirectSender> sender_;
  const std::string client_;  // its ClientLoad budget: the process
  std::map<uint32_t, Stream> streams_;  // the connection's thread only
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

// One transport's streams to the server of its own process.
class ParameterService::InProcessSession final : public InProcessService::Session {
 public:
  explicit InProcessSession(ParameterService* service) : service_(service) {}
  ~InProcessSession() override { CancelAll(); }

  void Exchange(ParameterMethod method, std::vector<grpc::ByteBuffer> requests,
                InProcessService::SentFn on_sent, InProcessService::ReplyFn on_reply,
                InProcessService::DoneFn on_done) override {
    CloseEnded();
    auto state = std::make_shared<InProcessStream>(&service_->load_, kClient, std::move(on_reply),
                                                   std::move(on_done));
    if (absl::Status s = service_->load_.OpenStream(kClient); !s.ok()) {
      state->Fail(s);
      return;
    }
    auto stream = std::make_shared<Stream>(state, service_, method);
    {
      absl::MutexLock lock(&mu_);
      streams_.push_back(stream);
    }
    {
      absl::MutexLock lock(&stream->mu);
      for (const grpc::ByteBuffer& request : requests) {
        if (stream->closed || state->ended()) break;
        if (absl::Status s = stream->requests.Handle(request, state); !s.ok()) {
          state->Fail(s);
          break;
        }
      }
    }
    if (!state->ended() && on_sent) on_sent();
    state->LastRequest();
  }

  void CancelAll() override {
    std::vector<std::shared_ptr<Stream>> all;
    {
      absl::MutexLock lock(&mu_);
      all.swap(streams_);
    }
    for (const auto& stream : all) {
      stream->state->Cancel();
      Close(*stream);
    }
  }

 private:
  // The budget of this process's worker.
  static constexpr char kClient[] = "this process";

  struct Stream {
    Stream(std::shared_ptr<InProcessStream> s, ParameterService* service, Method method)
        : state(std::move(s)), requests(service->store_, method, service->roster_, std::nullopt) {}
    const std::shared_ptr<InProcessStream> state;
    absl::Mutex mu;  // a stream's requests are handled, or closed, one at a time
    StreamRequests requests ABSL_GUARDED_BY(mu);
    bool closed ABSL_GUARDED_BY(mu) = false;
  };

  void Close(Stream& stream) {
    absl::MutexLock lock(&stream.mu);
    if (stream.closed) return;
    stream.closed = true;
    stream.requests.DropWaits();
    service_->load_.CloseStream(kClient);
  }

  // Streams that ended are closed as new ones come.
  void CloseEnded() {
    std::vector<std::shared_ptr<Stream>> ended;
    {
      absl::MutexLock lock(&mu_);
      auto end = std::partition(streams_.begin(), streams_.end(),
                                [](const auto& s) { return !s->state->ended(); });
      ended.assign(end, streams_.end());
      streams_.erase(end, streams_.end());
    }
    for (const auto& stream : ended) Close(*stream);
  }

  ParameterService* const service_;
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Stream>> streams_ ABSL_GUARDED_BY(mu_);
};

std::unique_ptr<InProcessService::Session> ParameterService::OpenSession() {
  return std::make_unique<InProcessSession>(this);
}

uint64_t ParameterService::instance() const {
  absl::MutexLock lock(&hello_mu_);
  return instance_;
}

ParameterService::ParameterService(ShardStore* store, const WorkerRoster* roster,
                                   ClientLimits limits)
    : store_(store), roster_(roster), load_(limits) {}

ParameterService::~ParameterService() { StopDirectConnections(); }

void ParameterService::Accept(std::unique_ptr<DirectConnection> connection) {
  absl::MutexLock lock(&direct_mu_);
  if (direct_stopped_) return;
  // Peers whose client went away are dropped as new ones come.
  std::erase_if(direct_peers_, [](const std::unique_ptr<DirectPeer>& p) { return p->closed(); });
  direct_peers_.push_back(std::make_unique<DirectPeer>(this, std::move(connection)));
}

absl::Status ParameterService::AddListener(
    absl::StatusOr<std::unique_ptr<DirectListener>> listener) {
  if (!listener.ok()) return listener.status();
  absl::MutexLock lock(&direct_mu_);
  direct_listeners_.push_back(*std::move(listener));
  return absl::OkStatus();
}

absl::Status ParameterService::ServeSharedMemory(const std::string& name, uint64_t instance,
                                                 const ShmOptions& options) {
  return AddListener(DirectListener::Listen(
      name, instance, options,
      [this](std::unique_ptr<DirectConnection> c) { Accept(std::move(c)); }));
}

absl::StatusOr<int> ParameterService::ServeDirectTcp(const std::string& host, uint64_t instance,
                                                     const ShmOptions& options) {
  absl::StatusOr<std::unique_ptr<DirectListener>> listener = DirectListener::ListenTcp(
      host, instance, options,
      [this](std::unique_ptr<DirectConnection> c) { Accept(std::move(c)); });
  const int port = listener.ok() ? (*listener)->port() : 0;
  PSTRAIN_RETURN_IF_ERROR(AddListener(std::move(listener)));
  return port;
}

void ParameterService::StopDirectConnections() {
  std::vector<std::unique_ptr<DirectListener>> listeners;
  {
    absl::MutexLock lock(&direct_mu_);
    direct_stopped_ = true;
    listeners.swap(direct_listeners_);
  }
  for (const auto& listener : listeners) listener->Stop();
  std::vector<std::unique_ptr<DirectPeer>> peers;
  {
    absl::MutexLock lock(&direct_mu_);
    peers.swap(direct_peers_);
  }
  peers.clear();  // each ends its connection and drops its streams
}

void ParameterService::SetHello(const v1::HelloReply& hello) {
  absl::MutexLock lock(&hello_mu_);
  hello_ = hello.SerializeAsString();
  instance_ = hello.instance();
}

absl::Status ClientLoad::OpenStream(const std::string& client) {
  absl::MutexLock lock(&mu_);
  Load& load = clients_[client];
  if (load.streams >= limits_.streams) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client ", client, " has ", load.streams,
        " streams open, the most this server allows (--max_streams_per_client)"));
  }
  ++load.streams;
  return absl::OkStatus();
}

void ClientLoad::CloseStream(const std::string& client) {
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  --it->second.streams;
  Forget(it);
}

absl::Status ClientLoad::Owe(const std::string& client) {
  absl::MutexLock lock(&mu_);
  Load& load = clients_[client];
  if (load.owed >= limits_.owed_replies) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "client ", client, " is owed ", load.owed,
        " replies (waiting pulls and pushes), the most this server allows "
        "(--max_waits_per_client)"));
  }
  ++load.owed;
  return absl::OkStatus();
}

void ClientLoad::Paid(const std::string& client, int64_t replies) {
  if (replies == 0) return;
  absl::MutexLock lock(&mu_);
  auto it = clients_.find(client);
  it->second.owed -= replies;
  Forget(it);
}

void ClientLoad::Forget(std::map<std::string, Load>::iterator it) {
  if (it->second.streams == 0 && it->second.owed == 0) clients_.erase(it);
}

void WorkerRoster::Set(const std::string& job_id, int64_t generation,
                       std::vector<std::string> workers) {
  absl::MutexLock lock(&mu_);
  Job& job = jobs_[job_id];
  if (job.current.generation == generation) {
    job.current.workers = std::move(workers);
    return;
  }
  job.previous = std::move(job.current);
  job.current = {.generation = generation, .workers = std::move(workers)};
}

void WorkerRoster::Remove(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  jobs_.erase(job_id);
}

absl::Status WorkerRoster::Check(const std::string& caller, const v1::ChunkHeader& header) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = jobs_.find(header.job_id());
  if (it == jobs_.end()) {
    return absl::NotFoundError(absl::StrCat("job ", header.job_id().substr(0, 80), " is not held"));
  }
  const Job& job = it->second;
  const Generation* generation = header.generation() == job.current.generation ? &job.current
                                 : header.generation() == job.previous.generation
                                     ? &job.previous
                                     : nullptr;
  if (generation == nullptr) {
    if (header.generation() > job.current.generation) {
      return absl::UnavailableError(
          absl::StrCat("generation ", header.generation(), " is not loaded yet"));
    }
    return absl::AbortedError(absl::StrCat("generation ", header.generation(), " is over"));
  }
  const std::vector<std::string>& workers = generation->workers;
  if (header.kind() == v1::FRAME_KIND_PUSH || header.kind() == v1::FRAME_KIND_STEP_END ||
      header.kind() == v1::FRAME_KIND_INIT) {
    if (header.worker() < workers.size() && workers[header.worker()] == caller) {
      return absl::OkStatus();
    }
    return absl::PermissionDeniedError(absl::StrCat("node '", caller, "' is not worker ",
                                                    header.worker(), " of ", header.job_id()));
  }
  if (std::find(workers.begin(), workers.end(), caller) != workers.end()) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat("node '", caller, "' is not a worker of ", header.job_id()));
}

}  // namespace pstrain::server
