#include "common/membership_client.h"

#include <unistd.h>

#include "absl/strings/str_format.h"

#include "common/clock.h"
#include "common/node_id.h"
#include "common/rpc.h"
#include "common/tls.h"
#include "glog/logging.h"

namespace pstrain {

MembershipClient::MembershipClient(Options options, Callbacks callbacks)
    : options_(std::move(options)),
      callbacks_(std::move(callbacks)),
      stub_(v1::Membership::NewStub(
          MakeChannel(options_.coordinator_address,
                      {.security = options_.security,
                       .peer_roles = {PeerRole::kCoordinator},
                       .metrics = options_.rpc}))),
      incarnation_(RandomProcessToken()),
      // Without an id of its own the node names itself, so that a retried
      // registration is recognised as the same node.
      node_id_(!options_.node_id.empty()
                   ? options_.node_id
                   : absl::StrFormat("%s-%08x",
                                     options_.role == v1::NODE_ROLE_SERVER ? "server" : "worker",
                                     static_cast<uint32_t>(incarnation_))),
      interval_(options_.heartbeat_interval) {}

// The node's end of its Session stream: every event asks for a heartbeat.
class MembershipClient::SessionReader final
    : public grpc::ClientReadReactor<v1::SessionEvent> {
 public:
  SessionReader(MembershipClient* client, v1::SessionRequest request)
      : client_(client), request_(std::move(request)) {}
  void Start(v1::Membership::Stub* stub) {
    stub->async()->Session(&context_, &request_, this);
    StartRead(&event_);
    StartCall();
  }
  void Cancel() { context_.TryCancel(); }
  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows
    client_->Nudge();
    StartRead(&event_);
  }
  void OnDone(const grpc::Status& status) override {
    VLOG(1) << "session ended: " << status.error_message();
    client_->SessionEnded();
  }

 private:
  MembershipClient* const client_;
  grpc::ClientContext context_;
  const v1::SessionRequest request_;
  v1::SessionEvent event_;
};

MembershipClient::~MembershipClient() { Stop(); }

void MembershipClient::Nudge() {
  {
    absl::MutexLock lock(&mu_);
    nudged_ = true;
  }
  wake_.NotifyAll();
}

void MembershipClient::SessionEnded() {
  absl::MutexLock lock(&mu_);
  session_ended_ = true;
}

void MembershipClient::KeepSessionOpen() {
  {
    absl::MutexLock lock(&mu_);
    if (!session_ended_) return;
  }
  session_.reset();  // it has ended: its last callback has run
  v1::SessionRequest request;
  request.set_node_id(node_id());
  request.set_incarnation(incarnation_);
  {
    absl::MutexLock lock(&mu_);
    session_ended_ = false;
  }
  session_ = std::make_unique<SessionReader>(this, std::move(request));
  session_->Start(stub_.get());
}

void MembershipClient::CloseSession() {
  if (session_ == nullptr) return;
  session_->Cancel();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(&session_ended_));
}

void MembershipClient::Start() { thread_ = std::thread([this] { Loop(); }); }

void MembershipClient::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  wake_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

std::string MembershipClient::node_id() const {
  absl::MutexLock lock(&mu_);
  return node_id_;
}

absl::Status MembershipClient::Register() {
  v1::RegisterRequest request;
  request.set_role(options_.role);
  request.set_address(options_.address);
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  request.set_hostname(host);
  request.set_pid(getpid());
  request.set_node_id(node_id());
  request.set_incarnation(incarnation_);
  request.set_max_memory_bytes(options_.max_memory_bytes);
  request.set_metrics_address(options_.metrics_address);
  request.set_join_job(options_.join_job);
  request.set_colocated_with(options_.colocated_with);
  request.set_checkpoint_root(options_.checkpoint_root);
  v1::RegisterResponse response;
  grpc::ClientContext context;
  SetTimeout(context, options_.rpc_timeout);
  absl::Status status = FromGrpcStatus(stub_->Register(&context, request, &response));
  if (!status.ok()) return status;
  absl::MutexLock lock(&mu_);
  node_id_ = response.node_id();
  if (response.heartbeat_interval_ms() > 0) {
    interval_ = absl::Milliseconds(response.heartbeat_interval_ms());
  }
  LOG(INFO) << "registered with coordinator " << options_.coordinator_address << " as "
            << node_id_;
  return absl::OkStatus();
}

absl::Status MembershipClient::Heartbeat() {
  v1::HeartbeatRequest request;
  request.set_node_id(node_id());
  request.set_incarnation(incarnation_);
  if (callbacks_.held_jobs) {
    for (v1::HeldJob& job : callbacks_.held_jobs()) *request.add_held() = std::move(job);
  }
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetTimeout(context, options_.rpc_timeout);
  absl::Status status = FromGrpcStatus(stub_->Heartbeat(&context, request, &response));
  if (!status.ok()) return status;
  if (callbacks_.on_heartbeat) callbacks_.on_heartbeat(response);
  return absl::OkStatus();
}

void MembershipClient::Loop() {
  // On the monotonic clock: a step of the wall clock is not a silence.
  absl::Time last_contact = MonotonicClock()->Now();
  absl::Duration backoff = absl::Milliseconds(100);
  while (true) {
    absl::Status status = registered_ ? Heartbeat() : Register();
    if (status.ok()) {
      if (!registered_) {
        registered_ = true;
        status = Heartbeat();  // the first assignments without waiting an interval
      }
    }
    if (status.ok()) {
      last_contact = MonotonicClock()->Now();
      backoff = absl::Milliseconds(100);
      KeepSessionOpen();
    } else {
      if (status.code() == absl::StatusCode::kNotFound) {
        LOG(WARNING) << "coordinator does not know this node; registering again";
        registered_ = false;
      } else if (status.code() == absl::StatusCode::kFailedPrecondition) {
        LOG(ERROR) << "fenced: " << status.message();
        registered_ = false;
        CloseSession();
        if (callbacks_.on_fenced) callbacks_.on_fenced(status);
        return;
      } else {
        LOG_EVERY_N(WARNING, 10) << "no answer from the coordinator: " << status;
      }
      if (options_.coordinator_loss_timeout > absl::ZeroDuration() &&
          MonotonicClock()->Now() - last_contact > options_.coordinator_loss_timeout) {
        LOG(ERROR) << "no answer from the coordinator for "
                   << absl::FormatDuration(options_.coordinator_loss_timeout);
        registered_ = false;
        CloseSession();
        if (callbacks_.on_coordinator_lost) callbacks_.on_coordinator_lost();
        return;
      }
    }
    bool stop;
    {
      absl::MutexLock lock(&mu_);
      const absl::Duration wait = status.ok() ? interval_ : backoff;
      if (!status.ok()) backoff = std::min(backoff * 2, interval_);
      // A nudge from the coordinator cuts the wait short.
      wake_.AwaitWithTimeout(
          mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || nudged_; }, wait);
      nudged_ = false;
      stop = stopping_;
    }
    if (stop) {
      registered_ = false;
      CloseSession();
      return;
    }
  }
}

absl::Status MembershipClient::Retry(const RetryPolicy& policy,
                                     absl::FunctionRef<absl::Status()> call) {
  return pstrain::Retry(policy, call, [this](absl::Duration pause) {
    absl::MutexLock lock(&mu_);
    return !wake_.AwaitWithTimeout(
        mu_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_; }, pause);
  });
}

absl::StatusOr<bool> MembershipClient::ReportProgress(v1::ReportProgressRequest request,
                                                      absl::Duration patience) {
  bool active = false;
  absl::Status status = Retry(options_.retry.WithPatience(patience), [&] {
    request.set_node_id(node_id());
    request.set_incarnation(incarnation_);
    v1::ReportProgressResponse response;
    grpc::ClientContext context;
    SetTimeout(context, options_.rpc_timeout);
    absl::Status s = FromGrpcStatus(stub_->ReportProgress(&context, request, &response));
    active = response.job_active();
    return s;
  });
  if (!status.ok()) return status;
  return active;
}

absl::Status MembershipClient::UploadModel(const std::string& job_id, const std::string& file,
                                           absl::Duration patience) {
  constexpr size_t kPiece = 1 << 20;
  return Retry(options_.retry.AlsoRetrying({absl::StatusCode::kAlreadyExists}).WithPatience(patience),
               [&] {
    grpc::ClientContext context;
    SetTimeout(context, options_.rpc_timeout + absl::Seconds(file.size() / (10 << 20)));
    v1::UploadModelResponse response;
    std::unique_ptr<grpc::ClientWriter<v1::UploadModelRequest>> writer =
        stub_->UploadModel(&context, &response);
    v1::UploadModelRequest piece;
    piece.set_node_id(node_id());
    piece.set_job_id(job_id);
    for (size_t at = 0; at == 0 || at < file.size(); at += kPiece) {
      piece.set_data(file.substr(at, kPiece));
      if (!writer->Write(piece)) break;
      piece.clear_node_id();
      piece.clear_job_id();
    }
    writer->WritesDone();
    return FromGrpcStatus(writer->Finish());
  });
}

}  // namespace pstrain
