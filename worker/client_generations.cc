// Client::Impl: joining a job, the heartbeats, and recoveries into its next
// generation (worker/client_impl.h).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/node_id.h"
#include "common/partition.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/client_control.h"
#include "worker/client_impl.h"

namespace pstrain {
namespace {

using worker::ParameterClient;

}  // namespace

absl::Status Client::Impl::Join() {
  PSTRAIN_RETURN_IF_ERROR(CheckConnect(options_.connect));
  if (options_.job_id.empty()) return absl::InvalidArgumentError("job_id: required");
  if (!options_.node_id.empty() && !IsValidNodeId(options_.node_id)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "node_id: '", options_.node_id,
        "' is not a node id (1-63 of a-z, 0-9, '-' and '.', starting and ending alphanumeric)"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(security_, LoadSecurity(options_.connect));
  if (security_ != nullptr) {
    const std::string& certified = security_->identity().name;
    if (options_.node_id.empty()) options_.node_id = certified;
    if (options_.node_id != certified) {
      return absl::InvalidArgumentError(absl::StrCat("node_id: '", options_.node_id,
                                                     "' is not the certificate's '", certified,
                                                     "'"));
    }
  }
  // The job must exist and have an external model: else no coordinator
  // would ever place this worker.
  PSTRAIN_RETURN_IF_ERROR(CheckJobIsExternal(options_.connect, security_.get(), options_.job_id));

  MembershipClient::Options m;
  m.coordinator_address = options_.connect.coordinator;
  m.role = v1::NODE_ROLE_WORKER;
  m.node_id = options_.node_id;
  m.join_job = options_.job_id;
  m.security = security_.get();
  MembershipClient::Callbacks callbacks;
  callbacks.held_jobs = [this] {
    absl::MutexLock lock(&mu_);
    return worker::HeldJobs(options_.job_id, generation_);
  };
  callbacks.on_heartbeat = [this](const v1::HeartbeatResponse& r) { OnHeartbeat(r); };
  callbacks.on_fenced = [this](const absl::Status& status) {
    absl::MutexLock lock(&mu_);
    ended_ = absl::StrCat("another process took node id ", node_id_, ": ", status.message());
    assignment_changed_.NotifyAll();
    if (params_ != nullptr) params_->Cancel();
    if (sparse_ != nullptr) sparse_->Cancel();
  };
  membership_ = std::make_unique<MembershipClient>(std::move(m), std::move(callbacks));
  node_id_ = membership_->node_id();
  membership_->Start();
  reporter_ = std::make_unique<worker::ProgressReporter>(membership_.get(), nullptr);
  return EnterNextGeneration(options_.join_timeout);
}

absl::StatusOr<int64_t> Client::Impl::AbandonStep(const absl::Status& error) {
  params_->Cancel();
  FinishAll(deferred_->Take()).IgnoreError();
  PSTRAIN_RETURN_IF_ERROR(Recover(error));
  return step_;
}

void Client::Impl::OnHeartbeat(const v1::HeartbeatResponse& response) {
  absl::MutexLock lock(&mu_);
  assignment_changed_.NotifyAll();
  const v1::WorkerAssignment* mine = worker::AssignmentOf(response, options_.job_id);
  if (mine == nullptr) {
    // Listed before, not any more: the job ended (or dropped this worker).
    if (generation_ > 0 && ended_.empty()) {
      ended_ = absl::StrCat("job ", options_.job_id, " is no longer running here");
      if (params_ != nullptr) params_->Cancel();
      if (sparse_ != nullptr) sparse_->Cancel();
    }
    return;
  }
  if (mine->has_spec()) {
    next_ = *mine;
  } else if (next_.has_value() && next_->generation() == mine->generation()) {
    next_->set_checkpoint_request_step(mine->checkpoint_request_step());
  }
  requested_checkpoint_ = mine->checkpoint_request_step();
  // A new generation: what this one waits for will not come.
  if (mine->generation() > generation_ && generation_ > 0 && params_ != nullptr) {
    params_->Cancel();
    if (sparse_ != nullptr) sparse_->Cancel();
  }
}

absl::Status Client::Impl::FinishDeferred() {
  if (!deferred_.has_value() || deferred_->empty()) return absl::OkStatus();
  const absl::Time start = MonotonicNow();
  const absl::Status status = FinishAll(deferred_->Take());
  awaited_seconds_ += absl::ToDoubleSeconds(MonotonicNow() - start);
  if (status.ok()) return status;
  PSTRAIN_RETURN_IF_ERROR(Recover(status));
  step_discarded_ = true;
  return absl::OkStatus();
}

absl::Status Client::Impl::FinishAll(std::vector<std::unique_ptr<ParameterClient::Pending>> pending) {
  absl::Status status;
  for (auto& p : pending) {
    absl::Status s = params_->Finish(std::move(p));
    if (status.ok()) status = s;
  }
  return status;
}

absl::Status Client::Impl::ToNextGeneration(const absl::Status& error) {
  {
    absl::MutexLock lock(&mu_);
    if (!ended_.empty()) return absl::CancelledError(ended_);
  }
  if (error.code() != absl::StatusCode::kAborted &&
      error.code() != absl::StatusCode::kCancelled) {
    return error;
  }
  const v1::RecoverySpec& recovery = spec_.recovery();
  return EnterNextGeneration(absl::Seconds(recovery.replace_after_seconds() +
                                           recovery.wait_timeout_seconds() + 60));
}

absl::Status Client::Impl::Recover(const absl::Status& error) {
  PSTRAIN_RETURN_IF_ERROR(ToNextGeneration(error));
  return GoOnWithGeneration();
}

absl::Status Client::Impl::EnterNextGeneration(absl::Duration timeout) {
  v1::WorkerAssignment next;
  {
    absl::MutexLock lock(&mu_);
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !ended_.empty() || (next_.has_value() && next_->generation() > generation_);
    };
    if (!assignment_changed_.AwaitWithTimeout(mu_, ready, timeout)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "the coordinator placed this worker in no (new) generation of job ", options_.job_id,
          " within ", absl::FormatDuration(timeout)));
    }
    if (!ended_.empty()) return absl::CancelledError(ended_);
    next = *next_;
  }
  PSTRAIN_ASSIGN_OR_RETURN(spec_, NormalizeJobSpec(next.spec()));
  if (spec_.model().type() != v1::MODEL_TYPE_EXTERNAL) {
    return absl::InvalidArgumentError("the assigned job's model is not external");
  }
  PSTRAIN_RETURN_IF_ERROR(ValidatePartitionPlan(next.plan(), NumParamsOf(spec_)));
  // The global batch, cut over the generation's workers as the built-in
  // workers cut it.
  PSTRAIN_ASSIGN_OR_RETURN(const worker::BatchShare share, worker::BatchShareOf(spec_, next));
  if (static_cast<uint32_t>(next.server_addresses_size()) != next.plan().num_servers()) {
    return absl::InvalidArgumentError("the assignment's server addresses do not match its plan");
  }
  const std::vector<kernels::TensorDesc> descs = JobTensors(spec_);
  if (tables_.empty()) {
    for (const v1::EmbeddingTableSpec& table : spec_.tables()) {
      tables_.push_back({table.name(), table.dim(), table.initial_rows()});
    }
  }
  if (descs_.empty()) {
    descs_ = descs;
    int64_t widest = 0;
    for (const kernels::TensorDesc& d : descs_) {
      const v1::ExternalTensor& e = spec_.model().tensors(static_cast<int>(tensors_.size()));
      tensors_.push_back({d.name, d.shape, e.buffer(), TensorDTypeName(e)});
      widest = std::max(widest, d.size);
    }
    bound_.assign(descs_.size(), nullptr);
    zeros_ = std::make_shared<std::vector<float>>(widest);
  }
  chunks_of_tensor_.assign(descs_.size(), {});
  for (const v1::ChunkInfo& c : next.plan().chunks()) {
    if (c.tensor() >= descs_.size()) return absl::InvalidArgumentError("a chunk of no tensor");
    chunks_of_tensor_[c.tensor()].push_back(c.id());
  }
  share_ = share;

  std::vector<std::string> servers(next.server_addresses().begin(),
                                   next.server_addresses().end());
  worker::GrpcTransportOptions transport_options;
  transport_options.security = security_.get();
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<worker::ParameterTransport> transport,
                           worker::CreateGrpcTransport(servers, transport_options));
  ParameterClient::Options c;
  c.job_id = options_.job_id;
  c.worker = next.worker_index();
  c.generation = next.generation();
  c.mode = spec_.mode();
  c.plan = next.plan();
  c.wire_dtype = spec_.wire_dtype();
  // Servers out of reach are the coordinator's to recover from: keep
  // trying at least as long.
  const v1::RecoverySpec& recovery = spec_.recovery();
  c.retry = c.retry.WithPatience(std::max(
      c.retry.patience(),
      absl::Seconds(recovery.replace_after_seconds() + recovery.wait_timeout_seconds() + 60)));
  auto sparse_client = std::make_unique<worker::SparseClient>(
      worker::SparseClient::OptionsFor(next, spec_, c.retry), transport.get());
  auto params = std::make_unique<ParameterClient>(std::move(c), transport.get());
  WaitForRowPush().IgnoreError();  // the last generation's, cancelled
  std::unique_ptr<ParameterClient> old_params;
  std::unique_ptr<worker::SparseClient> old_sparse;
  std::unique_ptr<worker::ParameterTransport> old_transport;
  {
    absl::MutexLock lock(&mu_);
    old_params = std::exchange(params_, std::move(params));
    old_sparse = std::exchange(sparse_, std::move(sparse_client));
    generation_ = next.generation();
  }
  old_sparse.reset();
  old_params.reset();  // waits for its streams
  old_transport = std::exchange(transport_, std::move(transport));
  assignment_ = std::move(next);
  {
    absl::MutexLock lock(&push_mu_);
    pending_.emplace(params_.get());
    pushed_.assign(descs_.size(), false);
  }
  deferred_.emplace(params_.get());
  pulled_step_ = -1;
  awaited_seconds_ = 0;
  step_ = assignment_.resume_step();
  first_step_ = step_;
  const v1::WorkerResumeState& resume = assignment_.resume_state();
  const int64_t total = TotalSteps(spec_);
  log_.emplace(resume, step_, total);
  loss_scale_ = worker::LossScaleOf(spec_, resume);
  stats_before_ = params_->stats();
  LOG(INFO) << "job " << options_.job_id << ": worker " << assignment_.worker_index() << " of "
            << share_.num_workers << " at generation " << assignment_.generation() << ", step "
            << step_;
  return absl::OkStatus();
}

absl::Status Client::Impl::GoOnWithGeneration() {
  if (!started_) return absl::OkStatus();  // Start() does it
  while (true) {
    absl::Status status;
    if (assignment_.worker_index() == 0) {
      std::vector<std::unique_ptr<ParameterClient::Pending>> inits;
      for (size_t t = 0; t < descs_.size(); ++t) {
        inits.push_back(params_->StartInit({initial_->data() + descs_[t].offset,
                                            descs_[t].offset},
                                           initial_, chunks_of_tensor_[t]));
      }
      status = FinishAll(std::move(inits));
      // A generation from the initial values (no checkpoint): the tables'.
      if (status.ok() && step_ == 0 && !initial_rows_.empty()) {
        status = sparse_->Init(initial_rows_);
      }
    }
    if (status.ok()) {
      status = PullInto(spec_.mode() == v1::MODE_SYNC ? step_ : 0);
    }
    if (status.ok()) {
      last_step_end_ = MonotonicNow();
      log_->Start(last_step_end_);
      return absl::OkStatus();
    }
    PSTRAIN_RETURN_IF_ERROR(ToNextGeneration(status));
  }
}

absl::Status Client::Impl::PullInto(int64_t steps_applied) {
  std::vector<std::unique_ptr<ParameterClient::Pending>> pulls;
  for (size_t t = 0; t < descs_.size(); ++t) {
    pulls.push_back(params_->StartPull({bound_[t], descs_[t].offset}, steps_applied,
                                       chunks_of_tensor_[t]));
  }
  return FinishAll(std::move(pulls));
}

}  // namespace pstrain
