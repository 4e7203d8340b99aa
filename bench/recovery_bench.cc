// checkpoint: what checkpoints cost the quick-start job: its samples/s with
// a checkpoint every 100 steps against none, in pairs run one after the
// other (alternating which goes first, since a shared machine's speed
// drifts), and what each checkpoint's copies took on the servers (the
// training step waits for them; the write itself is in the background).
//
// recovery: how long a running job takes to recover from the death of a
// process: from the SIGKILL to the job's next completed step, with the
// steps redone, when the dead process is restarted under its id (as
// pstrain-local or a container runtime does) and when a spare server takes
// the place of one that stays dead.
#include <signal.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench.h"
#include "bench/bench_util.h"
#include "cli/local_cluster.h"
#include "common/rpc.h"
#include "glog/logging.h"
#include "pstrain/v1/control.grpc.pb.h"

namespace pstrain::bench {
namespace {

// The quick-start job (examples/fashion_mlp.yaml), with `extra` lines.
std::string QuickStartJob(int64_t steps, const std::string& extra) {
  return absl::StrCat(
      "name: bench-checkpoint\n"
      "model: {type: mlp, hidden: [256, 128]}\n"
      "data: {dataset: fashion_mnist, dir: /usr/share/datasets/fashion-mnist}\n"
      "optimizer: {type: adam, learning_rate: 0.001}\n"
      "mode: sync\nbatch_size: 64\nnum_servers: 2\nnum_workers: 2\nchunk_bytes: 65536\nseed: 1\n",
      steps > 0 ? absl::StrCat("steps: ", steps, "\n") : "epochs: 3\n", extra);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 == 1 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

// The "copies took X ms" of every checkpoint in the servers' logs.
std::vector<double> CopyMilliseconds(const std::string& run_dir) {
  std::vector<double> ms;
  for (const char* server : {"server-0", "server-1"}) {
    std::ifstream in(absl::StrCat(run_dir, "/", server, ".log"));
    std::string line;
    while (std::getline(in, line)) {
      const size_t at = line.find("the copies took ");
      double value;
      if (at != std::string::npos &&
          absl::SimpleAtod(line.substr(at + 16, line.find(" ms", at + 16) - at - 16), &value)) {
        ms.push_back(value);
      }
    }
  }
  return ms;
}

}  // namespace

int RunCheckpointBench(const CheckpointBenchOptions& options) {
  Table table("checkpoint", {"pair", "first", "samples/s with", "samples/s without", "ratio",
                             "checkpoints", "copy ms (median)", "copy ms (max)"});
  std::vector<double> ratios, copies;
  const std::string with = absl::StrCat("checkpoint: {every_steps: ", options.every_steps, "}\n");
  // pstrain-local checkpoints by default: "without" sets a step never reached.
  const std::string without = "checkpoint: {every_steps: 1000000000000}\n";
  for (int pair = 0; pair < options.pairs; ++pair) {
    const bool with_first = pair % 2 == 0;
    double rate[2] = {0, 0};  // with, without
    std::vector<double> pair_copies;
    for (int i = 0; i < 2; ++i) {
      const bool checkpointing = (i == 0) == with_first;
      absl::StatusOr<LocalRun> run = RunPstrainLocal(
          options.bin_dir, QuickStartJob(options.steps, checkpointing ? with : without),
          /*keep_run_dir=*/checkpointing);
      if (!run.ok()) {
        LOG(ERROR) << "checkpoint: " << run.status();
        return 1;
      }
      rate[checkpointing ? 0 : 1] = run->samples_per_second;
      if (checkpointing) {
        pair_copies = CopyMilliseconds(run->run_dir);
        RemoveRunDir(run->run_dir);
      }
    }
    ratios.push_back(rate[0] / rate[1]);
    copies.insert(copies.end(), pair_copies.begin(), pair_copies.end());
    table.Add(Table::Row()
                  .Int(pair + 1)
                  .Text(with_first ? "with" : "without")
                  .Number(rate[0], 0)
                  .Number(rate[1], 0)
                  .Number(rate[0] / rate[1], 3)
                  .Int(static_cast<int64_t>(pair_copies.size()))
                  .Number(Median(pair_copies), 3)
                  .Number(pair_copies.empty()
                              ? 0
                              : *std::max_element(pair_copies.begin(), pair_copies.end()),
                          3));
  }
  table.Add(Table::Row()
                .Text("median")
                .Text("-")
                .Text("-")
                .Text("-")
                .Number(Median(ratios), 3)
                .Int(static_cast<int64_t>(copies.size()))
                .Number(Median(copies), 3)
                .Number(copies.empty() ? 0 : *std::max_element(copies.begin(), copies.end()), 3));
  return 0;
}

int RunTlsBench(const TlsBenchOptions& options) {
  Table table("tls", {"pair", "first", "samples/s TLS", "samples/s plaintext", "ratio"});
  std::vector<double> ratios;
  for (int pair = 0; pair < options.pairs; ++pair) {
    const bool tls_first = pair % 2 == 0;
    double rate[2] = {0, 0};  // TLS, plaintext
    for (int i = 0; i < 2; ++i) {
      const bool tls = (i == 0) == tls_first;
      absl::StatusOr<LocalRun> run = RunPstrainLocal(options.bin_dir, QuickStartJob(options.steps, ""),
                                                     /*keep_run_dir=*/false, tls ? "--tls" : "");
      if (!run.ok()) {
        LOG(ERROR) << "tls: " << run.status();
        return 1;
      }
      rate[tls ? 0 : 1] = run->samples_per_second;
    }
    ratios.push_back(rate[0] / rate[1]);
    table.Add(Table::Row()
                  .Int(pair + 1)
                  .Text(tls_first ? "TLS" : "plaintext")
                  .Number(rate[0], 0)
                  .Number(rate[1], 0)
                  .Number(rate[0] / rate[1], 3));
  }
  table.Add(
      Table::Row().Text("median").Text("-").Text("-").Text("-").Number(Median(ratios), 3));
  return 0;
}

namespace {

// A running job's cluster, followed through the control API.
class Recoveries {
 public:
  static absl::StatusOr<std::unique_ptr<Recoveries>> Start(const RecoveryBenchOptions& options,
                                                           int spare_servers,
                                                           absl::Duration lease,
                                                           const std::string& recovery) {
    auto r = std::unique_ptr<Recoveries>(new Recoveries);
    char dir_template[] = "/tmp/pstrain-bench.XXXXXX";
    if (mkdtemp(dir_template) == nullptr) return absl::InternalError("cannot make a directory");
    r->dir_ = dir_template;
    cli::LocalCluster::Options o;
    o.bin_dir = options.bin_dir;
    o.run_dir = r->dir_;
    o.num_servers = 2 + spare_servers;
    o.num_workers = 2;
    o.lease = lease;
    o.restart_exited_children = true;
    o.state_dir = r->dir_ + "/state";
    // Progress often: the measure is only as fine as the reports.
    for (int w = 0; w < 2; ++w) o.worker_flags[w] = {"--report_interval_ms=20"};
    absl::StatusOr<std::unique_ptr<cli::LocalCluster>> cluster = cli::LocalCluster::Start(o);
    if (!cluster.ok()) return cluster.status();
    r->cluster_ = std::move(*cluster);
    r->stub_ = v1::Control::NewStub(MakeChannel(r->cluster_->coordinator_address()));
    v1::SubmitJobRequest submit;
    submit.set_spec_yaml(QuickStartJob(
        100000000, absl::StrCat("checkpoint: {dir: ", r->dir_, "/checkpoints, every_steps: ",
                                options.every_steps, "}\n", recovery)));
    v1::SubmitJobResponse submitted;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(30));
    context.set_wait_for_ready(true);
    if (grpc::Status s = r->stub_->SubmitJob(&context, submit, &submitted); !s.ok()) {
      return absl::InternalError(s.error_message());
    }
    r->job_id_ = submitted.job_id();
    return r;
  }

  ~Recoveries() {
    if (cluster_ != nullptr) cluster_->Stop();
    RemoveRunDir(dir_);
  }

  v1::Job Get() {
    v1::GetJobRequest request;
    request.set_job_id(job_id_);
    v1::Job job;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    context.set_wait_for_ready(true);
    stub_->GetJob(&context, request, &job);
    return job;
  }

  // Waits until the job runs and is past `step` of its current generation.
  absl::Status WaitForStep(int64_t step, absl::Duration patience) {
    const absl::Time give_up = absl::Now() + patience;
    while (true) {
      const v1::Job job = Get();
      if (job.state() > v1::JOB_STATE_RUNNING) return absl::InternalError(job.reason());
      if (job.progress().step() >= step) return absl::OkStatus();
      if (absl::Now() > give_up) return absl::DeadlineExceededError("no progress");
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  struct Recovery {
    double seconds;
    int64_t steps_redone;
  };
  // Kills the job's server (or worker) `index` with SIGKILL; returns how
  // long until the job's next step of the new generation is done.
  absl::StatusOr<Recovery> Kill(bool server, int index, bool restart) {
    const v1::Job before = Get();
    const std::string node = server ? before.server_nodes(index) : before.worker_nodes(index);
    const int64_t at = before.progress().step();
    const absl::Time killed = absl::Now();
    if (!cluster_->Kill(node, SIGKILL, restart)) return absl::InternalError("no such node");
    const absl::Time give_up = killed + absl::Minutes(2);
    while (true) {
      cluster_->Supervise();
      const v1::Job job = Get();
      if (job.state() > v1::JOB_STATE_RUNNING) return absl::InternalError(job.reason());
      if (job.generation() > before.generation() && job.progress().step() > job.resume_step()) {
        return Recovery{absl::ToDoubleSeconds(absl::Now() - killed), at - job.resume_step()};
      }
      if (absl::Now() > give_up) return absl::DeadlineExceededError("no recovery");
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

 private:
  Recoveries() = default;
  std::string dir_;
  std::unique_ptr<cli::LocalCluster> cluster_;
  std::unique_ptr<v1::Control::Stub> stub_;
  std::string job_id_;
};

}  // namespace

int RunRecoveryBench(const RecoveryBenchOptions& options) {
  Table table("recovery", {"fault", "kills", "seconds (median)", "seconds (worst)",
                           "steps redone (median)", "steps redone (worst)"});
  auto report = [&](const std::string& fault, const std::vector<Recoveries::Recovery>& all) {
    std::vector<double> seconds, steps;
    for (const auto& r : all) {
      seconds.push_back(r.seconds);
      steps.push_back(static_cast<double>(r.steps_redone));
    }
    table.Add(Table::Row()
                  .Text(fault)
                  .Int(static_cast<int64_t>(all.size()))
                  .Number(Median(seconds), 2)
                  .Number(*std::max_element(seconds.begin(), seconds.end()), 2)
                  .Number(Median(steps), 0)
                  .Number(*std::max_element(steps.begin(), steps.end()), 0));
  };

  // Kills one process once a checkpoint's worth of steps (and `extra`) has
  // passed since the last recovery, so that each recovery redoes what a
  // fault at a random step does.
  auto kill_later = [&](Recoveries& r, int64_t extra, bool server, int index,
                        bool restart) -> absl::StatusOr<Recoveries::Recovery> {
    const int64_t step = r.Get().progress().step();
    if (absl::Status s = r.WaitForStep(step + options.every_steps + extra, absl::Minutes(2));
        !s.ok()) {
      return s;
    }
    return r.Kill(server, index, restart);
  };

  // Restarted under its id, with the default lease: the return does not
  // wait for it.
  {
    absl::StatusOr<std::unique_ptr<Recoveries>> r =
        Recoveries::Start(options, 0, absl::Seconds(10), "");
    if (!r.ok()) {
      LOG(ERROR) << "recovery: " << r.status();
      return 1;
    }
    for (bool server : {true, false}) {
      std::vector<Recoveries::Recovery> all;
      for (int k = 0; k < options.kills; ++k) {
        absl::StatusOr<Recoveries::Recovery> one =
            kill_later(**r, k * 7 % 50, server, k % 2, /*restart=*/true);
        if (!one.ok()) {
          LOG(ERROR) << "recovery: " << one.status();
          return 1;
        }
        all.push_back(*one);
      }
      report(server ? "server restarted under its id" : "worker restarted under its id", all);
    }
  }
  // A spare takes the place of a server that stays dead.
  {
    const int spares = options.spare_kills;
    absl::StatusOr<std::unique_ptr<Recoveries>> r = Recoveries::Start(
        options, spares, options.spare_lease,
        absl::StrCat("recovery: {replace_after_seconds: ", options.replace_after_seconds, "}\n"));
    if (!r.ok()) {
      LOG(ERROR) << "recovery: " << r.status();
      return 1;
    }
    std::vector<Recoveries::Recovery> all;
    for (int k = 0; k < spares; ++k) {
      absl::StatusOr<Recoveries::Recovery> one =
          kill_later(**r, 0, /*server=*/true, k % 2, /*restart=*/false);
      if (!one.ok()) {
        LOG(ERROR) << "recovery: " << one.status();
        return 1;
      }
      all.push_back(*one);
    }
    report(absl::StrFormat("spare server (lease %ds, replace_after %ds)",
                           absl::ToInt64Seconds(options.spare_lease),
                           options.replace_after_seconds),
           all);
  }
  return 0;
}

}  // namespace pstrain::bench
