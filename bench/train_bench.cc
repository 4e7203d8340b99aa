// train: Fashion-MNIST MLP samples/s at one per-worker batch as real local
// clusters (pstrain-local: coordinator, servers and workers as processes)
// with 1 worker + 1 server and 2 workers + 2 servers, sync and async, and 2
// workers with colocated servers (the quick start's job), against the
// model trained in this process without any server at each cluster's
// global batch; with each cluster's step-time breakdown.
#include <cstdio>

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
                    int servers, bool colocated = false) {
  return absl::StrFormat(
      "name: bench-train\n"
      "model: {type: mlp, hidden: [256, 128]}\n"
      "data: {dataset: fashion_mnist, dir: %s}\n"
      "optimizer: {type: adam, learning_rate: 0.001}\n"
      "mode: %s\nbatch_size: %d\nsteps: %d\nnum_servers: %d\nnum_workers: %d\n"
      "colocated_servers: %s\nchunk_bytes: %d\nseed: 1\n",
      kFashionDir, mode, options.batch, options.steps, servers, workers,
      colocated ? "true" : "false", options.chunk_bytes);
}

// samples/s of the model trained in this process at `batch`, no server.
absl::StatusOr<double> InProcessRate(const TrainBenchOptions& options, int batch,
                                     const Dataset& train) {
  TrainBenchOptions one = options;
  one.batch = batch;
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, ParseJobSpecYaml(JobYaml(one, "sync", 1, 1)));
  const absl::Time start = absl::Now();
  PSTRAIN_RETURN_IF_ERROR(worker::TrainInProcess(spec, options.steps, train).status());
  return static_cast<double>(options.steps) * batch / SecondsSince(start);
}

// The share of a step outside compute, from pstrain-local's step time line
// ("compute C ms, reduce R ms, push P ms, wait W ms, pull L ms (T ms per
// step)"): (P + W + L) / T; -1 if the line does not parse.
double NonComputeShare(const std::string& step_time) {
  double compute, reduce, push, wait, pull, total;
  if (std::sscanf(step_time.c_str(),
                  "compute %lf ms, reduce %lf ms, push %lf ms, wait %lf ms, pull %lf ms (%lf",
                  &compute, &reduce, &push, &wait, &pull, &total) != 6 ||
      !(total > 0)) {
    return -1;
  }
  return (push + wait + pull) / total;
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
    bool colocated = false;
  };
  const Setup setups[] = {{"sync", 1, 1},  {"async", 1, 1},       {"sync", 2, 2},
                          {"async", 2, 2}, {"sync", 2, 2, true}, {"async", 2, 2, true}};
  // The baselines, one process with each global batch, run before and
  // after the clusters; ratios are against the mean of the two, so that a
  // machine that changes speed during the run (a shared one) shows in the
  // two rows instead of skewing the ratios.
  const int batches[] = {options.batch, 2 * options.batch};
  double before[2], after[2];
  auto baselines = [&](double* rates) {
    for (int i = 0; i < 2; ++i) {
      absl::StatusOr<double> rate = InProcessRate(options, batches[i], *train);
      if (!rate.ok()) {
        LOG(ERROR) << "train in process: " << rate.status();
        return false;
      }
      rates[i] = *rate;
    }
    return true;
  };
  if (!baselines(before)) return 1;
  std::vector<LocalRun> runs;
  for (const Setup& s : setups) {
    absl::StatusOr<LocalRun> run =
        RunPstrainLocal(options.bin_dir,
                        JobYaml(options, s.mode, s.workers, s.servers, s.colocated));
    if (!run.ok()) {
      LOG(ERROR) << "train " << s.mode << " " << s.workers << "w: " << run.status();
      return 1;
    }
    runs.push_back(*std::move(run));
  }
  if (!baselines(after)) return 1;

  Table table("train", {"setup", "mode", "workers", "servers", "global_batch", "samples/s",
                        "ratio", "non_compute"});
  // The mode column says when the baseline ran.
  for (int i = 0; i < 2; ++i) {
    const double baseline = (before[i] + after[i]) / 2;
    for (const auto& [when, rate] : {std::pair{"before", before[i]}, std::pair{"after", after[i]}}) {
      table.Add(Table::Row()
                    .Text("in-process")
                    .Text(when)
                    .Int(1)
                    .Int(0)
                    .Int(batches[i])
                    .Number(rate, 0)
                    .Number(rate / baseline, 3)
                    .Text("-"));
    }
  }
  for (size_t i = 0; i < runs.size(); ++i) {
    // Against one process with the same global batch.
    const int b = setups[i].workers == 1 ? 0 : 1;
    const double baseline = (before[b] + after[b]) / 2;
    table.Add(Table::Row()
                  .Text(setups[i].colocated ? "colocated" : "local cluster")
                  .Text(setups[i].mode)
                  .Int(setups[i].workers)
                  .Int(setups[i].servers)
                  .Int(setups[i].workers * options.batch)
                  .Number(runs[i].samples_per_second, 0)
                  .Number(runs[i].samples_per_second / baseline, 3)
                  .Number(NonComputeShare(runs[i].step_time), 3));
  }
  table.Finish();
  for (size_t i = 0; i < runs.size(); ++i) {
    std::printf("%s %dw x %ds%s step time: %s\n", setups[i].mode, setups[i].workers,
                setups[i].servers, setups[i].colocated ? " colocated" : "",
                runs[i].step_time.c_str());
  }
  return 0;
}

}  // namespace pstrain::bench
