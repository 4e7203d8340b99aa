// pstrain-local: runs one job on a local cluster of real processes.
#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "cli/job_output.h"
#include "cli/launch.h"
#include "cli/local_cluster.h"
#include "common/clock.h"
#include "common/cpu_affinity.h"
#include "common/dataset.h"
#include "common/files.h"
#include "common/model_file.h"
#include "common/init.h"
#include "common/job_spec.h"
#include "common/process.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/table_file.h"
#include "common/tls.h"
#include "kernels/click_model.h"
#include "server/table_export.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "worker/click_eval.h"
#include "worker/devices.h"
#include "worker/in_process.h"

ABSL_FLAG(std::string, job, "", "job file (YAML), e.g. examples/fashion_mlp.yaml");
ABSL_FLAG(std::string, export, "",
          "write the trained model to this file once the job succeeded (as psctl export "
          "does; a job with embedding tables: a directory of its model file and tables); "
          "pstrain-local --eval PATH evaluates it");
ABSL_FLAG(std::string, eval, "",
          "instead of training: evaluate this model file or export directory (psctl export) "
          "on the test set");
ABSL_FLAG(std::string, data_dir, "",
          "with --eval: the Fashion-MNIST directory; default: the job's data.dir");
ABSL_FLAG(std::string, bin_dir, "",
          "directory of the pstrain binaries; default: the directory of pstrain-local");
ABSL_FLAG(std::string, run_dir, "",
          "directory for the processes' logs; default: a new /tmp/pstrain-local.XXXXXX");
ABSL_FLAG(bool, keep_run_dir, false,
          "keep the run directory (a new /tmp/pstrain-local.XXXXXX) when the job succeeds; "
          "it is kept anyway when the job fails, and a --run_dir always");
ABSL_FLAG(int, lease_s, 10, "heartbeat lease of the nodes, seconds");
ABSL_FLAG(std::string, devices, "cpu:1",
          "every worker's devices: cpu:N or cuda:0,cuda:1,... (see pstrain-worker)");
ABSL_FLAG(bool, pin_cpus, true,
          "give each worker CPUs of its own (split evenly; server s shares worker s's), when "
          "there are CPUs enough for every worker's compute threads");
ABSL_FLAG(double, progress_interval_s, 1.0, "seconds between progress lines");
ABSL_FLAG(bool, tls, false,
          "mutual TLS between all processes and bearer tokens on the control API, with "
          "certificates and tokens that make-dev-certs.sh makes in RUN_DIR/tls");
ABSL_FLAG(std::string, tls_dir, "",
          "like --tls, with the certificates and tokens of this directory (made by "
          "deploy/tls/make-dev-certs.sh DIR SERVERS WORKERS)");

namespace pstrain::cli {
namespace {

// --pin_cpus: `cpus` split among the workers, when every worker's group
// has a CPU for each of its compute threads; else none (nothing pinned).
std::vector<std::vector<int>> WorkerCpus(const std::vector<int>& cpus, int workers,
                                         int compute_threads) {
  if (static_cast<int64_t>(cpus.size()) < int64_t{workers} * compute_threads) return {};
  return SplitCpus(cpus, workers);
}

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

// --eval DIR: an export of a click model (its model file and tables) on
// the job's test set.
int EvaluateExport(const std::string& dir) {
  absl::StatusOr<TableExport> exported = ReadTableExport(PosixFileSystem(), dir);
  if (!exported.ok()) {
    std::cerr << "pstrain-local: " << exported.status().message() << "\n";
    return kExitUsage;
  }
  const v1::JobSpec& spec = exported->model.header.spec();
  if (spec.model().type() != v1::MODEL_TYPE_CLICK) {
    std::cerr << "pstrain-local: " << dir << ": the export of a model other than a click model\n";
    return kExitUsage;
  }
  std::optional<double> oracle_auc;
  absl::StatusOr<ClickBatch> test = worker::ClickTestSet(spec, &oracle_auc);
  absl::StatusOr<std::unique_ptr<kernels::ClickModelKernels>> model =
      test.ok() ? kernels::CreateCpuClickModelKernels(ClickModelShapeOf(spec),
                                                      worker::kClickEvalBatch)
                : test.status();
  if (!model.ok()) {
    std::cerr << "pstrain-local: " << model.status().message() << "\n";
    return kExitUsage;
  }
  // A key without a row reads as zeros, as on the servers.
  const std::vector<TableFile>& tables = exported->tables;
  absl::StatusOr<worker::ClickEvaluation> eval = worker::EvaluateClickModel(
      worker::ClickKeys(spec), **model, exported->model.params, *test,
      [&](worker::ClickRows& batch) {
        batch.rows_by_table.resize(tables.size());
        for (size_t t = 0; t < tables.size(); ++t) {
          const int dim = tables[t].dim;
          const std::vector<uint64_t>& keys = batch.tables[t].keys;
          std::vector<float>& rows = batch.rows_by_table[t];
          rows.assign(keys.size() * dim, 0.0f);
          for (size_t k = 0; k < keys.size(); ++k) {
            if (const float* row = tables[t].Find(keys[k]); row != nullptr) {
              std::copy(row, row + dim, rows.begin() + static_cast<int64_t>(k) * dim);
            }
          }
        }
        return absl::OkStatus();
      });
  if (!eval.ok()) {
    std::cerr << "pstrain-local: " << eval.status().message() << "\n";
    return kExitFailed;
  }
  int64_t rows = 0;
  for (const TableFile& t : tables) rows += static_cast<int64_t>(t.keys.size());
  const std::string& job_id = exported->model.header.job_id();
  std::printf("%s (click model, job %s, %lld rows): test AUC %.6f, test log loss %.6f%s\n",
              dir.c_str(), job_id.c_str(), static_cast<long long>(rows), eval->auc,
              eval->log_loss,
              oracle_auc.has_value() ? absl::StrFormat(" (the data's oracle AUC %.6f)",
                                                       *oracle_auc).c_str()
                                     : "");
  std::printf("{\"export\":%s,\"job\":%s,\"test_auc\":%.6f,\"test_log_loss\":%.6f%s}\n",
              JsonQuote(dir).c_str(), JsonQuote(job_id).c_str(), eval->auc, eval->log_loss,
              oracle_auc.has_value() ? absl::StrFormat(",\"oracle_auc\":%.6f", *oracle_auc).c_str()
                                     : "");
  return 0;
}

// --eval: a model file's accuracy on the test set.
int Evaluate(const std::string& path) {
  if (std::filesystem::is_directory(path)) return EvaluateExport(path);
  absl::StatusOr<ModelFile> model = ReadModelFile(path);
  if (!model.ok()) {
    std::cerr << "pstrain-local: " << model.status().message() << "\n";
    return kExitUsage;
  }
  const v1::JobSpec& spec = model->header.spec();
  if (spec.model().type() == v1::MODEL_TYPE_CLICK) {
    std::cerr << "pstrain-local: " << path
              << ": a click model's file holds its dense part only: evaluate the directory "
                 "that --export or psctl export wrote (its model file and tables)\n";
    return kExitUsage;
  }
  const std::string dir =
      absl::GetFlag(FLAGS_data_dir).empty() ? spec.data().dir() : absl::GetFlag(FLAGS_data_dir);
  absl::StatusOr<Dataset> test = LoadFashionMnist(dir, /*train=*/false);
  if (!test.ok()) {
    std::cerr << "pstrain-local: " << test.status().message() << "\n";
    return kExitUsage;
  }
  absl::StatusOr<worker::Evaluation> eval = worker::Evaluate(spec, model->params, *test);
  if (!eval.ok()) {
    std::cerr << "pstrain-local: " << eval.status().message() << "\n";
    return kExitFailed;
  }
  std::printf("%s (%s, job %s): test accuracy %.4f, test loss %.4f\n", path.c_str(),
              ModelSummary(spec).c_str(), model->header.job_id().c_str(), eval->accuracy,
              eval->loss);
  std::printf("{\"model\":%s,\"job\":%s,\"test_accuracy\":%.4f,\"test_loss\":%.6f}\n",
              JsonQuote(path).c_str(), JsonQuote(model->header.job_id()).c_str(),
              eval->accuracy, eval->loss);
  return 0;
}

// Runs make-dev-certs.sh (beside the binaries) for a cluster of this size.
absl::Status MakeDevCertificates(const std::string& bin_dir, const std::string& dir,
                                 int servers, int workers, const std::string& run_dir) {
  SpawnOptions make;
  make.argv = {bin_dir + "/make-dev-certs.sh", dir, absl::StrCat(servers),
               absl::StrCat(workers)};
  make.log_path = run_dir + "/make-dev-certs.log";
  make.die_with_parent = true;
  PSTRAIN_ASSIGN_OR_RETURN(pid_t pid, Spawn(make));
  const int status = WaitOrKill(pid, MonotonicNow() + absl::Minutes(5));
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    return absl::InternalError(absl::StrCat(make.argv[0], " ", DescribeWaitStatus(status),
                                            "; see ", make.log_path));
  }
  return absl::OkStatus();
}

// What pstrain-local presents to its coordinator: the admin certificate
// and the operator's token of a make-dev-certs.sh directory (none without
// one).
struct ClientCredentials {
  std::unique_ptr<TransportSecurity> security;
  std::string token;
};

absl::StatusOr<ClientCredentials> LoadClientCredentials(const std::string& dir) {
  ClientCredentials credentials;
  if (dir.empty()) return credentials;
  PSTRAIN_ASSIGN_OR_RETURN(credentials.security,
                           TransportSecurity::Load({.cert = dir + "/admin.crt",
                                                    .key = dir + "/admin.key",
                                                    .ca = dir + "/ca.crt"}));
  if (absl::StatusOr<std::string> token = ReadFile(dir + "/operator.token"); token.ok()) {
    credentials.token = std::string(absl::StripAsciiWhitespace(*token));
  }
  return credentials;
}

int Run() {
  const std::string job_path = absl::GetFlag(FLAGS_job);
  if (!absl::GetFlag(FLAGS_eval).empty()) {
    if (!job_path.empty()) {
      std::cerr << "pstrain-local: give --job or --eval, not both\n";
      return kExitUsage;
    }
    return Evaluate(absl::GetFlag(FLAGS_eval));
  }
  if (job_path.empty()) {
    std::cerr << "pstrain-local: --job FILE (train) or --eval FILE (evaluate) is required\n";
    return kExitUsage;
  }
  if (absl::Status s = CheckExportPath(absl::GetFlag(FLAGS_export)); !s.ok()) {
    std::cerr << "pstrain-local: " << s.message() << "\n";
    return kExitUsage;
  }
  absl::StatusOr<v1::JobSpec> spec = LoadJobSpecFile(job_path);
  // Checkpoints go to the run directory unless the job file names a
  // directory: the job is checked as it will run (the run directory itself
  // is made further down).
  const bool checkpoints_in_run_dir = spec.ok() && spec->checkpoint().dir().empty();
  if (checkpoints_in_run_dir) spec->mutable_checkpoint()->set_dir("/run-dir/checkpoints");
  if (spec.ok()) spec = NormalizeJobSpec(*std::move(spec));
  if (!spec.ok()) {
    std::cerr << "pstrain-local: " << job_path << ": " << spec.status().message() << "\n";
    return kExitUsage;
  }
  if (spec->data().dataset() == v1::DATASET_FASHION_MNIST) {
    for (const char* file : {"train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz"}) {
      const std::string path = absl::StrCat(spec->data().dir(), "/", file);
      if (access(path.c_str(), R_OK) != 0) {
        std::cerr << "pstrain-local: " << job_path << ": data.dir: cannot read " << path
                  << " (Debian package dataset-fashion-mnist)\n";
        return kExitUsage;
      }
    }
  }
  const v1::ClickDataSpec& clicks = spec->data().clicks();
  for (const auto& [field, files] : {std::pair{"train_files", &clicks.train_files()},
                                     std::pair{"test_files", &clicks.test_files()}}) {
    for (const std::string& path : *files) {
      if (access(path.c_str(), R_OK) != 0) {
        std::cerr << "pstrain-local: " << job_path << ": data.clicks." << field
                  << ": cannot read " << path << "\n";
        return kExitUsage;
      }
    }
  }

  absl::StatusOr<worker::DeviceList> devices = worker::ParseDevices(absl::GetFlag(FLAGS_devices));
  if (!devices.ok()) {
    std::cerr << "pstrain-local: --" << devices.status().message() << "\n";
    return kExitUsage;
  }

  // Signals: stop following the job, then stop the cluster.
  absl::Mutex mu;
  int signal_received = 0;
  std::string dead_child;                 // a child that is not restarted
  JobFollower* follower = nullptr;        // once the job is followed
  TerminationSignals signals([&](int signo) {
    absl::MutexLock lock(&mu);
    signal_received = signo;
    if (follower != nullptr) follower->Stop(absl::StrCat("signal ", signo));
  });

  std::string run_dir = absl::GetFlag(FLAGS_run_dir);
  // A directory of pstrain-local's own goes once the job has succeeded.
  const bool remove_run_dir = run_dir.empty() && !absl::GetFlag(FLAGS_keep_run_dir);
  if (run_dir.empty()) {
    char tmpl[] = "/tmp/pstrain-local.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::cerr << "pstrain-local: cannot create a run directory in /tmp\n";
      return kExitFailed;
    }
    run_dir = tmpl;
  } else {
    mkdir(run_dir.c_str(), 0755);
    if (run_dir.front() != '/') {
      char cwd[PATH_MAX];
      if (getcwd(cwd, sizeof(cwd)) != nullptr) run_dir = absl::StrCat(cwd, "/", run_dir);
    }
  }
  std::string tls_dir = absl::GetFlag(FLAGS_tls_dir);
  const std::string bin_dir =
      absl::GetFlag(FLAGS_bin_dir).empty() ? ExecutableDir() : absl::GetFlag(FLAGS_bin_dir);
  if (absl::GetFlag(FLAGS_tls) && tls_dir.empty()) {
    tls_dir = run_dir + "/tls";
    if (absl::Status s = MakeDevCertificates(bin_dir, tls_dir, spec->num_servers(),
                                             spec->num_workers(), run_dir);
        !s.ok()) {
      std::cerr << "pstrain-local: --tls: " << s.message() << "\n";
      return kExitFailed;
    }
  }
  absl::StatusOr<ClientCredentials> credentials = LoadClientCredentials(tls_dir);
  if (!credentials.ok()) {
    std::cerr << "pstrain-local: --tls_dir: " << credentials.status().message() << "\n";
    return kExitUsage;
  }
  // So that a process killed during the run is recovered from them.
  if (checkpoints_in_run_dir) spec->mutable_checkpoint()->set_dir(run_dir + "/checkpoints");
  LocalCluster::Options options;
  options.bin_dir = bin_dir;
  options.tls_dir = tls_dir;
  // The user who runs pstrain-local chose these directories: the servers'
  // and workers' roots.
  if (!checkpoints_in_run_dir) {
    std::error_code error;
    std::filesystem::create_directories(spec->checkpoint().dir(), error);
    options.checkpoint_root = spec->checkpoint().dir();
  }
  // Click data names its files, which the user chose as the directories.
  options.data_root = spec->data().clicks().train_files_size() > 0 ? "/" : spec->data().dir();
  options.run_dir = run_dir;
  // Colocated: the servers are the workers' processes.
  options.colocated_servers = spec->colocated_servers();
  options.num_servers = spec->colocated_servers() ? 0 : spec->num_servers();
  options.num_workers = spec->num_workers();
  options.lease = absl::Seconds(absl::GetFlag(FLAGS_lease_s));
  for (int w = 0; w < spec->num_workers(); ++w) {
    options.worker_flags[w] = {"--devices=" + absl::GetFlag(FLAGS_devices)};
  }
  if (absl::GetFlag(FLAGS_pin_cpus)) {
    const int compute_threads = devices->kind == worker::DeviceList::Kind::kCpu
                                    ? static_cast<int>(devices->indices.size())
                                    : 1;
    const std::vector<std::vector<int>> groups =
        WorkerCpus(AllowedCpus(), spec->num_workers(), compute_threads);
    // A pinned worker shares its CPUs with the servers beside it (unpinned,
    // every process shares every CPU: LocalCluster's default).
    std::vector<int> sharing(groups.size(), 1);
    for (int s = 0; s < options.num_servers && !groups.empty(); ++s) {
      ++sharing[s % groups.size()];
    }
    for (size_t g = 0; g < groups.size(); ++g) {
      options.worker_flags[g].push_back("--cpus=" + FormatCpuList(groups[g]));
      options.worker_flags[g].push_back(absl::StrCat("--processes_sharing_cpus=", sharing[g]));
    }
    for (int s = 0; s < options.num_servers && !groups.empty(); ++s) {
      const size_t g = s % groups.size();
      options.server_flags[s] = {"--cpus=" + FormatCpuList(groups[g]),
                                 absl::StrCat("--processes_sharing_cpus=", sharing[g])};
    }
  }
  options.state_dir = run_dir + "/state";
  options.prometheus_sd_file = run_dir + "/prometheus-targets.json";
  // A child that dies is restarted under its node id, as a container
  // runtime would: the job recovers and its result does not change.
  options.restart_exited_children = true;
  std::printf("pstrain-local: %d server(s)%s, %d worker(s), logs in %s%s, Prometheus targets in "
              "%s\n",
              spec->num_servers(), spec->colocated_servers() ? " in the workers' processes" : "",
              spec->num_workers(), run_dir.c_str(),
              remove_run_dir ? " (removed if the job succeeds)" : "",
              options.prometheus_sd_file.c_str());
  std::fflush(stdout);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  if (!cluster.ok()) {
    std::cerr << "pstrain-local: " << cluster.status().message() << "\n";
    return kExitFailed;
  }

  // A child that dies is restarted; one that cannot be ends the run.
  std::atomic<bool> done{false};
  std::thread monitor([&] {
    while (!done) {
      {
        absl::MutexLock lock(&mu);
        for (const std::string& line : (*cluster)->Supervise()) {
          std::fprintf(stderr, "%s\n", line.c_str());
          if (!absl::EndsWith(line, ", restarting") && dead_child.empty()) {
            dead_child = line;
            if (follower != nullptr) follower->Stop(line);
          }
        }
        if (!dead_child.empty()) return;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  });
  auto finish = [&](int code) {
    done = true;
    monitor.join();
    (*cluster)->Stop();
    return code;
  };

  auto stub = v1::Control::NewStub(
      MakeChannel((*cluster)->coordinator_address(),
                  {.security = credentials->security.get(),
                   .peer_roles = {PeerRole::kCoordinator}}));
  const auto authorize = [&](grpc::ClientContext& context) {
    AddBearerToken(context, credentials->token);
  };
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = *spec;
  v1::SubmitJobResponse submitted;
  grpc::ClientContext submit_context;
  SetTimeout(submit_context, absl::Seconds(10));
  authorize(submit_context);
  if (absl::Status s = FromGrpcStatus(stub->SubmitJob(&submit_context, submit, &submitted));
      !s.ok()) {
    std::cerr << "pstrain-local: submit: " << s.message() << "\n";
    return finish(s.code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed);
  }
  std::printf("job %s submitted: %s, %s, %d worker(s) x %s, %d server(s)\n",
              submitted.job_id().c_str(), ModelSummary(*spec).c_str(),
              ModeSummary(*spec).c_str(), spec->num_workers(), WorkerBatchSummary(*spec).c_str(),
              spec->num_servers());
  std::fflush(stdout);

  ProgressDisplay display(stdout, isatty(STDOUT_FILENO),
                          absl::Seconds(absl::GetFlag(FLAGS_progress_interval_s)));
  JobFollower following(stub.get(), authorize);
  {
    absl::MutexLock lock(&mu);
    follower = &following;
    if (signal_received != 0) following.Stop(absl::StrCat("signal ", signal_received));
    if (!dead_child.empty()) following.Stop(dead_child);
  }
  const absl::StatusOr<v1::Job> job =
      following.Follow(submitted.job_id(), display, /*patience=*/absl::Minutes(2),
                       /*retry_every_error=*/false);
  int signo;
  std::string dead;
  {
    absl::MutexLock lock(&mu);
    follower = nullptr;
    signo = signal_received;
    dead = dead_child;
  }
  if (signo != 0) {
    std::cerr << "pstrain-local: signal " << signo << ", stopping the cluster\n";
    return finish(128 + signo);
  }
  if (!dead.empty()) {
    std::cerr << "pstrain-local: a process exited: " << dead << "\n";
    return finish(kExitFailed);
  }
  const int code = EndLaunch({.program = "pstrain-local",
                              .run_dir = run_dir,
                              .export_path = absl::GetFlag(FLAGS_export),
                              .stop = finish},
                             *stub, authorize, job, "");
  if (code == 0 && remove_run_dir) {
    std::error_code ignored;
    std::filesystem::remove_all(run_dir, ignored);
  }
  return code;
}

}  // namespace
}  // namespace pstrain::cli

int main(int argc, char** argv) {
  pstrain::InitMain(argc, argv, "pstrain-local --job FILE [flags] | pstrain-local --eval FILE");
  return pstrain::cli::Run();
}
