#include "pstrain/client.h"

#include <algorithm>
#include <cmath>
#include <future>
#include <map>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "common/chunk_codec.h"
#include "common/clock.h"
#include "common/dataset.h"
#include "common/enum_names.h"
#include "common/job_spec.h"
#include "common/membership_client.h"
#include "common/model_file.h"
#include "common/node_id.h"
#include "common/partition.h"
#include "common/rpc.h"
#include "common/script_metrics.h"
#include "common/status.h"
#include "common/tls.h"
#include "glog/logging.h"
#include "worker/client_control.h"
#include "worker/generation.h"
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

class Client::Impl {
 public:
  explicit Impl(Options options) : options_(std::move(options)) {}

  // The reporter and the heartbeats first: nothing calls back into the
  // parameter client once it goes.
  ~Impl() {
    if (reporter_ != nullptr) reporter_->Stop();
    if (membership_ != nullptr) membership_->Stop();
    if (sparse_ != nullptr) sparse_->Cancel();
    WaitForRowPush().IgnoreError();
    sparse_.reset();
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

  // ---- The job as this worker runs it ----

  const Options& options() const { return options_; }
  const std::string& node_id() const { return node_id_; }
  const v1::JobSpec& spec() const { return spec_; }
  const v1::WorkerAssignment& assignment() const { return assignment_; }
  int batch() const { return share_.batch; }
  int64_t batch_offset() const { return share_.offset; }
  int num_workers() const { return share_.num_workers; }
  int64_t step() const { return step_; }
  const std::vector<TensorSpec>& tensors() const { return tensors_; }
  const std::vector<TableInfo>& tables() const { return tables_; }
  double loss_scale() const { return loss_scale_.has_value() ? loss_scale_->scale() : 1.0; }

  absl::StatusOr<int> TensorIndex(std::string_view name) const {
    for (size_t t = 0; t < tensors_.size(); ++t) {
      if (tensors_[t].name == name) return static_cast<int>(t);
    }
    return absl::NotFoundError(absl::StrCat("the model of job ", options_.job_id,
                                            " has no tensor '", std::string(name), "'"));
  }

  absl::StatusOr<int> TableIndex(std::string_view name) const {
    for (size_t t = 0; t < tables_.size(); ++t) {
      if (tables_[t].name == name) return static_cast<int>(t);
    }
    return absl::NotFoundError(absl::StrCat("job ", options_.job_id, " has no table '",
                                            std::string(name), "'"));
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

  absl::Status BindTableRows(int table, const float* rows, int64_t count) {
    if (table < 0 || table >= static_cast<int>(tables_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("table ", table, " outside [0, ",
                                                     tables_.size(), ")"));
    }
    const TableInfo& info = tables_[table];
    if (rows == nullptr || count != info.initial_rows || count == 0) {
      return absl::InvalidArgumentError(absl::StrCat("table '", info.name, "' starts from ",
                                                     info.initial_rows, " given rows, not ",
                                                     count));
    }
    std::erase_if(initial_rows_, [&](const auto& r) { return r.table == uint32_t(table); });
    initial_rows_.push_back({static_cast<uint32_t>(table), rows, count});
    return absl::OkStatus();
  }

  absl::Status Start() {
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
    const int64_t first = (step % per_epoch) * global + share_.offset;
    return std::vector<int64_t>(order_.begin() + first, order_.begin() + first + share_.batch);
  }

  absl::Status PushGradient(int tensor, const float* grad, int64_t size,
                            std::shared_ptr<const void> keep_alive) {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    PSTRAIN_RETURN_IF_ERROR(CheckTensor(tensor, size));
    // A buffer's values, copied now: the program goes on with its own.
    if (descs_[tensor].buffer && grad != nullptr) return PushCopy(tensor, grad);
    return Push(tensor, grad, std::move(keep_alive));
  }

  // Pushes a copy of `values` (a buffer's: the tensor's size).
  absl::Status PushCopy(int tensor, const float* values) {
    auto copy = std::make_shared<std::vector<float>>(values, values + descs_[tensor].size);
    return Push(tensor, copy->data(), copy);
  }

  // Starts the push of `tensor` (a gradient, or a buffer's values) and the
  // pull of its new values.
  absl::Status Push(int tensor, const float* grad, std::shared_ptr<const void> keep_alive) {
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

  absl::Status PullRows(const std::vector<RowPull>& pulls) {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    std::vector<worker::SparseClient::TableKeys> keys(tables_.size());
    for (const RowPull& pull : pulls) {
      PSTRAIN_RETURN_IF_ERROR(CheckRows(pull.table, pull.keys, pull.n, pull.rows));
      keys[pull.table].keys.insert(keys[pull.table].keys.end(), pull.keys, pull.keys + pull.n);
    }
    for (size_t t = 0; t < keys.size(); ++t) {
      PSTRAIN_RETURN_IF_ERROR(CheckDistinct(static_cast<int>(t), keys[t].keys));
    }
    PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
    std::vector<std::vector<float>> rows;
    absl::Status status = step_discarded_ ? absl::OkStatus() : PullTableRows(keys, rows);
    if (!status.ok()) {
      PSTRAIN_RETURN_IF_ERROR(Recover(status));
      step_discarded_ = true;  // the rows of a step that will not be applied
    }
    std::vector<int64_t> taken(tables_.size(), 0);
    for (const RowPull& pull : pulls) {
      const int64_t floats = pull.n * tables_[pull.table].dim;
      if (step_discarded_) {
        std::fill_n(pull.rows, floats, 0.0f);
      } else {
        std::copy_n(rows[pull.table].data() + taken[pull.table], floats, pull.rows);
      }
      taken[pull.table] += floats;
    }
    return absl::OkStatus();
  }

  absl::Status PushRowGradients(int table, const uint64_t* keys, const uint32_t* counts,
                                const float* grads, int64_t n) {
    PSTRAIN_RETURN_IF_ERROR(CheckStarted());
    PSTRAIN_RETURN_IF_ERROR(CheckRows(table, keys, n, grads));
    if (n > 0 && counts == nullptr) return absl::InvalidArgumentError("null counts");
    PSTRAIN_RETURN_IF_ERROR(FinishDeferred());
    if (step_discarded_) return absl::OkStatus();
    if (row_pushed_[table]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "table '", tables_[table].name, "' was already pushed in step ", step_));
    }
    PSTRAIN_RETURN_IF_ERROR(CheckDistinct(table, absl::MakeConstSpan(keys, n)));
    worker::SparseClient::TableKeys& rows = row_push_[table];
    rows.keys.assign(keys, keys + n);
    rows.counts.assign(counts, counts + n);
    rows.grads.assign(grads, grads + n * tables_[table].dim);
    for (float g : rows.grads) {
      row_max_abs_ = std::max(row_max_abs_, std::isfinite(g) ? std::abs(g) : INFINITY);
    }
    row_pushed_[table] = true;
    if (std::all_of(row_pushed_.begin(), row_pushed_.end(), [](bool b) { return b; })) {
      StartRowPush();
    }
    return absl::OkStatus();
  }

  absl::StatusOr<int64_t> EndStep(double loss, int64_t samples, bool await_values) {
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

  absl::Status AwaitValues(int tensor) {
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

  absl::Status ReportMetrics(const std::map<std::string, double>& metrics) {
    google::protobuf::Map<std::string, double> merged = script_metrics_;
    for (const auto& [name, value] : metrics) merged[name] = value;
    PSTRAIN_RETURN_IF_ERROR(CheckScriptMetrics(merged));
    script_metrics_ = std::move(merged);
    return absl::OkStatus();
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

  // ---- Rows of the embedding tables ----

  absl::Status CheckRows(int table, const uint64_t* keys, int64_t n, const float* rows) const {
    if (table < 0 || table >= static_cast<int>(tables_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("table ", table, " outside [0, ",
                                                     tables_.size(), ")"));
    }
    if (n < 0) return absl::InvalidArgumentError("a negative number of keys");
    if (n > 0 && (keys == nullptr || rows == nullptr)) {
      return absl::InvalidArgumentError("null keys or rows");
    }
    return absl::OkStatus();
  }

  absl::Status CheckDistinct(int table, absl::Span<const uint64_t> keys) const {
    absl::flat_hash_set<uint64_t> seen;
    seen.reserve(keys.size());
    for (uint64_t key : keys) {
      if (!seen.insert(key).second) {
        return absl::InvalidArgumentError(absl::StrCat("table '", tables_[table].name,
                                                       "': key ", key, " twice in one step's "
                                                       "pulls or push (keys must be distinct)"));
      }
    }
    return absl::OkStatus();
  }

  // What a pull of step_'s rows waits for: the tables' version (sync) and
  // every worker's clock (ssp), as the dense values do.
  std::pair<int64_t, int64_t> RowsWaitFor() const {
    return {spec_.mode() == v1::MODE_SYNC ? step_ : 0,
            StepsAppliedBefore(step_, StalenessOf(spec_))};
  }

  // The rows of step_ (as the step reads them) of every table's keys.
  absl::Status PullTableRows(const std::vector<worker::SparseClient::TableKeys>& keys,
                             std::vector<std::vector<float>>& rows) {
    const auto [version, pushed_steps] = RowsWaitFor();
    PSTRAIN_RETURN_IF_ERROR(sparse_->Pull(step_, version, pushed_steps, keys, rows));
    pulled_step_ = step_;
    return absl::OkStatus();
  }

  // Sends the step's row gradients (tables not pushed: none) to every
  // server on a thread of its own, unless sent already. A server takes a
  // worker's push of a step once its tables have reached the step, which
  // the step's pull waits for: without one, an empty pull goes first.
  void StartRowPush() {
    if (row_push_done_.valid()) return;
    const bool pull_first = pulled_step_ != step_;
    row_push_done_ = std::async(
        std::launch::async, [sparse = sparse_.get(), step = step_, wait = RowsWaitFor(),
                             pull_first, rows = std::exchange(row_push_, {})]() -> absl::Status {
          if (pull_first) {
            std::vector<std::vector<float>> none;
            PSTRAIN_RETURN_IF_ERROR(sparse->Pull(
                step, wait.first, wait.second,
                std::vector<worker::SparseClient::TableKeys>(rows.size()), none));
          }
          return sparse->Push(step, rows);
        });
  }

  // Waits for the step's row push, if one was started, and makes ready
  // for the next step's.
  absl::Status WaitForRowPush() {
    absl::Status status;
    if (row_push_done_.valid()) status = row_push_done_.get();
    ResetRowPush();
    return status;
  }

  void ResetRowPush() {
    row_push_.assign(tables_.size(), {});
    row_pushed_.assign(tables_.size(), false);
    row_max_abs_ = 0;
  }

  // A step whose exchanges failed: the step's dense exchanges end (they
  // would wait for a step end that is not coming) and the job goes on
  // from where it recovers to, if it does.
  absl::StatusOr<int64_t> AbandonStep(const absl::Status& error) {
    params_->Cancel();
    FinishAll(deferred_->Take()).IgnoreError();
    PSTRAIN_RETURN_IF_ERROR(Recover(error));
    return step_;
  }

  void OnHeartbeat(const v1::HeartbeatResponse& response) {
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

  // Finishes the exchanges of the last step whose values EndStep left to
  // arrive. After a recovery the step being computed is discarded: its
  // pushes and its EndStep do nothing, and EndStep returns the step the
  // job goes on from.
  absl::Status FinishDeferred() {
    if (!deferred_.has_value() || deferred_->empty()) return absl::OkStatus();
    const absl::Time start = MonotonicNow();
    const absl::Status status = FinishAll(deferred_->Take());
    awaited_seconds_ += absl::ToDoubleSeconds(MonotonicNow() - start);
    if (status.ok()) return status;
    PSTRAIN_RETURN_IF_ERROR(Recover(status));
    step_discarded_ = true;
    return absl::OkStatus();
  }

  // Finishes every exchange, also after an error; the first error.
  absl::Status FinishAll(std::vector<std::unique_ptr<ParameterClient::Pending>> pending) {
    absl::Status status;
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
    *r.mutable_metrics() = script_metrics_;
    return r;
  }

  // The bookkeeping of a completed step: losses, the checkpoint's resume
  // state, the progress report. The step's time as pstrain's workers split
  // it: the program's compute (from the last step's end to EndStep), and
  // the wait in EndStep, the exchanges not hidden behind compute.
  void RecordStep(double loss, int64_t samples, absl::Time wait_start) {
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
  std::unique_ptr<worker::SparseClient> sparse_;

  // The current generation.
  v1::WorkerAssignment assignment_;
  v1::JobSpec spec_;
  std::unique_ptr<worker::ParameterTransport> transport_;
  worker::BatchShare share_;  // of the global batch
  int64_t step_ = 0;
  int64_t first_step_ = 0;

  // The model.
  std::vector<kernels::TensorDesc> descs_;
  std::vector<TensorSpec> tensors_;
  std::vector<std::vector<uint32_t>> chunks_of_tensor_;
  std::vector<float*> bound_;
  std::shared_ptr<std::vector<float>> zeros_;    // the gradient of an unused tensor
  std::shared_ptr<std::vector<float>> initial_;  // worker 0: the initial values, flat
  std::vector<worker::SparseClient::InitialRows> initial_rows_;  // BindTableRows
  bool started_ = false;

  // The step's pushes.
  absl::Mutex push_mu_;
  std::vector<bool> pushed_ ABSL_GUARDED_BY(push_mu_);
  std::optional<worker::StepExchanges> pending_ ABSL_GUARDED_BY(push_mu_);
  // The last step's exchanges, their values still arriving (EndStep
  // without awaiting them), and the time spent awaiting them since; both
  // are the generation's (EnterNextGeneration).
  std::optional<worker::StepExchanges> deferred_;
  double awaited_seconds_ = 0;
  bool step_discarded_ = false;  // a recovery happened while it was computed

  // The embedding tables, and the step's row gradients until they go (all
  // pushed, or EndStep) on a thread of their own.
  std::vector<TableInfo> tables_;
  std::vector<worker::SparseClient::TableKeys> row_push_;
  std::vector<bool> row_pushed_;
  float row_max_abs_ = 0;  // of the step's row gradients; +inf for a NaN
  std::future<absl::Status> row_push_done_;
  int64_t pulled_step_ = -1;  // the last step whose rows were pulled

  // precision fp16: the scale of the step being computed.
  std::optional<worker::DynamicLossScale> loss_scale_;

  // Progress.
  std::optional<worker::StepLog> log_;  // of the current generation
  absl::Time last_step_end_;
  // The script's own metrics: the latest value of each name, in every report.
  google::protobuf::Map<std::string, double> script_metrics_;
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
