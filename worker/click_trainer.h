// One worker's part of a click-model job (model: {type: click}): the
// batches of click logs (files or generated, docs/click-data.md), the
// batch's distinct keys pulled from the servers' tables, the click model's
// forward and backward pass on the CPU (kernels/click_model.h), the dense
// gradient pushed as the built-in models' is and the rows' gradients
// pushed by key (worker/sparse_client.h), and the test set's AUC and log
// loss (worker 0). One CPU device.
#ifndef PSTRAIN_WORKER_CLICK_TRAINER_H_
#define PSTRAIN_WORKER_CLICK_TRAINER_H_

#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "common/click_data.h"
#include "kernels/click_model.h"
#include "worker/click_eval.h"
#include "worker/parameter_client.h"
#include "worker/sparse_client.h"
#include "worker/trainer.h"

namespace pstrain::worker {

class ClickInput;

class ClickTrainer final : public JobTrainer {
 public:
  // INVALID_ARGUMENT on an inconsistent assignment; the data's error (a
  // file missing or refused) otherwise. Uses options.assignment, report,
  // report_interval, metrics, transport / make_transport and client.
  static absl::StatusOr<std::unique_ptr<ClickTrainer>> Create(TrainerOptions options);
  ~ClickTrainer() override;

  absl::Status Run() override;
  void Cancel() override;
  void RequestCheckpointAt(int64_t step) override { requested_checkpoint_ = step; }
  const v1::JobSpec& spec() const override { return spec_; }
  const std::vector<float>& params() const override { return params_; }

 private:
  explicit ClickTrainer(TrainerOptions options);
  absl::Status PullRows(int64_t step, int64_t version, int64_t pushed_steps, ClickRows& batch);
  // The test set's AUC with dense values `params` and the rows the servers
  // hold after `steps` steps.
  absl::StatusOr<ClickEvaluation> Evaluate(const std::vector<float>& params, int64_t steps);

  TrainerOptions options_;
  v1::JobSpec spec_;
  kernels::ClickModelShape shape_;
  int batch_ = 0;
  int batch_offset_ = 0;
  std::optional<ClickKeys> keys_;
  std::unique_ptr<ClickInput> input_;
  std::optional<ClickBatch> test_;  // worker 0
  std::optional<double> oracle_auc_;  // generated data
  std::unique_ptr<kernels::ClickModelKernels> model_;
  std::unique_ptr<ParameterTransport> owned_transport_;
  ParameterTransport* transport_ = nullptr;
  std::unique_ptr<ParameterClient> client_;
  std::unique_ptr<SparseClient> sparse_;
  std::vector<float> params_;
  std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> requested_checkpoint_{0};
};

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_CLICK_TRAINER_H_
