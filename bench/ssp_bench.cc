// ssp: bounded staleness with a straggler. Two workers and two servers in
// this process (real gRPC on loopback) train the quick-start MLP in mode
// ssp at each staleness bound; worker 1 sleeps, every step, as long as a
// step of the job takes without a straggler, so it runs half as fast.
// Reports samples/s while both workers train (until the first finishes),
// the whole job's time, and the final model's test accuracy.
#include <atomic>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "common/dataset.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/status.h"
#include "glog/logging.h"
#include "kernels/cpu/cpu_kernels.h"
#include "server/parameter_server.h"
#include "worker/in_process.h"
#include "worker/trainer.h"

namespace pstrain::bench {
namespace {

constexpr char kFashionDir[] = "/usr/share/datasets/fashion-mnist";
constexpr int kWorkers = 2;
constexpr int kSlowWorker = 1;

absl::StatusOr<v1::JobSpec> Spec(const SspBenchOptions& options, int64_t staleness,
                                 int workers) {
  PSTRAIN_ASSIGN_OR_RETURN(
      v1::JobSpec spec,
      ParseJobSpecYaml(absl::StrFormat(
          "name: bench-ssp\n"
          "model: {type: mlp, hidden: [256, 128]}\n"
          "data: {dataset: fashion_mnist, dir: %s}\n"
          "optimizer: {type: adam, learning_rate: 0.001}\n"
          "mode: ssp\nstaleness: %d\nbatch_size: %d\nsteps: %d\nnum_servers: 2\n"
          "num_workers: %d\nchunk_bytes: 65536\nseed: 1\n",
          kFashionDir, staleness, options.batch, options.steps, workers)));
  return NormalizeJobSpec(spec);
}

struct Outcome {
  double both_training_rate = 0;  // samples/s until the first worker finished
  double job_seconds = 0;
  double accuracy = 0;
};

// One job of two trainers (threads) against two in-process servers.
absl::StatusOr<Outcome> RunJob(const v1::JobSpec& spec, DatasetCache& data,
                               absl::Duration slow_step) {
  PSTRAIN_ASSIGN_OR_RETURN(
      v1::PartitionPlan plan,
      ComputePartitionPlan(kernels::ModelTensors(ModelShapeOf(spec)), spec.chunk_bytes(),
                           spec.num_servers()));
  std::vector<std::unique_ptr<server::ParameterServer>> servers;
  for (int i = 0; i < spec.num_servers(); ++i) {
    PSTRAIN_ASSIGN_OR_RETURN(std::unique_ptr<server::ParameterServer> s,
                             server::ParameterServer::Create({}));
    v1::ServerAssignment a;
    a.set_job_id("bench-ssp");
    a.set_server_index(i);
    *a.mutable_spec() = spec;
    *a.mutable_plan() = plan;
    PSTRAIN_RETURN_IF_ERROR(s->store().AddJob(a));
    servers.push_back(std::move(s));
  }
  std::array<std::atomic<int64_t>, kWorkers> steps_computed{};
  absl::Mutex mu;
  absl::Status status;
  std::optional<absl::Time> first_done;
  int64_t samples_when_first_done = 0;
  std::vector<float> final_params;
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (int w = 0; w < kWorkers; ++w) {
    threads.emplace_back([&, w] {
      worker::TrainerOptions options;
      options.assignment.set_job_id("bench-ssp");
      options.assignment.set_worker_index(w);
      *options.assignment.mutable_spec() = spec;
      *options.assignment.mutable_plan() = plan;
      for (const auto& s : servers) options.assignment.add_server_addresses(s->address());
      options.data = &data;
      // A step's backward ends with layer 0's.
      options.trace = [&, w](const worker::StepEvent& e) {
        if (e.kind != worker::StepEvent::Kind::kBackwardDone || e.layer != 0) return;
        if (w == kSlowWorker) absl::SleepFor(slow_step);
        if (++steps_computed[w] < spec.steps()) return;
        // (Worker 0's Run goes on to wait for the final model.)
        absl::MutexLock lock(&mu);
        if (first_done.has_value()) return;
        first_done = absl::Now();
        samples_when_first_done = (steps_computed[0] + steps_computed[1]) * spec.batch_size();
      };
      absl::StatusOr<std::unique_ptr<worker::Trainer>> trainer =
          worker::Trainer::Create(std::move(options));
      const absl::Status run = trainer.ok() ? (*trainer)->Run() : trainer.status();
      absl::MutexLock lock(&mu);
      if (!run.ok() && status.ok()) status = run;
      if (w == 0 && trainer.ok()) final_params = (*trainer)->params();
    });
  }
  for (std::thread& t : threads) t.join();
  Outcome outcome;
  outcome.job_seconds = SecondsSince(start);
  for (auto& s : servers) s->Shutdown(absl::Seconds(1));
  PSTRAIN_RETURN_IF_ERROR(status);
  if (!first_done.has_value()) return absl::InternalError("no worker computed all its steps");
  outcome.both_training_rate =
      static_cast<double>(samples_when_first_done) / absl::ToDoubleSeconds(*first_done - start);
  PSTRAIN_ASSIGN_OR_RETURN(std::shared_ptr<const Dataset> test,
                           data.FashionMnist(kFashionDir, false));
  PSTRAIN_ASSIGN_OR_RETURN(worker::Evaluation eval, worker::Evaluate(spec, final_params, *test));
  outcome.accuracy = eval.accuracy;
  return outcome;
}

}  // namespace

int RunSspBench(const SspBenchOptions& options) {
  DatasetCache data;
  absl::StatusOr<std::shared_ptr<const Dataset>> train = data.FashionMnist(kFashionDir, true);
  if (!train.ok()) {
    LOG(ERROR) << "ssp: " << train.status();
    return 1;
  }
  kernels::SetBlasThreads(1);  // as every worker runs
  // The straggler's extra time per step: one step of the same job without
  // a straggler (and without waits), measured first.
  SspBenchOptions calibration = options;
  calibration.steps = std::min(options.steps, 300);
  absl::StatusOr<v1::JobSpec> unslowed = Spec(calibration, calibration.steps, kWorkers);
  absl::StatusOr<Outcome> calibrated =
      unslowed.ok() ? RunJob(*unslowed, data, absl::ZeroDuration())
                    : absl::StatusOr<Outcome>(unslowed.status());
  if (!calibrated.ok()) {
    LOG(ERROR) << "ssp: " << calibrated.status();
    return 1;
  }
  const absl::Duration slow_step =
      absl::Seconds(kWorkers * options.batch / calibrated->both_training_rate);

  Table table("ssp", {"staleness", "both-training samples/s", "ratio", "job s", "test accuracy",
                      "straggler's extra ms/step"});
  double baseline = 0;
  for (int64_t bound : options.staleness) {
    const bool unbounded = bound == kUnboundedStaleness;
    // Unbounded: a bound no worker can reach (async's waits, ssp's scaling).
    absl::StatusOr<v1::JobSpec> spec = Spec(options, unbounded ? options.steps : bound, kWorkers);
    absl::StatusOr<Outcome> outcome =
        spec.ok() ? RunJob(*spec, data, slow_step) : absl::StatusOr<Outcome>(spec.status());
    if (!outcome.ok()) {
      LOG(ERROR) << "ssp staleness " << bound << ": " << outcome.status();
      return 1;
    }
    if (baseline == 0) baseline = outcome->both_training_rate;
    table.Add(Table::Row()
                  .Text(unbounded ? "unbounded" : absl::StrCat(bound))
                  .Number(outcome->both_training_rate, 0)
                  .Number(outcome->both_training_rate / baseline, 3)
                  .Number(outcome->job_seconds, 1)
                  .Number(outcome->accuracy, 4)
                  .Number(absl::ToDoubleMilliseconds(slow_step), 2));
  }
  return 0;
}

}  // namespace pstrain::bench
