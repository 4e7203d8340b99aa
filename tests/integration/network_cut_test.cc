// Network cuts: a worker (and, separately, a server) runs in a network
// namespace of its own behind a veth pair; the link goes down for longer
// than the lease, then up again. The job follows its policy (on_worker_loss:
// wait; a server is not replaced before replace_after_seconds) and the node
// comes back as the same process: the final parameters are bitwise those of
// a run without the cut. Needs root (ip netns); skipped where namespaces
// cannot be made.
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"

namespace pstrain::testing {
namespace {

// A network namespace joined to the test's by a veth pair: the host side
// 10.77.N.1, the namespace side 10.77.N.2. Removed by the destructor.
class NetworkNamespace {
 public:
  NetworkNamespace() {
    const int n = 1 + getpid() % 250;
    name_ = absl::StrFormat("pstrain-cut-%d", getpid());
    host_if_ = absl::StrFormat("pscut%dh", getpid() % 100000);
    ns_if_ = absl::StrFormat("pscut%dn", getpid() % 100000);
    host_ip_ = absl::StrFormat("10.77.%d.1", n);
    ns_ip_ = absl::StrFormat("10.77.%d.2", n);
    ok_ = Ip({"netns", "add", name_}) &&
          Ip({"link", "add", host_if_, "type", "veth", "peer", "name", ns_if_}) &&
          Ip({"link", "set", ns_if_, "netns", name_}) &&
          Ip({"addr", "add", host_ip_ + "/24", "dev", host_if_}) &&
          Ip({"link", "set", host_if_, "up"}) &&
          Ip({"-n", name_, "addr", "add", ns_ip_ + "/24", "dev", ns_if_}) &&
          Ip({"-n", name_, "link", "set", ns_if_, "up"}) &&
          Ip({"-n", name_, "link", "set", "lo", "up"});
  }
  ~NetworkNamespace() {
    Ip({"link", "del", host_if_});
    Ip({"netns", "del", name_});
  }

  bool ok() const { return ok_; }
  const std::string& host_ip() const { return host_ip_; }
  const std::string& ns_ip() const { return ns_ip_; }
  std::vector<std::string> Exec() const { return {"ip", "netns", "exec", name_}; }
  bool SetLink(bool up) { return Ip({"link", "set", host_if_, up ? "up" : "down"}); }

 private:
  static bool Ip(std::vector<std::string> args) {
    args.insert(args.begin(), "ip");
    ProcessResult r = RunProcess(args, absl::Seconds(30));
    if (r.exit_code() != 0) std::cerr << absl::StrJoin(args, " ") << ": " << r.err;
    return r.exit_code() == 0;
  }

  std::string name_, host_if_, ns_if_, host_ip_, ns_ip_;
  bool ok_ = false;
};

class NetworkCutTest : public ClusterFixture {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "network namespaces need root";
    net_ = std::make_unique<NetworkNamespace>();
    if (!net_->ok()) GTEST_SKIP() << "cannot make a network namespace here (ip netns, veth)";
  }

  v1::JobSpec Spec() {
    v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 400);
    spec.mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints");
    spec.mutable_checkpoint()->set_every_steps(50);
    return spec;
  }

  // Cuts the link for longer than the lease, until the coordinator has
  // lost `node`, then joins it again; the job must end as a clean run did.
  void CutAndCompare(const std::string& node) {
    const std::vector<float> clean = FinalParams(Submit(Spec()));
    const std::string id = Submit(Spec());
    WaitFor(id, [](const v1::Job& job) { return job.progress().step() >= 50; });
    ASSERT_TRUE(net_->SetLink(false));
    const absl::Time give_up = absl::Now() + absl::Minutes(2);
    while (true) {
      bool lost = false;
      for (const v1::Node& n : Nodes()) lost |= n.id() == node && n.state() == v1::NODE_STATE_LOST;
      if (lost) break;
      ASSERT_LT(absl::Now(), give_up) << node << " was never lost";
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_TRUE(net_->SetLink(true));
    ExpectBitwiseEqual(FinalParams(id), clean);
    EXPECT_EQ(Get(id).recoveries(), 0) << "the node came back as the same process";
  }

  cli::LocalCluster::Options Options() {
    cli::LocalCluster::Options options;
    options.listen_host = net_->host_ip();
    options.lease = absl::Seconds(4);
    options.state_dir = dir_.path() + "/state";
    return options;
  }

  std::unique_ptr<NetworkNamespace> net_;
};

// Over mutual TLS: the cut worker's connections come back with new handshakes.
TEST_F(NetworkCutTest, AWorkerCutOffForLongerThanTheLeaseComesBack) {
  cli::LocalCluster::Options options = Options();
  options.tls_dir = dir_.path() + "/tls";
  ASSERT_NO_FATAL_FAILURE(MakeDevCertificates({options.tls_dir, "2", "2"}));
  options.wrappers["worker-1"] = net_->Exec();
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, options));
  CutAndCompare("worker-1");
}

// In plaintext, which off loopback needs --insecure.
TEST_F(NetworkCutTest, AServerCutOffForLongerThanTheLeaseComesBack) {
  cli::LocalCluster::Options options = Options();
  options.insecure = true;
  options.wrappers["server-1"] = net_->Exec();
  options.server_flags[1] = {absl::StrCat("--listen=", net_->ns_ip(), ":0")};
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, options));
  CutAndCompare("server-1");
  // No shared memory reaches a server of another network namespace: the
  // workers reached it over direct TCP connections, which the cut ended
  // or held.
  for (const char* worker : {"worker-0", "worker-1"}) {
    std::ifstream in(absl::StrCat(dir_.path(), "/", worker, ".log"));
    std::stringstream log;
    log << in.rdbuf();
    EXPECT_TRUE(absl::StrContains(log.str(), absl::StrCat(net_->ns_ip(), ":")) &&
                absl::StrContains(log.str(), "reached over a direct TCP connection"))
        << worker << ":\n" << log.str();
  }
}

}  // namespace
}  // namespace pstrain::testing
