#include "worker/trainer.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/generation.h"
#include "worker/gradient_pusher.h"
#include "worker/in_process.h"

namespace pstrain::worker {
namespace {

// Worker 0 evaluates the model (the final one, and during training); with
// early stopping every worker does, so that all judge the same evaluations.
bool EvaluatesTheModel(const v1::JobSpec& spec, int worker) {
  return worker == 0 || spec.early_stopping().patience() > 0;
}


kernels::Precision PrecisionOf(v1::Precision p) {
  switch (p) {
    case v1::PRECISION_TF32:
      return kernels::Precision::kTf32;
    case v1::PRECISION_BF16:
      return kernels::Precision::kBf16;
    case v1::PRECISION_FP16:
      return kernels::Precision::kFp16;
    default:
      return kernels::Precision::kFp32;
  }
}

}  // namespace

struct Trainer::DeviceState {
  std::unique_ptr<kernels::Device> device;
  std::unique_ptr<kernels::ModelKernels> model;
  int share = 0;   // samples of the node batch per step
  int offset = 0;  // where they start in the node batch
  // The share is computed in micro_batches pieces (as even as can be, of at
  // most `micro` samples), their gradients summed into `accumulated` (host,
  // flat) before the push. Every device of the node has as many: the
  // reduction across them runs once per piece.
  int micro = 0;
  int micro_batches = 1;
  std::vector<float> accumulated;
  // Device memory. params_ptr/grad_ptr point into these, or, for a single
  // device that uses host memory, into the node's host buffers (no copies).
  kernels::DeviceBuffer params, grad, x, y, send, recv;
  float* params_ptr = nullptr;
  float* grad_ptr = nullptr;
  std::vector<float> host_x;
  std::vector<int32_t> host_y;
  // Host memory, flat: the reduced gradient slices this device pushes.
  std::shared_ptr<std::vector<float>> push_grad;
  std::unique_ptr<ParameterTransport> owned_transport;
  std::unique_ptr<ParameterClient> client;
  // The exchanges of the step in progress, or those of the last step (the
  // node's step end first, on device 0): their values are awaited chunk by
  // chunk as the next forward pass asks for them (AwaitValues).
  std::unique_ptr<StepExchanges> exchanges;
  // Layers whose values for the next forward pass the device holds (the
  // model's layer count: all).
  int layers_loaded = 0;
  std::atomic<int64_t> samples{0};
};

struct Trainer::StepResult {
  kernels::BatchStats stats;
  double compute_seconds = 0;
  double reduce_seconds = 0;
  // Of the compute: waiting for the last step's values (no compute).
  double params_wait_seconds = 0;
};

Trainer::Trainer(TrainerOptions options) : options_(std::move(options)) {}

Trainer::~Trainer() {
  // Clients refer to transports, buffers to devices: destroy in that order.
  for (auto& d : devices_) {
    d->exchanges.reset();
    d->client.reset();
    d->owned_transport.reset();
  }
  devices_.clear();
  if (metrics_.has_value()) options_.metrics->expiring.JobEnded(options_.assignment.job_id());
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(TrainerOptions options) {
  if (options.data == nullptr) return absl::InvalidArgumentError("TrainerOptions.data is null");
  if (options.devices.indices.empty()) options.devices.indices = {0};
  std::unique_ptr<Trainer> t(new Trainer(std::move(options)));
  const v1::WorkerAssignment& a = t->options_.assignment;
  PSTRAIN_ASSIGN_OR_RETURN(t->spec_, NormalizeJobSpec(a.spec()));
  const kernels::ModelShape shape = ModelShapeOf(t->spec_);
  PSTRAIN_RETURN_IF_ERROR(ValidatePartitionPlan(a.plan(), kernels::NumParams(shape)));
  PSTRAIN_ASSIGN_OR_RETURN(const BatchShare share, BatchShareOf(t->spec_, a));
  t->batch_ = share.batch;
  t->batch_offset_ = share.offset;
  t->requested_checkpoint_ = a.checkpoint_request_step();
  t->loss_scale_ = LossScaleOf(t->spec_, a.resume_state());
  if (a.resume_step() < 0 || a.resume_step() > TotalSteps(t->spec_)) {
    return absl::InvalidArgumentError("resume_step outside the job's steps");
  }
  PSTRAIN_ASSIGN_OR_RETURN(t->train_, t->options_.data->FashionMnist(t->spec_.data().dir(), true));
  PSTRAIN_RETURN_IF_ERROR(CheckDataFitsJob(t->spec_, *t->train_, /*train=*/true));
  if (EvaluatesTheModel(t->spec_, a.worker_index())) {
    PSTRAIN_ASSIGN_OR_RETURN(t->test_,
                             t->options_.data->FashionMnist(t->spec_.data().dir(), false));
    PSTRAIN_RETURN_IF_ERROR(CheckDataFitsJob(t->spec_, *t->test_, /*train=*/false));
  }
  PSTRAIN_RETURN_IF_ERROR(t->CreateDevices());
  if (t->options_.metrics != nullptr) t->metrics_ = t->options_.metrics->BindJob(a.job_id());
  return t;
}

absl::Status Trainer::CreateDevices() {
  const v1::WorkerAssignment& a = options_.assignment;
  const v1::PartitionPlan& plan = a.plan();
  const int64_t total = plan.total_floats();
  const int batch = batch_;
  const int k_devices = static_cast<int>(options_.devices.indices.size());
  if (k_devices > batch) {
    return absl::InvalidArgumentError(absl::StrCat("batch_size ", batch, " is smaller than the ",
                                                   k_devices, " devices of this worker"));
  }
  PSTRAIN_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<kernels::Device>> devices,
                           worker::CreateDevices(options_.devices));
  PSTRAIN_ASSIGN_OR_RETURN(reducer_, CreateReducer(options_.devices));

  const std::vector<std::pair<int, int>> layers = LayerChunkRanges(plan);
  int64_t padded = 0;
  for (const auto& [first, last] : layers) {
    layer_layouts_.push_back(SliceLayout::Create(plan, first, last, k_devices));
    padded = std::max(padded, layer_layouts_.back().padded_floats());
  }
  host_params_.assign(total, 0.0f);

  const kernels::ModelShape shape = ModelShapeOf(spec_);
  std::vector<std::string> addresses(a.server_addresses().begin(), a.server_addresses().end());
  int offset = 0;
  for (int k = 0; k < k_devices; ++k) {
    auto d = std::make_unique<DeviceState>();
    d->device = std::move(devices[k]);
    kernels::Device& dev = *d->device;
    d->share = batch / k_devices + (k < batch % k_devices ? 1 : 0);
    d->offset = offset;
    offset += d->share;
    // accumulate_steps pieces, unless the smallest share has fewer samples.
    d->micro_batches = std::min(spec_.accumulate_steps(), batch / k_devices);
    d->micro = (d->share + d->micro_batches - 1) / d->micro_batches;
    if (d->micro_batches > 1) d->accumulated.resize(total);
    PSTRAIN_ASSIGN_OR_RETURN(
        d->model, dev.CreateModelKernels(shape, d->micro, PrecisionOf(spec_.precision())));
    d->push_grad = std::make_shared<std::vector<float>>(total);
    const bool shared = dev.host_memory() && k_devices == 1;
    if (shared) {
      d->params_ptr = host_params_.data();
      d->grad_ptr = d->push_grad->data();
    } else {
      PSTRAIN_ASSIGN_OR_RETURN(d->params, dev.Allocate(total * sizeof(float)));
      PSTRAIN_ASSIGN_OR_RETURN(d->grad, dev.Allocate(total * sizeof(float)));
      d->params_ptr = d->params.as<float>();
      d->grad_ptr = d->grad.as<float>();
    }
    PSTRAIN_ASSIGN_OR_RETURN(d->x, dev.Allocate(static_cast<size_t>(d->micro) *
                                                 train_->input_dim * sizeof(float)));
    PSTRAIN_ASSIGN_OR_RETURN(d->y, dev.Allocate(d->micro * sizeof(int32_t)));
    if (!dev.host_memory()) {
      d->host_x.resize(static_cast<size_t>(d->micro) * train_->input_dim);
      d->host_y.resize(d->micro);
    }
    if (k_devices > 1) {
      PSTRAIN_ASSIGN_OR_RETURN(d->send, dev.Allocate(padded * sizeof(float)));
      PSTRAIN_ASSIGN_OR_RETURN(d->recv, dev.Allocate(padded * sizeof(float)));
    }
    ParameterTransport* transport = options_.transport ? options_.transport(k) : nullptr;
    if (transport == nullptr) {
      if (addresses.size() != plan.num_servers()) {
        return absl::InvalidArgumentError("server_addresses do not match the plan");
      }
      const TransportFactory& make =
          options_.make_transport ? options_.make_transport : GrpcTransportFactory();
      PSTRAIN_ASSIGN_OR_RETURN(d->owned_transport, make(addresses));
      transport = d->owned_transport.get();
    }
    ParameterClient::Options client = options_.client;
    client.job_id = a.job_id();
    client.worker = a.worker_index();
    client.generation = a.generation();
    client.mode = spec_.mode();
    client.wire_dtype = spec_.wire_dtype();
    client.plan = plan;
    d->client = std::make_unique<ParameterClient>(std::move(client), transport);
    d->exchanges = std::make_unique<StepExchanges>(d->client.get());
    devices_.push_back(std::move(d));
  }
  return absl::OkStatus();
}

int64_t Trainer::samples_processed(int device) const { return devices_[device]->samples; }

ParameterClient::Stats Trainer::client_stats() const {
  ParameterClient::Stats sum;
  for (const auto& d : devices_) {
    const ParameterClient::Stats s = d->client->stats();
    sum.retries += s.retries;
    sum.bytes_pushed += s.bytes_pushed;
    sum.bytes_pulled += s.bytes_pulled;
    sum.push_seconds += s.push_seconds;
    sum.wait_seconds += s.wait_seconds;
    sum.pull_seconds += s.pull_seconds;
  }
  return sum;
}

void Trainer::Cancel() {
  cancelled_ = true;
  if (reducer_ != nullptr) reducer_->Abort();
  for (auto& d : devices_) d->client->Cancel();
}

absl::Status Trainer::OnAllDevices(const std::function<absl::Status(int)>& fn) {
  const int n = static_cast<int>(devices_.size());
  if (n == 1) return fn(0);
  std::vector<absl::Status> status(n);
  std::vector<std::thread> threads;
  for (int k = 1; k < n; ++k) {
    threads.emplace_back([&, k] {
      status[k] = fn(k);
      // A device that fails must not leave the others waiting in a collective.
      if (!status[k].ok()) reducer_->Abort();
    });
  }
  status[0] = fn(0);
  if (!status[0].ok()) reducer_->Abort();
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) {
    if (!s.ok() && s.code() != absl::StatusCode::kCancelled) return s;
  }
  for (const absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Trainer::LoadParams() {
  return OnAllDevices([&](int k) -> absl::Status {
    DeviceState& d = *devices_[k];
    d.layers_loaded = static_cast<int>(layer_layouts_.size());
    if (ReadsValuesInPlace(k)) return absl::OkStatus();
    return d.device->CopyToDevice(d.params_ptr, host_params_.data(),
                                  host_params_.size() * sizeof(float));
  });
}

bool Trainer::ReadsValuesInPlace(int k) const {
  return devices_[k]->params_ptr == host_params_.data();
}

absl::Status Trainer::AwaitValues(int k, int layer, int64_t floats, double* wait_seconds,
                                  double* load_seconds) {
  DeviceState& d = *devices_[k];
  const int num_layers = static_cast<int>(layer_layouts_.size());
  const bool in_place = ReadsValuesInPlace(k);
  for (int l = d.layers_loaded; l <= layer; ++l) {
    const SliceLayout& layout = layer_layouts_[l];
    const SliceLayout::Slice& mine = layout.slices[k];
    // In place, as far as the pass reads (the rows of a block); else this
    // device's whole slice of the layer, which goes to the device at once.
    const bool whole = !in_place || l < layer || floats >= layout.total_floats();
    const int64_t end = whole ? mine.flat_offset + mine.floats : mine.flat_offset + floats;
    const absl::Time t0 = MonotonicNow();
    const bool landed = d.exchanges->AwaitInOrder(mine.first_chunk, mine.last_chunk, end);
    // All of them before backward writes the gradient (a retry would send
    // it), or at once when one was lost: the one to retry.
    if (!landed || (whole && l + 1 == num_layers)) {
      PSTRAIN_RETURN_IF_ERROR(d.exchanges->FinishAll());
    }
    const absl::Time t1 = MonotonicNow();
    *wait_seconds += absl::ToDoubleSeconds(t1 - t0);
    if (!whole) return absl::OkStatus();
    if (!in_place) {
      PSTRAIN_RETURN_IF_ERROR(LoadLayer(k, l));
      *load_seconds += absl::ToDoubleSeconds(MonotonicNow() - t1);
    }
    d.layers_loaded = l + 1;
    if (options_.trace) options_.trace({StepEvent::Kind::kValuesLoaded, l, k});
  }
  return absl::OkStatus();
}

absl::Status Trainer::LoadLayer(int k, int layer) {
  DeviceState& d = *devices_[k];
  kernels::Device& dev = *d.device;
  const SliceLayout& layout = layer_layouts_[layer];
  if (devices_.size() == 1) {
    const SliceLayout::Slice& whole = layout.slices[0];
    return dev.CopyToDevice(d.params_ptr + whole.flat_offset, host_params_.data() + whole.flat_offset,
                            whole.floats * sizeof(float));
  }
  // Each device holds the servers' answer for its own slice; the
  // all-gather gives every device all of them.
  const SliceLayout::Slice& mine = layout.slices[k];
  PSTRAIN_RETURN_IF_ERROR(dev.CopyToDevice(d.send.as<float>(), host_params_.data() + mine.flat_offset,
                                           mine.floats * sizeof(float)));
  PSTRAIN_RETURN_IF_ERROR(
      reducer_->AllGather(k, d.send.as<float>(), d.recv.as<float>(), layout.slice_floats));
  for (int r = 0; r < static_cast<int>(devices_.size()); ++r) {
    PSTRAIN_RETURN_IF_ERROR(
        layout.UnpackSlice(dev, r, d.recv.as<float>() + r * layout.slice_floats, d.params_ptr));
  }
  return absl::OkStatus();
}

absl::Status Trainer::ComputeAndPush(int k, int64_t step, const int64_t* node_samples,
                                     StepResult* result) {
  DeviceState& d = *devices_[k];
  kernels::Device& dev = *d.device;
  const int k_devices = static_cast<int>(devices_.size());
  const absl::Time start = MonotonicNow();

  // The last step's values, when they are still arriving (DeferValues
  // left them): the forward pass asks for each layer before it reads it.
  const v1::PartitionPlan& plan = options_.assignment.plan();
  const int num_layers = static_cast<int>(layer_layouts_.size());
  double reduce_seconds = 0;
  kernels::ParamsNeededFn params_needed;
  if (d.layers_loaded < num_layers) {
    params_needed = [&](int layer, int64_t floats) {
      if (options_.trace) options_.trace({StepEvent::Kind::kValuesAsked, layer, k});
      return AwaitValues(k, layer, floats, &result->params_wait_seconds, &reduce_seconds);
    };
  }

  // As each layer's gradient is final: reduce it across the node's devices
  // and, after the last micro-batch, start pushing this device's slice of
  // it (with the earlier micro-batches' sum added). A single device pushes
  // the whole chunks of a final prefix of a layer at once (without
  // micro-batches).
  // The loss scale (precision fp16; else 1): the gradients computed are
  // scale times the loss's, and go out divided by it.
  const double loss_scale = loss_scale_ ? loss_scale_->scale() : 1.0;
  absl::Status push_status;
  GradientPusher::Options pushes;
  pushes.step = step;
  pushes.grad = d.push_grad;
  pushes.params = host_params_.data();
  pushes.loss_scale = loss_scale;
  pushes.min_push_bytes = options_.min_push_bytes;
  for (const SliceLayout& layout : layer_layouts_) {
    pushes.first_chunks.push_back(layout.slices[k].first_chunk);
  }
  if (options_.trace) {
    pushes.on_started = [&](int layer) {
      options_.trace({StepEvent::Kind::kPushStarted, layer, k});
    };
  }
  GradientPusher pusher(d.client.get(), d.exchanges.get(), std::move(pushes));
  int micro_batch = 0;
  auto on_ready = [&](int layer, int64_t ready_floats) {
    if (d.layers_loaded < num_layers && push_status.ok()) {
      // A retry of them would send this gradient: a kernel that breaks
      // the contract of ParamsNeededFn.
      push_status = absl::InternalError(
          "the model's forward pass did not ask for its last layer's parameters before "
          "backward wrote a gradient");
    }
    const SliceLayout& layout = layer_layouts_[layer];
    const SliceLayout::Slice& slice = layout.slices[k];
    const bool last = micro_batch + 1 == d.micro_batches;
    if (ready_floats < layout.total_floats()) {
      // A prefix: its whole chunks, when they are already in host memory.
      if (k_devices > 1 || d.micro_batches > 1 || d.grad_ptr != d.push_grad->data() ||
          !push_status.ok()) {
        return;
      }
      const int64_t ready_end = slice.flat_offset + ready_floats;
      int end = pusher.first_unpushed(layer);
      while (end < slice.last_chunk &&
             plan.chunks(end).offset() + plan.chunks(end).size() <= ready_end) {
        ++end;
      }
      pusher.PushUpTo(layer, end);
      return;
    }
    if (last && options_.trace) options_.trace({StepEvent::Kind::kBackwardDone, layer, k});
    if (!push_status.ok()) return;
    const absl::Time t0 = MonotonicNow();
    float* push_at = d.push_grad->data() + slice.flat_offset;
    if (k_devices == 1) {
      if (d.grad_ptr != d.push_grad->data()) {
        push_status = dev.CopyToHost(push_at, d.grad_ptr + slice.flat_offset,
                                     slice.floats * sizeof(float));
      }
    } else {
      push_status = layout.Pack(dev, d.grad_ptr, d.send.as<float>());
      if (push_status.ok()) {
        push_status = reducer_->ReduceScatter(k, d.send.as<float>(), d.recv.as<float>(),
                                              layout.slice_floats);
      }
      if (push_status.ok()) {
        push_status = dev.CopyToHost(push_at, d.recv.as<float>(), slice.floats * sizeof(float));
      }
    }
    reduce_seconds += absl::ToDoubleSeconds(MonotonicNow() - t0);
    if (!push_status.ok()) return;
    if (d.micro_batches > 1) {
      // Summed in micro-batch order: every run adds the same floats alike.
      float* sum = d.accumulated.data() + slice.flat_offset;
      if (micro_batch == 0) {
        std::copy(push_at, push_at + slice.floats, sum);
      } else {
        float* into = last ? push_at : sum;
        for (int64_t i = 0; i < slice.floats; ++i) into[i] = sum[i] + push_at[i];
      }
    }
    if (last) pusher.PushUpTo(layer, slice.last_chunk);
  };
  // Sync: the servers sum the workers' gradients, so each is scaled to its
  // share of the global batch's mean; ssp too, so that a step's pushes add
  // up to the same update. Async: each node's push is a step of its own.
  const float grad_scale = static_cast<float>(
      loss_scale / static_cast<double>(ScalesToTheGlobalBatch(spec_) ? GlobalBatch(spec_) : batch_));
  absl::Status status;
  for (; micro_batch < d.micro_batches && status.ok() && push_status.ok(); ++micro_batch) {
    // This device's samples of the node batch, one micro-batch at a time.
    const int even = d.share / d.micro_batches, more = d.share % d.micro_batches;
    const int n = even + (micro_batch < more ? 1 : 0);
    const int64_t* samples =
        node_samples + d.offset + micro_batch * even + std::min(micro_batch, more);
    if (dev.host_memory()) {
      train_->Gather(samples, n, d.x.as<float>(), d.y.as<int32_t>());
    } else {
      train_->Gather(samples, n, d.host_x.data(), d.host_y.data());
      PSTRAIN_RETURN_IF_ERROR(dev.CopyToDevice(
          d.x.as<float>(), d.host_x.data(), static_cast<size_t>(n) * train_->input_dim * sizeof(float)));
      PSTRAIN_RETURN_IF_ERROR(
          dev.CopyToDevice(d.y.as<int32_t>(), d.host_y.data(), n * sizeof(int32_t)));
    }
    status = d.model->ForwardBackward(d.params_ptr, d.x.as<float>(), d.y.as<int32_t>(), n,
                                      grad_scale, d.grad_ptr, &result->stats, on_ready,
                                      micro_batch == 0 ? params_needed : nullptr);
  }
  if (status.ok() && push_status.ok()) pusher.Flush();
  result->compute_seconds = absl::ToDoubleSeconds(MonotonicNow() - start) - reduce_seconds -
                            result->params_wait_seconds;
  result->reduce_seconds = reduce_seconds;
  PSTRAIN_RETURN_IF_ERROR(status);
  return push_status;
}

void Trainer::DeferValues(int k) {
  DeviceState& d = *devices_[k];
  d.layers_loaded = 0;
  d.exchanges->Rewind();
  d.samples += d.share;
}

absl::StatusOr<Evaluation> Trainer::EvaluateAfter(int64_t steps) {
  eval_params_.resize(host_params_.size());
  // What a worker computing step `steps` may see (sync: exactly the model
  // after that many steps).
  PSTRAIN_RETURN_IF_ERROR(devices_[0]->client->PullAll(
      eval_params_.data(), StepsAppliedBefore(steps, StalenessOf(spec_))));
  return Evaluate(spec_, eval_params_, *test_);
}

absl::Status Trainer::Run() {
  const v1::WorkerAssignment& a = options_.assignment;
  const int64_t global_batch = GlobalBatch(spec_);
  const int64_t total_steps = TotalSteps(spec_);
  const int64_t steps_per_epoch = StepsPerEpoch(spec_);
  const int64_t first_step = a.resume_step();
  const int64_t checkpoint_every = spec_.checkpoint().every_steps();
  const bool sync = spec_.mode() == v1::MODE_SYNC;
  ParameterClient& client0 = *devices_[0]->client;

  // The values the first step is computed from. Sync: the values after
  // first_step steps (the servers restored them). Async and ssp at the
  // job's start: the seed's initial values, made here as the servers made
  // theirs (a pull could already hold a faster worker's first pushes);
  // later, whatever the servers have now (their clocks start again in each
  // generation: the bound holds from the first push on).
  if (!sync && first_step == 0 && a.generation() <= 1) {
    kernels::InitParams(ModelShapeOf(spec_), spec_.seed(), 0,
                        static_cast<int64_t>(host_params_.size()), host_params_.data());
  } else {
    PSTRAIN_RETURN_IF_ERROR(client0.PullAll(host_params_.data(), sync ? first_step : 0));
  }
  PSTRAIN_RETURN_IF_ERROR(LoadParams());

  std::vector<int64_t> order;
  int64_t epoch = -1;
  v1::ReportProgressRequest report;
  report.set_job_id(a.job_id());
  report.set_worker(a.worker_index());
  report.set_generation(a.generation());
  StepLog log(a.resume_state(), first_step, total_steps);
  // Evaluation during training.
  const int64_t eval_every = spec_.eval_every_steps();
  const bool evaluates = eval_every > 0 && EvaluatesTheModel(spec_, a.worker_index());
  EarlyStopper stopper(spec_.early_stopping(), a.resume_state());
  std::optional<Evaluation> last_eval;
  std::string stopped_early;  // why, once early stopping ends the training
  int64_t last_step = total_steps;
  ParameterClient::Stats before = client_stats();
  std::vector<StepResult> results(devices_.size());
  steps_done_ = first_step;
  log.Start(MonotonicNow());

  for (int64_t step = first_step; step < total_steps; ++step) {
    if (cancelled_) return absl::CancelledError("training cancelled");
    const absl::Time step_start = MonotonicNow();
    if (step / steps_per_epoch != epoch) {
      epoch = step / steps_per_epoch;
      order = EpochOrder(spec_.seed(), epoch, train_->num_samples);
    }
    const int64_t* node_samples =
        order.data() + (step % steps_per_epoch) * global_batch + batch_offset_;
    std::fill(results.begin(), results.end(), StepResult{});
    float max_abs = 0;  // of everything the node pushed (infinity: not finite)
    absl::Status status = OnAllDevices(
        [&](int k) { return ComputeAndPush(k, step, node_samples, &results[k]); });
    if (status.ok()) {
      // The node's step end, once every device has started its pushes: the
      // servers apply none of the step before it. Device 0 finishes it as
      // the first of its exchanges (a lost one is sent again before
      // anything else), when the next forward pass awaits the values.
      for (const auto& d : devices_) max_abs = std::max(max_abs, d->client->PushedMaxAbs(step));
      devices_[0]->exchanges->AddFirst(client0.StartEndStep(step, max_abs));
      for (int k = 0; k < static_cast<int>(devices_.size()); ++k) DeferValues(k);
    }
    if (!status.ok()) {
      if (cancelled_) return absl::CancelledError("training cancelled");
      return status;
    }
    const absl::Time step_end = MonotonicNow();
    steps_done_ = step + 1;
    double loss_sum = 0;
    for (const StepResult& r : results) loss_sum += r.stats.loss_sum;
    const double loss = loss_sum / batch_;
    if (!std::isfinite(loss)) {
      // A diverged job fails: its parameters are no model.
      return absl::FailedPreconditionError(
          absl::StrCat("the training loss is ", loss, " at step ", step,
                       ": the job diverged (try a lower optimizer.learning_rate)"));
    }
    if (loss_scale_.has_value()) {
      // An overflow: the servers skipped the step (as any non-finite one).
      const bool overflowed = !std::isfinite(max_abs);
      loss_scale_->Update(overflowed);
      if (metrics_.has_value()) {
        if (overflowed) metrics_->overflows->Increment();
        metrics_->loss_scale->Set(loss_scale_->scale());
      }
    }

    // Where the step's time went: device 0's compute and reduce, and the
    // rest, the exchanges with the servers not hidden behind compute.
    const ParameterClient::Stats after = client_stats();
    const ParameterClient::Stats exchanged = StatsSince(before, after);
    before = after;
    const double step_seconds = absl::ToDoubleSeconds(step_end - step_start);
    const double compute = std::min(results[0].compute_seconds, step_seconds);
    const double reduce = std::min(results[0].reduce_seconds, step_seconds - compute);
    const StepPhases phases =
        SplitStepTime(compute, reduce, step_seconds - compute - reduce, exchanged);
    log.Add(step, loss, batch_, phases);
    RecordStepMetrics(step_seconds, phases, exchanged, loss, log.loss_ema());

    // Evaluation during training (the last step's is the final one below),
    // before the checkpoint state, which carries early stopping's part.
    const int64_t done = step + 1;
    bool evaluated = false;
    if (evaluates && done % eval_every == 0 && done < total_steps) {
      // The step end must be in before the servers can answer for `done`.
      PSTRAIN_RETURN_IF_ERROR(
          OnAllDevices([&](int k) { return devices_[k]->exchanges->FinishAll(); }));
      PSTRAIN_ASSIGN_OR_RETURN(last_eval, EvaluateAfter(done));
      before = client_stats();  // the evaluation's pull is no step's
      evaluated = true;
      const float accuracy = static_cast<float>(last_eval->accuracy);
      if (a.worker_index() == 0) {
        report.set_evaluated(true);
        report.set_evaluated_step(done);
        report.set_test_accuracy(accuracy);
        report.set_test_loss(static_cast<float>(last_eval->loss));
      }
      stopped_early = stopper.Evaluated(accuracy, done);
      if (!stopped_early.empty()) last_step = done;
    }

    // At a checkpoint step (sync: what the servers checkpoint after this
    // step), what a replacement needs to go on from it exactly.
    if (sync && !spec_.checkpoint().dir().empty() &&
        (done % checkpoint_every == 0 || done == requested_checkpoint_)) {
      v1::WorkerResumeState* state = report.add_checkpoint_states();
      *state = log.ResumeState(a.worker_index(), done, a.generation(), step_end);
      stopper.SaveTo(state);
      SaveLossScale(loss_scale_, state);
    }

    if (log.WindowDue(step_end, options_.report_interval) || done == last_step ||
        (evaluated && a.worker_index() == 0)) {
      const double samples_per_second = log.TakeWindow(step_end, &report);
      if (metrics_.has_value() && samples_per_second > 0) {
        metrics_->samples_per_second->Set(samples_per_second);
      }
      report.set_step(done);
      report.set_epoch(static_cast<int32_t>(epoch));
      if (options_.report) options_.report(report);
      ClearSentOnce(&report);
    }
    if (done == last_step) break;
  }
  // The last step's values, where the next forward pass would have
  // awaited them.
  PSTRAIN_RETURN_IF_ERROR(OnAllDevices([&](int k) { return devices_[k]->exchanges->FinishAll(); }));
  *report.mutable_step_times() = log.MeanStepTimes(last_step - first_step);
  // The final report's loss is the mean over the last steps (the same in
  // every run of a sync job, recoveries included); its samples were
  // reported above.
  report.set_step(last_step);
  report.set_stopped_early(stopped_early);
  report.set_loss(static_cast<float>(log.FinalLoss()));
  report.set_samples(0);
  report.set_seconds(0);
  report.set_finished(true);
  report.set_train_seconds(log.TrainSeconds(MonotonicNow()));

  if (a.worker_index() == 0) {
    // The final model: every worker's last push applied on every chunk.
    PSTRAIN_RETURN_IF_ERROR(client0.PullAll(host_params_.data(), last_step));
    Evaluation eval;
    if (!stopped_early.empty()) {
      eval = *last_eval;  // the model it stopped at was just evaluated
    } else {
      PSTRAIN_ASSIGN_OR_RETURN(eval, Evaluate(spec_, host_params_, *test_));
    }
    report.set_evaluated(true);
    report.set_evaluated_step(last_step);
    report.set_test_accuracy(static_cast<float>(eval.accuracy));
    report.set_test_loss(static_cast<float>(eval.loss));
  }
  if (options_.report) options_.report(report);
  return absl::OkStatus();
}

void Trainer::RecordStepMetrics(double step_seconds, const StepPhases& phases,
                                const ParameterClient::Stats& exchanged, double loss,
                                double loss_ema) {
  if (!metrics_.has_value()) return;
  metrics_->steps->Increment();
  metrics_->samples->Increment(batch_);
  metrics_->step_seconds->Observe(step_seconds);
  for (size_t p = 0; p < phases.size(); ++p) metrics_->phase_seconds[p]->Increment(phases[p]);
  metrics_->pushed_bytes->Increment(static_cast<double>(exchanged.bytes_pushed));
  metrics_->pulled_bytes->Increment(static_cast<double>(exchanged.bytes_pulled));
  metrics_->retries->Increment(static_cast<double>(exchanged.retries));
  metrics_->loss->Set(loss);
  metrics_->loss_ema->Set(loss_ema);
}

}  // namespace pstrain::worker
