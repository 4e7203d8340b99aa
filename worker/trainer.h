// One worker's part of one job: the training loop over the node's devices.
//
// The node's batch of B samples is split across its K devices (B/K each,
// the remainder spread over the first ones). Each device runs forward and
// backward on its share; as soon as a layer's gradient is final on every
// device, the node reduce-scatters it (device k gets the sum of slice k of
// the layer's chunks) and device k starts pushing its slice to the servers
// on its own streams — while the earlier layers are still being computed.
// When every reply is in, the new parameters are all-gathered onto every
// device. With one CPU device all of that reduces to pushing the gradient
// from where backward wrote it.
#ifndef PSTRAIN_WORKER_TRAINER_H_
#define PSTRAIN_WORKER_TRAINER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dataset.h"
#include "kernels/device.h"
#include "kernels/model.h"
#include "kernels/reducer.h"
#include "pstrain/v1/membership.pb.h"
#include "worker/devices.h"
#include "worker/in_process.h"
#include "worker/loss_scale.h"
#include "worker/parameter_client.h"
#include "worker/progress_reporter.h"
#include "worker/slice_layout.h"
#include "worker/step_log.h"
#include "worker/transport.h"
#include "worker/worker_metrics.h"

namespace pstrain::worker {

// What the step trace records (tests of the overlap). A layer's pushes may
// start before its kBackwardDone when the kernel announces a final prefix of
// it (the CPU MLP's first layer).
struct StepEvent {
  // kValuesAsked: the forward pass asks for (part of) the layer's new
  // values; kValuesLoaded: they are all on the device.
  enum class Kind { kBackwardDone, kPushStarted, kValuesAsked, kValuesLoaded };
  Kind kind;
  int layer;
  int device;
};

struct TrainerOptions {
  // What to run: the job, this worker's index, the plan and server
  // addresses, and the generation: its step to start from (with this
  // worker's losses up to it) and its number of workers, over which the
  // global batch (spec.num_workers x spec.batch_size) is cut.
  v1::WorkerAssignment assignment;
  // Where the data comes from; required, shared across jobs.
  DatasetCache* data = nullptr;
  // The node's devices.
  DeviceList devices;
  // The transport to the servers for device k, owned by the caller (tests);
  // it must outlive the trainer. Null: make_transport.
  std::function<ParameterTransport*(int device)> transport;
  // Makes each device's own transport to assignment.server_addresses (its
  // own channels: K devices stream in parallel). Default: gRPC with default
  // options.
  TransportFactory make_transport;
  // Receives progress (about every report_interval and at the end) on the
  // training thread; must not block for long.
  std::function<void(const v1::ReportProgressRequest&)> report;
  absl::Duration report_interval = absl::Milliseconds(500);
  // Where to count steps, bytes, phases...; null: nowhere. Must outlive
  // the trainer.
  WorkerMetrics* metrics = nullptr;
  // Called from the device threads as backward and pushes progress (tests).
  std::function<void(const StepEvent&)> trace;
  // Gradient chunks that are final wait until at least this many bytes of
  // them (or the end of the backward pass) are there, then go out in one
  // exchange: a push costs a stream per server on both ends, which would
  // outweigh what a small layer's early start gains. 0: every layer (and
  // every row block of the first) goes out as soon as it is final.
  int64_t min_push_bytes = 256 << 10;
  // Retry and timeout policy of the parameter clients (job_id, worker, mode
  // and plan are filled in from the assignment).
  ParameterClient::Options client;
};

// A worker's part of one job, whichever model it trains: Trainer (the
// softmax, MLP and CNN on Fashion-MNIST, over the node's devices) or
// ClickTrainer (the click model, click_trainer.h).
class JobTrainer {
 public:
  virtual ~JobTrainer() = default;
  // Pulls the values of the generation's first step, trains every step
  // from there, and (worker 0) evaluates the final model on the test set.
  // Sends the final report (finished) on success. CANCELLED after Cancel();
  // ABORTED when the servers have gone on to a newer generation.
  virtual absl::Status Run() = 0;
  // Thread-safe; Run returns soon after.
  virtual void Cancel() = 0;
  // A checkpoint asked for at `step` (psctl checkpoint): the worker's
  // resume state at that step goes out with its progress. Thread-safe.
  virtual void RequestCheckpointAt(int64_t step) = 0;
  // The job's spec, normalized.
  virtual const v1::JobSpec& spec() const = 0;
  // The dense parameters as this worker last received them.
  virtual const std::vector<float>& params() const = 0;
};

// The trainer of the assignment's model.
absl::StatusOr<std::unique_ptr<JobTrainer>> CreateJobTrainer(TrainerOptions options);

class Trainer final : public JobTrainer {
 public:
  // Creates the devices, loads the data and builds the kernels.
  // INVALID_ARGUMENT on an inconsistent assignment; the devices' or the
  // data loader's error otherwise.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options);
  ~Trainer() override;

  absl::Status Run() override;
  void Cancel() override;
  void RequestCheckpointAt(int64_t step) override { requested_checkpoint_ = step; }
  const v1::JobSpec& spec() const override { return spec_; }
  const std::vector<float>& params() const override { return host_params_; }
  int64_t steps_done() const { return steps_done_; }
  // Samples device k has processed.
  int64_t samples_processed(int device) const;
  // The parameter clients' counters, summed over the devices.
  ParameterClient::Stats client_stats() const;

 private:
  struct DeviceState;
  struct StepResult;

  explicit Trainer(TrainerOptions options);
  absl::Status CreateDevices();
  // Device k's part of one step: its forward and backward pass, starting
  // each layer's pushes as the layer's gradient is final...
  absl::Status ComputeAndPush(int k, int64_t step, const int64_t* node_samples,
                              StepResult* result);
  // ... and, after the node's step end, leaves the new values to the next
  // ComputeAndPush, whose forward pass starts on the first layers as they
  // land.
  void DeferValues(int k);
  // What the forward pass asks before it reads the first `floats` of layer
  // `layer` (kernels::ParamsNeededFn): awaits device k's chunks of the
  // layers up to it (a device reading host_params_ in place: only as far
  // as asked) and loads each whole layer onto the device (all-gathered
  // across the node's devices); finishes every exchange when the last
  // layer is asked for, or at once when one was lost. Adds the time spent
  // waiting and loading.
  absl::Status AwaitValues(int k, int layer, int64_t floats, double* wait_seconds,
                           double* load_seconds);
  // Copies layer `layer` of host_params_ to device k (several devices:
  // device k's slice, all-gathered).
  absl::Status LoadLayer(int k, int layer);
  // Whether device k reads its parameters from host_params_ itself.
  bool ReadsValuesInPlace(int k) const;
  // Runs fn(k) for every device, on the devices' threads; the first error.
  absl::Status OnAllDevices(const std::function<absl::Status(int)>& fn);
  // Copies the node's host parameters to every device.
  absl::Status LoadParams();
  // The step's counters, gauges and histograms, if measured.
  void RecordStepMetrics(double step_seconds, const StepPhases& phases,
                         const ParameterClient::Stats& exchanged, double loss, double loss_ema);
  // The test-set evaluation of the model the servers hold after `steps`
  // steps (sync; async: what they hold now), pulled into eval_params_.
  absl::StatusOr<Evaluation> EvaluateAfter(int64_t steps);

  TrainerOptions options_;
  v1::JobSpec spec_;
  std::shared_ptr<const Dataset> train_;
  std::shared_ptr<const Dataset> test_;
  std::unique_ptr<kernels::Reducer> reducer_;
  std::vector<std::unique_ptr<DeviceState>> devices_;
  // By layer: which device reduces, pushes and all-gathers which chunks.
  std::vector<SliceLayout> layer_layouts_;
  // The node's parameters in host memory: what the servers answered.
  std::vector<float> host_params_;
  std::vector<float> eval_params_;  // evaluations during training
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> requested_checkpoint_{0};
  int64_t steps_done_ = 0;
  // This worker's part of the global batch in this generation.
  int batch_ = 0;         // samples per step
  int batch_offset_ = 0;  // where they start in the global batch
  std::optional<WorkerMetrics::Job> metrics_;
  std::optional<DynamicLossScale> loss_scale_;  // precision fp16
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_TRAINER_H_
