#include "pstrain/client.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <functional>
#include <optional>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "common/chunk_codec.h"
#include "common/clock.h"
#include "common/dataset.h"
#include "common/job_spec.h"
#include "common/membership_client.h"
#include "common/model_file.h"
#include "common/node_id.h"
#include "common/partition.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"
#include "glog/logging.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "worker/parameter_client.h"
#include "worker/progress_reporter.h"
#include "worker/transport.h"

namespace pstrain {

int64_t TensorSpec::size() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

using worker::ParameterClient;

absl::StatusOr<std::unique_ptr<TransportSecurity>> LoadSecurity(const ConnectOptions& c) {
  const TlsFiles files{.cert = c.cert_file, .key = c.key_file, .ca = c.ca_file};
  if (files.empty()) return std::unique_ptr<TransportSecurity>();
  return TransportSecurity::Load(files);
}

std::unique_ptr<v1::Control::Stub> ControlStub(const ConnectOptions& c,
                                               const TransportSecurity* security) {
  return v1::Control::NewStub(MakeChannel(
      c.coordinator, {.security = security, .peer_roles = {PeerRole::kCoordinator}}));
}

// Calls `call` with a fresh context until it succeeds, fails other than
// UNAVAILABLE, or connect.timeout runs out.
absl::Status CallControl(const ConnectOptions& c,
                         const std::function<grpc::Status(grpc::ClientContext&)>& call) {
  const absl::Time give_up = MonotonicNow() + c.timeout;
  while (true) {
    grpc::ClientContext context;
    SetTimeout(context, std::max(give_up - MonotonicNow(), absl::Milliseconds(1)));
    AddBearerToken(context, c.token);
    const grpc::Status status = call(context);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || MonotonicNow() >= give_up) {
      return FromGrpcStatus(status);
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
}

absl::Status CheckConnect(const ConnectOptions& c) {
  if (c.coordinator.empty()) return absl::InvalidArgumentError("coordinator: required (host:port)");
  if (c.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout: must be > 0");
  return absl::OkStatus();
}

}  // namespace

int64_t DataPlaneCopiedBytes() { return CopiedPayloadBytes(); }

std::vector<int64_t> SampleOrder(uint64_t seed, int64_t epoch, int64_t n) {
  return EpochOrder(seed, epoch, n);
}

absl::StatusOr<std::string> SubmitJob(const ConnectOptions& connect, const std::string& job_yaml,
                                      const std::vector<TensorSpec>& tensors,
                                      const std::string& request_id) {
  PSTRAIN_RETURN_IF_ERROR(CheckConnect(connect));
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, ParseJobSpecYaml(job_yaml));
  v1::ModelSpec& model = *spec.mutable_model();
  if (model.type() != v1::MODEL_TYPE_UNSPECIFIED && model.type() != v1::MODEL_TYPE_EXTERNAL) {
    return absl::InvalidArgumentError(
        "model.type: a job submitted with its tensors has an external model");
  }
  if (model.tensors_size() != 0) {
    return absl::InvalidArgumentError("model.tensors: given by the tensors argument");
  }
  model.set_type(v1::MODEL_TYPE_EXTERNAL);
  for (const TensorSpec& t : tensors) {
    v1::ExternalTensor* e = model.add_tensors();
    e->set_name(t.name);
    for (int64_t d : t.shape) e->add_shape(d);
  }
  // Checked here first: the error names the field either way.
  PSTRAIN_RETURN_IF_ERROR(NormalizeJobSpec(spec).status());
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<TransportSecurity> security, LoadSecurity(connect));
  const std::unique_ptr<v1::Control::Stub> stub = ControlStub(connect, security.get());
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  std::random_device random;
  request.set_request_id(request_id.empty() ? absl::StrFormat("client-%08x%08x%08x", random(),
                                                              random(), random())
                                            : request_id);
  v1::SubmitJobResponse response;
  PSTRAIN_RETURN_IF_ERROR(CallControl(connect, [&](grpc::ClientContext& context) {
    return stub->SubmitJob(&context, request, &response);
  }));
  return response.job_id();
}

class Client::Impl {
 public:
  explicit Impl(Options options) : options_(std::move(options)) {}

  // The reporter and the heartbeats first: nothing calls back into the
  // parameter client once it goes.
  ~Impl() {
    if (reporter_ != nullptr) reporter_->Stop();
    if (membership_ != nullptr) membership_->Stop();
    params_.reset();
    transport_.reset();
  }

  absl::Status Join() {
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
    {
      const std::unique_ptr<v1::Control::Stub> stub = ControlStub(options_.connect, security_.get());
      v1::GetJobRequest request;
      request.set_job_id(options_.job_id);
      v1::Job job;
      PSTRAIN_RETURN_IF_ERROR(CallControl(options_.connect, [&](grpc::ClientContext& context) {
        return stub->GetJob(&context, request, &job);
      }));
      if (job.spec().model().type() != v1::MODEL_TYPE_EXTERNAL) {
        return absl::InvalidArgumentError(absl::StrCat(
            "job_id: job ", options_.job_id, " trains a built-in model (",
            ModelTypeName(job.spec().model().type()), "): pool workers run it, not the client"));
      }
    }

    MembershipClient::Options m;
    m.coordinator_address = options_.connect.coordinator;
    m.role = v1::NODE_ROLE_WORKER;
    m.node_id = options_.node_id;
    m.join_job = options_.job_id;
    m.security = security_.get();
    MembershipClient::Callbacks callbacks;
    callbacks.held_jobs = [this] {
      absl::MutexLock lock(&mu_);
      std::vector<v1::HeldJob> held;
      if (generation_ > 0) {
        v1::HeldJob& h = held.emplace_back();
        h.set_job_id(options_.job_id);
        h.set_generation(generation_);
      }
      return held;
    };
    callbacks.on_heartbeat = [this](const v1::HeartbeatResponse& r) { OnHeartbeat(r); };
    callbacks.on_fenced = [this](const absl::Status& status) {
      absl::MutexLock lock(&mu_);
      ended_ = absl::StrCat("another process took node id ", node_id_, ": ", status.message());
      assignment_changed_.NotifyAll();
      if (params_ != nullptr) params_->Cancel();
    };
    membership_ = std::make_unique<MembershipClient>(std::move(m), std::move(callbacks));
    node_id_ = membership_->node_id();
    membership_->Start();
    reporter_ = std::make_unique<worker::ProgressReporter>(membership_.get(), nullptr);
    return EnterNextGeneration(options_.join_timeout);
  }

  // ---- The job as this worker runs it ----

  const Options& options() const { return options_; }
  const std::string& node_id() const { return node_id_; }
  const v1::JobSpec& spec() const { return spec_; }
  const v1::WorkerAssignment& assignment() const { return assignment_; }
  int batch() const { return batch_; }
  int num_workers() const { return num_workers_; }
  int64_t step() const { return step_; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }

  absl::StatusOr<int> TensorIndex(std::string_view name) const {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (tensors_[t].name == name) return static_cast<int>(t);
    }
    return absl::NotFoundError(absl::StrCat("the model of job ", options_.job_id,
                                            " has no tensor '", std::string(name), "'"));
  }

  absl::Status CheckTensor(int tensor, int64_t size) const {
    if (tensor < 0 || tensor >= static_cast<int>(tensors_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor, " outside [0, ",
                                                     tensors_.size(), ")"));
    }
    if (size != descs_[tensor].size) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", tensors_[tensor].name, "' has ",
                                                     descs_[tensor].size, " values, not ", size));
    }
    return absl::OkStatus();
  }

  absl::Status BindTensor(int tensor, float* values, int64_t size) {
    PSTRAIN_RETURN_IF_ERROR(CheckTensor(tensor, size));
    if (values == nullptr) return absl::InvalidArgumentError("null values");
    bound_[tensor] = values;
    return absl::OkStatus();
  }

  absl::Status Start() {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (bound_[t] == nullptr) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor '", tensors_[t].name, "' is not bound (BindTensor)"));
      }
    }
    if (started_) return absl::FailedPreconditionError("already started");
    if (assignment_.worker_index() == 0) {
      // Kept: a later generation that starts from the initial values (no
      // checkpoint) needs them again.
      initial_ = std::make_shared<std::vector<float>>(NumParamsOf(spec_));
      for (size_t t = 0; t < tensors_.size(); ++t) {
        std::copy_n(bound_[t], descs_[t].size, initial_->data() + descs_[t].offset);
      }
    }
    started_ = true;
    start_time_ = MonotonicNow();
    window_start_ = start_time_;
    return GoOnWithGeneration();
  }

  absl::StatusOr<std::vector<int64_t>> BatchIndices(int64_t step, int64_t n) const {
    const int64_t global = GlobalBatch(spec_);
    if (n < global) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a training set of ", n, " samples is smaller than the global batch of ", global));
    }
    if (step < 0) return absl::InvalidArgumentError("negative step");
    const int64_t per_epoch = n / global;
    const int64_t epoch = step / per_epoch;
    if (epoch != order_epoch_ || n != order_size_) {
      order_ = EpochOrder(spec_.seed(), epoch, n);
      order_epoch_ = epoch;
      order_size_ = n;
    }
    const int64_t first = (step % per_epoch) * global + batch_offset_;
    return std::vector<int64_t>(order_.begin() + first, order_.begin() + first + batch_);
  }

  absl::Status PushGradient(int tensor, const float* grad, int64_t size,
                            std::shared_ptr<const void> keep_alive) {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    PSTRAIN_RETURN_IF_ERROR(CheckTensor(tensor, size));
    if (grad == nullptr) return absl::InvalidArgumentError("null gradient");
    // The last step's values first: a retry of its pushes must still find
    // the gradients it reads, which the caller may reuse once this returns.
    PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
    if (step_discarded_) return absl::OkStatus();
    absl::MutexLock lock(&push_mu_);
    if (pushed_[tensor]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", tensors_[tensor].name, "' was already pushed in step ", step_));
    }
    pushed_[tensor] = true;
    exchange_of_tensor_[tensor] = static_cast<int>(pending_.size());
    const int64_t offset = descs_[tensor].offset;
    // The frames only read the gradient.
    pending_.push_back(params_->StartPushPull(step_, {const_cast<float*>(grad), offset},
                                              std::move(keep_alive), {bound_[tensor], offset},
                                              chunks_of_tensor_[tensor]));
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> EndStep(double loss, int64_t samples, bool await_values) {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
    if (step_discarded_) {
      // Computed from a generation that is gone: its pushes went nowhere.
      step_discarded_ = false;
      last_step_end_ = MonotonicNow();
      awaited_seconds_ = 0;
      return step_;
    }
    if (step_ >= TotalSteps(spec_)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the job's ", TotalSteps(spec_), " steps are done: Finish"));
    }
    // Until EndStep, the program computed (its pushes overlapping).
    const absl::Time wait_start = MonotonicNow();
    for (size_t t = 0; t < tensors_.size(); ++t) {
      bool pushed;
      {
        absl::MutexLock lock(&push_mu_);
        pushed = pushed_[t];
      }
      // A tensor that took no part in the loss has a zero gradient.
      if (!pushed) PSTRAIN_RETURN_IF_ERROR(PushGradient(t, zeros_->data(), descs_[t].size, zeros_));
    }
    std::vector<std::unique_ptr<ParameterClient::Pending>> pending;
    {
      absl::MutexLock lock(&push_mu_);
      pending.swap(pending_);
      std::fill(pushed_.begin(), pushed_.end(), false);
    }
    std::unique_ptr<ParameterClient::Pending> step_end =
        params_->StartEndStep(step_, params_->PushedMaxAbs(step_));
    // The last step's values are awaited here: a recovery found after the
    // program's loop is over could not send it back.
    if (!await_values && step_ + 1 < TotalSteps(spec_)) {
      // The next forward pass awaits each tensor's values (AwaitValues);
      // the step end is finished first, as below (the pushes' replies wait
      // for it: a lost one is sent again before anything waits for them).
      deferred_.push_back(std::move(step_end));
      for (auto& p : pending) deferred_.push_back(std::move(p));
      RecordStep(loss, samples, wait_start);
      return step_;
    }
    // The step end first: the pushes' replies wait for it.
    const absl::Status ended = params_->Finish(std::move(step_end));
    const absl::Status status = FinishAll(std::move(pending), ended);
    if (!status.ok()) {
      PSTRAIN_RETURN_IF_ERROR(Recover(status));
      return step_;
    }
    RecordStep(loss, samples, wait_start);
    return step_;
  }

  absl::Status AwaitValues(int tensor) {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    if (tensor < 0 || tensor >= static_cast<int>(tensors_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor, " outside [0, ",
                                                     tensors_.size(), ")"));
    }
    if (deferred_.empty()) return absl::OkStatus();
    const absl::Time start = MonotonicNow();
    size_t exchange;
    {
      absl::MutexLock lock(&push_mu_);
      exchange = exchange_of_tensor_[tensor];
    }
    bool landed = true;
    for (uint32_t chunk : chunks_of_tensor_[tensor]) {
      landed = params_->AwaitReply(deferred_, kDeferredPushes + exchange, chunk);
      if (!landed) break;
    }
    awaited_seconds_ += absl::ToDoubleSeconds(MonotonicNow() - start);
    // A chunk of the step to send again: all of them, with their retries.
    return landed ? absl::OkStatus() : FinishDeferred();
  }

  absl::Status Pull() {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
    absl::Status status = PullInto(/*steps_applied=*/0);
    if (!status.ok()) PSTRAIN_RETURN_IF_ERROR(Recover(status));
    return absl::OkStatus();
  }

  absl::Status Finish(std::optional<Evaluation> evaluation) {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
    const int64_t total = TotalSteps(spec_);
    if (step_ != total) {
      return absl::FailedPreconditionError(
          absl::StrCat("step ", step_, " of ", total, ": the job's steps are not done"));
    }
    v1::ReportProgressRequest report = Report();
    double recent = 0;
    for (double l : recent_losses_) recent += l;
    report.set_step(total);
    report.set_loss(static_cast<float>(recent / static_cast<double>(recent_losses_.size())));
    report.set_finished(true);
    report.set_train_seconds(seconds_before_ +
                             absl::ToDoubleSeconds(last_step_end_ - start_time_));
    const double n = static_cast<double>(std::max<int64_t>(total - first_step_, 1));
    v1::StepTimes& times = *report.mutable_step_times();
    times.set_compute_seconds(phase_seconds_[0] / n);
    times.set_push_seconds(phase_seconds_[1] / n);
    times.set_wait_seconds(phase_seconds_[2] / n);
    times.set_pull_seconds(phase_seconds_[3] / n);
    if (assignment_.worker_index() == 0) {
      // The final model: every worker's last push applied on every chunk.
      std::vector<float> model(NumParamsOf(spec_));
      PSTRAIN_RETURN_IF_ERROR(params_->PullAll(model.data(), total));
      PSTRAIN_RETURN_IF_ERROR(membership_->UploadModel(
          options_.job_id, EncodeModelFile(options_.job_id, spec_, model), absl::Seconds(60)));
      if (evaluation.has_value()) {
        report.set_evaluated(true);
        report.set_evaluated_step(total);
        report.set_test_accuracy(static_cast<float>(evaluation->accuracy));
        report.set_test_loss(static_cast<float>(evaluation->loss));
      }
    }
    // What is queued first (a checkpoint's resume state), and nothing after.
    reporter_->Flush();
    reporter_->Stop();
    return membership_->ReportProgress(report, absl::Seconds(60)).status();
  }

  absl::Status Fail(const std::string& message) {
    v1::ReportProgressRequest report = Report();
    report.set_error(message.empty() ? "the client failed the job" : message);
    reporter_->Stop();
    return membership_->ReportProgress(report, absl::Seconds(30)).status();
  }

 private:
  absl::Status CheckStarted() const {
    if (!started_) return absl::FailedPreconditionError("not started (Start)");
    return absl::OkStatus();
  }

  void OnHeartbeat(const v1::HeartbeatResponse& response) {
    absl::MutexLock lock(&mu_);
    assignment_changed_.NotifyAll();
    const v1::WorkerAssignment* mine = nullptr;
    for (const v1::WorkerAssignment& a : response.worker_jobs()) {
      if (a.job_id() == options_.job_id) mine = &a;
    }
    if (mine == nullptr) {
      // Listed before, not any more: the job ended (or dropped this worker).
      if (generation_ > 0 && ended_.empty()) {
        ended_ = absl::StrCat("job ", options_.job_id, " is no longer running here");
        if (params_ != nullptr) params_->Cancel();
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
    }
  }

  // Finishes the exchanges of the last step whose values EndStep left to
  // arrive. After a recovery the step being computed is discarded: its
  // pushes and its EndStep do nothing, and EndStep returns the step the
  // job goes on from.
  absl::Status FinishDeferred() {
    if (deferred_.empty()) return absl::OkStatus();
    const absl::Time start = MonotonicNow();
    const absl::Status status = FinishAll(std::exchange(deferred_, {}));
    awaited_seconds_ += absl::ToDoubleSeconds(MonotonicNow() - start);
    if (status.ok()) return status;
    PSTRAIN_RETURN_IF_ERROR(Recover(status));
    step_discarded_ = true;
    return absl::OkStatus();
  }

  // Finishes every exchange; the first error (`status` if it is one).
  absl::Status FinishAll(std::vector<std::unique_ptr<ParameterClient::Pending>> pending,
                         absl::Status status = absl::OkStatus()) {
    for (auto& p : pending) {
      absl::Status s = params_->Finish(std::move(p));
      if (status.ok()) status = s;
    }
    return status;
  }

  // After a failed exchange: enters the job's next generation if there is
  // one (ABORTED, or CANCELLED by a heartbeat that announced it), else
  // returns the error (CANCELLED once the job is over here).
  absl::Status ToNextGeneration(const absl::Status& error) {
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

  // ToNextGeneration, and its start.
  absl::Status Recover(const absl::Status& error) {
    PSTRAIN_RETURN_IF_ERROR(ToNextGeneration(error));
    return GoOnWithGeneration();
  }

  // Waits for an assignment of a generation after the current one and
  // makes it the current one.
  absl::Status EnterNextGeneration(absl::Duration timeout) {
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
    const int workers = next.num_workers() > 0 ? static_cast<int>(next.num_workers())
                                               : spec_.num_workers();
    if (workers > spec_.num_workers() || next.worker_index() >= static_cast<uint32_t>(workers)) {
      return absl::InvalidArgumentError("worker_index outside num_workers");
    }
    if (static_cast<uint32_t>(next.server_addresses_size()) != next.plan().num_servers()) {
      return absl::InvalidArgumentError("the assignment's server addresses do not match its plan");
    }
    const std::vector<kernels::TensorDesc> descs = JobTensors(spec_);
    if (descs_.empty()) {
      descs_ = descs;
      int64_t widest = 0;
      for (const kernels::TensorDesc& d : descs_) {
        tensors_.push_back({d.name, d.shape});
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
    // The global batch, cut over the generation's workers as the built-in
    // workers cut it.
    const int global = static_cast<int>(GlobalBatch(spec_));
    const int w = static_cast<int>(next.worker_index());
    num_workers_ = workers;
    batch_ = global / workers + (w < global % workers ? 1 : 0);
    batch_offset_ = w * (global / workers) + std::min(w, global % workers);

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
    auto params = std::make_unique<ParameterClient>(std::move(c), transport.get());
    std::unique_ptr<ParameterClient> old_params;
    std::unique_ptr<worker::ParameterTransport> old_transport;
    {
      absl::MutexLock lock(&mu_);
      old_params = std::exchange(params_, std::move(params));
      generation_ = next.generation();
    }
    old_params.reset();  // waits for its streams
    old_transport = std::exchange(transport_, std::move(transport));
    assignment_ = std::move(next);
    {
      absl::MutexLock lock(&push_mu_);
      pending_.clear();
      pushed_.assign(descs_.size(), false);
      exchange_of_tensor_.assign(descs_.size(), 0);
    }
    deferred_.clear();
    awaited_seconds_ = 0;
    step_ = assignment_.resume_step();
    first_step_ = step_;
    const v1::WorkerResumeState& resume = assignment_.resume_state();
    const int64_t total = TotalSteps(spec_);
    recent_losses_.assign(std::min<int64_t>(worker::kFinalLossSteps, total), 0.0);
    for (int i = 0; i < resume.recent_losses_size(); ++i) {
      const int64_t s = step_ - resume.recent_losses_size() + i;
      if (s >= 0) recent_losses_[s % recent_losses_.size()] = resume.recent_losses(i);
    }
    loss_ema_ = resume.loss_ema();
    seconds_before_ = resume.train_seconds();
    phase_seconds_ = {};
    stats_before_ = params_->stats();
    LOG(INFO) << "job " << options_.job_id << ": worker " << assignment_.worker_index() << " of "
              << workers << " at generation " << assignment_.generation() << ", step " << step_;
    return absl::OkStatus();
  }

  // The generation's start once the tensors are bound: worker 0's initial
  // values (which servers that restored a checkpoint ignore), then the
  // values of step_ into the bound tensors.
  absl::Status GoOnWithGeneration() {
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
      }
      if (status.ok()) {
        status = PullInto(spec_.mode() == v1::MODE_SYNC ? step_ : 0);
      }
      if (status.ok()) {
        start_time_ = MonotonicNow();
        last_step_end_ = start_time_;
        window_start_ = start_time_;
        return absl::OkStatus();
      }
      PSTRAIN_RETURN_IF_ERROR(ToNextGeneration(status));
    }
  }

  absl::Status PullInto(int64_t steps_applied) {
    std::vector<std::unique_ptr<ParameterClient::Pending>> pulls;
    for (size_t t = 0; t < descs_.size(); ++t) {
      pulls.push_back(params_->StartPull({bound_[t], descs_[t].offset}, steps_applied,
                                         chunks_of_tensor_[t]));
    }
    return FinishAll(std::move(pulls));
  }

  v1::ReportProgressRequest Report() const {
    v1::ReportProgressRequest r;
    r.set_job_id(options_.job_id);
    r.set_worker(assignment_.worker_index());
    r.set_generation(assignment_.generation());
    r.set_step(step_);
    r.set_epoch(static_cast<int32_t>(step_ / StepsPerEpoch(spec_)));
    return r;
  }

  // The bookkeeping of a completed step: losses, the checkpoint's resume
  // state, the progress report.
  // The step's time as pstrain's workers split it: the program's compute
  // (from the last step's end to EndStep), and the wait in EndStep, the
  // exchanges not hidden behind compute, split in proportion to the
  // exchanges' own push, wait and pull times.
  void RecordStep(double loss, int64_t samples, absl::Time wait_start) {
    const absl::Time now = MonotonicNow();
    const ParameterClient::Stats stats = params_->stats();
    const double push = stats.push_seconds - stats_before_.push_seconds;
    const double wait = stats.wait_seconds - stats_before_.wait_seconds;
    const double pull = stats.pull_seconds - stats_before_.pull_seconds;
    stats_before_ = stats;
    // The values awaited while computing (AwaitValues) were exchange time.
    const double awaited = std::exchange(awaited_seconds_, 0.0);
    const double exposed = absl::ToDoubleSeconds(now - wait_start) + awaited;
    const double exchange = push + wait + pull;
    phase_seconds_[0] += absl::ToDoubleSeconds(wait_start - last_step_end_) - awaited;
    if (exchange > 0) {
      phase_seconds_[1] += exposed * push / exchange;
      phase_seconds_[2] += exposed * wait / exchange;
      phase_seconds_[3] += exposed * pull / exchange;
    } else {
      phase_seconds_[2] += exposed;
    }
    last_step_end_ = now;
    recent_losses_[step_ % recent_losses_.size()] = loss;
    loss_ema_ = step_ == 0 ? loss : loss_ema_ + worker::kLossEmaWeight * (loss - loss_ema_);
    window_loss_ += loss;
    ++window_steps_;
    window_samples_ += samples;
    const int64_t done = ++step_;
    const v1::CheckpointSpec& checkpoint = spec_.checkpoint();
    int64_t requested;
    {
      absl::MutexLock lock(&mu_);
      requested = requested_checkpoint_;
    }
    std::vector<v1::WorkerResumeState> states;
    if (spec_.mode() == v1::MODE_SYNC && !checkpoint.dir().empty() &&
        (done % checkpoint.every_steps() == 0 || done == requested)) {
      v1::WorkerResumeState& state = states.emplace_back();
      state.set_worker(assignment_.worker_index());
      state.set_step(done);
      state.set_generation(assignment_.generation());
      const int64_t kept = std::min<int64_t>(done, recent_losses_.size());
      for (int64_t s = done - kept; s < done; ++s) {
        state.add_recent_losses(static_cast<float>(recent_losses_[s % recent_losses_.size()]));
      }
      state.set_loss_ema(loss_ema_);
      state.set_train_seconds(seconds_before_ + absl::ToDoubleSeconds(now - start_time_));
    }
    if (now - window_start_ >= absl::Milliseconds(500) || !states.empty() ||
        done == TotalSteps(spec_)) {
      v1::ReportProgressRequest r = Report();
      r.set_loss(static_cast<float>(window_loss_ / window_steps_));
      r.set_samples(window_samples_);
      r.set_seconds(absl::ToDoubleSeconds(now - window_start_));
      for (v1::WorkerResumeState& s : states) *r.add_checkpoint_states() = std::move(s);
      reporter_->Enqueue(r);
      window_loss_ = 0;
      window_steps_ = 0;
      window_samples_ = 0;
      window_start_ = now;
    }
  }

  Options options_;
  std::string node_id_;
  std::unique_ptr<TransportSecurity> security_;
  std::unique_ptr<MembershipClient> membership_;
  std::unique_ptr<worker::ProgressReporter> reporter_;

  // What the heartbeats say (the heartbeat thread writes it).
  absl::Mutex mu_;
  std::optional<v1::WorkerAssignment> next_ ABSL_GUARDED_BY(mu_);  // the newest, with its spec
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // the one running here; 0: none yet
  int64_t requested_checkpoint_ ABSL_GUARDED_BY(mu_) = 0;
  std::string ended_ ABSL_GUARDED_BY(mu_);  // non-empty: why the job is over here
  MonotonicCondVar assignment_changed_;      // next_ or ended_ may have changed
  // Written by the driving thread under mu_, read by it without.
  std::unique_ptr<ParameterClient> params_;

  // The current generation.
  v1::WorkerAssignment assignment_;
  v1::JobSpec spec_;
  std::unique_ptr<worker::ParameterTransport> transport_;
  int num_workers_ = 0;  // of the generation
  int batch_ = 0;
  int batch_offset_ = 0;
  int64_t step_ = 0;
  int64_t first_step_ = 0;

  // The model.
  std::vector<kernels::TensorDesc> descs_;
  std::vector<TensorSpec> tensors_;
  std::vector<std::vector<uint32_t>> chunks_of_tensor_;
  std::vector<float*> bound_;
  std::shared_ptr<std::vector<float>> zeros_;    // the gradient of an unused tensor
  std::shared_ptr<std::vector<float>> initial_;  // worker 0: the initial values, flat
  bool started_ = false;

  // The step's pushes.
  absl::Mutex push_mu_;
  std::vector<bool> pushed_ ABSL_GUARDED_BY(push_mu_);
  std::vector<std::unique_ptr<ParameterClient::Pending>> pending_ ABSL_GUARDED_BY(push_mu_);
  // By tensor: its exchange in pending_ (and in deferred_, a step later).
  std::vector<int> exchange_of_tensor_ ABSL_GUARDED_BY(push_mu_);
  // The last step's exchanges, their values still arriving (EndStep
  // without awaiting them), and the time spent awaiting them since.
  // The step end, then the pushes in pending_'s order.
  std::vector<std::unique_ptr<ParameterClient::Pending>> deferred_;
  static constexpr size_t kDeferredPushes = 1;
  double awaited_seconds_ = 0;
  bool step_discarded_ = false;  // a recovery happened while it was computed

  // Progress.
  std::vector<double> recent_losses_;  // by step, a ring
  double loss_ema_ = 0;
  double seconds_before_ = 0;  // training time before this generation
  absl::Time start_time_;
  absl::Time last_step_end_;
  absl::Time window_start_;
  double window_loss_ = 0;
  int64_t window_steps_ = 0;
  int64_t window_samples_ = 0;
  // Compute, push, wait, pull over this generation's steps (RecordStep).
  std::array<double, 4> phase_seconds_{};
  ParameterClient::Stats stats_before_;  // the parameter client's, at the last step's end

  // BatchIndices' epoch order.
  mutable std::vector<int64_t> order_;
  mutable int64_t order_epoch_ = -1;
  mutable int64_t order_size_ = 0;
};

absl::StatusOr<std::unique_ptr<Client>> Client::Join(Options options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  PSTRAIN_RETURN_IF_ERROR(impl->Join());
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

const std::string& Client::job_id() const { return impl_->options().job_id; }
const std::string& Client::node_id() const { return impl_->node_id(); }
int Client::worker_index() const { return static_cast<int>(impl_->assignment().worker_index()); }
int Client::num_workers() const { return impl_->num_workers(); }
int Client::batch_size() const { return impl_->batch(); }
int64_t Client::global_batch() const { return GlobalBatch(impl_->spec()); }
int64_t Client::total_steps() const { return TotalSteps(impl_->spec()); }
int64_t Client::steps_per_epoch() const { return StepsPerEpoch(impl_->spec()); }
uint64_t Client::seed() const { return impl_->spec().seed(); }
std::string Client::mode() const { return ModeName(impl_->spec().mode()); }
double Client::gradient_scale() const {
  if (!ScalesToTheGlobalBatch(impl_->spec())) return 1.0;
  return static_cast<double>(impl_->batch()) / static_cast<double>(global_batch());
}
int64_t Client::step() const { return impl_->step(); }
const std::vector<TensorSpec>& Client::tensors() const { return impl_->tensors(); }
absl::StatusOr<int> Client::TensorIndex(std::string_view name) const {
  return impl_->TensorIndex(name);
}
absl::Status Client::BindTensor(int tensor, float* values, int64_t size) {
  return impl_->BindTensor(tensor, values, size);
}
absl::Status Client::Start() { return impl_->Start(); }
absl::StatusOr<std::vector<int64_t>> Client::BatchIndices(int64_t step,
                                                          int64_t dataset_size) const {
  return impl_->BatchIndices(step, dataset_size);
}
absl::Status Client::PushGradient(int tensor, const float* grad, int64_t size,
                                  std::shared_ptr<const void> keep_alive) {
  return impl_->PushGradient(tensor, grad, size, std::move(keep_alive));
}
absl::StatusOr<int64_t> Client::EndStep(double loss, int64_t samples, bool await_values) {
  return impl_->EndStep(loss, samples, await_values);
}
absl::Status Client::AwaitValues(int tensor) { return impl_->AwaitValues(tensor); }
absl::Status Client::Pull() { return impl_->Pull(); }
absl::Status Client::Finish(std::optional<Evaluation> evaluation) {
  return impl_->Finish(evaluation);
}
absl::Status Client::Fail(const std::string& message) { return impl_->Fail(message); }

}  // namespace pstrain
