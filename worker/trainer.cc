#include "worker/trainer.h"

#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "worker/in_process.h"

namespace pstrain::worker {
namespace {

// The final loss of a worker is its mean training loss over this many steps.
constexpr int64_t kFinalLossSteps = 50;
// Weight of each step's loss in the exported moving average.
constexpr double kLossEmaWeight = 0.02;

}  // namespace

Trainer::Trainer(TrainerOptions options) : options_(std::move(options)) {}

Trainer::~Trainer() {
  // The client refers to the transport: destroy it first.
  client_.reset();
  owned_transport_.reset();
  if (metrics_.has_value()) options_.metrics->expiring.JobEnded(options_.assignment.job_id());
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerOptions options) {
  if (options.data == nullptr) return absl::InvalidArgumentError("TrainerOptions.data is null");
  std::unique_ptr<Trainer> t(new Trainer(std::move(options)));
  const v1::WorkerAssignment& a = t->options_.assignment;
  PSTRAIN_ASSIGN_OR_RETURN(t->spec_, NormalizeJobSpec(a.spec()));
  const kernels::ModelShape shape = ModelShapeOf(t->spec_);
  PSTRAIN_RETURN_IF_ERROR(ValidatePartitionPlan(a.plan(), kernels::NumParams(shape)));
  if (a.worker_index() >= static_cast<uint32_t>(t->spec_.num_workers())) {
    return absl::InvalidArgumentError("worker_index outside num_workers");
  }
  PSTRAIN_ASSIGN_OR_RETURN(t->train_, t->options_.data->FashionMnist(t->spec_.data().dir(), true));
  if (a.worker_index() == 0) {
    PSTRAIN_ASSIGN_OR_RETURN(t->test_,
                             t->options_.data->FashionMnist(t->spec_.data().dir(), false));
  }
  PSTRAIN_ASSIGN_OR_RETURN(t->kernels_,
                           kernels::CreateCpuModelKernels(shape, t->spec_.batch_size()));
  ParameterTransport* transport = t->options_.transport;
  if (transport == nullptr) {
    std::vector<std::string> addresses(a.server_addresses().begin(), a.server_addresses().end());
    if (addresses.size() != a.plan().num_servers()) {
      return absl::InvalidArgumentError("server_addresses do not match the plan");
    }
    PSTRAIN_ASSIGN_OR_RETURN(t->owned_transport_, CreateGrpcTransport(addresses, t->options_.rpc));
    transport = t->owned_transport_.get();
  }
  ParameterClient::Options client = t->options_.client;
  client.job_id = a.job_id();
  client.worker = a.worker_index();
  client.mode = t->spec_.mode();
  client.plan = a.plan();
  t->client_ = std::make_unique<ParameterClient>(std::move(client), transport);
  if (t->options_.metrics != nullptr) t->metrics_ = t->options_.metrics->BindJob(a.job_id());
  t->params_.resize(a.plan().total_floats());
  t->grad_ = std::make_shared<std::vector<float>>(a.plan().total_floats());
  return t;
}

void Trainer::Cancel() {
  cancelled_ = true;
  client_->Cancel();
}

absl::Status Trainer::Run() {
  const v1::WorkerAssignment& a = options_.assignment;
  const int64_t workers = spec_.num_workers();
  const int batch = spec_.batch_size();
  const int64_t worker = a.worker_index();
  const int64_t total_steps = TotalSteps(spec_);
  const int64_t steps_per_epoch = StepsPerEpoch(spec_);
  const bool sync = spec_.mode() == v1::MODE_SYNC;
  // Sync: the servers sum W gradients, so each is scaled to its share of the
  // global batch's mean. Async: each push is applied alone.
  const float grad_scale = 1.0f / static_cast<float>(sync ? workers * batch : batch);

  PSTRAIN_RETURN_IF_ERROR(client_->PullAll(0, params_.data()));

  std::vector<float> x(static_cast<size_t>(batch) * train_->input_dim);
  std::vector<int32_t> y(batch);
  std::vector<int64_t> order;
  int64_t epoch = -1;

  v1::ReportProgressRequest report;
  report.set_job_id(a.job_id());
  report.set_worker(a.worker_index());
  double window_loss = 0;
  int64_t window_steps = 0;
  // The losses of the last kFinalLossSteps steps, for the final report.
  std::vector<double> recent_losses(std::min<int64_t>(kFinalLossSteps, total_steps));
  const absl::Time start = absl::Now();
  absl::Time window_start = start;

  // Seconds spent in each StepPhase over the whole job.
  std::array<double, kStepPhaseNames.size()> phase_totals{};
  double loss_ema = 0;
  ParameterClient::Stats before = client_->stats();
  for (int64_t step = 0; step < total_steps; ++step) {
    if (cancelled_) return absl::CancelledError("training cancelled");
    const absl::Time step_start = absl::Now();
    if (step / steps_per_epoch != epoch) {
      epoch = step / steps_per_epoch;
      order = EpochOrder(spec_.seed(), epoch, train_->num_samples);
    }
    const int64_t first = (step % steps_per_epoch) * workers * batch + worker * batch;
    train_->Gather(order.data() + first, batch, x.data(), y.data());
    kernels::BatchStats stats;
    PSTRAIN_RETURN_IF_ERROR(kernels_->ForwardBackward(params_.data(), x.data(), y.data(), batch,
                                                      grad_scale, grad_->data(), &stats));
    if (options_.step_delay > absl::ZeroDuration()) absl::SleepFor(options_.step_delay);
    const absl::Time computed = absl::Now();
    PSTRAIN_RETURN_IF_ERROR(client_->PushPull(step, grad_, params_.data()));
    const absl::Time step_end = absl::Now();
    steps_done_ = step + 1;
    const double loss = stats.loss_sum / batch;
    recent_losses[step % recent_losses.size()] = loss;
    window_loss += loss;
    ++window_steps;
    loss_ema = step == 0 ? loss : loss_ema + kLossEmaWeight * (loss - loss_ema);

    // Where the step's time went.
    const ParameterClient::Stats after = client_->stats();
    std::array<double, kStepPhaseNames.size()> phases{};
    phases[static_cast<int>(StepPhase::kCompute)] = absl::ToDoubleSeconds(computed - step_start);
    phases[static_cast<int>(StepPhase::kPush)] = after.push_seconds - before.push_seconds;
    phases[static_cast<int>(StepPhase::kWait)] = after.wait_seconds - before.wait_seconds;
    phases[static_cast<int>(StepPhase::kPull)] = after.pull_seconds - before.pull_seconds;
    for (size_t p = 0; p < phases.size(); ++p) phase_totals[p] += phases[p];
    if (metrics_.has_value()) {
      metrics_->steps->Increment();
      metrics_->samples->Increment(batch);
      metrics_->step_seconds->Observe(absl::ToDoubleSeconds(step_end - step_start));
      for (size_t p = 0; p < phases.size(); ++p) metrics_->phase_seconds[p]->Increment(phases[p]);
      metrics_->pushed_bytes->Increment(static_cast<double>(after.bytes_pushed - before.bytes_pushed));
      metrics_->pulled_bytes->Increment(static_cast<double>(after.bytes_pulled - before.bytes_pulled));
      metrics_->retries->Increment(static_cast<double>(after.retries - before.retries));
      metrics_->loss->Set(loss);
      metrics_->loss_ema->Set(loss_ema);
    }
    before = after;

    if (step_end - window_start >= options_.report_interval || step + 1 == total_steps) {
      const double seconds = absl::ToDoubleSeconds(step_end - window_start);
      if (metrics_.has_value() && seconds > 0) {
        metrics_->samples_per_second->Set(window_steps * batch / seconds);
      }
      report.set_step(step + 1);
      report.set_epoch(static_cast<int32_t>(epoch));
      report.set_loss(static_cast<float>(window_loss / window_steps));
      report.set_samples(window_steps * batch);
      report.set_seconds(seconds);
      if (options_.report) options_.report(report);
      window_loss = 0;
      window_steps = 0;
      window_start = step_end;
    }
  }
  v1::StepTimes& times = *report.mutable_step_times();
  const double n = static_cast<double>(total_steps);
  times.set_compute_seconds(phase_totals[static_cast<int>(StepPhase::kCompute)] / n);
  times.set_reduce_seconds(phase_totals[static_cast<int>(StepPhase::kReduce)] / n);
  times.set_push_seconds(phase_totals[static_cast<int>(StepPhase::kPush)] / n);
  times.set_wait_seconds(phase_totals[static_cast<int>(StepPhase::kWait)] / n);
  times.set_pull_seconds(phase_totals[static_cast<int>(StepPhase::kPull)] / n);
  // The final report's loss is the mean over the last steps (the same in
  // every run of a sync job); its samples were reported above.
  double recent = 0;
  for (double loss : recent_losses) recent += loss;
  report.set_loss(static_cast<float>(recent / recent_losses.size()));
  report.set_samples(0);
  report.set_seconds(0);
  report.set_finished(true);
  report.set_train_seconds(absl::ToDoubleSeconds(absl::Now() - start));

  if (worker == 0) {
    // The final model: every worker's last push applied on every chunk.
    const int64_t final_version = sync ? total_steps : workers * total_steps;
    PSTRAIN_RETURN_IF_ERROR(client_->PullAll(final_version, params_.data()));
    PSTRAIN_ASSIGN_OR_RETURN(const Evaluation eval, Evaluate(spec_, params_, *test_));
    report.set_evaluated(true);
    report.set_test_accuracy(static_cast<float>(eval.accuracy));
    report.set_test_loss(static_cast<float>(eval.loss));
  }
  if (options_.report) options_.report(report);
  return absl::OkStatus();
}

}  // namespace pstrain::worker
