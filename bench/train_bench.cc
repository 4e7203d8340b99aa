// train: Fashion-MNIST MLP samples/s at one per-worker batch, trained in
// this process without any server, and as real local clusters
// (pstrain-local: coordinator, servers and workers as processes) with
// 1 worker + 1 server and 2 workers + 2 servers, sync and async.
#include <cstdio>
#include <cstdlib>

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
      "chunk_bytes: 65536\nseed: 1\n",
      kFashionDir, mode, options.batch, options.steps, servers, workers);
}

// samples/s of the job run by pstrain-local: the "samples_per_second" of its
// last line.
absl::StatusOr<double> LocalClusterRate(const TrainBenchOptions& options, const char* mode,
                                        int workers, int servers) {
  char dir_template[] = "/tmp/pstrain-bench.XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("cannot make a directory");
  const std::string dir = dir_template;
  const std::string job = dir + "/job.yaml";
  PSTRAIN_RETURN_IF_ERROR(
      WriteFileAtomically(job, JobYaml(options, mode, workers, servers)));
  const std::string command =
      absl::StrCat(options.bin_dir, "/pstrain-local --job ", job, " --run_dir ", dir,
                   " --progress_interval_s=1000 2>", dir, "/stderr.txt");
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("cannot start pstrain-local");
  std::string last, line;
  char buffer[4096];
  while (std::fgets(buffer, sizeof(buffer), pipe) != nullptr) {
    line += buffer;
    if (!line.empty() && line.back() == '\n') {
      if (line.size() > 1) last = line;
      line.clear();
    }
  }
  const int status = pclose(pipe);
  if (status != 0) {
    return absl::InternalError(
        absl::StrCat("pstrain-local failed (status ", status, "), logs in ", dir));
  }
  const size_t key = last.find("\"samples_per_second\":");
  if (key == std::string::npos) {
    return absl::InternalError(absl::StrCat("no samples_per_second in: ", last));
  }
  return std::atof(last.c_str() + key + 21);
}

}  // namespace

int RunTrainBench(const TrainBenchOptions& options) {
  // The baseline: one process, the same model and batch, no server.
  absl::StatusOr<Dataset> train = LoadFashionMnist(kFashionDir, true);
  if (!train.ok()) {
    LOG(ERROR) << "train: " << train.status();
    return 1;
  }
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(JobYaml(options, "sync", 1, 1));
  CHECK(spec.ok()) << spec.status();
  kernels::SetBlasThreads(1);  // as every worker runs
  const absl::Time start = absl::Now();
  absl::StatusOr<std::vector<float>> params = worker::TrainInProcess(*spec, options.steps, *train);
  if (!params.ok()) {
    LOG(ERROR) << "train in process: " << params.status();
    return 1;
  }
  const double baseline = static_cast<double>(options.steps) * options.batch / SecondsSince(start);

  Table table("train", {"setup", "mode", "workers", "servers", "batch", "samples/s", "ratio"});
  table.Add(Table::Row()
                .Text("in-process")
                .Text("-")
                .Int(1)
                .Int(0)
                .Int(options.batch)
                .Number(baseline, 0)
                .Number(1, 3));
  struct Setup {
    const char* mode;
    int workers, servers;
  };
  for (const Setup& s : {Setup{"sync", 1, 1}, Setup{"async", 1, 1}, Setup{"sync", 2, 2},
                         Setup{"async", 2, 2}}) {
    absl::StatusOr<double> rate = LocalClusterRate(options, s.mode, s.workers, s.servers);
    if (!rate.ok()) {
      LOG(ERROR) << "train " << s.mode << " " << s.workers << "w: " << rate.status();
      return 1;
    }
    table.Add(Table::Row()
                  .Text("local cluster")
                  .Text(s.mode)
                  .Int(s.workers)
                  .Int(s.servers)
                  .Int(options.batch)
                  .Number(*rate, 0)
                  .Number(*rate / baseline, 3));
  }
  return 0;
}

}  // namespace pstrain::bench
