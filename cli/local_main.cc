// pstrain-local: runs one job on a local cluster of real processes.
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "cli/local_cluster.h"
#include "common/init.h"
#include "common/job_spec.h"
#include "common/process.h"
#include "common/rpc.h"
#include "pstrain/v1/control.grpc.pb.h"

ABSL_FLAG(std::string, job, "", "job file (YAML), e.g. examples/fashion_mlp.yaml");
ABSL_FLAG(std::string, bin_dir, "",
          "directory of the pstrain binaries; default: the directory of pstrain-local");
ABSL_FLAG(std::string, run_dir, "",
          "directory for the processes' logs; default: a new /tmp/pstrain-local.XXXXXX");
ABSL_FLAG(int, lease_s, 10, "heartbeat lease of the nodes, seconds");
ABSL_FLAG(double, progress_interval_s, 1.0, "seconds between progress lines");

namespace pstrain::cli {
namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string ResultJson(const v1::Job& job) {
  const v1::JobSpec& spec = job.spec();
  const v1::JobResult& r = job.result();
  return absl::StrFormat(
      "{\"job\":%s,\"name\":%s,\"mode\":%s,\"workers\":%d,\"servers\":%d,\"steps\":%d,"
      "\"train_seconds\":%.3f,\"samples_per_second\":%.1f,\"final_loss\":%.6f,"
      "\"test_accuracy\":%.4f}",
      JsonString(job.id()), JsonString(spec.name()), JsonString(ModeName(spec.mode())),
      spec.num_workers(), spec.num_servers(), r.steps(), r.train_seconds(),
      r.samples_per_second(), r.final_loss(), r.test_accuracy());
}

void PrintProgress(const v1::Progress& p) {
  std::printf("epoch %d/%d  step %lld/%lld  loss %.4f  %.0f samples/s\n", p.epoch() + 1,
              p.total_epochs(), static_cast<long long>(p.step()),
              static_cast<long long>(p.total_steps()), p.loss(), p.samples_per_second());
  std::fflush(stdout);
}

// Watches the job until it ends; returns its final state. Cancelling
// `context` (on a signal or a dead child) ends the watch early.
absl::StatusOr<v1::Job> Follow(v1::Control::Stub& stub, const std::string& job_id,
                               grpc::ClientContext& context, absl::Duration progress_interval) {
  v1::WatchJobRequest request;
  request.set_job_id(job_id);
  auto reader = stub.WatchJob(&context, request);
  v1::JobEvent event;
  v1::Job job;
  absl::Time last_print = absl::InfinitePast();
  while (reader->Read(&event)) {
    switch (event.kind_case()) {
      case v1::JobEvent::kSnapshot:
        job = event.snapshot();
        break;
      case v1::JobEvent::kState:
        job.set_state(event.state().state());
        job.set_reason(event.state().reason());
        if (event.state().state() == v1::JOB_STATE_RUNNING) {
          std::printf("job %s running\n", job_id.c_str());
        }
        break;
      case v1::JobEvent::kProgress:
        *job.mutable_progress() = event.progress();
        if (absl::Now() - last_print >= progress_interval) {
          PrintProgress(event.progress());
          last_print = absl::Now();
        }
        break;
      case v1::JobEvent::kEvaluation:
        std::printf("test accuracy %.4f  test loss %.4f\n", event.evaluation().test_accuracy(),
                    event.evaluation().test_loss());
        break;
      case v1::JobEvent::kCompleted:
        *job.mutable_result() = event.completed();
        break;
      default:
        break;
    }
    std::fflush(stdout);
  }
  absl::Status status = FromGrpcStatus(reader->Finish());
  if (!status.ok()) return status;
  return job;
}

int Run() {
  const std::string job_path = absl::GetFlag(FLAGS_job);
  if (job_path.empty()) {
    std::cerr << "pstrain-local: --job FILE is required\n";
    return kExitUsage;
  }
  absl::StatusOr<v1::JobSpec> spec = LoadJobSpecFile(job_path);
  if (spec.ok()) spec = NormalizeJobSpec(*std::move(spec));
  if (!spec.ok()) {
    std::cerr << "pstrain-local: " << job_path << ": " << spec.status().message() << "\n";
    return kExitUsage;
  }
  for (const char* file : {"train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz"}) {
    const std::string path = absl::StrCat(spec->data().dir(), "/", file);
    if (access(path.c_str(), R_OK) != 0) {
      std::cerr << "pstrain-local: " << job_path << ": data.dir: cannot read " << path
                << " (Debian package dataset-fashion-mnist)\n";
      return kExitUsage;
    }
  }

  // Signals: stop following the job, then stop the cluster.
  absl::Mutex mu;
  int signal_received = 0;
  grpc::ClientContext watch_context;
  TerminationSignals signals([&](int signo) {
    absl::MutexLock lock(&mu);
    signal_received = signo;
    watch_context.TryCancel();
  });

  std::string run_dir = absl::GetFlag(FLAGS_run_dir);
  if (run_dir.empty()) {
    char tmpl[] = "/tmp/pstrain-local.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::cerr << "pstrain-local: cannot create a run directory in /tmp\n";
      return kExitFailed;
    }
    run_dir = tmpl;
  } else {
    mkdir(run_dir.c_str(), 0755);
  }
  LocalCluster::Options options;
  options.bin_dir = absl::GetFlag(FLAGS_bin_dir).empty() ? ExecutableDir()
                                                         : absl::GetFlag(FLAGS_bin_dir);
  options.run_dir = run_dir;
  options.num_servers = spec->num_servers();
  options.num_workers = spec->num_workers();
  options.lease = absl::Seconds(absl::GetFlag(FLAGS_lease_s));
  options.state_dir = run_dir + "/state";
  std::printf("pstrain-local: %d server(s), %d worker(s), logs in %s\n", spec->num_servers(),
              spec->num_workers(), run_dir.c_str());
  std::fflush(stdout);
  absl::StatusOr<std::unique_ptr<LocalCluster>> cluster = LocalCluster::Start(options);
  if (!cluster.ok()) {
    std::cerr << "pstrain-local: " << cluster.status().message() << "\n";
    return kExitFailed;
  }

  // A child that dies ends the run.
  std::atomic<bool> done{false};
  std::string dead_child;
  std::thread monitor([&] {
    while (!done) {
      {
        absl::MutexLock lock(&mu);
        if (std::optional<std::string> dead = (*cluster)->CheckChildren()) {
          dead_child = *dead;
          watch_context.TryCancel();
          return;
        }
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
  });
  auto finish = [&](int code) {
    done = true;
    monitor.join();
    (*cluster)->Stop();
    return code;
  };

  auto stub = v1::Control::NewStub(MakeChannel((*cluster)->coordinator_address()));
  v1::SubmitJobRequest submit;
  *submit.mutable_spec() = *spec;
  v1::SubmitJobResponse submitted;
  grpc::ClientContext submit_context;
  SetTimeout(submit_context, absl::Seconds(10));
  if (absl::Status s = FromGrpcStatus(stub->SubmitJob(&submit_context, submit, &submitted));
      !s.ok()) {
    std::cerr << "pstrain-local: submit: " << s.message() << "\n";
    return finish(s.code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed);
  }
  std::printf("job %s submitted: %s, %s, %d worker(s) x batch %d, %d server(s)\n",
              submitted.job_id().c_str(), ModelTypeName(spec->model().type()).c_str(),
              ModeName(spec->mode()).c_str(), spec->num_workers(), spec->batch_size(),
              spec->num_servers());
  std::fflush(stdout);

  absl::StatusOr<v1::Job> job =
      Follow(*stub, submitted.job_id(), watch_context,
             absl::Seconds(absl::GetFlag(FLAGS_progress_interval_s)));
  int signo;
  std::string dead;
  {
    absl::MutexLock lock(&mu);
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
  if (!job.ok()) {
    std::cerr << "pstrain-local: watching the job: " << job.status().message() << "\n";
    return finish(kExitFailed);
  }
  if (job->state() != v1::JOB_STATE_SUCCEEDED) {
    std::cerr << "pstrain-local: job " << job->id() << " "
              << v1::JobState_Name(job->state()) << ": " << job->reason() << " (logs in "
              << run_dir << ")\n";
    return finish(kExitFailed);
  }
  const int code = finish(0);
  const v1::JobResult& r = job->result();
  std::printf("done: %lld steps in %.1f s, %.0f samples/s, final loss %.4f, test accuracy %.4f\n",
              static_cast<long long>(r.steps()), r.train_seconds(), r.samples_per_second(),
              r.final_loss(), r.test_accuracy());
  std::printf("%s\n", ResultJson(*job).c_str());
  std::fflush(stdout);
  return code;
}

}  // namespace
}  // namespace pstrain::cli

int main(int argc, char** argv) {
  pstrain::InitMain(argc, argv, "pstrain-local --job FILE [flags]");
  return pstrain::cli::Run();
}
