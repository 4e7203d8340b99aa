#include "worker/click_trainer.h"

#include <algorithm>
#include <cmath>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/click_generator.h"
#include "common/clock.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/random.h"
#include "common/roc_auc.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/generation.h"
#include "worker/step_log.h"

namespace pstrain::worker {

// The training samples of every step, as every worker of the job reads
// them (docs/click-data.md): generated rows by position, or the files'
// windowed order, epoch after epoch (an epoch ends at the first global
// batch its stream cannot fill).
class ClickInput {
 public:
  explicit ClickInput(const v1::JobSpec& spec) : spec_(spec) {
    const v1::ClickDataSpec& clicks = spec.data().clicks();
    if (clicks.has_generate()) generator_.emplace(ClickDataSpecOf(spec.data()));
  }

  // Appends samples [offset, offset + count) of step `step`'s global batch.
  absl::Status Read(int64_t step, int64_t offset, int64_t count, ClickBatch& out) {
    const int64_t global = GlobalBatch(spec_);
    if (generator_.has_value()) {
      const int64_t first = (step % StepsPerEpoch(spec_)) * global + offset;
      for (int64_t i = 0; i < count; ++i) generator_->Generate(ClickSplit::kTrain, first + i, out);
      return absl::OkStatus();
    }
    if (stream_ == nullptr || step < epoch_first_step_) {
      epoch_ = 0;
      epoch_first_step_ = 0;
      PSTRAIN_RETURN_IF_ERROR(OpenEpoch());
    }
    while (true) {
      const int64_t t = step - epoch_first_step_;
      PSTRAIN_ASSIGN_OR_RETURN(const int64_t available, stream_->Available((t + 1) * global));
      if (available == (t + 1) * global) return stream_->Read(t * global + offset, count, out);
      if (t == 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "data.clicks.train_files hold ", available, " lines, fewer than one global batch of ",
            global));
      }
      ++epoch_;  // the stream cannot fill global batch t: the next epoch starts here
      epoch_first_step_ = step;
      PSTRAIN_RETURN_IF_ERROR(OpenEpoch());
    }
  }

 private:
  absl::Status OpenEpoch() {
    const v1::ClickDataSpec& clicks = spec_.data().clicks();
    PSTRAIN_ASSIGN_OR_RETURN(
        stream_, ClickStream::Open({.files = {clicks.train_files().begin(),
                                              clicks.train_files().end()},
                                    .layout = {.dense = clicks.dense(), .fields = clicks.fields()},
                                    .seed = spec_.seed(),
                                    .epoch = epoch_,
                                    .shuffle_window = clicks.shuffle_window()}));
    return absl::OkStatus();
  }

  const v1::JobSpec spec_;
  std::optional<ClickGenerator> generator_;
  std::unique_ptr<ClickStream> stream_;
  int64_t epoch_ = 0;
  int64_t epoch_first_step_ = 0;
};

absl::StatusOr<std::unique_ptr<JobTrainer>> CreateJobTrainer(TrainerOptions options) {
  if (options.assignment.spec().model().type() == v1::MODEL_TYPE_CLICK) {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<ClickTrainer> t,
                             ClickTrainer::Create(std::move(options)));
    return std::unique_ptr<JobTrainer>(std::move(t));
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> t, Trainer::Create(std::move(options)));
  return std::unique_ptr<JobTrainer>(std::move(t));
}

ClickTrainer::ClickTrainer(TrainerOptions options) : options_(std::move(options)) {}

ClickTrainer::~ClickTrainer() {
  sparse_.reset();
  client_.reset();
  owned_transport_.reset();
}

absl::StatusOr<std::unique_ptr<ClickTrainer>> ClickTrainer::Create(TrainerOptions options) {
  std::unique_ptr<ClickTrainer> t(new ClickTrainer(std::move(options)));
  const v1::WorkerAssignment& a = t->options_.assignment;
  PSTRAIN_ASSIGN_OR_RETURN(t->spec_, NormalizeJobSpec(a.spec()));
  if (t->spec_.model().type() != v1::MODEL_TYPE_CLICK) {
    return absl::InvalidArgumentError("ClickTrainer runs click models");
  }
  t->shape_ = ClickModelShapeOf(t->spec_);
  PSTRAIN_RETURN_IF_ERROR(ValidatePartitionPlan(a.plan(), kernels::ClickModelParams(t->shape_)));
  PSTRAIN_ASSIGN_OR_RETURN(const BatchShare share, BatchShareOf(t->spec_, a));
  t->batch_ = share.batch;
  t->batch_offset_ = share.offset;
  if (a.resume_step() < 0 || a.resume_step() > TotalSteps(t->spec_)) {
    return absl::InvalidArgumentError("resume_step outside the job's steps");
  }
  t->requested_checkpoint_ = a.checkpoint_request_step();
  t->keys_.emplace(t->spec_);
  const v1::ClickDataSpec& clicks = t->spec_.data().clicks();
  const std::string root = t->options_.data != nullptr ? t->options_.data->root() : "";
  for (const auto& [field, files] : {std::pair{"data.clicks.train_files", &clicks.train_files()},
                                     std::pair{"data.clicks.test_files", &clicks.test_files()}}) {
    for (const std::string& file : *files) {
      PSTRAIN_RETURN_IF_ERROR(CheckPathWithin(field, file, "--data_root", root));
    }
  }
  t->input_ = std::make_unique<ClickInput>(t->spec_);
  if (a.worker_index() == 0) {
    PSTRAIN_ASSIGN_OR_RETURN(t->test_, ClickTestSet(t->spec_, &t->oracle_auc_));
  }
  PSTRAIN_ASSIGN_OR_RETURN(t->model_, kernels::CreateCpuClickModelKernels(
                                          t->shape_, std::max(t->batch_, kClickEvalBatch)));
  if (t->options_.transport) {
    t->transport_ = t->options_.transport(0);
  } else {
    const TransportFactory make =
        t->options_.make_transport ? t->options_.make_transport : GrpcTransportFactory();
    PSTRAIN_ASSIGN_OR_RETURN(t->owned_transport_,
                             make({a.server_addresses().begin(), a.server_addresses().end()}));
    t->transport_ = t->owned_transport_.get();
  }
  ParameterClient::Options client = t->options_.client;
  client.job_id = a.job_id();
  client.worker = a.worker_index();
  client.generation = a.generation();
  client.mode = t->spec_.mode();
  client.wire_dtype = t->spec_.wire_dtype();
  client.plan = a.plan();
  t->client_ = std::make_unique<ParameterClient>(client, t->transport_);
  t->sparse_ = std::make_unique<SparseClient>(SparseClient::OptionsFor(a, t->spec_, client.retry),
                                              t->transport_);
  t->params_.assign(kernels::ClickModelParams(t->shape_), 0.0f);
  return t;
}

void ClickTrainer::Cancel() {
  cancelled_ = true;
  if (client_ != nullptr) client_->Cancel();
  if (sparse_ != nullptr) sparse_->Cancel();
}

absl::Status ClickTrainer::PullRows(int64_t step, int64_t version, int64_t pushed_steps,
                                    ClickRows& batch) {
  PSTRAIN_RETURN_IF_ERROR(
      sparse_->Pull(step, version, pushed_steps, batch.tables, batch.rows_by_table));
  batch.JoinRows();
  return absl::OkStatus();
}

absl::StatusOr<ClickEvaluation> ClickTrainer::Evaluate(const std::vector<float>& params,
                                                       int64_t steps) {
  const bool sync = spec_.mode() == v1::MODE_SYNC;
  return EvaluateClickModel(*keys_, *model_, params, *test_, [&](ClickRows& batch) {
    return sparse_->Pull(steps, sync ? steps : 0, 0, batch.tables, batch.rows_by_table);
  });
}

absl::Status ClickTrainer::Run() {
  const v1::WorkerAssignment& a = options_.assignment;
  const int64_t total_steps = TotalSteps(spec_);
  const int64_t first_step = a.resume_step();
  const int64_t staleness = StalenessOf(spec_);
  const bool sync = spec_.mode() == v1::MODE_SYNC;
  const int dim = shape_.dim;
  // The values the first step is computed from, as Trainer::Run takes them.
  if (!sync && first_step == 0 && a.generation() <= 1) {
    kernels::InitClickParams(shape_, spec_.seed(), 0, static_cast<int64_t>(params_.size()),
                             params_.data());
  } else {
    PSTRAIN_RETURN_IF_ERROR(client_->PullAll(params_.data(), sync ? first_step : 0));
  }
  const float grad_scale =
      1.0f / static_cast<float>(ScalesToTheGlobalBatch(spec_) ? GlobalBatch(spec_) : batch_);
  v1::ReportProgressRequest report;
  report.set_job_id(a.job_id());
  report.set_worker(a.worker_index());
  report.set_generation(a.generation());
  StepLog log(a.resume_state(), first_step, total_steps);
  const int64_t eval_every = spec_.eval_every_steps();
  const bool evaluates = a.worker_index() == 0;
  auto set_evaluation = [&](v1::ReportProgressRequest& r, int64_t done,
                            const ClickEvaluation& eval) {
    r.set_evaluated(true);
    r.set_evaluated_step(done);
    r.set_test_accuracy(static_cast<float>(eval.accuracy));
    r.set_test_loss(static_cast<float>(eval.log_loss));
    (*r.mutable_metrics())["test_auc"] = eval.auc;
    (*r.mutable_metrics())["test_log_loss"] = eval.log_loss;
    if (oracle_auc_.has_value()) (*r.mutable_metrics())["oracle_auc"] = *oracle_auc_;
  };
  auto grad = std::make_shared<std::vector<float>>(params_.size());
  std::vector<float> row_grad;
  ClickBatch samples;
  samples.layout = {.dense = shape_.dense, .fields = shape_.fields};
  ClickRows batch;
  ParameterClient::Stats before = client_->stats();
  log.Start(MonotonicNow());
  for (int64_t step = first_step; step < total_steps; ++step) {
    if (cancelled_) return absl::CancelledError("training cancelled");
    const absl::Time step_start = MonotonicNow();
    samples.Clear();
    PSTRAIN_RETURN_IF_ERROR(input_->Read(step, batch_offset_, batch_, samples));
    PSTRAIN_RETURN_IF_ERROR(keys_->Prepare(samples, batch));
    PSTRAIN_RETURN_IF_ERROR(
        PullRows(step, sync ? step : 0, StepsAppliedBefore(step, staleness), batch));
    const absl::Time compute_start = MonotonicNow();
    row_grad.resize(batch.rows.size());
    kernels::ClickStats stats;
    const kernels::ClickInputs inputs{batch_, samples.dense.data(), samples.labels.data(),
                                      &batch.bags};
    PSTRAIN_RETURN_IF_ERROR(model_->ForwardBackward(params_.data(), batch.rows.data(), inputs,
                                                    grad_scale, grad->data(), row_grad.data(),
                                                    nullptr, &stats));
    const double compute_seconds = absl::ToDoubleSeconds(MonotonicNow() - compute_start);
    float max_abs = 0;
    for (int t = 0; t < spec_.tables_size(); ++t) {
      const float* g = row_grad.data() + batch.table_first_row[t] * dim;
      batch.tables[t].grads.assign(g, g + batch.tables[t].keys.size() * dim);
    }
    for (float g : row_grad) max_abs = std::max(max_abs, std::isfinite(g) ? std::abs(g) : INFINITY);
    std::unique_ptr<ParameterClient::Pending> pushed =
        client_->StartPushPull(step, grad, params_.data());
    absl::Status status = sparse_->Push(step, batch.tables);
    max_abs = std::max(max_abs, client_->PushedMaxAbs(step));
    if (status.ok()) status = client_->Finish(client_->StartEndStep(step, max_abs));
    if (status.ok()) status = sparse_->EndStep(step, max_abs);
    const absl::Status values = client_->Finish(std::move(pushed));
    if (status.ok()) status = values;
    if (!status.ok()) return cancelled_ ? absl::CancelledError("training cancelled") : status;

    const absl::Time step_end = MonotonicNow();
    const double loss = stats.loss_sum / batch_;
    if (!std::isfinite(loss)) {
      return absl::FailedPreconditionError(
          absl::StrCat("the training loss is ", loss, " at step ", step,
                       ": the job diverged (try a lower learning rate)"));
    }
    const ParameterClient::Stats after = client_->stats();
    const double step_seconds = absl::ToDoubleSeconds(step_end - step_start);
    const double compute = std::min(compute_seconds, step_seconds);
    log.Add(step, loss, batch_,
            SplitStepTime(compute, 0, step_seconds - compute, StatsSince(before, after)));
    before = after;

    const int64_t done = step + 1;
    bool evaluated = false;
    if (evaluates && eval_every > 0 && done % eval_every == 0 && done < total_steps) {
      std::vector<float> params(params_.size());
      PSTRAIN_RETURN_IF_ERROR(
          client_->PullAll(params.data(), StepsAppliedBefore(done, staleness)));
      PSTRAIN_ASSIGN_OR_RETURN(const ClickEvaluation eval, Evaluate(params, done));
      set_evaluation(report, done, eval);
      before = client_->stats();
      evaluated = true;
    }
    // At a checkpoint step (sync: what the servers checkpoint after this
    // step), what a replacement needs to go on from it exactly.
    if (sync && !spec_.checkpoint().dir().empty() &&
        (done % spec_.checkpoint().every_steps() == 0 || done == requested_checkpoint_)) {
      *report.add_checkpoint_states() =
          log.ResumeState(a.worker_index(), done, a.generation(), step_end);
    }
    if (log.WindowDue(step_end, options_.report_interval) || done == total_steps || evaluated) {
      log.TakeWindow(step_end, &report);
      report.set_step(done);
      if (options_.report) options_.report(report);
      ClearSentOnce(&report);
    }
  }
  *report.mutable_step_times() = log.MeanStepTimes(total_steps - first_step);
  report.set_step(total_steps);
  report.set_loss(static_cast<float>(log.FinalLoss()));
  report.set_samples(0);
  report.set_seconds(0);
  report.set_finished(true);
  report.set_train_seconds(log.TrainSeconds(MonotonicNow()));
  if (evaluates) {
    // The final model: every worker's last push applied everywhere.
    PSTRAIN_RETURN_IF_ERROR(client_->PullAll(params_.data(), total_steps));
    PSTRAIN_ASSIGN_OR_RETURN(const ClickEvaluation eval, Evaluate(params_, total_steps));
    set_evaluation(report, total_steps, eval);
    LOG(INFO) << "job " << a.job_id() << ": test AUC " << eval.auc << ", log loss "
              << eval.log_loss
              << (oracle_auc_.has_value() ? absl::StrCat(", the data's oracle AUC ", *oracle_auc_)
                                          : "");
  }
  if (options_.report) options_.report(report);
  return absl::OkStatus();
}

}  // namespace pstrain::worker
