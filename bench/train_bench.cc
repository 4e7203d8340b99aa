// train: Fashion-MNIST MLP samples/s at one per-worker batch, trained in
// this process without any server, and as real local clusters
// (pstrain-local: coordinator, servers and workers as processes) with
// 1 worker + 1 server and 2 workers + 2 servers, sync and async.
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/dataset.h"
#include "common/files.h"
#include "common/job_spec.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "worker/in_process.h"

namespace pstrain::bench {
namespace {

constexpr char kFashionDir[] = "/usr/share/datasets/fashion-mnist";

// The job file of one run: the quick-start model at this batch.
std::string JobYaml(const TrainBenchOptions& options, const char* mode, int workers,
                    int servers) {
  return absl::StrFormat(
      "name: bench-train\n"
      "model: {type: mlp, hidden: [256, 128]}\n"
      "data: {dataset: fashion_mnist, dir: %s}\n"
      "optimizer: {type: adam, learning_rate: 0.001}\n"
      "mode: %s\nbatch_size: %d\nsteps: %d\nnum_servers: %d\nnum_workers: %d\n"
      "chunk_bytes: %d\nseed: 1\n",
      kFashionDir, mode, options.batch, options.steps, servers, workers, options.chunk_bytes);
}

// samples/s of the same model and batch trained in this process, no server.
absl::StatusOr<double> InProcessRate(const TrainBenchOptions& options, const Dataset& train) {
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, ParseJobSpecYaml(JobYaml(options, "sync", 1, 1)));
  const absl::Time start = absl::Now();
  PSTRAIN_RETURN_IF_ERROR(worker::TrainInProcess(spec, options.steps, train).status());
  return static_cast<double>(options.steps) * options.batch / SecondsSince(start);
}

}  // namespace

int RunTrainBench(const TrainBenchOptions& options) {
  absl::StatusOr<Dataset> train = LoadFashionMnist(kFashionDir, true);
  if (!train.ok()) {
    LOG(ERROR) << "train: " << train.status();
    return 1;
  }
  kernels::SetBlasThreads(1);  // as every worker runs
  struct Setup {
    const char* mode;
    int workers, servers;
  };
  const Setup setups[] = {{"sync", 1, 1}, {"async", 1, 1}, {"sync", 2, 2}, {"async", 2, 2}};
  // The baseline runs before and after the clusters; ratios are against
  // the mean of the two, so that a machine that changes speed during the
  // run (a shared one) shows in the two rows instead of skewing the ratios.
  absl::StatusOr<double> before = InProcessRate(options, *train);
  if (!before.ok()) {
    LOG(ERROR) << "train in process: " << before.status();
    return 1;
  }
  std::vector<double> rates;
  for (const Setup& s : setups) {
    absl::StatusOr<LocalRun> run =
        RunPstrainLocal(options.bin_dir, JobYaml(options, s.mode, s.workers, s.servers));
    if (!run.ok()) {
      LOG(ERROR) << "train " << s.mode << " " << s.workers << "w: " << run.status();
      return 1;
    }
    rates.push_back(run->samples_per_second);
  }
  absl::StatusOr<double> after = InProcessRate(options, *train);
  if (!after.ok()) {
    LOG(ERROR) << "train in process: " << after.status();
    return 1;
  }
  const double baseline = (*before + *after) / 2;

  Table table("train", {"setup", "mode", "workers", "servers", "batch", "samples/s", "ratio"});
  // The mode column says when the baseline ran.
  for (const auto& [when, rate] : {std::pair{"before", *before}, std::pair{"after", *after}}) {
    table.Add(Table::Row()
                  .Text("in-process")
                  .Text(when)
                  .Int(1)
                  .Int(0)
                  .Int(options.batch)
                  .Number(rate, 0)
                  .Number(rate / baseline, 3));
  }
  for (size_t i = 0; i < rates.size(); ++i) {
    table.Add(Table::Row()
                  .Text("local cluster")
                  .Text(setups[i].mode)
                  .Int(setups[i].workers)
                  .Int(setups[i].servers)
                  .Int(options.batch)
                  .Number(rates[i], 0)
                  .Number(rates[i] / baseline, 3));
  }
  return 0;
}

}  // namespace pstrain::bench
