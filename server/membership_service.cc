#include "server/membership_service.h"

#include <map>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/model_file.h"
#include "common/rpc.h"
#include "common/script_metrics.h"
#include "common/status.h"
#include "glog/logging.h"
#include "server/control_service.h"
#include "server/job_progress.h"
#include "server/recovery.h"
#include "server/scheduler.h"

namespace pstrain::server {
namespace {

// The most of a node's error message (a worker's failure, a server's) that
// goes into a job's reason.
constexpr size_t kMaxErrorBytes = 1000;

}  // namespace

grpc::ServerUnaryReactor* MembershipService::Register(grpc::CallbackServerContext* ctx,
                                                      const v1::RegisterRequest* request,
                                                      v1::RegisterResponse* response) {
  if (absl::Status s = access_.CheckNode(*ctx, request->node_id(), request->role()); !s.ok()) {
    return Reply(ctx, s);
  }
  // Over TLS a node that names no id gets its certificate's.
  v1::RegisterRequest checked = *request;
  if (checked.node_id().empty()) checked.set_node_id(AccessPolicy::CertifiedNodeId(*ctx));
  absl::StatusOr<NodeRegistry::Registration> registered;
  {
    absl::MutexLock lock(&state_.mu);
    registered = state_.registry.Register(checked);
    state_.UpdateGauges();
  }
  if (!registered.ok()) return Reply(ctx, registered.status());
  response->set_node_id(registered->node_id);
  response->set_lease_ms(absl::ToInt64Milliseconds(state_.options.lease));
  response->set_heartbeat_interval_ms(
      absl::ToInt64Milliseconds(state_.options.heartbeat_interval));
  // The new node may let a pending job start. Scheduling is durable, so
  // it waits for the disk, but holds nothing that reads need.
  if (absl::Status s = state_.Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu) {
        ScheduleJobs(txn, state_.registry);
        return absl::OkStatus();
      });
      !s.ok()) {
    LOG(WARNING) << "scheduling after a registration: " << s;  // the control loop retries
  }
  loop_.Wake();
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* MembershipService::Heartbeat(grpc::CallbackServerContext* ctx,
                                                       const v1::HeartbeatRequest* request,
                                                       v1::HeartbeatResponse* response) {
  if (absl::Status s = access_.CheckNode(*ctx, request->node_id(), v1::NODE_ROLE_UNSPECIFIED);
      !s.ok()) {
    return Reply(ctx, s);
  }
  absl::MutexLock lock(&state_.mu);
  const NodeRegistry::Node* before = state_.registry.Find(request->node_id());
  const bool was_lost = before != nullptr && before->info.state() == v1::NODE_STATE_LOST;
  if (absl::Status s = state_.registry.Heartbeat(*request); !s.ok()) return Reply(ctx, s);
  if (RecordHeld(*request) || was_lost) loop_.Wake();
  Assignments(*request, response);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* MembershipService::ReportProgress(
    grpc::CallbackServerContext* ctx, const v1::ReportProgressRequest* request,
    v1::ReportProgressResponse* response) {
  if (absl::Status s = access_.CheckNode(*ctx, request->node_id(), v1::NODE_ROLE_WORKER);
      !s.ok()) {
    return Reply(ctx, s);
  }
  bool active = false;
  absl::Status status = state_.Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu) {
    return Progress(txn, *request, &active);
  });
  response->set_job_active(active);
  return Reply(ctx, status);
}

grpc::ServerReadReactor<v1::UploadModelRequest>* MembershipService::UploadModel(
    grpc::CallbackServerContext* ctx, v1::UploadModelResponse*) {
  return NewModelUpload(ctx, this, AccessPolicy::CertifiedNodeId(*ctx));
}

grpc::ServerWriteReactor<v1::SessionEvent>* MembershipService::Session(
    grpc::CallbackServerContext* ctx, const v1::SessionRequest* request) {
  auto* session = new NodeSession(this, *request);
  absl::Status refused = access_.CheckNode(*ctx, request->node_id(), v1::NODE_ROLE_UNSPECIFIED);
  if (refused.ok()) {
    absl::MutexLock lock(&state_.mu);
    const NodeRegistry::Node* node = state_.registry.Find(request->node_id());
    if (state_.shut_down) {
      refused = absl::UnavailableError("coordinator shutting down");
    } else if (node == nullptr || node->info.state() == v1::NODE_STATE_AWAITED) {
      refused = absl::NotFoundError(absl::StrCat("unknown node '", request->node_id(), "'"));
    } else if (!state_.registry.SessionOpened(request->node_id(), request->incarnation())) {
      refused = absl::FailedPreconditionError(
          absl::StrCat("node ", request->node_id(), " is held by another process"));
    } else {
      state_.sessions[request->node_id()] = session;
    }
  }
  if (!refused.ok()) session->End(ToGrpcStatus(refused));
  return session;
}

void MembershipService::SessionClosed(NodeSession* session) {
  {
    absl::MutexLock lock(&state_.mu);
    state_.registry.SessionClosed(session->node_id(), session->incarnation());
  }
  loop_.Wake();
}

void MembershipService::SessionDone(NodeSession* session) {
  absl::MutexLock lock(&state_.mu);
  auto it = state_.sessions.find(session->node_id());
  if (it != state_.sessions.end() && it->second == session) state_.sessions.erase(it);
}

absl::StatusOr<ModelUploadHandler::Upload> MembershipService::BeginUpload(
    const std::string& node_id, const std::string& job_id, std::function<void()> cancel) {
  absl::MutexLock lock(&state_.mu);
  const JobRecord* record = state_.jobs.Find(job_id);
  if (record == nullptr) return UnknownJob(job_id);
  PSTRAIN_ASSIGN_OR_RETURN(const int64_t max_bytes, UploadLimit(record->job, node_id));
  PSTRAIN_ASSIGN_OR_RETURN(const uint64_t id,
                           state_.uploads.Open(job_id, state_.clock->Now(), std::move(cancel)));
  return Upload{.id = id, .max_bytes = max_bytes};
}

void MembershipService::EndUpload(const std::string& job_id, uint64_t upload) {
  absl::MutexLock lock(&state_.mu);
  state_.uploads.Close(job_id, upload);
}

// Checks the file and writes it without holding the lock, then records
// that the job has a model.
absl::Status MembershipService::FinishUpload(const std::string& job_id, uint64_t upload,
                                             std::string bytes) {
  PSTRAIN_ASSIGN_OR_RETURN(ModelFile file, DecodeModelFile(bytes));
  int64_t total_floats;
  {
    absl::MutexLock lock(&state_.mu);
    if (!state_.uploads.IsOpen(job_id, upload)) {
      return absl::CancelledError("the upload took too long and was cancelled");
    }
    const JobRecord* record = state_.jobs.Find(job_id);
    if (record == nullptr) return UnknownJob(job_id);
    total_floats = NumParamsOf(record->job.spec());
  }
  PSTRAIN_RETURN_IF_ERROR(CheckUploadedModel(file.header, job_id, total_floats));
  if (absl::Status s = state_.models.Put(job_id, std::move(bytes)); !s.ok()) {
    return absl::UnavailableError(absl::StrCat("cannot keep the model file: ", s.message()));
  }
  return state_.Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu) {
    if (txn.Get(job_id).state() != v1::JOB_STATE_RUNNING) {
      return absl::FailedPreconditionError(absl::StrCat(job_id, " is not running"));
    }
    txn.Mutable(job_id)->set_has_model(true);
    return absl::OkStatus();
  });
}

bool MembershipService::RecordHeld(const v1::HeartbeatRequest& request) {
  bool news = false;
  for (const v1::HeldJob& held : request.held()) {
    JobRecord* record = state_.jobs.Find(held.job_id());
    // A succeeded job's servers report the checkpoints written at its end.
    if (record == nullptr || (record->job.state() != v1::JOB_STATE_RUNNING &&
                              record->job.state() != v1::JOB_STATE_SUCCEEDED)) {
      continue;
    }
    const v1::Job& job = record->job;
    for (int s = 0; s < job.server_nodes_size(); ++s) {
      if (job.server_nodes(s) != request.node_id() ||
          job.server_incarnations(s) != request.incarnation()) {
        continue;
      }
      if (record->reports.by_server.size() < static_cast<size_t>(job.server_nodes_size())) {
        record->reports.by_server.resize(job.server_nodes_size());
      }
      std::vector<v1::CheckpointRecord> written(held.checkpoints().begin(),
                                                held.checkpoints().end());
      if (written.size() != record->reports.by_server[s].size()) news = true;
      record->reports.by_server[s] = std::move(written);
      if (!held.load_error().empty() && held.generation() == job.generation() &&
          !record->load_failures.contains(s)) {
        record->load_failures[s] = held.load_error();
        news = true;
      }
      if (!held.error().empty() && held.generation() == job.generation() &&
          !record->server_errors.contains(s)) {
        record->server_errors[s] = held.error().substr(0, kMaxErrorBytes);
        news = true;
      }
    }
  }
  return news;
}

void MembershipService::Assignments(const v1::HeartbeatRequest& request,
                                    v1::HeartbeatResponse* response) {
  const NodeRegistry::Node& node = *state_.registry.Find(request.node_id());
  std::map<std::string, int64_t> held;
  for (const v1::HeldJob& h : request.held()) held[h.job_id()] = h.generation();
  // Specs and plans of jobs new to the node, within the reply's budget.
  int64_t new_job_bytes = 0;
  auto fits = [&](const v1::JobSpec& spec, const v1::PartitionPlan& plan) {
    const int64_t bytes = static_cast<int64_t>(spec.ByteSizeLong() + plan.ByteSizeLong());
    if (new_job_bytes > 0 &&
        new_job_bytes + bytes > state_.options.limits.heartbeat_reply_bytes) {
      return false;
    }
    new_job_bytes += bytes;
    return true;
  };
  for (const std::string& id : state_.jobs.running()) {
    const JobRecord& record = state_.jobs.at(id);
    const v1::Job& job = record.job;
    auto h = held.find(id);
    const bool has_it = h != held.end() && h->second == job.generation();
    if (node.info.role() == v1::NODE_ROLE_SERVER) {
      for (int s = 0; s < job.server_nodes_size(); ++s) {
        if (job.server_nodes(s) != node.info.id()) continue;
        if (!has_it && !fits(job.spec(), record.plan)) continue;
        v1::ServerAssignment* a = response->add_server_jobs();
        a->set_job_id(id);
        a->set_server_index(s);
        a->set_generation(job.generation());
        a->set_num_workers(job.worker_nodes_size());
        *a->mutable_worker_nodes() = job.worker_nodes();
        const std::optional<v1::CheckpointRecord> from = ResumeCheckpoint(job);
        if (KeepsValues(job, s)) {
          a->set_keep_values(true);
        } else if (from.has_value()) {
          a->set_restore_step(from->step());
          a->set_restore_generation(from->generation());
        } else if (job.spec().mode() != v1::MODE_SYNC && job.generation() > 1) {
          a->set_restore_step(-1);  // async: the server's own newest checkpoint
        }
        *a->mutable_retained_checkpoints() = job.checkpoints();
        a->set_checkpoint_request_step(job.checkpoint_request_step());
        if (!has_it) {
          *a->mutable_spec() = job.spec();
          *a->mutable_plan() = record.plan;
        }
      }
    } else {
      for (int w = 0; w < job.worker_nodes_size(); ++w) {
        if (job.worker_nodes(w) != node.info.id() || job.workers(w).finished()) continue;
        if (!has_it && !fits(job.spec(), record.plan)) continue;
        v1::WorkerAssignment* a = response->add_worker_jobs();
        a->set_job_id(id);
        a->set_worker_index(w);
        a->set_generation(job.generation());
        a->set_num_workers(job.worker_nodes_size());
        a->set_resume_step(job.spec().mode() == v1::MODE_SYNC ? job.resume_step()
                                                               : job.workers(w).step());
        a->set_checkpoint_request_step(job.checkpoint_request_step());
        if (!has_it) {
          *a->mutable_spec() = job.spec();
          *a->mutable_plan() = record.plan;
          *a->mutable_server_addresses() = job.server_addresses();
          *a->mutable_resume_state() = ResumeStateOf(job, w);
        }
      }
    }
  }
}

absl::Status MembershipService::Progress(Txn& txn, const v1::ReportProgressRequest& r,
                                         bool* active) {
  JobRecord* record = state_.jobs.Find(r.job_id());
  if (record == nullptr) return UnknownJob(r.job_id());
  const v1::Job& job = txn.Get(r.job_id());
  if (job.state() != v1::JOB_STATE_RUNNING) return absl::OkStatus();  // not active
  if (r.worker() >= static_cast<uint32_t>(job.worker_nodes_size()) ||
      job.worker_nodes(r.worker()) != r.node_id()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "worker: node '", r.node_id(), "' is not worker ", r.worker(), " of ", r.job_id()));
  }
  if (job.worker_incarnations(r.worker()) != r.incarnation()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "incarnation: this process of node ", r.node_id(), " does not run ", r.job_id()));
  }
  // A generation that is over: nothing of it counts any more.
  if (r.generation() != job.generation()) return absl::OkStatus();
  if (!r.metrics().empty()) {
    google::protobuf::Map<std::string, double> merged = job.workers(r.worker()).metrics();
    for (const auto& [name, value] : r.metrics()) merged[name] = value;
    PSTRAIN_RETURN_IF_ERROR(CheckScriptMetrics(merged));
  }
  for (const v1::WorkerResumeState& state : r.checkpoint_states()) {
    if (state.worker() != r.worker() || state.generation() != job.generation()) continue;
    auto& states = record->reports.states[{state.step(), state.generation()}];
    if (states.emplace(state.worker(), state).second) loop_.Wake();
  }
  if (!r.error().empty()) {
    txn.SetState(r.job_id(), v1::JOB_STATE_FAILED,
                 absl::StrCat("worker ", r.worker(), ": ", r.error().substr(0, kMaxErrorBytes)));
    ScheduleJobs(txn, state_.registry);
    return absl::OkStatus();
  }
  *active = true;
  if (job.workers(r.worker()).finished()) return absl::OkStatus();
  v1::Job& changed = r.finished() ? *txn.Mutable(r.job_id()) : *txn.MutableVolatile(r.job_id());
  ApplyProgressReport(r, &changed);
  if (record->metrics.has_value()) {
    record->metrics->steps->Set(static_cast<double>(changed.progress().step()));
    if (r.evaluated()) {
      record->metrics->accuracy->Set(r.test_accuracy());
      if (r.has_test_loss()) record->metrics->test_loss->Set(r.test_loss());
    }
    state_.jobs.SetScriptMetrics(*record, changed.progress());
  }
  v1::JobEvent event = txn.Event();
  *event.mutable_progress() = changed.progress();
  txn.Publish(r.job_id(), event);
  if (r.evaluated()) {
    v1::JobEvent eval = txn.Event();
    *eval.mutable_evaluation() = changed.last_evaluation();
    txn.Publish(r.job_id(), eval);
  }
  if (r.finished() && AllWorkersFinished(changed)) {
    *changed.mutable_result() = CompletedResult(changed);
    changed.mutable_progress()->set_samples_per_second(changed.result().samples_per_second());
    v1::JobEvent completed = txn.Event();
    *completed.mutable_completed() = changed.result();
    txn.Publish(r.job_id(), completed);
    txn.SetState(r.job_id(), v1::JOB_STATE_SUCCEEDED, changed.reason());  // early stopping's
    ScheduleJobs(txn, state_.registry);
  }
  return absl::OkStatus();
}

}  // namespace pstrain::server
