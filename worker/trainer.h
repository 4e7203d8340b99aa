// One worker's part of one job: the training loop.
#ifndef PSTRAIN_WORKER_TRAINER_H_
#define PSTRAIN_WORKER_TRAINER_H_

#include <atomic>
#include <optional>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dataset.h"
#include "kernels/model.h"
#include "pstrain/v1/membership.pb.h"
#include "worker/parameter_client.h"
#include "worker/transport.h"
#include "worker/worker_metrics.h"

namespace pstrain::worker {

struct TrainerOptions {
  // What to run: the job, this worker's index, the plan and server addresses.
  v1::WorkerAssignment assignment;
  // Where the data comes from; required, shared across jobs.
  DatasetCache* data = nullptr;
  // The transport to the servers; null: gRPC to assignment.server_addresses.
  // When set, it must outlive the trainer.
  ParameterTransport* transport = nullptr;
  // Receives progress (about every report_interval and at the end) on the
  // training thread; must not block for long.
  std::function<void(const v1::ReportProgressRequest&)> report;
  absl::Duration report_interval = absl::Milliseconds(500);
  // Fault injection for tests: sleep this long in every step.
  absl::Duration step_delay = absl::ZeroDuration();
  // Where to count steps, bytes, phases...; null: nowhere. Must outlive
  // the trainer.
  WorkerMetrics* metrics = nullptr;
  // Measures the calls to the servers; null: not measured.
  RpcMetrics* rpc = nullptr;
  // Retry and timeout policy of the parameter client (job_id, worker, mode
  // and plan are filled in from the assignment).
  ParameterClient::Options client;
};

class Trainer {
 public:
  // Loads the data and builds the kernels. INVALID_ARGUMENT on an
  // inconsistent assignment; the data loader's error if the data is bad.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(TrainerOptions options);
  ~Trainer();

  // Pulls the initial values, trains every step, and (worker 0) evaluates
  // the final model on the test set. Sends the final report (finished) on
  // success. CANCELLED after Cancel().
  absl::Status Run();

  // Thread-safe; Run returns soon after.
  void Cancel();

  // The job's spec, normalized.
  const v1::JobSpec& spec() const { return spec_; }
  // The parameters as this worker last received them.
  const std::vector<float>& params() const { return params_; }
  int64_t steps_done() const { return steps_done_; }
  ParameterClient::Stats client_stats() const { return client_->stats(); }

 private:
  explicit Trainer(TrainerOptions options);

  TrainerOptions options_;
  v1::JobSpec spec_;
  std::shared_ptr<const Dataset> train_;
  std::shared_ptr<const Dataset> test_;
  std::unique_ptr<kernels::ModelKernels> kernels_;
  std::unique_ptr<ParameterTransport> owned_transport_;
  std::unique_ptr<ParameterClient> client_;
  std::vector<float> params_;
  // Shared with in-flight push frames, which keep it alive.
  std::shared_ptr<std::vector<float>> grad_;
  std::atomic<bool> cancelled_{false};
  int64_t steps_done_ = 0;
  std::optional<WorkerMetrics::Job> metrics_;
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_TRAINER_H_
