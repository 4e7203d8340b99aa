// A fixture that runs a LocalCluster of real processes and talks to its
// coordinator through the control API.
#ifndef PSTRAIN_TESTS_INTEGRATION_CLUSTER_FIXTURE_H_
#define PSTRAIN_TESTS_INTEGRATION_CLUSTER_FIXTURE_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cli/local_cluster.h"
#include "common/tls.h"
#include "gtest/gtest.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "tests/integration/integration_util.h"

namespace pstrain::testing {

class ClusterFixture : public ::testing::Test {
 protected:
  // Starts a cluster and waits until all its nodes have registered. With
  // options.tls_dir the fixture's calls and psctl use that directory's admin
  // certificate and operator token.
  void StartCluster(int servers, int workers, cli::LocalCluster::Options options = {});

  std::string Submit(const v1::JobSpec& spec);
  v1::Job Get(const std::string& id);
  std::vector<v1::Node> Nodes();
  v1::Job Cancel(const std::string& id);

  // Polls the job until `done(job)`; fails the test after `patience`.
  v1::Job WaitFor(const std::string& id, const std::function<bool(const v1::Job&)>& done,
                  absl::Duration patience = absl::Minutes(3));
  v1::Job WaitForEnd(const std::string& id, absl::Duration patience = absl::Minutes(5));

  // Runs psctl against this cluster's coordinator.
  ProcessResult Psctl(const std::vector<std::string>& args);

  // Waits for the job to succeed (a test failure if it does not) and
  // returns its final parameters, from its exported model file.
  std::vector<float> FinalParams(const std::string& id, v1::Job* ended = nullptr,
                                 absl::Duration patience = absl::Minutes(5));
  // Both parameter sets are there and bitwise equal.
  static void ExpectBitwiseEqual(const std::vector<float>& actual,
                                 const std::vector<float>& clean);

  TempDir dir_;
  std::unique_ptr<cli::LocalCluster> cluster_;
  std::string tls_dir_;
  std::unique_ptr<TransportSecurity> client_security_;
  std::string token_;
  std::unique_ptr<v1::Control::Stub> control_;
};

}  // namespace pstrain::testing

#endif  // PSTRAIN_TESTS_INTEGRATION_CLUSTER_FIXTURE_H_
