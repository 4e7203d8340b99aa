#include "pstrain/client.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/chunk_codec.h"
#include "common/clock.h"
#include "common/dataset.h"
#include "common/enum_names.h"
#include "common/job_spec.h"
#include "common/model_file.h"
#include "common/script_metrics.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/client_impl.h"
#include "worker/parameter_client.h"
#include "worker/progress_reporter.h"
#include "worker/sparse_client.h"
#include "worker/step_log.h"
#include "worker/transport.h"

namespace pstrain {

int64_t TensorSpec::size() const {
  v1::ExternalTensor e;
  for (int64_t d : shape) e.add_shape(d);
  e.set_buffer(buffer);
  e.set_dtype(TensorDTypeOf(dtype).value_or(v1::TENSOR_DTYPE_FLOAT32));
  return FloatsOf(e);
}

namespace {

using worker::ParameterClient;

}  // namespace

int64_t DataPlaneCopiedBytes() { return CopiedPayloadBytes(); }

absl::Status SetLogLevel(std::string_view level) {
  static constexpr std::pair<std::string_view, int> kLevels[] = {
      {"info", google::GLOG_INFO},
      {"warning", google::GLOG_WARNING},
      {"error", google::GLOG_ERROR},
      {"off", google::NUM_SEVERITIES}};
  for (const auto& [name, min_level] : kLevels) {
    if (level != name) continue;
    if (!google::IsGoogleLoggingInitialized()) {
      FLAGS_logtostderr = true;  // no log files
      google::InitGoogleLogging("pstrain");
    }
    FLAGS_minloglevel = min_level;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "log level '", std::string(level), "': one of info, warning, error, off"));
}

std::vector<int64_t> SampleOrder(uint64_t seed, int64_t epoch, int64_t n) {
  return EpochOrder(seed, epoch, n);
}

absl::StatusOr<int> Client::Impl::TensorIndex(std::string_view name) const {
  for (size_t t = 0; t < tensors_.size(); ++t) {
    if (tensors_[t].name == name) return static_cast<int>(t);
  }
  return absl::NotFoundError(absl::StrCat("the model of job ", options_.job_id,
                                          " has no tensor '", std::string(name), "'"));
}

absl::StatusOr<int> Client::Impl::TableIndex(std::string_view name) const {
  for (size_t t = 0; t < tables_.size(); ++t) {
    if (tables_[t].name == name) return static_cast<int>(t);
  }
  return absl::NotFoundError(absl::StrCat("job ", options_.job_id, " has no table '",
                                          std::string(name), "'"));
}

absl::Status Client::Impl::CheckTensor(int tensor, int64_t size) const {
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

absl::Status Client::Impl::BindTensor(int tensor, float* values, int64_t size) {
  PSTRAIN_RETURN_IF_ERROR(CheckTensor(tensor, size));
  if (values == nullptr) return absl::InvalidArgumentError("null values");
  bound_[tensor] = values;
  return absl::OkStatus();
}

absl::Status Client::Impl::Start() {
  for (size_t t = 0; t < tensors_.size(); ++t) {
    if (bound_[t] == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("tensor '", tensors_[t].name, "' is not bound (BindTensor)"));
    }
  }
  for (size_t t = 0; t < tables_.size(); ++t) {
    const bool bound = std::any_of(initial_rows_.begin(), initial_rows_.end(),
                                   [&](const auto& r) { return r.table == t; });
    if (tables_[t].initial_rows > 0 && !bound && assignment_.worker_index() == 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "table '", tables_[t].name, "' starts from given rows: bind them (BindTableRows)"));
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
  return GoOnWithGeneration();
}

absl::StatusOr<std::vector<int64_t>> Client::Impl::BatchIndices(int64_t step, int64_t n) const {
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
  const int64_t first = (step % per_epoch) * global + share_.offset;
  return std::vector<int64_t>(order_.begin() + first, order_.begin() + first + share_.batch);
}

absl::Status Client::Impl::PushGradient(int tensor, const float* grad, int64_t size,
                          std::shared_ptr<const void> keep_alive) {
  PSTRAIN_RETURN_IF_ERROR(CheckStarted());
  PSTRAIN_RETURN_IF_ERROR(CheckTensor(tensor, size));
  // A buffer's values, copied now: the program goes on with its own.
  if (descs_[tensor].buffer && grad != nullptr) return PushCopy(tensor, grad);
  return Push(tensor, grad, std::move(keep_alive));
}

absl::Status Client::Impl::PushCopy(int tensor, const float* values) {
  auto copy = std::make_shared<std::vector<float>>(values, values + descs_[tensor].size);
  return Push(tensor, copy->data(), copy);
}

absl::Status Client::Impl::Push(int tensor, const float* grad, std::shared_ptr<const void> keep_alive) {
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
  const int64_t offset = descs_[tensor].offset;
  // The frames only read the gradient.
  pending_->Add(params_->StartPushPull(step_, {const_cast<float*>(grad), offset},
                                       std::move(keep_alive), {bound_[tensor], offset},
                                       chunks_of_tensor_[tensor]),
                chunks_of_tensor_[tensor]);
  return absl::OkStatus();
}

absl::StatusOr<int64_t> Client::Impl::EndStep(double loss, int64_t samples, bool await_values) {
  PSTRAIN_RETURN_IF_ERROR(CheckStarted());
  PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
  if (step_discarded_) {
    // Computed from a generation that is gone: its pushes went nowhere.
    step_discarded_ = false;
    ResetRowPush();
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
    if (pushed) continue;
    if (descs_[t].buffer) {
      // Its values as they are now, from a copy of their own: the new
      // ones land in the bound memory while the push may still be sent.
      PSTRAIN_RETURN_IF_ERROR(PushCopy(static_cast<int>(t), bound_[t]));
    } else {
      // A tensor that took no part in the loss has a zero gradient.
      PSTRAIN_RETURN_IF_ERROR(Push(static_cast<int>(t), zeros_->data(), zeros_));
    }
  }
  {
    absl::MutexLock lock(&push_mu_);
    // deferred_ holds none (FinishDeferred): it takes the step's
    // exchanges, and pending_ goes on with its buffers.
    std::swap(*pending_, *deferred_);
    std::fill(pushed_.begin(), pushed_.end(), false);
  }
  // The step's rows: every server has them before it hears the step end,
  // which bounds them too.
  const float row_max_abs = row_max_abs_;
  if (!tables_.empty()) {
    StartRowPush();
    absl::Status status = WaitForRowPush();
    if (!status.ok()) return AbandonStep(status);
  }
  // The step end first: the pushes' replies wait for it (a lost one is
  // sent again before anything waits for them).
  const float max_abs = std::max(params_->PushedMaxAbs(step_), row_max_abs);
  deferred_->AddFirst(params_->StartEndStep(step_, max_abs));
  if (!tables_.empty()) {
    // The servers that hold no dense chunk, which the dense step end skips.
    absl::Status status = sparse_->EndStep(step_, max_abs);
    if (!status.ok()) return AbandonStep(status);
  }
  // An overflow: the servers skip the step (as any non-finite one).
  if (loss_scale_.has_value()) loss_scale_->Update(!std::isfinite(max_abs));
  // The last step's values are awaited here: a recovery found after the
  // program's loop is over could not send it back.
  if (!await_values && step_ + 1 < TotalSteps(spec_)) {
    // The next forward pass awaits each tensor's values (AwaitValues).
    RecordStep(loss, samples, wait_start);
    return step_;
  }
  const absl::Status status = FinishAll(deferred_->Take());
  if (!status.ok()) {
    PSTRAIN_RETURN_IF_ERROR(Recover(status));
    return step_;
  }
  RecordStep(loss, samples, wait_start);
  return step_;
}

absl::Status Client::Impl::AwaitValues(int tensor) {
  PSTRAIN_RETURN_IF_ERROR(CheckStarted());
  if (tensor < 0 || tensor >= static_cast<int>(tensors_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor, " outside [0, ",
                                                   tensors_.size(), ")"));
  }
  if (!deferred_.has_value() || deferred_->empty()) return absl::OkStatus();
  const absl::Time start = MonotonicNow();
  bool landed = true;
  for (uint32_t chunk : chunks_of_tensor_[tensor]) {
    landed = deferred_->Await(chunk);
    if (!landed) break;
  }
  awaited_seconds_ += absl::ToDoubleSeconds(MonotonicNow() - start);
  // A chunk of the step to send again: all of them, with their retries.
  return landed ? absl::OkStatus() : FinishDeferred();
}

absl::Status Client::Impl::Pull() {
  PSTRAIN_RETURN_IF_ERROR(CheckStarted());
  PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
  absl::Status status = PullInto(/*steps_applied=*/0);
  if (!status.ok()) PSTRAIN_RETURN_IF_ERROR(Recover(status));
  return absl::OkStatus();
}

absl::Status Client::Impl::Finish(std::optional<Evaluation> evaluation) {
  PSTRAIN_RETURN_IF_ERROR(CheckStarted());
  PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
  const int64_t total = TotalSteps(spec_);
  if (step_ != total) {
    return absl::FailedPreconditionError(
        absl::StrCat("step ", step_, " of ", total, ": the job's steps are not done"));
  }
  v1::ReportProgressRequest report = Report();
  report.set_step(total);
  report.set_loss(static_cast<float>(log_->FinalLoss()));
  report.set_finished(true);
  report.set_train_seconds(log_->TrainSeconds(last_step_end_));
  *report.mutable_step_times() = log_->MeanStepTimes(total - first_step_);
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
      if (evaluation->loss.has_value()) {
        report.set_test_loss(static_cast<float>(*evaluation->loss));
      }
    }
  }
  // What is queued first (a checkpoint's resume state), and nothing after.
  reporter_->Flush();
  reporter_->Stop();
  return membership_->ReportProgress(report, absl::Seconds(60)).status();
}

absl::Status Client::Impl::ReportMetrics(const std::map<std::string, double>& metrics) {
  google::protobuf::Map<std::string, double> merged = script_metrics_;
  for (const auto& [name, value] : metrics) merged[name] = value;
  PSTRAIN_RETURN_IF_ERROR(CheckScriptMetrics(merged));
  script_metrics_ = std::move(merged);
  return absl::OkStatus();
}

absl::Status Client::Impl::Fail(const std::string& message) {
  v1::ReportProgressRequest report = Report();
  report.set_error(message.empty() ? "the client failed the job" : message);
  reporter_->Stop();
  return membership_->ReportProgress(report, absl::Seconds(30)).status();
}

absl::Status Client::Impl::CheckStarted() const {
  if (!started_) return absl::FailedPreconditionError("not started (Start)");
  return absl::OkStatus();
}

v1::ReportProgressRequest Client::Impl::Report() const {
  v1::ReportProgressRequest r;
  r.set_job_id(options_.job_id);
  r.set_worker(assignment_.worker_index());
  r.set_generation(assignment_.generation());
  r.set_step(step_);
  r.set_epoch(static_cast<int32_t>(step_ / StepsPerEpoch(spec_)));
  *r.mutable_metrics() = script_metrics_;
  return r;
}

void Client::Impl::RecordStep(double loss, int64_t samples, absl::Time wait_start) {
  const absl::Time now = MonotonicNow();
  const ParameterClient::Stats stats = params_->stats();
  const ParameterClient::Stats exchanged = worker::StatsSince(stats_before_, stats);
  stats_before_ = stats;
  // The values awaited while computing (AwaitValues) were exchange time.
  const double awaited = std::exchange(awaited_seconds_, 0.0);
  log_->Add(step_, loss, samples,
            worker::SplitStepTime(absl::ToDoubleSeconds(wait_start - last_step_end_) - awaited,
                                  0, absl::ToDoubleSeconds(now - wait_start) + awaited,
                                  exchanged));
  last_step_end_ = now;
  const int64_t done = ++step_;
  const v1::CheckpointSpec& checkpoint = spec_.checkpoint();
  int64_t requested;
  {
    absl::MutexLock lock(&mu_);
    requested = requested_checkpoint_;
  }
  const bool checkpointed = spec_.mode() == v1::MODE_SYNC && !checkpoint.dir().empty() &&
                            (done % checkpoint.every_steps() == 0 || done == requested);
  if (log_->WindowDue(now, absl::Milliseconds(500)) || checkpointed ||
      done == TotalSteps(spec_)) {
    v1::ReportProgressRequest r = Report();
    log_->TakeWindow(now, &r);
    if (checkpointed) {
      v1::WorkerResumeState* state = r.add_checkpoint_states();
      *state = log_->ResumeState(assignment_.worker_index(), done, assignment_.generation(), now);
      worker::SaveLossScale(loss_scale_, state);
    }
    reporter_->Enqueue(r);
  }
}

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
int64_t Client::batch_offset() const { return impl_->batch_offset(); }
int64_t Client::global_batch() const { return GlobalBatch(impl_->spec()); }
int64_t Client::total_steps() const { return TotalSteps(impl_->spec()); }
int64_t Client::steps_per_epoch() const { return StepsPerEpoch(impl_->spec()); }
uint64_t Client::seed() const { return impl_->spec().seed(); }
std::string Client::mode() const { return EnumName(impl_->spec().mode()); }
double Client::gradient_scale() const {
  // The sum of accumulate_steps micro-batches' mean-loss gradients (each
  // micro-batch counts for its share), computed under the loss scale.
  const double divisor = accumulate_steps() * loss_scale();
  if (!ScalesToTheGlobalBatch(impl_->spec())) return 1.0 / divisor;
  return static_cast<double>(impl_->batch()) / static_cast<double>(global_batch()) / divisor;
}
double Client::loss_scale() const { return impl_->loss_scale(); }
int Client::accumulate_steps() const { return std::max(1, impl_->spec().accumulate_steps()); }
int64_t Client::step() const { return impl_->step(); }
int64_t Client::generation() const { return impl_->assignment().generation(); }
const std::vector<TensorSpec>& Client::tensors() const { return impl_->tensors(); }
absl::StatusOr<int> Client::TensorIndex(std::string_view name) const {
  return impl_->TensorIndex(name);
}
const std::vector<TableInfo>& Client::tables() const { return impl_->tables(); }
absl::StatusOr<int> Client::TableIndex(std::string_view name) const {
  return impl_->TableIndex(name);
}
absl::Status Client::PullRows(const std::vector<RowPull>& pulls) { return impl_->PullRows(pulls); }
absl::Status Client::PushRowGradients(int table, const uint64_t* keys, const uint32_t* counts,
                                      const float* grads, int64_t n) {
  return impl_->PushRowGradients(table, keys, counts, grads, n);
}
absl::Status Client::BindTensor(int tensor, float* values, int64_t size) {
  return impl_->BindTensor(tensor, values, size);
}
absl::Status Client::BindTableRows(int table, const float* rows, int64_t count) {
  return impl_->BindTableRows(table, rows, count);
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
absl::Status Client::ReportMetrics(const std::map<std::string, double>& metrics) {
  return impl_->ReportMetrics(metrics);
}
absl::Status Client::Fail(const std::string& message) { return impl_->Fail(message); }

}  // namespace pstrain
