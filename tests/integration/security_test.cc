// Mutual TLS and bearer tokens: a coordinator with certificates made by
// deploy/tls/make-dev-certs.sh, called by clients with their own channels
// (a rogue client among them), then whole clusters and psctl over TLS.
#include <sys/stat.h>

#include <limits>
#include <tuple>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "common/chunk_codec.h"
#include "common/files.h"
#include "common/rpc.h"
#include "common/status.h"
#include "common/tls.h"
#include "gtest/gtest.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "pstrain/v1/membership.grpc.pb.h"
#include "server/coordinator.h"
#include "tests/cluster_util.h"
#include "tests/integration/cluster_fixture.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"
#include "worker/transport.h"

namespace pstrain::testing {
namespace {

v1::RegisterRequest Registration(v1::NodeRole role, const std::string& node_id = "") {
  v1::RegisterRequest request;
  request.set_role(role);
  request.set_node_id(node_id);
  if (role == v1::NODE_ROLE_SERVER) request.set_address("127.0.0.1:1");
  request.set_hostname("test");
  request.set_pid(1);
  request.set_incarnation(42);
  return request;
}

absl::StatusOr<std::string> Register(const std::shared_ptr<grpc::Channel>& channel,
                                            const v1::RegisterRequest& request) {
  auto stub = v1::Membership::NewStub(channel);
  v1::RegisterResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(5));
  PSTRAIN_RETURN_IF_ERROR(FromGrpcStatus(stub->Register(&context, request, &response)));
  return response.node_id();
}

absl::StatusOr<int> CountNodes(const std::shared_ptr<grpc::Channel>& channel, const std::string& token = "") {
  auto stub = v1::Control::NewStub(channel);
  v1::ListNodesResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(5));
  AddBearerToken(context, token);
  PSTRAIN_RETURN_IF_ERROR(
      FromGrpcStatus(stub->ListNodes(&context, v1::ListNodesRequest(), &response)));
  return response.nodes_size();
}

absl::Status SubmitYaml(const std::shared_ptr<grpc::Channel>& channel, const std::string& token) {
  return SubmitJobYaml(*v1::Control::NewStub(channel), kSmallJobYaml, absl::Seconds(5), token)
      .status();
}

// One frame to a parameter server over the transport workers use; the
// stream's status.
absl::Status SendFrame(const TransportSecurity* security, const std::string& server,
                       worker::ParameterMethod method, const v1::ChunkHeader& header,
                       const std::vector<float>& payload) {
  PSTRAIN_ASSIGN_OR_RETURN(
      std::unique_ptr<worker::ParameterTransport> transport,
      worker::CreateGrpcTransport({server}, {.channels_per_server = 1, .security = security}));
  std::vector<grpc::ByteBuffer> requests;
  requests.push_back(EncodeFrame(header, payload.empty() ? nullptr : payload.data()));
  absl::Notification done;
  absl::Status result;
  transport->StartExchange(
      0, 0, method, std::move(requests), absl::Now() + absl::Seconds(10), [] {},
      [](const grpc::ByteBuffer&) {},
      [&](absl::Status status) {
        result = std::move(status);
        done.Notify();
      });
  done.WaitForNotification();
  return result;
}


// Certificates shared by the suite: `good` (the cluster's CA), `other` (a
// CA of its own) and `expired` (the cluster's CA, certificates that expired
// yesterday).
class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    const std::string good = dir_->path() + "/good", other = dir_->path() + "/other",
                      expired = dir_->path() + "/expired";
    ASSERT_NO_FATAL_FAILURE(MakeDevCertificates({good, "1", "2"}));
    ASSERT_NO_FATAL_FAILURE(MakeDevCertificates({other, "1", "2"}));
    PSTRAIN_ASSERT_OK(CopyFile(good + "/ca.crt", expired + "/ca.crt"));
    PSTRAIN_ASSERT_OK(CopyFile(good + "/ca.key", expired + "/ca.key"));
    ASSERT_NO_FATAL_FAILURE(
        MakeDevCertificates({expired, "--names", "worker-0"}, {"PSTRAIN_CERT_DAYS=-1"}));
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }

  static absl::Status CopyFile(const std::string& from, const std::string& to) {
    mkdir(to.substr(0, to.rfind('/')).c_str(), 0700);
    PSTRAIN_ASSIGN_OR_RETURN(std::string bytes, ReadFile(from));
    return WriteFileAtomically(to, bytes);
  }

  static std::string Path(const std::string& set, const std::string& file) {
    return absl::StrCat(dir_->path(), "/", set, "/", file);
  }
  static std::string Pem(const std::string& set, const std::string& file) {
    absl::StatusOr<std::string> pem = ReadFile(Path(set, file));
    PSTRAIN_EXPECT_OK(pem);
    return pem.value_or("");
  }
  static TlsFiles Files(const std::string& set, const std::string& name) {
    return {.cert = Path(set, name + ".crt"), .key = Path(set, name + ".key"),
            .ca = Path("good", "ca.crt")};
  }
  std::unique_ptr<TransportSecurity> Load(const std::string& name) {
    absl::StatusOr<std::unique_ptr<TransportSecurity>> s = TransportSecurity::Load(Files("good", name));
    PSTRAIN_EXPECT_OK(s);
    return s.ok() ? std::move(*s) : nullptr;
  }

  // Starts the coordinator with the certificate `name` (empty: plaintext).
  void StartCoordinator(std::optional<server::AuthTokens> tokens = std::nullopt,
                        const std::string& name = "coordinator") {
    if (!name.empty()) coordinator_security_ = Load(name);
    server::Coordinator::Options options;
    options.security = coordinator_security_.get();
    options.auth_tokens = std::move(tokens);
    absl::StatusOr<std::unique_ptr<server::Coordinator>> c = server::Coordinator::Create(options);
    PSTRAIN_ASSERT_OK(c);
    coordinator_ = std::move(*c);
  }
  void TearDown() override {
    if (coordinator_ != nullptr) coordinator_->Shutdown(absl::Seconds(1));
  }

  // A channel to the coordinator with `security` (this process's
  // certificate, checked as pstrain does).
  std::shared_ptr<grpc::Channel> Channel(const TransportSecurity* security) {
    return MakeChannel(coordinator_->address(),
                       {.security = security, .peer_roles = {PeerRole::kCoordinator}});
  }
  // A channel with credentials that pstrain would not load (a rogue's):
  // any key, certificate and CA; plaintext when all are empty.
  std::shared_ptr<grpc::Channel> RawChannel(const std::string& cert, const std::string& key,
                                            const std::string& ca) {
    std::shared_ptr<grpc::ChannelCredentials> credentials =
        ca.empty() ? grpc::InsecureChannelCredentials()
                   : grpc::SslCredentials({.pem_root_certs = ca,
                                           .pem_private_key = key,
                                           .pem_cert_chain = cert});
    return grpc::CreateChannel(coordinator_->address(), credentials);
  }

  static TempDir* dir_;
  std::unique_ptr<TransportSecurity> coordinator_security_;
  std::unique_ptr<server::Coordinator> coordinator_;
};

TempDir* SecurityTest::dir_ = nullptr;

TEST_F(SecurityTest, LoadingRefusesWhatAPeerWouldRefuse) {
  const auto message = [](const TlsFiles& files) {
    absl::StatusOr<std::unique_ptr<TransportSecurity>> s = TransportSecurity::Load(files);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    return std::string(s.status().message());
  };
  TlsFiles partial = Files("good", "worker-0");
  partial.ca.clear();
  EXPECT_TRUE(absl::StrContains(message(partial), "go together")) << message(partial);
  TlsFiles missing = Files("good", "worker-7");
  EXPECT_TRUE(absl::StrContains(message(missing), "--tls_cert: cannot read"));
  TlsFiles other_ca = Files("other", "worker-0");
  EXPECT_TRUE(absl::StrContains(message(other_ca), "does not verify against --tls_ca"));
  TlsFiles expired = Files("expired", "worker-0");
  EXPECT_TRUE(absl::StrContains(message(expired), "expired")) << message(expired);
  TlsFiles wrong_key = Files("good", "worker-0");
  wrong_key.key = Path("good", "worker-1.key");
  EXPECT_TRUE(absl::StrContains(message(wrong_key), "is not the key of"));
  TlsFiles not_pem = Files("good", "worker-0");
  not_pem.cert = Path("good", "auth_tokens");
  EXPECT_TRUE(absl::StrContains(message(not_pem), "not a PEM certificate"));

  std::unique_ptr<TransportSecurity> worker = Load("worker-1");
  ASSERT_NE(worker, nullptr);
  EXPECT_EQ(worker->identity().name, "worker-1");
  EXPECT_EQ(worker->identity().role, PeerRole::kWorker);
}

TEST_F(SecurityTest, CertificateNamesCarryRoles) {
  EXPECT_EQ(RoleOfName("coordinator"), PeerRole::kCoordinator);
  EXPECT_EQ(RoleOfName("server-0"), PeerRole::kServer);
  EXPECT_EQ(RoleOfName("pstrain-server-12"), PeerRole::kServer);
  EXPECT_EQ(RoleOfName("worker-3"), PeerRole::kWorker);
  EXPECT_EQ(RoleOfName("pstrain-worker-0"), PeerRole::kWorker);
  for (const char* client : {"admin", "server", "worker-", "myserver-1", "server-1a", "alice"}) {
    EXPECT_EQ(RoleOfName(client), PeerRole::kClient) << client;
  }
}

TEST_F(SecurityTest, OnlyCertificatesOfTheClustersCaThatAreValidGetIn) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator());
  // Another CA's worker certificate, a certificate of the cluster's CA that
  // has expired, and plaintext: each is refused in the handshake.
  const std::string ca = Pem("good", "ca.crt");
  for (const auto& [what, channel] :
       std::vector<std::pair<std::string, std::shared_ptr<grpc::Channel>>>{
           {"another CA", RawChannel(Pem("other", "worker-0.crt"), Pem("other", "worker-0.key"), ca)},
           {"expired", RawChannel(Pem("expired", "worker-0.crt"), Pem("expired", "worker-0.key"), ca)},
           {"no client certificate", RawChannel("", "", ca)},
           {"plaintext", RawChannel("", "", "")}}) {
    absl::StatusOr<std::string> id = Register(channel, Registration(v1::NODE_ROLE_WORKER));
    EXPECT_EQ(id.status().code(), absl::StatusCode::kUnavailable) << what << ": " << id.status();
  }
  // A valid one does, and the refused ones left nothing behind.
  std::unique_ptr<TransportSecurity> admin = Load("admin");
  absl::StatusOr<int> nodes = CountNodes(Channel(admin.get()));
  PSTRAIN_ASSERT_OK(nodes);
  EXPECT_EQ(*nodes, 0);
}

TEST_F(SecurityTest, ANodeHoldsOnlyTheRoleAndIdItsCertificateCarries) {
  ASSERT_NO_FATAL_FAILURE(StartCoordinator());
  std::unique_ptr<TransportSecurity> worker = Load("worker-0");
  std::shared_ptr<grpc::Channel> channel = Channel(worker.get());
  const auto code = [&](const v1::RegisterRequest& r) {
    return Register(channel, r).status().code();
  };
  EXPECT_EQ(code(Registration(v1::NODE_ROLE_SERVER)), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(code(Registration(v1::NODE_ROLE_SERVER, "server-0")),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(code(Registration(v1::NODE_ROLE_WORKER, "worker-1")),
            absl::StatusCode::kPermissionDenied);
  // Without an id the node gets its certificate's.
  absl::StatusOr<std::string> id = Register(channel, Registration(v1::NODE_ROLE_WORKER));
  PSTRAIN_ASSERT_OK(id);
  EXPECT_EQ(*id, "worker-0");

  // Another worker cannot heartbeat, report for or take over worker-0.
  std::unique_ptr<TransportSecurity> other = Load("worker-1");
  std::shared_ptr<grpc::Channel> other_channel = Channel(other.get());
  EXPECT_EQ(Register(other_channel, Registration(v1::NODE_ROLE_WORKER, "worker-0"))
                .status()
                .code(),
            absl::StatusCode::kPermissionDenied);
  auto membership = v1::Membership::NewStub(other_channel);
  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("worker-0");
  heartbeat.set_incarnation(42);
  v1::HeartbeatResponse reply;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(5));
  EXPECT_EQ(membership->Heartbeat(&context, heartbeat, &reply).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  v1::ReportProgressRequest report;
  report.set_node_id("worker-0");
  report.set_job_id("job-000001");
  report.set_error("forged");
  v1::ReportProgressResponse progress;
  grpc::ClientContext report_context;
  SetTimeout(report_context, absl::Seconds(5));
  EXPECT_EQ(membership->ReportProgress(&report_context, report, &progress).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);

  // A node's certificate is not a user's credential; a client certificate is.
  EXPECT_EQ(CountNodes(channel).status().code(), absl::StatusCode::kPermissionDenied);
  std::unique_ptr<TransportSecurity> admin = Load("admin");
  absl::StatusOr<int> nodes = CountNodes(Channel(admin.get()));
  PSTRAIN_ASSERT_OK(nodes);
  EXPECT_EQ(*nodes, 1);
  // And a client certificate cannot register as a node.
  EXPECT_EQ(Register(Channel(admin.get()), Registration(v1::NODE_ROLE_WORKER))
                .status()
                .code(),
            absl::StatusCode::kPermissionDenied);
}

TEST_F(SecurityTest, ANodeRefusesACoordinatorWhoseCertificateIsNotACoordinators) {
  // A coordinator that presents a server's certificate: nodes, which expect
  // a coordinator's, do not talk to it.
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(std::nullopt, "server-0"));
  std::unique_ptr<TransportSecurity> worker = Load("worker-0");
  absl::StatusOr<std::string> id =
      Register(Channel(worker.get()), Registration(v1::NODE_ROLE_WORKER));
  EXPECT_EQ(id.status().code(), absl::StatusCode::kUnavailable) << id.status();
}

TEST_F(SecurityTest, TokensDecideWhatAUserMayDo) {
  absl::StatusOr<server::AuthTokens> tokens =
      server::AuthTokens::Parse(absl::StrCat("# users\n", "viewer vera ",
                                             server::Sha256Hex("vera-token"), "\n",
                                             "operator otto ", server::Sha256Hex("otto-token"),
                                             "  # the operator\n"),
                                "tokens");
  PSTRAIN_ASSERT_OK(tokens);
  // Over plaintext on loopback: the token alone decides.
  ASSERT_NO_FATAL_FAILURE(StartCoordinator(std::move(*tokens), /*name=*/""));
  std::shared_ptr<grpc::Channel> channel = Channel(nullptr);
  EXPECT_EQ(CountNodes(channel).status().code(), absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(CountNodes(channel, "guess").status().code(),
            absl::StatusCode::kUnauthenticated);
  PSTRAIN_EXPECT_OK(CountNodes(channel, "vera-token"));
  const absl::Status viewer_submit = SubmitYaml(channel, "vera-token");
  EXPECT_EQ(viewer_submit.code(), absl::StatusCode::kPermissionDenied) << viewer_submit;
  EXPECT_TRUE(absl::StrContains(viewer_submit.message(), "vera")) << viewer_submit;
  EXPECT_EQ(SubmitYaml(channel, "").code(), absl::StatusCode::kUnauthenticated);
  PSTRAIN_EXPECT_OK(SubmitYaml(channel, "otto-token"));
}

TEST(AuthTokensTest, MalformedFilesAreRefusedNamingTheLine) {
  const std::string hash = server::Sha256Hex("t");
  EXPECT_EQ(hash, "e3b98a4da31a127d4bde6e43033f66ba274cab0eb7eb1c70ec41402bf6273dd8");
  for (const auto& [text, why] : std::vector<std::pair<std::string, std::string>>{
           {"", "no users"},
           {"# nothing\n\n", "no users"},
           {"admin root " + hash, ":1: the role must be viewer or operator"},
           {"viewer v\n", ":1: expected 'ROLE NAME SHA256'"},
           {"viewer v " + hash + "\nviewer w abc", ":2: the token's SHA-256 must be 64 hex"},
           {"viewer v " + hash + "\noperator o " + hash, ":2: the same token as user 'v'"}}) {
    absl::StatusOr<server::AuthTokens> tokens = server::AuthTokens::Parse(text, "f");
    EXPECT_EQ(tokens.status().code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StrContains(tokens.status().message(), why)) << tokens.status();
  }
  absl::StatusOr<server::AuthTokens> tokens =
      server::AuthTokens::Parse("operator o " + absl::AsciiStrToUpper(hash), "f");
  PSTRAIN_ASSERT_OK(tokens);
  ASSERT_TRUE(tokens->Find("t").has_value());
  EXPECT_EQ(tokens->Find("t")->name, "o");
  EXPECT_FALSE(tokens->Find("u").has_value());
  EXPECT_FALSE(tokens->Find("").has_value());
}

class SecuredClusterTest : public ClusterFixture {};

// A whole cluster over mutual TLS with tokens: the same job gives bitwise the
// same parameters as over plaintext, and psctl needs its credentials.
TEST_F(SecuredClusterTest, TrainsTheSameModelAsPlaintextAndPsctlNeedsItsToken) {
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 1e-3f, 2, 32, 2, 120);
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2));
  const std::vector<float> plaintext = FinalParams(Submit(spec));
  cluster_->Stop();

  const std::string tls = dir_.path() + "/tls";
  ASSERT_NO_FATAL_FAILURE(MakeDevCertificates({tls, "2", "2"}));
  cli::LocalCluster::Options options;
  options.tls_dir = tls;
  ASSERT_NO_FATAL_FAILURE(StartCluster(2, 2, options));
  const std::string id = Submit(spec);
  ExpectBitwiseEqual(FinalParams(id), plaintext);

  // psctl with the fixture's credentials (admin certificate, operator token).
  ProcessResult listed = Psctl({"list"});
  EXPECT_EQ(listed.exit_code(), 0) << listed.err;
  EXPECT_TRUE(absl::StrContains(listed.out, id)) << listed.out;
  // Without a token, or a viewer's for an operator's verb: exit 4, one line.
  const std::string coordinator = "--coordinator=" + cluster_->coordinator_address();
  const std::vector<std::string> tls_flags = {coordinator, "--tls_cert=" + tls + "/admin.crt",
                                              "--tls_key=" + tls + "/admin.key",
                                              "--tls_ca=" + tls + "/ca.crt"};
  const auto psctl = [&](std::vector<std::string> args) {
    std::vector<std::string> argv = {BinDir() + "/psctl"};
    argv.insert(argv.end(), tls_flags.begin(), tls_flags.end());
    argv.insert(argv.end(), args.begin(), args.end());
    return RunProcess(argv);
  };
  ProcessResult anonymous = psctl({"list"});
  EXPECT_EQ(anonymous.exit_code(), 4) << anonymous.err;
  EXPECT_TRUE(absl::StrContains(anonymous.err, "needs a bearer token")) << anonymous.err;
  ProcessResult viewer_cancel = psctl({"--token_file=" + tls + "/viewer.token", "cancel", id});
  EXPECT_EQ(viewer_cancel.exit_code(), 4) << viewer_cancel.err;
  EXPECT_TRUE(absl::StrContains(viewer_cancel.err, "is a viewer")) << viewer_cancel.err;
  ProcessResult viewer_get = psctl({"--token_file=" + tls + "/viewer.token", "get", id});
  EXPECT_EQ(viewer_get.exit_code(), 0) << viewer_get.err;
  // Plaintext to a TLS coordinator: unreachable (3).
  ProcessResult plain = RunProcess({BinDir() + "/psctl", coordinator, "--timeout=3", "list"});
  EXPECT_EQ(plain.exit_code(), 3) << plain.err;
  // A worker's certificate is not a user's.
  ProcessResult as_worker =
      RunProcess({BinDir() + "/psctl", coordinator, "--tls_cert=" + tls + "/worker-0.crt",
                  "--tls_key=" + tls + "/worker-0.key", "--tls_ca=" + tls + "/ca.crt",
                  "--token_file=" + tls + "/operator.token", "nodes"});
  EXPECT_EQ(as_worker.exit_code(), 0) << "a token is the user's credential: " << as_worker.err;
}

// A rogue holding a valid certificate of the cluster (worker-2, in no job)
// and a worker of the job (worker-1) each try what the first paragraph of
// the threat model lists; everything is refused, and the job ends with the
// parameters of a run nobody interfered with.
TEST_F(SecuredClusterTest, ARogueNodesAttacksAreRefusedAndChangeNothing) {
  const std::string tls = dir_.path() + "/tls";
  ASSERT_NO_FATAL_FAILURE(MakeDevCertificates({tls, "1", "3"}));
  cli::LocalCluster::Options options;
  options.tls_dir = tls;
  // Slow steps, so that the job is still running while the attacks go on.
  options.worker_flags[0] = {"--fault_injection=delay=1,min_delay_ms=25,max_delay_ms=25,seed=1"};
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 2, options));
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.05f, 2, 32, 1, 200);
  const std::vector<float> clean = FinalParams(Submit(spec));
  const std::string id = Submit(spec);
  const v1::Job running = WaitFor(id, [](const v1::Job& j) { return j.progress().step() >= 2; });
  ASSERT_EQ(running.state(), v1::JOB_STATE_RUNNING);
  const std::string server = running.server_addresses(0);
  const auto load = [&](const std::string& name) {
    absl::StatusOr<std::unique_ptr<TransportSecurity>> s = TransportSecurity::Load(
        {.cert = tls + "/" + name + ".crt", .key = tls + "/" + name + ".key",
         .ca = tls + "/ca.crt"});
    PSTRAIN_EXPECT_OK(s);
    return s.ok() ? std::move(*s) : nullptr;
  };
  const std::unique_ptr<TransportSecurity> rogue = load("worker-2");
  const std::unique_ptr<TransportSecurity> insider = load("worker-1");

  // Data plane: a well-formed push of garbage as worker 0, for the next
  // step and for step INT64_MAX (async would silence worker 0 with it), its
  // step end, and a pull of the values.
  const v1::PartitionPlan plan = PlanFor(spec);
  v1::ChunkHeader push;
  push.set_kind(v1::FRAME_KIND_PUSH);
  push.set_job_id(id);
  push.set_worker(0);
  push.set_chunk(0);
  push.set_dtype(v1::DTYPE_FP32);
  push.set_num_elements(static_cast<uint32_t>(plan.chunks(0).size()));
  push.set_generation(running.generation());
  const std::vector<float> garbage(plan.chunks(0).size(), 1e30f);
  for (int64_t step : {running.progress().step() + 1, std::numeric_limits<int64_t>::max()}) {
    push.set_step(step);
    push.set_version(step);
    for (const TransportSecurity* who : {rogue.get(), insider.get()}) {
      for (worker::ParameterMethod method :
           {worker::ParameterMethod::kPush, worker::ParameterMethod::kPushPull}) {
        const absl::Status s = SendFrame(who, server, method, push, garbage);
        EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
      }
    }
  }
  // A step end in worker 0's name that calls its gradient infinite would
  // skip the step on every server.
  v1::ChunkHeader step_end = push;
  step_end.set_kind(v1::FRAME_KIND_STEP_END);
  step_end.set_num_elements(0);
  step_end.set_step(running.progress().step() + 1);
  step_end.set_gradient_max_abs(std::numeric_limits<float>::infinity());
  for (const TransportSecurity* who : {rogue.get(), insider.get()}) {
    const absl::Status s = SendFrame(who, server, worker::ParameterMethod::kPush, step_end, {});
    EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied) << s;
  }
  v1::ChunkHeader pull = push;
  pull.set_kind(v1::FRAME_KIND_PULL);
  pull.set_num_elements(0);
  pull.set_version(0);
  EXPECT_EQ(SendFrame(rogue.get(), server, worker::ParameterMethod::kPull, pull, {}).code(),
            absl::StatusCode::kPermissionDenied);

  // Membership: a server's role, a live worker's id, a forged failure
  // report and a model upload in worker 0's name.
  const std::shared_ptr<grpc::Channel> channel =
      MakeChannel(cluster_->coordinator_address(),
                  {.security = rogue.get(), .peer_roles = {PeerRole::kCoordinator}});
  EXPECT_EQ(Register(channel, Registration(v1::NODE_ROLE_SERVER)).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Register(channel, Registration(v1::NODE_ROLE_WORKER, "worker-0")).status().code(),
            absl::StatusCode::kPermissionDenied);
  auto membership = v1::Membership::NewStub(channel);
  for (const char* as : {"worker-0", "worker-2"}) {
    v1::ReportProgressRequest report;
    report.set_node_id(as);
    report.set_job_id(id);
    report.set_worker(0);
    report.set_error("forged");
    v1::ReportProgressResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(5));
    const grpc::Status s = membership->ReportProgress(&context, report, &response);
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::PERMISSION_DENIED ||
                s.error_code() == grpc::StatusCode::INVALID_ARGUMENT)
        << as << ": " << s.error_message();
  }
  {
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(5));
    v1::UploadModelResponse response;
    auto upload = membership->UploadModel(&context, &response);
    v1::UploadModelRequest piece;
    piece.set_node_id("worker-0");
    piece.set_job_id(id);
    piece.set_data("not a model");
    upload->Write(piece);
    upload->WritesDone();
    EXPECT_EQ(upload->Finish().error_code(), grpc::StatusCode::PERMISSION_DENIED);
  }
  // Control: a node's certificate cancels nothing, with or without a
  // viewer's token.
  auto control = v1::Control::NewStub(channel);
  for (const std::string& token : {std::string(), *ReadFile(tls + "/viewer.token")}) {
    v1::CancelJobRequest cancel;
    cancel.set_job_id(id);
    v1::Job response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(5));
    AddBearerToken(context, std::string(absl::StripAsciiWhitespace(token)));
    const grpc::Status s = control->CancelJob(&context, cancel, &response);
    EXPECT_TRUE(s.error_code() == grpc::StatusCode::UNAUTHENTICATED ||
                s.error_code() == grpc::StatusCode::PERMISSION_DENIED)
        << s.error_message();
  }
  ExpectBitwiseEqual(FinalParams(id), clean);
}

class ConfinementTest : public ClusterFixture {};

// A job's data.dir and checkpoint.dir are chosen by whoever submits it but
// read and written on the nodes' machines: outside the workers'
// --data_root or the servers' --checkpoint_root the job fails, naming the
// field, before anything is read or written there.
TEST_F(ConfinementTest, DataAndCheckpointsOutsideTheNodesRootsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1));  // data root: Debian's datasets; checkpoints: dir_
  const std::string elsewhere = "/var/tmp/pstrain-confinement-test";
  v1::JobSpec data = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.05f, 1, 32, 1, 20);
  data.mutable_data()->set_dir(dir_.path());
  const v1::Job job = WaitForEnd(Submit(data));
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(job.reason(), "data.dir")) << job.reason();
  EXPECT_TRUE(absl::StrContains(job.reason(), "outside this node's --data_root")) << job.reason();
  // The servers tell the coordinator their root: a directory none of them
  // takes is refused at submit, before anything runs.
  v1::JobSpec checkpoints = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.05f, 1, 32, 1, 20);
  checkpoints.mutable_checkpoint()->set_dir(elsewhere);
  v1::SubmitJobRequest request;
  *request.mutable_spec() = checkpoints;
  v1::SubmitJobResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  const grpc::Status refused = control_->SubmitJob(&context, request, &response);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(refused.error_message(),
                                "checkpoint.dir: " + elsewhere +
                                    " lies outside every server's --checkpoint_root"))
      << refused.error_message();
  struct stat st;
  EXPECT_NE(stat(elsewhere.c_str(), &st), 0) << "the server wrote outside its root";
  // Inside the roots the same cluster trains.
  v1::JobSpec fine = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.05f, 1, 32, 1, 20);
  fine.mutable_checkpoint()->set_dir(dir_.path() + "/checkpoints");
  EXPECT_EQ(WaitForEnd(Submit(fine)).state(), v1::JOB_STATE_SUCCEEDED);
}

// A diverging job fails, instead of succeeding with "final_loss": nan: its
// gradients overflow, no overflowing one is applied, and once a chunk has
// skipped max_skipped_steps steps in a row the job fails with the reason.
TEST_F(ConfinementTest, ADivergingJobFails) {
  ASSERT_NO_FATAL_FAILURE(StartCluster(1, 1));
  // Adam's steps of 100 make gradients that overflow fp16 on the wire.
  v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 100.0f, 1, 64, 1, 200);
  spec.set_wire_dtype(v1::DTYPE_FP16);
  spec.set_max_skipped_steps(4);
  const v1::Job job = WaitForEnd(Submit(spec));
  EXPECT_EQ(job.state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(job.reason(), "4 steps in a row were skipped (max_skipped_steps)"))
      << job.reason();
}

}  // namespace
}  // namespace pstrain::testing
