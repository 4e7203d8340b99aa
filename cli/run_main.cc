// pstrain-run: runs a training script as the workers of one job, as torchrun
// does: on a local cluster it starts (or against --coordinator), with
// supervision (a worker process that dies is started again under its node
// id and the job recovers), the job's progress, and the JSON result line at
// the end.
//
//   pstrain-run --workers 2 --servers 2 --job job.yaml -- python3 train.py ARGS
//
// --workers is the job's nodes (its workers); --nproc_per_node K starts K
// processes on each, which combine their gradients among themselves before
// the node's one push (pstrain.torch does it; LOCAL_RANK 0 is the node's
// worker of the job). Each process gets PSTRAIN_COORDINATOR, PSTRAIN_RUN_ID
// (the submit's request id: every process submits the same job and gets
// it), PSTRAIN_NODE_ID, PSTRAIN_NODE_RANK, PSTRAIN_NUM_WORKERS,
// PSTRAIN_NUM_SERVERS, torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE, RANK and
// WORLD_SIZE, with K > 1 PSTRAIN_LOCAL_GROUP (where the node's processes
// meet: a file:// URL for torch.distributed) and, with --job,
// PSTRAIN_JOB_FILE (pstrain.init reads them).
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <random>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "cli/job_output.h"
#include "cli/launch.h"
#include "cli/local_cluster.h"
#include "common/clock.h"
#include "common/cpu_budget.h"
#include "common/files.h"
#include "common/init.h"
#include "common/job_spec.h"
#include "common/process.h"
#include "common/rpc.h"
#include "common/status.h"
#include "pstrain/v1/control.grpc.pb.h"

ABSL_FLAG(int, workers, 1, "worker processes: the job's num_workers");
ABSL_FLAG(int, nproc_per_node, 1,
          "processes per node (worker): they combine their gradients among themselves, and "
          "the node's first (LOCAL_RANK 0) pushes the sum as the job's worker");
ABSL_FLAG(int, servers, 1, "parameter servers of the local cluster: the job's num_servers");
ABSL_FLAG(std::string, job, "",
          "job file (YAML) whose model is external; its num_workers and num_servers, if "
          "given, must match --workers and --servers. Empty: the script gives its own");
ABSL_FLAG(std::string, export, "",
          "write the trained model to this file once the job succeeded (as psctl export "
          "does)");
ABSL_FLAG(std::string, coordinator, "",
          "host:port of an existing cluster's coordinator: join it instead of starting one");
ABSL_FLAG(std::string, run_dir, "",
          "directory for the logs (the cluster's and each worker's, worker-N.log); default: "
          "a new /tmp/pstrain-run.XXXXXX");
ABSL_FLAG(std::string, bin_dir, "", "directory of the pstrain binaries; default: pstrain-run's");
ABSL_FLAG(int, max_restarts, 3,
          "times a node whose process failed is started again (all its processes)");
ABSL_FLAG(double, progress_interval_s, 1.0, "seconds between progress lines");
ABSL_FLAG(double, find_job_timeout_s, 600,
          "how long the scripts may take to submit the job (importing torch is slow)");

namespace pstrain::cli {
namespace {

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

// One process of the launch.
struct Script {
  SpawnOptions spawn;
  pid_t pid = -1;
};

// A node (one worker of the job): its processes, started and stopped
// together, and its restarts.
struct Node {
  std::vector<Script> processes;
  int starts = 0;
  int restarts = 0;
};

// The job file as the scripts will submit it (with pstrain-run's workers
// and servers, the scripts' tensors standing in as one), checked as the
// coordinator will check it, so that a bad field stops the launch before
// anything starts. Returns the file's checkpoint.dir ("" when it names
// none: the run directory's), or INVALID_ARGUMENT naming the field.
absl::StatusOr<std::string> CheckJobFile(const std::string& path, int workers, int servers) {
  PSTRAIN_ASSIGN_OR_RETURN(v1::JobSpec spec, LoadJobSpecFile(path));
  PSTRAIN_RETURN_IF_ERROR(MakeModelExternal(*spec.mutable_model()));
  if ((spec.num_workers() != 0 && spec.num_workers() != workers) ||
      (spec.num_servers() != 0 && spec.num_servers() != servers)) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_workers: ", spec.num_workers(), ", num_servers: ", spec.num_servers(),
                     " where the flags say --workers ", workers, ", --servers ", servers));
  }
  v1::ExternalTensor* stand_in = spec.mutable_model()->add_tensors();
  stand_in->set_name("parameters");
  stand_in->add_shape(1);
  spec.set_num_workers(workers);
  spec.set_num_servers(servers);
  const std::string checkpoint_dir = spec.checkpoint().dir();
  if (checkpoint_dir.empty()) spec.mutable_checkpoint()->set_dir("/run-dir/checkpoints");
  PSTRAIN_RETURN_IF_ERROR(NormalizeJobSpec(std::move(spec)).status());
  return checkpoint_dir;
}

int Run(const std::vector<std::string>& command) {
  const int workers = absl::GetFlag(FLAGS_workers);
  const int servers = absl::GetFlag(FLAGS_servers);
  if (command.empty()) {
    std::cerr << "pstrain-run: no command: pstrain-run [flags] -- python3 SCRIPT ARGS\n";
    return kExitUsage;
  }
  const int per_node = absl::GetFlag(FLAGS_nproc_per_node);
  if (workers < 1 || workers > 1024 || servers < 1 || servers > 256 || per_node < 1 ||
      per_node > 64) {
    std::cerr << "pstrain-run: --workers must be in [1, 1024], --servers in [1, 256] and "
                 "--nproc_per_node in [1, 64]\n";
    return kExitUsage;
  }
  if (absl::Status s = CheckExportPath(absl::GetFlag(FLAGS_export)); !s.ok()) {
    std::cerr << "pstrain-run: " << s.message() << "\n";
    return kExitUsage;
  }
  const std::string job_file = absl::GetFlag(FLAGS_job);
  std::string checkpoint_dir;  // the job file's checkpoint.dir, if it names one
  if (!job_file.empty()) {
    absl::StatusOr<std::string> checked = CheckJobFile(job_file, workers, servers);
    if (!checked.ok()) {
      std::cerr << "pstrain-run: " << job_file << ": " << checked.status().message() << "\n";
      return kExitUsage;
    }
    checkpoint_dir = *checked;
  }

  std::string run_dir = absl::GetFlag(FLAGS_run_dir);
  if (run_dir.empty()) {
    char tmpl[] = "/tmp/pstrain-run.XXXXXX";
    if (mkdtemp(tmpl) == nullptr) {
      std::cerr << "pstrain-run: cannot make a run directory in /tmp\n";
      return kExitFailed;
    }
    run_dir = tmpl;
  } else {
    std::error_code error;
    std::filesystem::create_directories(run_dir, error);
    run_dir = std::filesystem::absolute(run_dir).string();
  }

  // The scripts and the servers share this machine's CPUs: each script's
  // pools (OpenMP, OpenBLAS, MKL) get its share, unless the user set one.
  const int sharing =
      workers * per_node + (absl::GetFlag(FLAGS_coordinator).empty() ? servers : 0);
  const ThreadChoice threads = ThreadsFor(ProcessCpuBudget(), sharing);
  const std::optional<std::string> user_threads = ThreadVariableSet();
  std::vector<std::string> thread_env = {absl::StrCat("PSTRAIN_PROCESSES_SHARING_CPUS=", sharing)};
  if (!user_threads.has_value()) {
    for (const char* name : kThreadVariables) {
      thread_env.push_back(absl::StrCat(name, "=", threads.threads));
    }
  }

  std::unique_ptr<LocalCluster> cluster;
  std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (coordinator.empty()) {
    LocalCluster::Options options;
    options.bin_dir =
        absl::GetFlag(FLAGS_bin_dir).empty() ? ExecutableDir() : absl::GetFlag(FLAGS_bin_dir);
    options.run_dir = run_dir;
    options.num_servers = servers;
    options.num_workers = 0;  // the scripts are the workers
    // The servers may write where the job file says, or in the run directory.
    options.checkpoint_root = checkpoint_dir.empty() ? run_dir : checkpoint_dir;
    if (!checkpoint_dir.empty()) {
      std::error_code error;
      std::filesystem::create_directories(checkpoint_dir, error);
    }
    options.state_dir = run_dir + "/state";
    options.restart_exited_children = true;
    options.processes_sharing_cpus = sharing;
    absl::StatusOr<std::unique_ptr<LocalCluster>> started = LocalCluster::Start(options);
    if (!started.ok()) {
      std::cerr << "pstrain-run: " << started.status().message() << "\n";
      return kExitFailed;
    }
    cluster = std::move(*started);
    coordinator = cluster->coordinator_address();
  }
  std::random_device random;
  const std::string run_id = absl::StrFormat("run-%08x%08x", random(), random());
  std::printf("pstrain-run: %d worker(s) of `%s`%s, %s, logs in %s\n", workers,
              command[0].c_str(),
              per_node > 1 ? absl::StrCat(", ", per_node, " processes each").c_str() : "",
              cluster != nullptr ? absl::StrCat(servers, " server(s) started").c_str()
                                 : ("coordinator " + coordinator).c_str(),
              run_dir.c_str());
  if (user_threads.has_value()) {
    std::printf("pstrain-run: the worker processes' threads are the environment's (%s)\n",
                user_threads->c_str());
  } else {
    std::printf("pstrain-run: %d compute thread(s) a worker process (OMP_NUM_THREADS, "
                "OPENBLAS_NUM_THREADS, MKL_NUM_THREADS): %s\n",
                threads.threads, threads.why.c_str());
  }
  std::fflush(stdout);

  std::vector<Node> nodes(workers);
  for (int i = 0; i < workers; ++i) {
    for (int j = 0; j < per_node; ++j) {
      Script& s = nodes[i].processes.emplace_back();
      s.spawn.argv = command;
      // What the script starts (DataLoader workers) ends with it.
      s.spawn.own_process_group = true;
      s.spawn.log_path = per_node == 1 ? absl::StrCat(run_dir, "/worker-", i, ".log")
                                       : absl::StrCat(run_dir, "/worker-", i, "-", j, ".log");
      s.spawn.env = {"PSTRAIN_COORDINATOR=" + coordinator,
                     "PSTRAIN_RUN_ID=" + run_id,
                     absl::StrCat("PSTRAIN_NODE_ID=", run_id, "-", i),
                     absl::StrCat("PSTRAIN_NODE_RANK=", i),
                     absl::StrCat("PSTRAIN_NUM_WORKERS=", workers),
                     absl::StrCat("PSTRAIN_NUM_SERVERS=", servers),
                     absl::StrCat("LOCAL_RANK=", j),
                     absl::StrCat("LOCAL_WORLD_SIZE=", per_node),
                     absl::StrCat("RANK=", i * per_node + j),
                     absl::StrCat("WORLD_SIZE=", workers * per_node)};
      s.spawn.env.insert(s.spawn.env.end(), thread_env.begin(), thread_env.end());
      // The node's processes exchange gradients over loopback.
      if (per_node > 1) s.spawn.env.push_back("GLOO_SOCKET_IFNAME=lo");
      // Where the local cluster's servers may write checkpoints.
      if (cluster != nullptr) s.spawn.env.push_back("PSTRAIN_RUN_DIR=" + run_dir);
      if (!job_file.empty()) {
        s.spawn.env.push_back("PSTRAIN_JOB_FILE=" + std::filesystem::absolute(job_file).string());
      }
    }
  }
  // Starts node i's processes; with several, each start meets in a new file.
  auto start_node = [&](int i) -> absl::Status {
    Node& node = nodes[i];
    const std::string group = absl::StrCat(run_dir, "/group-", run_id, "-", i, "-", node.starts++);
    std::error_code ignored;
    std::filesystem::remove(group, ignored);
    for (Script& s : node.processes) {
      SpawnOptions spawn = s.spawn;
      // One process a node: none, whatever pstrain-run's own environment says.
      spawn.env.push_back("PSTRAIN_LOCAL_GROUP=" + (per_node > 1 ? "file://" + group : ""));
      PSTRAIN_ASSIGN_OR_RETURN(s.pid, Spawn(spawn));
    }
    return absl::OkStatus();
  };

  auto stub = v1::Control::NewStub(MakeChannel(coordinator));
  // Stopped with the reason the run cannot succeed, by the supervisor.
  JobFollower follower(stub.get(), nullptr);
  std::atomic<bool> job_ended{false};
  std::atomic<bool> done{false};
  auto give_up = [&](const std::string& why) { follower.Stop(why); };
  // SIGINT or SIGTERM: everything stops (the scripts with what they
  // started), and pstrain-run exits 128 + the signal.
  std::atomic<int> signalled{0};
  TerminationSignals signals([&](int signo) {
    signalled = signo;
    give_up(absl::StrCat("signal ", signo));
  });
  // Starts every script, then watches them (and the cluster): a script that
  // fails while the job runs is started again under its node id.
  std::thread supervisor([&] {
    absl::Time all_exited = absl::InfiniteFuture();
    for (int i = 0; i < workers; ++i) {
      if (absl::Status started = start_node(i); !started.ok()) {
        give_up(std::string(started.message()));  // those started are stopped below
        break;
      }
    }
    while (!done) {
      if (cluster != nullptr) {
        for (const std::string& line : cluster->Supervise()) {
          std::fprintf(stderr, "pstrain-run: %s\n", line.c_str());
        }
      }
      int running = 0;
      for (int i = 0; i < workers; ++i) {
        Node& node = nodes[i];
        std::string failed;  // the first process of the node that failed
        bool permanent = false;  // it exited 2: it would fail again
        for (int j = 0; j < per_node; ++j) {
          Script& s = node.processes[j];
          if (s.pid < 0) continue;
          const std::optional<int> status = TryReap(s.pid);
          if (!status.has_value()) {
            ++running;
            continue;
          }
          kill(-s.pid, SIGKILL);  // what it left behind
          s.pid = -1;
          if (WIFEXITED(*status) && WEXITSTATUS(*status) == 0) continue;
          if (failed.empty()) {
            permanent = WIFEXITED(*status) && WEXITSTATUS(*status) == kExitUsage;
            failed = absl::StrCat("worker process ", i, per_node > 1 ? absl::StrCat(".", j) : "",
                                  " ", DescribeWaitStatus(*status), " (", s.spawn.log_path,
                                  "): ", absl::StripAsciiWhitespace(LastLines(s.spawn.log_path, 1)));
          }
        }
        if (failed.empty() || job_ended) continue;
        // The node's other processes cannot go on without it: all start again.
        for (Script& s : node.processes) {
          if (s.pid < 0) continue;
          StopProcessGroup(s.pid, absl::Seconds(10));
          s.pid = -1;
          --running;
        }
        if (permanent || node.restarts >= absl::GetFlag(FLAGS_max_restarts)) {
          give_up(failed);
          continue;
        }
        ++node.restarts;
        std::fprintf(stderr, "pstrain-run: %s; starting %s again\n", failed.c_str(),
                     per_node > 1 ? "its node's processes" : "it");
        if (absl::Status started = start_node(i); !started.ok()) {
          give_up(std::string(started.message()));
          continue;
        }
        running += per_node;
      }
      // All exited 0 (the job ends as their final reports come in); a job
      // still running a minute later was left by them.
      if (running == 0 && !job_ended) {
        if (all_exited == absl::InfiniteFuture()) all_exited = MonotonicNow();
        if (MonotonicNow() - all_exited > absl::Minutes(1)) {
          give_up("every worker process exited, and the job did not end");
        }
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    for (Node& node : nodes) {
      for (Script& s : node.processes) {
        if (s.pid >= 0) StopProcessGroup(s.pid, absl::Seconds(10));
      }
    }
  });
  auto finish = [&](int code) {
    // The scripts finish on their own once the job ended (worker 0 uploads
    // the model first); a minute at most.
    const absl::Time deadline = MonotonicNow() + absl::Minutes(1);
    while (MonotonicNow() < deadline) {
      bool all = true;
      for (const Node& node : nodes) {
        for (const Script& s : node.processes) all = all && s.pid < 0;
      }
      if (all || !job_ended || signalled != 0) break;
      absl::SleepFor(absl::Milliseconds(100));
    }
    done = true;
    supervisor.join();
    if (cluster != nullptr) cluster->Stop();
    return code;
  };

  // The job: the one the scripts submitted under the run's request id.
  std::string job_id;
  const absl::Time find_deadline =
      MonotonicNow() + absl::Seconds(absl::GetFlag(FLAGS_find_job_timeout_s));
  while (job_id.empty()) {
    if (!follower.stopped().empty()) break;
    if (MonotonicNow() > find_deadline) {
      give_up("the worker processes submitted no job in time");
      break;
    }
    v1::ListJobsRequest request;
    v1::ListJobsResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    if (stub->ListJobs(&context, request, &response).ok()) {
      for (const v1::Job& j : response.jobs()) {
        if (j.request_id() == run_id) job_id = j.id();
      }
    }
    if (job_id.empty()) absl::SleepFor(absl::Milliseconds(200));
  }
  absl::StatusOr<v1::Job> job = absl::UnavailableError("no job");
  if (!job_id.empty()) {
    std::printf("job %s submitted\n", job_id.c_str());
    std::fflush(stdout);
    ProgressDisplay display(stdout, isatty(STDOUT_FILENO),
                            absl::Seconds(absl::GetFlag(FLAGS_progress_interval_s)));
    // Until the job ends or the worker processes do (Stop).
    job = follower.Follow(job_id, display, /*patience=*/absl::InfiniteDuration(),
                          /*retry_every_error=*/true);
    job_ended = true;
  }
  if (signalled != 0) {
    std::cerr << "pstrain-run: signal " << signalled << ", stopping\n";
    return finish(128 + signalled);
  }
  return EndLaunch({.program = "pstrain-run",
                    .run_dir = run_dir,
                    .export_path = absl::GetFlag(FLAGS_export),
                    .stop = finish},
                   *stub, nullptr, job, follower.stopped());
}

}  // namespace
}  // namespace pstrain::cli

int main(int argc, char** argv) {
  // Everything after "--" is the command.
  int flags_end = argc;
  std::vector<std::string> command;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--") {
      flags_end = i;
      command.assign(argv + i + 1, argv + argc);
      break;
    }
  }
  pstrain::InitMain(flags_end, argv,
                    "pstrain-run --workers W --servers S [--nproc_per_node K] [--job FILE] "
                    "[--coordinator HOST:PORT] -- COMMAND ARGS");
  return pstrain::cli::Run(command);
}
