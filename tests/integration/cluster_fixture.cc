#include "tests/integration/cluster_fixture.h"

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/model_file.h"
#include "common/files.h"
#include "common/rpc.h"
#include "common/tls.h"
#include "tests/test_util.h"

namespace pstrain::testing {

void ClusterFixture::StartCluster(int servers, int workers, cli::LocalCluster::Options options) {
  options.bin_dir = BinDir();
  options.run_dir = dir_.path();
  options.num_servers = servers;
  options.num_workers = workers;
  absl::StatusOr<std::unique_ptr<cli::LocalCluster>> cluster = cli::LocalCluster::Start(options);
  PSTRAIN_ASSERT_OK(cluster);
  cluster_ = std::move(*cluster);
  tls_dir_ = options.tls_dir;
  if (!tls_dir_.empty()) {
    // psctl's credentials: the admin certificate and the operator's token.
    absl::StatusOr<std::unique_ptr<TransportSecurity>> admin = TransportSecurity::Load(
        {.cert = tls_dir_ + "/admin.crt", .key = tls_dir_ + "/admin.key", .ca = tls_dir_ + "/ca.crt"});
    PSTRAIN_ASSERT_OK(admin);
    client_security_ = std::move(*admin);
    absl::StatusOr<std::string> token = ReadFile(tls_dir_ + "/operator.token");
    if (token.ok()) token_ = std::string(absl::StripAsciiWhitespace(*token));
  }
  control_ = v1::Control::NewStub(MakeChannel(
      cluster_->coordinator_address(),
      {.security = client_security_.get(), .peer_roles = {PeerRole::kCoordinator}}));
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  std::vector<v1::Node> nodes;
  while (static_cast<int>((nodes = Nodes()).size()) < servers + workers) {
    std::optional<std::string> dead = cluster_->CheckChildren();
    ASSERT_FALSE(dead.has_value()) << "a process exited: " << *dead;
    std::string registered;
    for (const v1::Node& n : nodes) registered += " " + n.id();
    ASSERT_LT(absl::Now(), give_up) << "the nodes did not register; registered:" << registered
                                    << "; logs in " << dir_.path();
    absl::SleepFor(absl::Milliseconds(20));
  }
}

namespace {

// Runs an idempotent call until it gets through: a call sent on the
// connection of a coordinator that was just killed fails UNAVAILABLE.
template <typename Call>
grpc::Status Retrying(const std::string& token, Call call) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (true) {
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    AddBearerToken(context, token);
    context.set_wait_for_ready(true);  // wait for the coordinator to reconnect
    grpc::Status status = call(context);
    if (status.error_code() != grpc::StatusCode::UNAVAILABLE || absl::Now() > give_up) {
      return status;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

}  // namespace

std::string ClusterFixture::Submit(const v1::JobSpec& spec) {
  v1::SubmitJobRequest request;
  *request.mutable_spec() = spec;
  v1::SubmitJobResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  AddBearerToken(context, token_);
  grpc::Status status = control_->SubmitJob(&context, request, &response);
  PSTRAIN_EXPECT_OK(status);
  return response.job_id();
}

v1::Job ClusterFixture::Get(const std::string& id) {
  v1::GetJobRequest request;
  request.set_job_id(id);
  v1::Job job;
  grpc::Status status = Retrying(token_,
      [&](grpc::ClientContext& context) { return control_->GetJob(&context, request, &job); });
  PSTRAIN_EXPECT_OK(status);
  return job;
}

std::vector<v1::Node> ClusterFixture::Nodes() {
  v1::ListNodesResponse response;
  grpc::Status status = Retrying(token_, [&](grpc::ClientContext& context) {
    return control_->ListNodes(&context, v1::ListNodesRequest(), &response);
  });
  PSTRAIN_EXPECT_OK(status);
  return {response.nodes().begin(), response.nodes().end()};
}

v1::Job ClusterFixture::Cancel(const std::string& id) {
  v1::CancelJobRequest request;
  request.set_job_id(id);
  v1::Job job;
  grpc::Status status = Retrying(token_,
      [&](grpc::ClientContext& context) { return control_->CancelJob(&context, request, &job); });
  PSTRAIN_EXPECT_OK(status);
  return job;
}

v1::Job ClusterFixture::WaitFor(const std::string& id,
                                const std::function<bool(const v1::Job&)>& done,
                                absl::Duration patience) {
  const absl::Time give_up = absl::Now() + patience;
  while (true) {
    v1::Job job = Get(id);
    if (done(job)) return job;
    if (std::optional<std::string> dead = cluster_->CheckChildren()) {
      ADD_FAILURE() << "a process exited: " << *dead;
      return job;
    }
    if (absl::Now() > give_up) {
      ADD_FAILURE() << "job " << id << " did not get there within " << patience
                    << "; it is " << v1::JobState_Name(job.state()) << " " << job.reason();
      return job;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

v1::Job ClusterFixture::WaitForEnd(const std::string& id, absl::Duration patience) {
  return WaitFor(
      id, [](const v1::Job& job) { return job.state() >= v1::JOB_STATE_SUCCEEDED; }, patience);
}

ProcessResult ClusterFixture::Psctl(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {BinDir() + "/psctl",
                                   "--coordinator=" + cluster_->coordinator_address()};
  if (!tls_dir_.empty()) {
    argv.insert(argv.end(), {"--tls_cert=" + tls_dir_ + "/admin.crt",
                             "--tls_key=" + tls_dir_ + "/admin.key",
                             "--tls_ca=" + tls_dir_ + "/ca.crt"});
    if (!token_.empty()) argv.push_back("--token_file=" + tls_dir_ + "/operator.token");
  }
  argv.insert(argv.end(), args.begin(), args.end());
  return RunProcess(argv);
}

std::vector<float> ClusterFixture::FinalParams(const std::string& id, v1::Job* ended,
                                               absl::Duration patience) {
  const v1::Job job = WaitForEnd(id, patience);
  EXPECT_EQ(job.state(), v1::JOB_STATE_SUCCEEDED) << job.reason();
  if (ended != nullptr) *ended = job;
  const std::string file = absl::StrCat(dir_.path(), "/", id, ".pstm");
  ProcessResult exported = Psctl({"export", id, file});
  EXPECT_EQ(exported.exit_code(), 0) << exported.err;
  absl::StatusOr<ModelFile> model = ReadModelFile(file);
  PSTRAIN_EXPECT_OK(model);
  return model.ok() ? model->params : std::vector<float>{};
}

void ClusterFixture::ExpectBitwiseEqual(const std::vector<float>& actual,
                                        const std::vector<float>& clean) {
  ASSERT_EQ(actual.size(), clean.size());
  ASSERT_FALSE(clean.empty());
  EXPECT_EQ(0, std::memcmp(actual.data(), clean.data(), clean.size() * sizeof(float)))
      << "the final parameters differ from the run without the fault";
}

}  // namespace pstrain::testing
