// sparse: W workers each pull and push the rows of K distinct keys of one
// embedding table per step (sync, Adagrad) from S servers in a process of
// their own — the click model's step without its computation: the sparse
// pull, the push of the rows' gradients, the step ends, and the push-pull
// of a dense part of a few floats — against the same bytes moved by a
// plain TCP socket pair in the same pattern (RawSocketRate).
#include <sys/socket.h>

#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "bench/transport_util.h"
#include "common/job_spec.h"
#include "common/job_yaml.h"
#include "common/random.h"
#include "common/status.h"
#include "glog/logging.h"
#include "worker/parameter_client.h"
#include "worker/sparse_client.h"
#include "worker/transport.h"

namespace pstrain::bench {
namespace {

// Each worker's keys of a step: K of its own, from a set of 4K (so that
// after four steps every row exists and each step reads and updates rows).
void KeysOf(int worker, int64_t step, int keys, worker::SparseClient::TableKeys& out) {
  out.keys.resize(keys);
  const uint64_t first = (static_cast<uint64_t>(worker) << 40) + (step % 4) * keys;
  for (int i = 0; i < keys; ++i) out.keys[i] = Mix64(first + i);
  out.counts.assign(keys, 1);
}

// The job's sync steps for `duration` after four untimed ones. Returns
// rows per second (a row pulled and its gradient pushed), all workers.
absl::StatusOr<double> PstrainRows(const v1::JobSpec& spec,
                                   const std::vector<std::string>& addresses, int keys,
                                   absl::Duration duration, int64_t* steps) {
  const int workers = spec.num_workers();
  const int dim = spec.tables(0).dim();
  const v1::PartitionPlan plan = PlanOf(spec);
  std::vector<int> without_chunks;
  {
    std::vector<bool> has(spec.num_servers(), false);
    for (const v1::ChunkInfo& c : plan.chunks()) has[c.server()] = true;
    for (int s = 0; s < spec.num_servers(); ++s) {
      if (!has[s]) without_chunks.push_back(s);
    }
  }
  // A worker's clients and buffers, which its steps share (the clients go
  // before the transport they use).
  struct Worker {
    std::unique_ptr<worker::ParameterTransport> transport;
    std::unique_ptr<worker::ParameterClient> dense;
    std::unique_ptr<worker::SparseClient> sparse;
    std::shared_ptr<std::vector<float>> grad;
    std::vector<float> params;
    std::vector<worker::SparseClient::TableKeys> tables{1};
    std::vector<std::vector<float>> rows;
  };
  auto make_step = [&](int w) -> absl::StatusOr<BenchStep> {
    auto me = std::make_shared<Worker>();
    PSTRAIN_ASSIGN_OR_RETURN(
        me->transport, worker::CreateGrpcTransport(addresses, worker::GrpcTransportOptions()));
    worker::ParameterClient::Options options;
    options.job_id = "bench";
    options.worker = w;
    options.mode = v1::MODE_SYNC;
    options.plan = plan;
    me->dense = std::make_unique<worker::ParameterClient>(options, me->transport.get());
    worker::SparseClient::Options sparse_options;
    sparse_options.job_id = "bench";
    sparse_options.worker = w;
    sparse_options.dims = {dim};
    sparse_options.servers_without_chunks = without_chunks;
    me->sparse = std::make_unique<worker::SparseClient>(sparse_options, me->transport.get());
    me->grad = std::make_shared<std::vector<float>>(plan.total_floats(), 1e-3f);
    me->params.resize(plan.total_floats());
    return [me, w, keys, dim](int64_t s) -> absl::Status {
      KeysOf(w, s, keys, me->tables[0]);
      PSTRAIN_RETURN_IF_ERROR(me->sparse->Pull(s, s, s, me->tables, me->rows));
      me->tables[0].grads.assign(static_cast<size_t>(keys) * dim, 1e-3f);
      std::unique_ptr<worker::ParameterClient::Pending> pushed =
          me->dense->StartPushPull(s, me->grad, me->params.data());
      absl::Status st = me->sparse->Push(s, me->tables);
      if (st.ok()) st = me->dense->Finish(me->dense->StartEndStep(s, 1e-3f));
      if (st.ok()) st = me->sparse->EndStep(s, 1e-3f);
      const absl::Status values = me->dense->Finish(std::move(pushed));
      return st.ok() ? values : st;
    };
  };
  // Four untimed steps: from then on every row exists.
  PSTRAIN_ASSIGN_OR_RETURN(const double seconds,
                           RunTimedSteps(workers, /*warm_steps=*/4, duration, make_step, steps));
  return static_cast<double>(workers) * keys * *steps / seconds;
}

}  // namespace

v1::JobSpec SparseJobOf(int workers, int servers, int dim) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(absl::StrCat(
      "name: sparse-bench\n"
      "model: {type: click, click: {bottom: [4], top: [4]}}\n"
      "tables: [{name: t, dim: ",
      dim,
      ", fields: [1], optimizer: {type: adagrad}}]\n"
      "data: {clicks: {dense: 1, fields: 1, generate: {train_rows: 1000000, test_rows: 16}}}\n"
      "optimizer: {type: sgd, learning_rate: 0.000001}\n"
      "batch_size: 1\nsteps: 1000000000\nseed: 1\n",
      "num_workers: ", workers, "\nnum_servers: ", servers, "\n"));
  CHECK(spec.ok()) << spec.status();
  spec = NormalizeJobSpec(*spec);
  CHECK(spec.ok()) << spec.status();
  return *std::move(spec);
}

int RunSparseBench(const SparseBenchOptions& options) {
  std::printf("dim %d, Adagrad, sync; %s per configuration\n", options.dim,
              absl::FormatDuration(options.duration).c_str());
  Table table("sparse", {"keys", "workers", "servers", "steps", "pstrain_rows/s", "baseline_rows/s",
                         "ratio", "pstrain_MiB/s"});
  // Bytes a row moves a step: its key out in the pull and its values back;
  // its key, count and gradient out in the push.
  const int64_t row_bytes = 8 + 4 * options.dim + 8 + 4 + 4 * options.dim;
  int status = 0;
  for (const auto& [workers, servers] : options.shapes) {
    const v1::JobSpec spec = SparseJobOf(workers, servers, options.dim);
    for (int keys : options.keys) {
      absl::StatusOr<std::unique_ptr<ServerProcess>> process =
          ServerProcess::Start(spec, 0, spec.chunk_bytes(), false, options.dim);
      int64_t steps = 0;
      absl::StatusOr<double> rows =
          process.ok() ? PstrainRows(spec, (*process)->addresses(), keys, options.duration, &steps)
                       : process.status();
      process = absl::InternalError("stopped");  // the servers go before the baseline runs
      // The same bytes by plain TCP: each worker sends every server its
      // share of them and reads as many back (half of the row's bytes each
      // way).
      const int64_t share = std::max<int64_t>(1, keys * row_bytes / 2 / servers);
      absl::StatusOr<double> plain =
          RawSocketRate(AF_INET, std::vector<int64_t>(servers, share), workers, options.duration);
      if (!rows.ok() || !plain.ok()) {
        std::fprintf(stderr, "sparse: %d keys, %dx%d: %s\n", keys, workers, servers,
                     std::string((rows.ok() ? plain.status() : rows.status()).message()).c_str());
        status = 1;
        continue;
      }
      const double baseline_rows = *plain / row_bytes;
      table.Add(Table::Row()
                    .Int(keys)
                    .Int(workers)
                    .Int(servers)
                    .Int(steps)
                    .Number(*rows, 0)
                    .Number(baseline_rows, 0)
                    .Number(*rows / baseline_rows, 3)
                    .Number(*rows * row_bytes / (1 << 20), 1));
    }
  }
  table.Finish();
  return status;
}

}  // namespace pstrain::bench
