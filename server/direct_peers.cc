#include "server/direct_peers.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status.h"
#include "glog/logging.h"

namespace pstrain::server {
namespace {

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
        on_end_(std::move(on_end)),
        owed_(load, std::move(client)) {}

  absl::Status ExpectReply() override {
    absl::MutexLock lock(&mu_);
    return owed_.Owe();
  }
  void Reply(grpc::ByteBuffer frame) override {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    owed_.Pay();
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
    if (!last_request_ || owed_.count() != 0) return false;
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
  const std::function<void()> on_end_;
  mutable absl::Mutex mu_;
  OwedReplies owed_ ABSL_GUARDED_BY(mu_);
  bool last_request_ ABSL_GUARDED_BY(mu_) = false;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

// One direct client (a worker's transport, through shared memory or over
// TCP): its streams, handled on the connection's thread as a gRPC stream's
// are on gRPC's.
class DirectPeers::Peer {
 public:
  Peer(const StreamContext& context, std::unique_ptr<DirectConnection> connection)
      : context_(context),
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
  ~Peer() { connection_->Close(); }

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
    if (absl::Status s = context_.load->OpenStream(client_); !s.ok()) {
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
        std::make_shared<DirectStream>(sender_, id, context_.load, client_, std::move(on_end));
    stream.requests = std::make_unique<StreamRequests>(context_.store, method, context_.roster,
                                                       std::nullopt);
  }

  void Erase(std::map<uint32_t, Stream>::iterator it) {
    it->second.requests->DropWaits();
    context_.load->CloseStream(client_);
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

  const StreamContext context_;
  const std::unique_ptr<DirectConnection> connection_;
  const std::shared_ptr<DirectSender> sender_;
  const std::string client_;  // its ClientLoad budget: the process
  std::map<uint32_t, Stream> streams_;  // the connection's thread only
  mutable absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

DirectPeers::DirectPeers(const StreamContext& context) : context_(context) {}

DirectPeers::~DirectPeers() { Stop(); }

void DirectPeers::Accept(std::unique_ptr<DirectConnection> connection) {
  absl::MutexLock lock(&mu_);
  if (stopped_) return;
  // Peers whose client went away are dropped as new ones come.
  std::erase_if(peers_, [](const std::unique_ptr<Peer>& p) { return p->closed(); });
  peers_.push_back(std::make_unique<Peer>(context_, std::move(connection)));
}

absl::Status DirectPeers::AddListener(
    absl::StatusOr<std::unique_ptr<DirectListener>> listener) {
  if (!listener.ok()) return listener.status();
  absl::MutexLock lock(&mu_);
  listeners_.push_back(*std::move(listener));
  return absl::OkStatus();
}

absl::Status DirectPeers::ServeSharedMemory(const std::string& name, uint64_t instance,
                                                 const ShmOptions& options) {
  return AddListener(DirectListener::Listen(
      name, instance, options,
      [this](std::unique_ptr<DirectConnection> c) { Accept(std::move(c)); }));
}

absl::StatusOr<int> DirectPeers::ServeDirectTcp(const std::string& host, uint64_t instance,
                                                     const ShmOptions& options) {
  absl::StatusOr<std::unique_ptr<DirectListener>> listener = DirectListener::ListenTcp(
      host, instance, options,
      [this](std::unique_ptr<DirectConnection> c) { Accept(std::move(c)); });
  const int port = listener.ok() ? (*listener)->port() : 0;
  PSTRAIN_RETURN_IF_ERROR(AddListener(std::move(listener)));
  return port;
}

void DirectPeers::Stop() {
  std::vector<std::unique_ptr<DirectListener>> listeners;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    listeners.swap(listeners_);
  }
  for (const auto& listener : listeners) listener->Stop();
  std::vector<std::unique_ptr<Peer>> peers;
  {
    absl::MutexLock lock(&mu_);
    peers.swap(peers_);
  }
  peers.clear();  // each ends its connection and drops its streams
}

}  // namespace pstrain::server
