// pstrain's client library: a training loop of one's own (C++ here, PyTorch
// through the Python package `pstrain`) works as a worker of a job whose
// model is external, against pstrain's parameter servers.
//
//   auto client = pstrain::Client::Join({.connect = {"127.0.0.1:7070"}, .job_id = id});
//   for (int t = 0; t < n; ++t) client->BindTensor(t, my_params[t], sizes[t]);
//   client->Start();                 // worker 0 sends the initial values
//   while (client->step() < client->total_steps()) {
//     auto batch = client->BatchIndices(client->step(), dataset_size);
//     ... forward, backward (the gradient of the mean loss times gradient_scale()) ...
//     for (int t = 0; t < n; ++t) client->PushGradient(t, my_grads[t], sizes[t]);
//     client->EndStep(loss, batch.size());  // the new values are in my_params
//   }
//   client->Finish();
//
// The optimizer named in the job runs on the servers. Sync jobs are exact:
// the servers sum the workers' pushes, so each worker pushes the gradient of
// its mean loss times gradient_scale() (its share of the global batch), and
// W workers of batch b train what one process of batch W*b does.
//
// Recovery: when the job goes on from a checkpoint (a node was lost), the
// client goes with it: EndStep returns the step to compute next, which is
// then earlier than the one just computed, and the bound tensors hold that
// step's values. A process that joins again under the node id of a lost one
// takes its place; step() says where it resumes.
//
// Thread-compatible: one thread drives a client (PushGradient may be called
// from other threads, never at the same time as another call).
#ifndef PSTRAIN_CLIENT_H_
#define PSTRAIN_CLIENT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

// The library exports its public API alone.
#define PSTRAIN_CLIENT_API __attribute__((visibility("default")))

namespace pstrain {

// One tensor of an external model: fp32, contiguous, row-major.
struct PSTRAIN_CLIENT_API TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // empty: a scalar
  // A buffer of the model (BatchNorm's running statistics): not trained.
  // PushGradient of a buffer sends its values (copied at once); EndStep
  // sends the bound values of a buffer not pushed in the step. The bound
  // memory then gets worker 0's values of the step, so every worker holds
  // the same.
  bool buffer = false;
  // A buffer's element type: float32, float64, float16, bfloat16, int64,
  // int32, int16, int8, uint8 or bool (a parameter is float32). Its bytes
  // travel as floats, unconverted.
  std::string dtype = "float32";
  // The floats it takes (BindTensor's size): the product of the shape; a
  // buffer's bytes over 4, rounded up.
  int64_t size() const;
};

// How to reach the coordinator.
struct ConnectOptions {
  std::string coordinator;  // host:port
  // Mutual TLS: PEM files of this process's certificate, its key, and the
  // CA; all empty: plaintext. A worker's certificate names its node id.
  std::string cert_file;
  std::string key_file;
  std::string ca_file;
  // The bearer token of the control API (SubmitJob), if it asks for one.
  std::string token;
  // How long one call to the coordinator may take, retries included.
  absl::Duration timeout = absl::Seconds(30);
};

// A table a model brings (pstrain.torch: an nn.Embedding or
// nn.EmbeddingBag with sparse=True, named after the module): the job
// file's table of that name if it declares one (its dim must be `dim`),
// else a table of `dim` whose row optimizer is the job's optimizer's twin
// (sgd, adagrad or adam with its learning rate, epsilon and betas; a job
// optimizer with momentum, weight decay or a schedule has none, and
// SubmitJob asks for the table in the job file). Its initial_rows are
// `initial_rows`.
struct TableDeclaration {
  std::string name;
  int dim = 0;
  int64_t initial_rows = 0;
};

// Submits a job whose model is external: `job_yaml` is a job file's text
// (its model section, if any, must say `type: external` and list no
// tensors) and `tensors` the model's tensors, in order; `tables` the
// tables the model brings, beside the job file's own. Returns the job id.
// INVALID_ARGUMENT naming the field for a bad spec; the coordinator's error
// otherwise.
// `request_id` (1-128 printable characters; empty: none) makes a submit
// idempotent: every submit with it gets the job the first one made (the
// processes of one launch can all submit, and all get one job).
PSTRAIN_CLIENT_API absl::StatusOr<std::string> SubmitJob(
    const ConnectOptions& connect, const std::string& job_yaml,
    const std::vector<TensorSpec>& tensors, const std::string& request_id = "",
    const std::vector<TableDeclaration>& tables = {});

// Payload bytes the data plane has copied in this process so far: 0 while
// every push was sent from the gradient's own memory and every value was
// written straight into the bound tensors.
PSTRAIN_CLIENT_API int64_t DataPlaneCopiedBytes();

// The library's log lines (glog's, to stderr) from `level` up: "info",
// "warning", "error" or "off" (none); INVALID_ARGUMENT for another. A
// program that initializes glog itself does so before this call, and keeps
// its settings but this level. The Python package sets PSTRAIN_LOG_LEVEL's,
// "error" by default.
PSTRAIN_CLIENT_API absl::Status SetLogLevel(std::string_view level);

// The order in which pstrain's sharding takes a training set of n samples
// in `epoch` with the job's seed: a permutation of [0, n), of which the
// global batch of the epoch's step t is [t * global, (t + 1) * global), cut
// by worker index (Client::BatchIndices). For a baseline (one process, DDP)
// that must see the same batches.
PSTRAIN_CLIENT_API std::vector<int64_t> SampleOrder(uint64_t seed, int64_t epoch, int64_t n);

// A model file (psctl export, pstrain-run --export): its tensors in order,
// each with its values (a buffer's bytes in the first bytes of `values`).
struct ModelTensor {
  TensorSpec spec;
  std::vector<float> values;  // spec.size() floats
};
// INVALID_ARGUMENT for a file that is not a whole model file, NOT_FOUND
// and the like for one that cannot be read.
PSTRAIN_CLIENT_API absl::StatusOr<std::vector<ModelTensor>> ReadModel(const std::string& path);

// An embedding table of an export: every row the job ended with, by key.
struct ExportedTable {
  std::string name;
  int dim = 0;
  std::vector<uint64_t> keys;  // ascending
  std::vector<float> rows;     // dim floats a key, in key order
};
// What a job left: the dense tensors (ReadModel's) and, for a job with
// embedding tables, each table in the job's order.
struct ModelExport {
  std::vector<ModelTensor> tensors;
  std::vector<ExportedTable> tables;
};
// A model file, or the directory that psctl export or --export wrote for a
// job with tables (its model file and tables/NAME.rows). Errors name the
// file at fault: INVALID_ARGUMENT, DATA_LOSS, NOT_FOUND.
PSTRAIN_CLIENT_API absl::StatusOr<ModelExport> ReadExport(const std::string& path);

// Click logs in Criteo's layout (docs/click-data.md), read in the order
// every worker of a click job agrees on: the files' windows of
// `shuffle_window` lines, each in an order drawn from (seed, epoch,
// window). Global batch t of G samples is positions [t*G, (t+1)*G), cut by
// worker index (Client::batch_offset()) as Client::BatchIndices cuts a
// training set; a baseline (one process, DDP) that reads the same
// positions sees the same batches.
struct ClickSamples {
  std::vector<float> labels;  // 0 or 1, one a sample
  // dense floats a sample: log(1 + max(x, 0)) of each integer feature
  std::vector<float> dense;
  // Bag b = sample * fields + field holds keys[bag_starts[b] ..
  // bag_starts[b+1]) (an empty feature: an empty bag).
  std::vector<int64_t> bag_starts;
  std::vector<uint64_t> keys;
};
class PSTRAIN_CLIENT_API ClickReader {
 public:
  struct Options {
    std::vector<std::string> files;  // plain or gzip, read as one stream
    int dense = 13;                  // integer columns
    int fields = 26;                 // categorical columns
    uint64_t seed = 0;               // the job's
    int64_t epoch = 0;
    int64_t shuffle_window = 65536;  // the job's data.clicks.shuffle_window
  };
  // NOT_FOUND naming a missing file; INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<ClickReader>> Open(Options options);
  ~ClickReader();
  ClickReader(const ClickReader&) = delete;
  ClickReader& operator=(const ClickReader&) = delete;

  // The samples at positions [from, from + count). `from` may not go below
  // that of an earlier call. OUT_OF_RANGE past the epoch's end;
  // INVALID_ARGUMENT naming the file and line of a line that does not
  // parse.
  absl::StatusOr<ClickSamples> Read(int64_t from, int64_t count);
  // How many of positions [0, end) the epoch has (reads ahead as needed).
  absl::StatusOr<int64_t> Available(int64_t end);

  class Impl;

 private:
  explicit ClickReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// One of the job's embedding tables (the job file's `tables`), whose rows
// live on the servers by 64-bit key.
struct TableInfo {
  std::string name;
  int dim = 0;  // floats a row
  // Keys [0, initial_rows) start from rows worker 0 gives (BindTableRows);
  // 0: the table's initializer draws a key's row when it is admitted.
  int64_t initial_rows = 0;
};

// A pull of one table's rows: n distinct keys, and where their rows go
// (n * dim floats).
struct RowPull {
  int table = 0;
  const uint64_t* keys = nullptr;
  int64_t n = 0;
  float* rows = nullptr;
};

// A test-set evaluation of the final model, which worker 0 reports.
struct Evaluation {
  double accuracy = 0;
  std::optional<double> loss;  // none: the program measures an accuracy alone
};

class PSTRAIN_CLIENT_API Client {
 public:
  struct Options {
    ConnectOptions connect;
    std::string job_id;  // the job to work on; required
    // The node id to register under (1-63 of a-z, 0-9, '-', '.'); empty:
    // a random one (with TLS: the certificate's). A process that comes back
    // under the id of a lost one takes its place in the job.
    std::string node_id;
    // How long Join waits for the coordinator to place this worker (the
    // job waits for all its workers).
    absl::Duration join_timeout = absl::Minutes(10);
  };

  // Registers as a worker of the job and waits until the coordinator has
  // placed it. INVALID_ARGUMENT for bad options or a job whose model is not
  // external, NOT_FOUND for an unknown job, DEADLINE_EXCEEDED after
  // join_timeout.
  static absl::StatusOr<std::unique_ptr<Client>> Join(Options options);
  // Stops heartbeating: a job not Finished sees this worker lost.
  ~Client();

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // The job as this worker runs it (in its current generation).
  const std::string& job_id() const;
  const std::string& node_id() const;
  int worker_index() const;
  int num_workers() const;
  int batch_size() const;       // this worker's samples per step
  // Where this worker's samples begin in the global batch of a step: worker
  // w takes [batch_offset(), batch_offset() + batch_size()) of it.
  int64_t batch_offset() const;
  int64_t global_batch() const;  // all workers' samples per step
  int64_t total_steps() const;
  // data.train_samples / global_batch(); a job of steps without train_samples: its steps.
  int64_t steps_per_epoch() const;
  uint64_t seed() const;
  std::string mode() const;  // "sync", "async" or "ssp"
  // The micro-batches of a step (the job's accumulate_steps, k): the
  // program cuts its step's batch (BatchIndices) into k of equal size, runs
  // forward and backward on each, sums their gradients, and pushes each
  // tensor once, after the last.
  int accumulate_steps() const;
  // What each worker multiplies the gradient of its mean loss by (the sum
  // of its k micro-batches' mean-loss gradients with accumulation): its
  // share of the global batch over k (batch_size / global_batch / k) where
  // the servers sum the workers' pushes (sync, ssp), 1 / k in async mode;
  // divided by loss_scale() too.
  double gradient_scale() const;
  // precision fp16: the factor the program multiplies the step's loss by
  // before its backward pass (so that small fp16 gradients survive),
  // which gradient_scale() divides out again; a power of two, halved after
  // a step whose pushed gradient was not finite (the servers skip that
  // step), doubled after loss_scale.growth_steps steps without one. 1 for
  // other precisions.
  double loss_scale() const;
  // The step to compute next.
  int64_t step() const;
  // The job's generation this worker computes in: a recovery starts a new
  // one (and sends step() back to its checkpoint's step).
  int64_t generation() const;
  const std::vector<TensorSpec>& tensors() const;
  // NOT_FOUND for a name the model does not have.
  absl::StatusOr<int> TensorIndex(std::string_view name) const;

  // The job's embedding tables, in the job file's order.
  const std::vector<TableInfo>& tables() const;
  // NOT_FOUND for a name the job's tables do not have.
  absl::StatusOr<int> TableIndex(std::string_view name) const;

  // Where tensor `tensor`'s values live: `size` floats that the client
  // writes the new values into, in place, and (worker 0) reads the initial
  // values from. They must stay valid while the client lives or until bound
  // again. INVALID_ARGUMENT for an unknown tensor or a wrong size.
  absl::Status BindTensor(int tensor, float* values, int64_t size);

  // A table with initial_rows (TableInfo): row k of `rows` (dim floats
  // each) is key k's initial row. Worker 0 sends them at Start, and again
  // when a recovery finds no checkpoint, so they must stay valid and
  // unchanged while the client lives; other workers may bind them too (not
  // sent). INVALID_ARGUMENT for an unknown table, or `count` other than its
  // initial_rows.
  absl::Status BindTableRows(int table, const float* rows, int64_t count);

  // Once every tensor is bound: worker 0 sends the bound values as the
  // initial values (the servers keep the first they get); then every
  // worker receives the values of step() into the bound tensors.
  // FAILED_PRECONDITION if a tensor is not bound, or (worker 0) a table
  // with initial_rows has no rows bound.
  absl::Status Start();

  // This worker's samples of `step`: indices into a training set of
  // `dataset_size` samples, as pstrain's own workers take theirs (each
  // epoch a permutation by the job's seed; the global batch cut by worker
  // index). INVALID_ARGUMENT if the set is smaller than the global batch.
  absl::StatusOr<std::vector<int64_t>> BatchIndices(int64_t step, int64_t dataset_size) const;

  // Starts pushing tensor `tensor`'s gradient of step() and returns at
  // once (pushes overlap with the rest of backward). The gradient is sent
  // from its own memory: it must stay unchanged until EndStep returns;
  // `keep_alive`, if set, is held until the frames that reference it are
  // gone. A tensor pushed twice in a step: INVALID_ARGUMENT.
  absl::Status PushGradient(int tensor, const float* grad, int64_t size,
                            std::shared_ptr<const void> keep_alive = nullptr);

  // The rows of each pull's keys as the step computed next reads them
  // (sync: once the servers have applied step() steps; async and SSP as
  // the dense values), one exchange per server for all the pulls. A key
  // the table has not admitted (docs/sparse-tables.md) reads as zeros.
  // Keys must be distinct within a table (pulls of one table are joined);
  // INVALID_ARGUMENT otherwise, or for an unknown table.
  absl::Status PullRows(const std::vector<RowPull>& pulls);

  // This step's gradients of table `table`'s rows: n distinct keys, each
  // with its occurrences in the batch (`counts`, which admission counts)
  // and its gradient (dim floats: the sum over its occurrences of the
  // gradient of the mean loss, times gradient_scale()). Copied at once.
  // Once every table is pushed the step's rows go to the servers, one
  // frame each, while the program goes on; EndStep sends the step's
  // tables not pushed (as pushes of no rows) and waits for them. A table
  // pushed twice in a step: INVALID_ARGUMENT.
  absl::Status PushRowGradients(int table, const uint64_t* keys, const uint32_t* counts,
                                const float* grads, int64_t n);

  // Ends step(): pushes zeros for the tensors not pushed, tells the servers
  // the step is complete, and waits for the values the next step is
  // computed from, which land in the bound tensors. `loss` (this worker's
  // mean loss of the step) and `samples` go into the job's progress.
  // Returns the step to compute next: step() + 1, or, after a recovery,
  // the step the job goes on from. CANCELLED once the job is no longer
  // running; the servers' error otherwise.
  //
  // await_values false: returns once the servers have the step end; the
  // values land in the bound tensors while the next step begins, and the
  // program calls AwaitValues(t) before it reads tensor t (the forward
  // pass starts on the first layers while the others arrive). Every other
  // call (PushGradient, EndStep, Pull, Finish) first waits for all of
  // them, and EndStep of the job's last step waits for its values as with
  // await_values true. A failure found while they arrive that the job recovers from
  // discards the step being computed: its pushes are ignored and EndStep
  // returns the step the job goes on from, as above.
  absl::StatusOr<int64_t> EndStep(double loss, int64_t samples, bool await_values = true);

  // Waits until tensor `tensor`'s values of the step EndStep(..., false)
  // ended are in its bound memory (at once if there is no such step).
  absl::Status AwaitValues(int tensor);

  // Receives the values the servers hold now into the bound tensors
  // (async and ssp: with the other workers' latest pushes).
  absl::Status Pull();

  // Ends this worker's part: step() must be total_steps(). Worker 0 first
  // waits for the final model, which becomes the job's model file (`psctl
  // export`), and reports `evaluation` with it.
  absl::Status Finish(std::optional<Evaluation> evaluation = std::nullopt);

  // The program's own metrics (say {"mse", 0.12}, {"auc", 0.79}): the
  // latest value of each name goes with this worker's progress reports and
  // its final one (Finish). The job shows, of each name, the mean over the
  // workers that gave it: in psctl get and watch, the result, and
  // Prometheus (pstrain_job_metric{name=...}). Names are 1-64 of
  // [A-Za-z0-9_] not starting with a digit, at most 32 in all; values are
  // finite. INVALID_ARGUMENT otherwise, and nothing is kept of the call.
  absl::Status ReportMetrics(const std::map<std::string, double>& metrics);

  // Fails the job with `message` (the script could not go on).
  absl::Status Fail(const std::string& message);

  class Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace pstrain

#endif  // PSTRAIN_CLIENT_H_
