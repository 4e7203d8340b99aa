#include "server/control_service.h"

#include <algorithm>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/rpc.h"
#include "common/status.h"
#include "server/recovery.h"
#include "server/scheduler.h"
#include "server/watch_queue.h"

namespace pstrain::server {
namespace {

// Watchers of one job at the same time.
constexpr size_t kMaxWatchersPerJob = 256;

// A new pending job.
v1::Job NewJob(const std::string& id, const std::string& request_id, const v1::JobSpec& spec,
               int64_t now_ms) {
  v1::Job job;
  job.set_id(id);
  job.set_request_id(request_id);
  *job.mutable_spec() = spec;
  job.set_state(v1::JOB_STATE_PENDING);
  job.set_create_time_ms(now_ms);
  const int64_t total = TotalSteps(spec);
  const int64_t per_epoch = StepsPerEpoch(spec);
  job.mutable_progress()->set_total_steps(total);
  job.mutable_progress()->set_total_epochs(
      static_cast<int32_t>((total + per_epoch - 1) / per_epoch));
  return job;
}

}  // namespace

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

grpc::ServerUnaryReactor* ControlService::SubmitJob(grpc::CallbackServerContext* ctx,
                                                    const v1::SubmitJobRequest* request,
                                                    v1::SubmitJobResponse* response) {
  if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "submit a job"); !s.ok()) {
    return Reply(ctx, s);
  }
  return Reply(ctx, Submit(*request, response));
}

grpc::ServerUnaryReactor* ControlService::GetJob(grpc::CallbackServerContext* ctx,
                                                 const v1::GetJobRequest* request,
                                                 v1::Job* response) {
  if (absl::Status s = access_.CheckUser(*ctx, UserRole::kViewer, "get a job"); !s.ok()) {
    return Reply(ctx, s);
  }
  absl::MutexLock lock(&state_.mu);
  const JobRecord* record = state_.jobs.Find(request->job_id());
  if (record == nullptr) return Reply(ctx, UnknownJob(request->job_id()));
  *response = record->job;
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* ControlService::ListJobs(grpc::CallbackServerContext* ctx,
                                                   const v1::ListJobsRequest* request,
                                                   v1::ListJobsResponse* response) {
  if (absl::Status s = access_.CheckUser(*ctx, UserRole::kViewer, "list jobs"); !s.ok()) {
    return Reply(ctx, s);
  }
  absl::MutexLock lock(&state_.mu);
  return Reply(ctx, state_.jobs.List(*request, response));
}

grpc::ServerUnaryReactor* ControlService::CancelJob(grpc::CallbackServerContext* ctx,
                                                    const v1::CancelJobRequest* request,
                                                    v1::Job* response) {
  if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "cancel a job"); !s.ok()) {
    return Reply(ctx, s);
  }
  const std::string& id = request->job_id();
  absl::Status status = state_.Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu) {
    if (!state_.jobs.contains(id)) return UnknownJob(id);
    if (!IsTerminal(txn.Get(id).state())) {
      txn.SetState(id, v1::JOB_STATE_CANCELLED, "cancelled by request");
      ScheduleJobs(txn, state_.registry);
    }
    return absl::OkStatus();
  });
  if (status.ok()) {
    absl::MutexLock lock(&state_.mu);
    *response = state_.jobs.at(id).job;
  }
  return Reply(ctx, status);
}

grpc::ServerWriteReactor<v1::JobEvent>* ControlService::WatchJob(
    grpc::CallbackServerContext* ctx, const v1::WatchJobRequest* request) {
  auto* watch = new JobWatch(state_.options.max_queued_events);
  const std::shared_ptr<WatchQueue> queue = watch->queue();
  const absl::Status allowed = access_.CheckUser(*ctx, UserRole::kViewer, "watch a job");
  absl::MutexLock lock(&state_.mu);
  if (!allowed.ok()) {
    queue->End(ToGrpcStatus(allowed));
  } else if (state_.shut_down) {
    queue->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "coordinator shutting down"));
  } else {
    state_.jobs.Watch(request->job_id(), queue, kMaxWatchersPerJob, WallMs());
  }
  return watch;
}

grpc::ServerUnaryReactor* ControlService::ListNodes(grpc::CallbackServerContext* ctx,
                                                    const v1::ListNodesRequest*,
                                                    v1::ListNodesResponse* response) {
  if (absl::Status s = access_.CheckUser(*ctx, UserRole::kViewer, "list nodes"); !s.ok()) {
    return Reply(ctx, s);
  }
  absl::MutexLock lock(&state_.mu);
  const std::map<std::string, int64_t> reserved = ReservedBytes(Txn(&state_.jobs, WallMs()));
  for (const auto& [id, node] : state_.registry.nodes()) {
    v1::Node* out = response->add_nodes();
    *out = node.info;
    if (auto it = reserved.find(id); it != reserved.end()) out->set_reserved_bytes(it->second);
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerWriteReactor<v1::ModelFileChunk>* ControlService::ExportModel(
    grpc::CallbackServerContext* ctx, const v1::ExportModelRequest* request) {
  if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "export a model");
      !s.ok()) {
    return NewModelExport(state_.fs, s);
  }
  return NewModelExport(state_.fs, FindModel(request->job_id()));
}

grpc::ServerUnaryReactor* ControlService::CheckpointJob(grpc::CallbackServerContext* ctx,
                                                        const v1::CheckpointJobRequest* request,
                                                        v1::CheckpointJobResponse* response) {
  if (absl::Status s = access_.CheckUser(*ctx, UserRole::kOperator, "checkpoint a job");
      !s.ok()) {
    return Reply(ctx, s);
  }
  const std::string& id = request->job_id();
  int64_t step = 0;
  absl::Status status = state_.Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu) {
    if (!state_.jobs.contains(id)) return UnknownJob(id);
    PSTRAIN_ASSIGN_OR_RETURN(step, RequestedCheckpointStep(txn.Get(id)));
    txn.Mutable(id)->set_checkpoint_request_step(step);
    return absl::OkStatus();
  });
  if (status.ok()) {
    response->set_step(step);
    absl::MutexLock lock(&state_.mu);
    state_.NudgeNodesOf(state_.jobs.at(id).job);
  }
  return Reply(ctx, status);
}

absl::Status ControlService::Submit(const v1::SubmitJobRequest& request,
                                    v1::SubmitJobResponse* response) {
  v1::JobSpec spec;
  switch (request.spec_source_case()) {
    case v1::SubmitJobRequest::kSpec:
      spec = request.spec();
      break;
    case v1::SubmitJobRequest::kSpecYaml: {
      PSTRAIN_ASSIGN_OR_RETURN(spec, ParseJobSpecYaml(request.spec_yaml()));
      break;
    }
    default:
      return absl::InvalidArgumentError("spec: missing (give spec or spec_yaml)");
  }
  PSTRAIN_ASSIGN_OR_RETURN(spec, NormalizeJobSpec(std::move(spec)));
  if (spec.checkpoint().dir().empty() && !state_.options.default_checkpoint_dir.empty()) {
    spec.mutable_checkpoint()->set_dir(state_.options.default_checkpoint_dir);
  }
  absl::StatusOr<v1::PartitionPlan> plan = PlanFor(spec);
  if (!plan.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("chunk_bytes: ", plan.status().message()));
  }
  const std::string& request_id = request.request_id();
  if (request_id.size() > 128 || !std::all_of(request_id.begin(), request_id.end(), [](char c) {
        return c > ' ' && c < 0x7f;
      })) {
    return absl::InvalidArgumentError(
        "request_id: must be 1 to 128 printable ASCII characters without spaces");
  }
  std::string id;
  PSTRAIN_RETURN_IF_ERROR(state_.Commit([&](Txn& txn) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_.mu) {
    PSTRAIN_RETURN_IF_ERROR(CheckCheckpointDirTaken(spec, state_.registry));
    if (const std::string* made = state_.jobs.JobOfRequest(request_id)) {
      // A retry: the job it made, unless this is another job under the same id.
      if (state_.jobs.at(*made).job.spec().SerializeAsString() != spec.SerializeAsString()) {
        return absl::AlreadyExistsError(
            absl::StrCat("request_id '", request_id, "' made ", *made, ", whose spec differs"));
      }
      id = *made;
      return absl::OkStatus();
    }
    const int64_t queued = static_cast<int64_t>(state_.jobs.pending().size());
    if (queued >= state_.options.limits.queued_jobs) {
      return absl::ResourceExhaustedError(absl::StrCat(
          queued, " jobs are queued, the most this coordinator holds "
          "(--max_queued_jobs); submit again once some have started"));
    }
    id = state_.jobs.NextId(state_.job_id_prefix);
    txn.Add(NewJob(id, request_id, spec, txn.now_ms()), *plan);
    ScheduleJobs(txn, state_.registry);
    return absl::OkStatus();
  }));
  response->set_job_id(id);
  return absl::OkStatus();
}

absl::StatusOr<ModelStore::Source> ControlService::FindModel(const std::string& job_id) {
  {
    absl::MutexLock lock(&state_.mu);
    const JobRecord* record = state_.jobs.Find(job_id);
    if (record == nullptr) return UnknownJob(job_id);
    const v1::Job& job = record->job;
    if (job.state() != v1::JOB_STATE_SUCCEEDED || !job.has_model()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job ", job_id, " has no model to export (it is ", EnumName(job.state()),
          job.state() == v1::JOB_STATE_SUCCEEDED ? ", without a model file)" : ")"));
    }
  }
  return state_.models.Find(job_id);
}

}  // namespace pstrain::server
