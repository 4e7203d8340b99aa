// What a container runtime or Kubernetes asks of each process: the gRPC
// health service of the coordinator and the servers, /healthz and /readyz
// of every process, `psctl health` as the probe that calls them, and
// --check_flags, with which a manifest's command line is tried against the
// real binary.
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/files.h"
#include "common/process.h"
#include "gtest/gtest.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/test_util.h"

namespace pstrain::testing {
namespace {

class HealthTest : public ClusterFixture {
 protected:
  ProcessResult Probe(const std::string& target, std::vector<std::string> flags = {}) {
    std::vector<std::string> argv = {BinDir() + "/psctl", "--timeout=5"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    argv.push_back("health");
    argv.push_back(target);
    return RunProcess(argv);
  }

  // Probes `target` until it exits with `code`; fails the test after a minute.
  ProcessResult ProbeUntil(const std::string& target, int code) {
    const absl::Time give_up = absl::Now() + absl::Minutes(1);
    while (true) {
      ProcessResult r = Probe(target);
      if (r.exit_code() == code || absl::Now() > give_up) return r;
      absl::SleepFor(absl::Milliseconds(100));
    }
  }

  static std::string Http(const std::string& address, const std::string& path) {
    return absl::StrCat("http://", address, path);
  }
};

TEST_F(HealthTest, EveryProcessAnswersItsProbes) {
  const int coordinator_metrics = PickFreePort();
  cli::LocalCluster::Options options;
  options.coordinator_flags = {absl::StrCat("--metrics_port=", coordinator_metrics)};
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 1, options));
  const std::string coordinator_http = absl::StrCat("127.0.0.1:", coordinator_metrics);

  ProcessResult grpc = Probe(cluster_->coordinator_address());
  EXPECT_EQ(grpc.exit_code(), 0) << grpc.err;
  EXPECT_EQ(grpc.out, "SERVING\n");
  for (const char* path : {"/healthz", "/readyz"}) {
    ProcessResult r = Probe(Http(coordinator_http, path));
    EXPECT_EQ(r.exit_code(), 0) << path << ": " << r.err;
  }
  ProcessResult metrics = Probe(Http(coordinator_http, "/metrics"));
  EXPECT_EQ(metrics.exit_code(), 0) << metrics.err;
  EXPECT_TRUE(absl::StrContains(metrics.out, "pstrain_jobs_submitted_total")) << metrics.out;

  int servers = 0;
  for (const v1::Node& node : Nodes()) {
    SCOPED_TRACE(node.id());
    if (node.role() == v1::NODE_ROLE_SERVER) {
      ++servers;
      ProcessResult r = Probe(node.address());
      EXPECT_EQ(r.exit_code(), 0) << r.err;
      EXPECT_EQ(r.out, "SERVING\n");
      // One service by name, and one the server does not have.
      EXPECT_EQ(Probe(node.address(), {"--service=pstrain.v1.Parameters"}).exit_code(), 0);
      ProcessResult unknown = Probe(node.address(), {"--service=no.such.Service"});
      EXPECT_EQ(unknown.exit_code(), 1) << unknown.err;
    }
    ProcessResult live = Probe(Http(node.metrics_address(), "/healthz"));
    EXPECT_EQ(live.exit_code(), 0) << live.err;
    EXPECT_EQ(live.out, "ok\n");
    ProcessResult ready = Probe(Http(node.metrics_address(), "/readyz"));
    EXPECT_EQ(ready.exit_code(), 0) << ready.err;
    EXPECT_EQ(ready.out, "ready\n");
    ProcessResult json = Probe(Http(node.metrics_address(), "/readyz"), {"-o", "json"});
    EXPECT_TRUE(absl::StrContains(json.out, "\"healthy\":true")) << json.out;
  }
  EXPECT_EQ(servers, 2);

  // Nobody there: exit 3; not an address: exit 2.
  EXPECT_EQ(Probe(absl::StrCat("127.0.0.1:", PickFreePort())).exit_code(), 3);
  EXPECT_EQ(Probe(Http(absl::StrCat("127.0.0.1:", PickFreePort()), "/healthz")).exit_code(), 3);
  EXPECT_EQ(Probe("http://no-port/healthz").exit_code(), 2);
}

// A server is live at once but ready, and SERVING, only once the
// coordinator has it registered; SIGTERM takes it down cleanly.
TEST_F(HealthTest, AServerIsReadyOnceRegistered) {
  const int coordinator_port = PickFreePort();
  const int metrics_port = PickFreePort();
  const std::string address_file = dir_.path() + "/server.address";
  SpawnOptions server;
  server.argv = {BinDir() + "/pstrain-server",
                 absl::StrCat("--coordinator=127.0.0.1:", coordinator_port),
                 "--address_file=" + address_file, "--node_id=server-7",
                 absl::StrCat("--metrics_port=", metrics_port)};
  server.log_path = dir_.path() + "/server.log";
  absl::StatusOr<pid_t> pid = Spawn(server);
  PSTRAIN_ASSERT_OK(pid);
  absl::StatusOr<std::string> address;
  const absl::Time give_up = absl::Now() + absl::Minutes(1);
  while (!(address = ReadFile(address_file)).ok() || address->empty()) {
    ASSERT_LT(absl::Now(), give_up) << "the server never wrote its address";
    absl::SleepFor(absl::Milliseconds(50));
  }
  const std::string grpc_address(absl::StripAsciiWhitespace(*address));
  const std::string http = absl::StrCat("127.0.0.1:", metrics_port);

  ProcessResult live = ProbeUntil(Http(http, "/healthz"), 0);
  EXPECT_EQ(live.exit_code(), 0) << live.err;
  ProcessResult not_ready = Probe(Http(http, "/readyz"));
  EXPECT_EQ(not_ready.exit_code(), 1);
  EXPECT_TRUE(absl::StrContains(not_ready.out, "not registered with the coordinator"))
      << not_ready.out;
  ProcessResult not_serving = Probe(grpc_address);
  EXPECT_EQ(not_serving.exit_code(), 1) << not_serving.err;
  EXPECT_EQ(not_serving.out, "NOT_SERVING\n");

  SpawnOptions coordinator;
  coordinator.argv = {BinDir() + "/pstrain-coordinator",
                      absl::StrCat("--listen=127.0.0.1:", coordinator_port)};
  coordinator.log_path = dir_.path() + "/coordinator.log";
  absl::StatusOr<pid_t> coordinator_pid = Spawn(coordinator);
  PSTRAIN_ASSERT_OK(coordinator_pid);
  EXPECT_EQ(ProbeUntil(grpc_address, 0).out, "SERVING\n");
  EXPECT_EQ(ProbeUntil(Http(http, "/readyz"), 0).exit_code(), 0);

  const int status = StopProcess(*pid, absl::Seconds(30));
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << DescribeWaitStatus(status);
  StopProcess(*coordinator_pid, absl::Seconds(30));
}

TEST(CheckFlagsTest, EveryDaemonTriesItsCommandLineWithoutStarting) {
  const std::string bin = BinDir();
  struct Case {
    std::vector<std::string> argv;
    int exit_code;
  };
  const std::vector<Case> cases = {
      {{bin + "/pstrain-coordinator", "--listen=0.0.0.0:50050",
        "--advertise_address=pstrain-coordinator:50050", "--state_dir=/var/lib/pstrain",
        "--metrics_host=0.0.0.0", "--metrics_port=9100", "--check_flags"},
       0},
      {{bin + "/pstrain-server", "--coordinator=pstrain-coordinator:50050",
        "--listen=0.0.0.0:50051", "--advertise_address={node_id}.pstrain-server:50051",
        "--node_id=pstrain-server-0", "--check_flags"},
       0},
      // A GPU worker's flags are checked where there is no GPU.
      {{bin + "/pstrain-worker", "--coordinator=pstrain-coordinator:50050", "--devices=cuda:0",
        "--check_flags"},
       0},
      {{bin + "/pstrain-worker", "--coordinator=c:1", "--cpus=0-1,4", "--check_flags"}, 0},
      {{bin + "/pstrain-worker", "--coordinator=c:1", "--shm_connections=4", "--check_flags"}, 0},
      {{bin + "/psctl", "--check_flags", "submit", "/etc/pstrain/job.yaml"}, 0},
      {{bin + "/psctl", "--check_flags", "health", "127.0.0.1:1"}, 0},
      // What --check_flags must catch.
      {{bin + "/pstrain-server", "--coordinator=c:1", "--no_such_flag", "--check_flags"}, 1},
      {{bin + "/pstrain-server", "--coordinator=c:1", "--advertise_address={node_id}:50051",
        "--check_flags"},
       2},
      {{bin + "/pstrain-worker", "--coordinator=c:1", "--devices=tpu:0", "--check_flags"}, 2},
      {{bin + "/pstrain-worker", "--coordinator=c:1", "--cpus=3-1", "--check_flags"}, 2},
      {{bin + "/pstrain-worker", "--coordinator=c:1", "--shm_connections=0", "--check_flags"}, 2},
      {{bin + "/pstrain-server", "--coordinator=c:1", "--cpus=all", "--check_flags"}, 2},
      // Not only checked: CPUs that no process here may use end the start.
      {{bin + "/pstrain-server", "--coordinator=c:1", "--cpus=1023"}, 2},
      {{bin + "/pstrain-coordinator", "--lease_s=0", "--check_flags"}, 2},
      {{bin + "/psctl", "--check_flags", "submit"}, 2},
  };
  for (const Case& c : cases) {
    ProcessResult r = RunProcess(c.argv);
    EXPECT_EQ(r.exit_code(), c.exit_code) << absl::StrJoin(c.argv, " ") << "\n" << r.err;
    if (c.exit_code == 0) {
      EXPECT_EQ(r.out, "flags ok\n") << absl::StrJoin(c.argv, " ");
    }
  }
}

// --help lists each program's own flags (Abseil's default lists none of
// ours: it looks for a file named after the program).
TEST(HelpTest, EveryProgramListsItsFlags) {
  for (const auto& [program, flag] :
       {std::pair{"pstrain-run", "--workers"}, std::pair{"pstrain-local", "--keep_run_dir"},
        std::pair{"pstrain-clickgen", "--train_rows"}, std::pair{"pstrain-server", "--apply_threads"},
        std::pair{"pstrain-worker", "--processes_sharing_cpus"},
        std::pair{"pstrain-coordinator", "--default_checkpoint_dir"},
        std::pair{"pstrain-bench", "--tiny"}}) {
    // pstrain-bench is no test's dependency: the hardening build has none.
    if (program == std::string("pstrain-bench") &&
        !std::filesystem::exists(BinDir() + "/" + program)) {
      continue;
    }
    const ProcessResult r = RunProcess({BinDir() + "/" + program, "--help"});
    EXPECT_TRUE(absl::StrContains(r.out + r.err, std::string(flag) + " (")) << program << ":\n"
                                                                            << r.out << r.err;
  }
  // Only the flags a program honours: pstrain-run has no --cpus.
  const ProcessResult run = RunProcess({BinDir() + "/pstrain-run", "--help"});
  EXPECT_FALSE(absl::StrContains(run.out + run.err, "--cpus (")) << run.out;
}

}  // namespace
}  // namespace pstrain::testing
