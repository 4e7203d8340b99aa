// The gRPC ParameterTransport: generic bidi streams over a pool of channels
// per server, each stream with a window of requests ahead of their replies.
#include "worker/transport.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <optional>
#include <set>
#include <thread>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/chunk_codec.h"
#include "common/direct_connection.h"
#include "common/in_process_service.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"
#include "glog/logging.h"
#include "grpcpp/generic/generic_stub.h"
#include "worker/direct_streams.h"

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
  ExchangeCall(GrpcTransport* transport, std::vector<grpc::ByteBuffer> requests, int window,
               int64_t window_bytes, ParameterTransport::SentFn on_sent,
               ParameterTransport::ReplyFn on_reply, ParameterTransport::DoneFn on_done)
      : transport_(transport),
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

  GrpcTransport* const transport_;
  grpc::ClientContext context_;
  const std::vector<grpc::ByteBuffer> requests_;
  const int window_;
  absl::Mutex mu_;
  size_t written_ ABSL_GUARDED_BY(mu_) = 0;  // requests whose write completed
  size_t replies_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ByteBuffer reply_;
  ParameterTransport::SentFn on_sent_;
  ParameterTransport::ReplyFn on_reply_;
  ParameterTransport::DoneFn on_done_;
};

// Which of a server's direct connections carries a stream of `requests`
// (null: none): a small one (a step end, a small model's chunks) the first,
// so that a step's messages meet the same threads on both ends; a larger
// one the connection with the fewest streams open, the first of those.
DirectStreams* DirectFor(const std::vector<std::unique_ptr<DirectStreams>>& direct,
                         const std::vector<grpc::ByteBuffer>& requests) {
  constexpr size_t kSmallStreamBytes = 256 << 10;
  if (direct.empty()) return nullptr;
  size_t bytes = 0;
  for (const grpc::ByteBuffer& r : requests) bytes += r.Length();
  if (bytes <= kSmallStreamBytes) return direct.front().get();
  DirectStreams* best = nullptr;
  int best_open = 0;
  for (const auto& d : direct) {
    const int open = d->open_streams();
    if (best == nullptr || open < best_open) {
      best = d.get();
      best_open = open;
    }
  }
  return best;
}

// How a transport reaches one server: the address its channels dial, and
// direct connections if the server takes them: options.shm_connections
// through shared memory if it is a process of this machine, else one over
// TCP.
struct ServerRoute {
  std::string dial;
  std::vector<std::unique_ptr<DirectConnection>> direct;  // none: gRPC only
  bool in_process = false;  // the server of this process (options.in_process)
};
ServerRoute RouteTo(const std::string& address, const GrpcTransportOptions& options);

class GrpcTransport final : public ParameterTransport {
 public:
  GrpcTransport(const std::vector<std::string>& addresses, const GrpcTransportOptions& options)
      : channels_per_server_(options.channels_per_server),
        window_(options.window),
        window_bytes_(options.window_bytes) {
    // gRPC shares one connection between all channels of a process with
    // equal arguments, whichever transport made them: every channel gets a
    // pool index of its own, process-wide.
    static std::atomic<int> next_pool_index{0};
    for (const std::string& server_address : addresses) {
      ServerRoute route = RouteTo(server_address, options);
      const std::string& address = route.dial;
      in_process_.push_back(route.in_process);
      if (route.in_process && session_ == nullptr) session_ = options.in_process->OpenSession();
      std::vector<std::unique_ptr<DirectStreams>>& direct = direct_.emplace_back();
      for (std::unique_ptr<DirectConnection>& c : route.direct) {
        direct.push_back(std::make_unique<DirectStreams>(std::move(c)));
      }
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

  ~GrpcTransport() override {
    CancelAll();
    session_.reset();
    direct_.clear();  // their streams have ended when this returns
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    starter_.join();  // after starting (cancelled) whatever was queued
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* open) { return *open == 0; }, &calls_open_));
  }

  int num_servers() const override {
    return static_cast<int>(stubs_.size()) / channels_per_server_;
  }
  int channels_per_server() const override { return channels_per_server_; }
  bool in_process(int server) const override { return in_process_[server]; }

  void StartExchange(int server, int channel, ParameterMethod method,
                     std::vector<grpc::ByteBuffer> requests, absl::Time deadline,
                     SentFn on_sent, ReplyFn on_reply, DoneFn on_done) override {
    if (in_process_[server]) {
      session_->Exchange(method, std::move(requests), std::move(on_sent), std::move(on_reply),
                         std::move(on_done));
      return;
    }
    // A direct connection while it lasts; gRPC after.
    if (DirectStreams* direct = DirectFor(direct_[server], requests);
        direct != nullptr &&
        direct->StartExchange(method, std::move(requests), deadline, on_sent, on_reply, on_done)) {
      return;
    }
    auto* call = new ExchangeCall(this, std::move(requests), window_, window_bytes_,
                                  std::move(on_sent), std::move(on_reply), std::move(on_done));
    call->context()->set_deadline(absl::ToChronoTime(deadline));
    {
      absl::MutexLock lock(&mu_);
      calls_.insert(call);
      ++calls_open_;
      if (cancelled_) call->context()->TryCancel();
      to_start_.push_back(
          {call, stubs_[server * channels_per_server_ + channel].get(), MethodName(method)});
    }
  }

  void CancelAll() override {
    if (session_ != nullptr) session_->CancelAll();
    for (const auto& server : direct_) {
      for (const auto& direct : server) direct->CancelAll();
    }
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
  struct ToStart {
    ExchangeCall* call;
    grpc::GenericStub* stub;
    const char* method;
  };

  // Starts the queued calls. Starting a call writes its first request, and
  // gRPC may do that write, socket included, on the thread that starts it:
  // here, so that a worker's training thread goes straight back to its
  // backward pass.
  void StartLoop() {
    while (true) {
      ToStart next;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(
            +[](GrpcTransport* t) ABSL_NO_THREAD_SAFETY_ANALYSIS {
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

  const int channels_per_server_;
  const int window_;
  const int64_t window_bytes_;
  // Server s, channel c: stubs_[s * channels_per_server_ + c].
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs_;
  // By server: its direct connections' streams; none: gRPC only.
  std::vector<std::vector<std::unique_ptr<DirectStreams>>> direct_;
  // By server: whether it is the server of this process, and the session
  // the transport reaches it through (if any is).
  std::vector<bool> in_process_;
  std::unique_ptr<InProcessService::Session> session_;
  absl::Mutex mu_;
  std::set<ExchangeCall*> calls_ ABSL_GUARDED_BY(mu_);  // cancellable
  int calls_open_ ABSL_GUARDED_BY(mu_) = 0;             // not yet Released
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<ToStart> to_start_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread starter_;
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

// The server's Hello reply over `target`; nullopt if there is none in time.
std::optional<v1::HelloReply> Hello(const std::string& target, absl::Duration timeout) {
  static std::atomic<int> next_pool_index{1 << 20};  // apart from the data channels
  grpc::GenericStub stub(MakeChannel(target, {.pool_index = next_pool_index++}));
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::Slice empty(v1::HelloRequest().SerializeAsString());
  const grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, kHelloMethod, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  std::vector<grpc::Slice> slices;
  if (!status.ok() || !response.Dump(&slices).ok()) return std::nullopt;
  std::string bytes;
  for (const grpc::Slice& slice : slices) {
    bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  v1::HelloReply reply;
  if (!reply.ParseFromString(bytes)) return std::nullopt;
  return reply;
}

// The same-machine socket that `remote` (the Hello reply from `address`)
// names, if it answers as the same process; else `address`.
std::string LocalSocketOf(const std::string& address, const v1::HelloReply& remote,
                          absl::Duration timeout) {
  if (remote.local_address().empty()) return address;
  const std::optional<v1::HelloReply> local = Hello(remote.local_address(), timeout);
  if (!local.has_value() || local->instance() != remote.instance()) {
    VLOG(1) << "server " << address << ": " << remote.local_address()
            << " is not reachable from here, or not the same process: TCP";
    return address;
  }
  VLOG(1) << "server " << address << " reached over " << remote.local_address();
  return remote.local_address();
}

// `count` direct connections to one server that `connect` makes, or none
// if one fails.
std::vector<std::unique_ptr<DirectConnection>> DirectConnections(
    const std::string& address, absl::string_view how, int count,
    absl::FunctionRef<absl::StatusOr<std::unique_ptr<DirectConnection>>()> connect) {
  std::vector<std::unique_ptr<DirectConnection>> connections;
  for (int i = 0; i < count; ++i) {
    absl::StatusOr<std::unique_ptr<DirectConnection>> c = connect();
    if (!c.ok()) {
      VLOG(1) << "server " << address << ": not reached " << how << ": " << c.status();
      return {};
    }
    connections.push_back(*std::move(c));
  }
  LOG(INFO) << "server " << address << " reached " << how << " (" << count << ")";
  return connections;
}

ServerRoute RouteTo(const std::string& address, const GrpcTransportOptions& options) {
  constexpr absl::Duration kHelloTimeout = absl::Seconds(2);
  ServerRoute route;
  route.dial = address;
  if (options.security != nullptr ||
      (!options.same_machine_sockets && !options.shared_memory && !options.direct_tcp &&
       options.in_process == nullptr)) {
    return route;
  }
  const std::optional<v1::HelloReply> remote = Hello(address, kHelloTimeout);
  if (!remote.has_value()) return route;
  if (options.in_process != nullptr && remote->instance() == options.in_process->instance()) {
    VLOG(1) << "server " << address << " is this process's own";
    route.in_process = true;
    return route;
  }
  if (options.same_machine_sockets) route.dial = LocalSocketOf(address, *remote, kHelloTimeout);
  if (options.shared_memory && !remote->shm_address().empty()) {
    // The handshake checks that the process behind the name is the one
    // that answered at `address`.
    route.direct = DirectConnections(address, "through shared memory", options.shm_connections,
                                     [&] {
      return DirectConnection::Connect(remote->shm_address(), remote->instance(), options.shm,
                                       kHelloTimeout);
    });
  }
  if (route.direct.empty() && options.direct_tcp && remote->direct_tcp_port() > 0) {
    route.direct = DirectConnections(address, "over a direct TCP connection", 1, [&] {
      return DirectConnection::ConnectTcp(SocketHost(address), remote->direct_tcp_port(),
                                          remote->instance(), options.shm, kHelloTimeout);
    });
  }
  return route;
}

}  // namespace

std::string SameMachineAddress(const std::string& address, absl::Duration timeout) {
  const std::optional<v1::HelloReply> remote = Hello(address, timeout);
  return remote.has_value() ? LocalSocketOf(address, *remote, timeout) : address;
}

absl::Status ValidateGrpcTransportOptions(const GrpcTransportOptions& options) {
  if (options.shm_connections < 1 || options.shm_connections > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory connections per server must be in [1, 16], not ",
        options.shm_connections));
  }
  if (options.channels_per_server < 1 || options.channels_per_server > 16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "channels per server must be in [1, 16], not ", options.channels_per_server));
  }
  if (options.window < 1 || options.window > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("stream window must be in [1, 1024], not ", options.window));
  }
  if (options.window_bytes < 0 || options.window_bytes > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream window bytes must be in [0, 1 GiB], not ", options.window_bytes));
  }
  return ValidateShmOptions(options.shm);
}

absl::StatusOr<std::unique_ptr<ParameterTransport>> CreateGrpcTransport(
    const std::vector<std::string>& server_addresses, const GrpcTransportOptions& options) {
  if (server_addresses.empty()) return absl::InvalidArgumentError("no server addresses");
  PSTRAIN_RETURN_IF_ERROR(ValidateGrpcTransportOptions(options));
  return std::make_unique<GrpcTransport>(server_addresses, options);
}

TransportFactory GrpcTransportFactory(GrpcTransportOptions options) {
  return [options](const std::vector<std::string>& addresses) {
    return CreateGrpcTransport(addresses, options);
  };
}

}  // namespace pstrain::worker
