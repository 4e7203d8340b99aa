// The client library's Client::Impl (pstrain/client.h): one worker's part
// of a job. Its duties live in three files: client.cc (the job as this
// worker runs it: tensors, the dense exchanges, the step's end and the
// progress), client_rows.cc (the rows of the embedding tables) and
// client_generations.cc (joining, the heartbeats, recoveries into a job's
// next generation).
#ifndef PSTRAIN_WORKER_CLIENT_IMPL_H_
#define PSTRAIN_WORKER_CLIENT_IMPL_H_

#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/clock.h"
#include "common/membership_client.h"
#include "common/tls.h"
#include "pstrain/client.h"
#include "worker/generation.h"
#include "worker/parameter_client.h"
#include "worker/progress_reporter.h"
#include "worker/sparse_client.h"
#include "worker/step_log.h"
#include "worker/transport.h"

namespace pstrain {

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

  absl::Status Join();

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

  absl::StatusOr<int> TensorIndex(std::string_view name) const;
  absl::StatusOr<int> TableIndex(std::string_view name) const;
  absl::Status CheckTensor(int tensor, int64_t size) const;
  absl::Status BindTensor(int tensor, float* values, int64_t size);
  absl::Status BindTableRows(int table, const float* rows, int64_t count);
  absl::Status Start();
  absl::StatusOr<std::vector<int64_t>> BatchIndices(int64_t step, int64_t n) const;
  absl::Status PushGradient(int tensor, const float* grad, int64_t size,
                            std::shared_ptr<const void> keep_alive);

  // Pushes a copy of `values` (a buffer's: the tensor's size).
  absl::Status PushCopy(int tensor, const float* values);

  // Starts the push of `tensor` (a gradient, or a buffer's values) and the
  // pull of its new values.
  absl::Status Push(int tensor, const float* grad, std::shared_ptr<const void> keep_alive);
  absl::Status PullRows(const std::vector<RowPull>& pulls);
  absl::Status PushRowGradients(int table, const uint64_t* keys, const uint32_t* counts,
                                const float* grads, int64_t n);

  absl::StatusOr<int64_t> EndStep(double loss, int64_t samples, bool await_values);
  absl::Status AwaitValues(int tensor);
  absl::Status Pull();
  absl::Status Finish(std::optional<Evaluation> evaluation);
  absl::Status ReportMetrics(const std::map<std::string, double>& metrics);
  absl::Status Fail(const std::string& message);

 private:
  absl::Status CheckStarted() const;

  // ---- Rows of the embedding tables ----

  absl::Status CheckRows(int table, const uint64_t* keys, int64_t n, const float* rows) const;
  absl::Status CheckDistinct(int table, absl::Span<const uint64_t> keys) const;

  // What a pull of step_'s rows waits for: the tables' version (sync) and
  // every worker's clock (ssp), as the dense values do.
  std::pair<int64_t, int64_t> RowsWaitFor() const;

  // The rows of step_ (as the step reads them) of every table's keys.
  absl::Status PullTableRows(const std::vector<worker::SparseClient::TableKeys>& keys,
                             std::vector<std::vector<float>>& rows);

  // Sends the step's row gradients (tables not pushed: none) to every
  // server on a thread of its own, unless sent already. A server takes a
  // worker's push of a step once its tables have reached the step, which
  // the step's pull waits for: without one, an empty pull goes first.
  void StartRowPush();

  // Waits for the step's row push, if one was started, and makes ready
  // for the next step's.
  absl::Status WaitForRowPush();
  void ResetRowPush();

  // A step whose exchanges failed: the step's dense exchanges end (they
  // would wait for a step end that is not coming) and the job goes on
  // from where it recovers to, if it does.
  absl::StatusOr<int64_t> AbandonStep(const absl::Status& error);
  void OnHeartbeat(const v1::HeartbeatResponse& response);

  // Finishes the exchanges of the last step whose values EndStep left to
  // arrive. After a recovery the step being computed is discarded: its
  // pushes and its EndStep do nothing, and EndStep returns the step the
  // job goes on from.
  absl::Status FinishDeferred();

  // Finishes every exchange, also after an error; the first error.
  absl::Status FinishAll(std::vector<std::unique_ptr<worker::ParameterClient::Pending>> pending);

  // After a failed exchange: enters the job's next generation if there is
  // one (ABORTED, or CANCELLED by a heartbeat that announced it), else
  // returns the error (CANCELLED once the job is over here).
  absl::Status ToNextGeneration(const absl::Status& error);

  // ToNextGeneration, and its start.
  absl::Status Recover(const absl::Status& error);

  // Waits for an assignment of a generation after the current one and
  // makes it the current one.
  absl::Status EnterNextGeneration(absl::Duration timeout);

  // The generation's start once the tensors are bound: worker 0's initial
  // values (which servers that restored a checkpoint ignore), then the
  // values of step_ into the bound tensors.
  absl::Status GoOnWithGeneration();
  absl::Status PullInto(int64_t steps_applied);
  v1::ReportProgressRequest Report() const;

  // The bookkeeping of a completed step: losses, the checkpoint's resume
  // state, the progress report. The step's time as pstrain's workers split
  // it: the program's compute (from the last step's end to EndStep), and
  // the wait in EndStep, the exchanges not hidden behind compute.
  void RecordStep(double loss, int64_t samples, absl::Time wait_start);

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
  std::unique_ptr<worker::ParameterClient> params_;
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
  worker::ParameterClient::Stats stats_before_;  // the parameter client's, at the last step's end

  // BatchIndices' epoch order.
  mutable std::vector<int64_t> order_;
  mutable int64_t order_epoch_ = -1;
  mutable int64_t order_size_ = 0;
};

}  // namespace pstrain

#endif  // PSTRAIN_WORKER_CLIENT_IMPL_H_
