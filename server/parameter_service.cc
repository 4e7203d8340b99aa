#include "server/parameter_service.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"

namespace pstrain::server {
namespace {

enum class Method { kPush, kPull, kPushPull };

// A stream stops reading requests while it owes this many replies, or has
// this many reply bytes queued, and reads on once half of that is left: a
// client that sends without reading cannot make the server buffer without
// bound.
constexpr int64_t kMaxRepliesOwed = 1024;
constexpr int64_t kMaxQueuedReplyBytes = 64 << 20;

class ChunkStream;

// The part of a stream that the store may call into after the reactor is
// gone: owned jointly by the reactor and by the store's waits.
class StreamState final : public ChunkWaiter {
 public:
  StreamState(ChunkStream* reactor, ClientLoad* load, std::string client)
      : reactor_(reactor), load_(load), client_(std::move(client)) {}
  // The replies still owed are released once the store holds no wait of
  // the stream any more.
  ~StreamState() override { load_->Paid(client_, replies_owed_); }

  void OnValues(const v1::ChunkHeader& request, const ChunkValues& values) override {
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
  void OnAbort(const absl::Status& status) override { Fail(status); }
  bool Abandoned() const override {
    absl::MutexLock lock(&mu_);
    return reactor_ == nullptr || !error_.ok();
  }

  // Called for every request before it is handled: it owes one reply.
  // RESOURCE_EXHAUSTED past the client's limit.
  absl::Status ExpectReply() {
    PSTRAIN_RETURN_IF_ERROR(load_->Owe(client_));
    absl::MutexLock lock(&mu_);
    ++replies_owed_;
    return absl::OkStatus();
  }
  void Reply(grpc::ByteBuffer frame);
  void Fail(const absl::Status& status);
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
      : store_(store),
        method_(method),
        roster_(roster),
        caller_(std::move(caller)),
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
    if (absl::Status s = Handle(); !s.ok()) {
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
    // Its waits are abandoned now: dropped, they release the client's budget.
    for (const auto& [job_id, chunk] : parked_) store_->DropAbandonedWaits(job_id, chunk);
    load_->CloseStream(client_);
    delete this;
  }

 private:
  void ReadNext() {
    StartRead(&request_);
    state_->ReadStarted();
  }

  absl::Status Handle() {
    absl::StatusOr<Frame> frame = Frame::Parse(request_);
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
    PSTRAIN_RETURN_IF_ERROR(state_->ExpectReply());
    absl::Status status;
    switch (method_) {
      case Method::kPush: {
        v1::ChunkHeader ack = frame->header();
        status = step_end ? store_->EndStep(ack)
                 : init   ? store_->Init(*frame)
                          : store_->Push(*std::move(frame), nullptr);
        if (status.ok()) {
          ack.set_kind(v1::FRAME_KIND_ACK);
          ack.set_num_elements(0);
          state_->Reply(EncodeFrame(ack, nullptr));
        }
        break;
      }
      case Method::kPushPull:
        parked_.emplace(frame->header().job_id(), frame->header().chunk());
        status = store_->Push(*std::move(frame), state_);
        break;
      case Method::kPull:
        parked_.emplace(frame->header().job_id(), frame->header().chunk());
        status = store_->Pull(frame->header(), state_);
        break;
    }
    return status;
  }

  ShardStore* const store_;
  const Method method_;
  const WorkerRoster* const roster_;
  const std::optional<std::string> caller_;
  ClientLoad* const load_;
  const std::string client_;
  const std::shared_ptr<StreamState> state_;
  // The chunks where the stream's requests may wait, by job.
  std::set<std::pair<std::string, uint32_t>> parked_;
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

void ParameterService::SetHello(const v1::HelloReply& hello) {
  absl::MutexLock lock(&hello_mu_);
  hello_ = hello.SerializeAsString();
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
