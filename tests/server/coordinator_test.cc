#include "server/coordinator.h"

#include <thread>

#include "absl/strings/match.h"
#include "common/rpc.h"
#include "gtest/gtest.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "pstrain/v1/membership.grpc.pb.h"

namespace pstrain::server {
namespace {

constexpr char kValid[] = R"(
model: {type: mlp, hidden: [32]}
optimizer: {type: sgd, learning_rate: 0.1}
batch_size: 8
steps: 10
num_servers: 1
num_workers: 1
)";

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Coordinator::Options options;
    absl::StatusOr<std::unique_ptr<Coordinator>> c = Coordinator::Create(options);
    ASSERT_TRUE(c.ok()) << c.status();
    coordinator_ = std::move(*c);
    control_ = v1::Control::NewStub(MakeChannel(coordinator_->address()));
    membership_ = v1::Membership::NewStub(MakeChannel(coordinator_->address()));
  }
  void TearDown() override { coordinator_->Shutdown(absl::Seconds(1)); }

  absl::StatusOr<std::string> Submit(const std::string& yaml) {
    v1::SubmitJobRequest request;
    request.set_spec_yaml(yaml);
    v1::SubmitJobResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    absl::Status s = FromGrpcStatus(control_->SubmitJob(&context, request, &response));
    if (!s.ok()) return s;
    return response.job_id();
  }

  absl::StatusOr<v1::Job> Get(const std::string& id) {
    v1::GetJobRequest request;
    request.set_job_id(id);
    v1::Job job;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    absl::Status s = FromGrpcStatus(control_->GetJob(&context, request, &job));
    if (!s.ok()) return s;
    return job;
  }

  // Registers a node; returns its id.
  std::string Register(v1::NodeRole role, const std::string& address) {
    v1::RegisterRequest request;
    request.set_role(role);
    request.set_address(address);
    v1::RegisterResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    EXPECT_TRUE(membership_->Register(&context, request, &response).ok());
    return response.node_id();
  }

  int CountJobs() {
    v1::ListJobsRequest request;
    v1::ListJobsResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    EXPECT_TRUE(control_->ListJobs(&context, request, &response).ok());
    return response.jobs_size();
  }

  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::Membership::Stub> membership_;
};

TEST_F(CoordinatorTest, InvalidSpecsAreRejectedNamingTheFieldAndNothingIsQueued) {
  auto with = [](std::string from, std::string to) {
    std::string yaml = kValid;
    yaml.replace(yaml.find(from), from.size(), to);
    return yaml;
  };
  const std::pair<std::string, std::string> cases[] = {
      {"model: {type: mlp\n", "job spec"},
      {with("type: mlp", "type: resnet"), "model.type"},
      {with("type: sgd", "type: rmsprop"), "optimizer.type"},
      {std::string(kValid) + "steps: 11\n", "steps: duplicate key"},
      {with("num_workers: 1", "num_workers: 0"), "num_workers"},
      {with("learning_rate: 0.1", "learning_rate: -1"), "optimizer.learning_rate"},
  };
  for (const auto& [yaml, field] : cases) {
    absl::StatusOr<std::string> id = Submit(yaml);
    ASSERT_FALSE(id.ok()) << yaml;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StartsWith(id.status().message(), field)) << id.status();
  }
  EXPECT_EQ(CountJobs(), 0);
}

TEST_F(CoordinatorTest, JobWaitsForNodesAndCanBeCancelledAndWatched) {
  absl::StatusOr<std::string> id = Submit(kValid);
  ASSERT_TRUE(id.ok()) << id.status();
  EXPECT_EQ(Get(*id)->state(), v1::JOB_STATE_PENDING);  // no nodes registered

  v1::CancelJobRequest cancel;
  cancel.set_job_id(*id);
  v1::Job cancelled;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  ASSERT_TRUE(control_->CancelJob(&context, cancel, &cancelled).ok());
  EXPECT_EQ(cancelled.state(), v1::JOB_STATE_CANCELLED);

  // A watch of an ended job: its snapshot, then the stream ends.
  v1::WatchJobRequest watch;
  watch.set_job_id(*id);
  grpc::ClientContext watch_context;
  SetTimeout(watch_context, absl::Seconds(10));
  auto reader = control_->WatchJob(&watch_context, watch);
  v1::JobEvent event;
  ASSERT_TRUE(reader->Read(&event));
  ASSERT_TRUE(event.has_snapshot());
  EXPECT_EQ(event.snapshot().state(), v1::JOB_STATE_CANCELLED);
  EXPECT_FALSE(reader->Read(&event));
  EXPECT_TRUE(reader->Finish().ok());
}

TEST_F(CoordinatorTest, UnknownIdsAndBadRegistrations) {
  EXPECT_EQ(Get("job-404").status().code(), absl::StatusCode::kNotFound);

  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("worker-404");
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  EXPECT_EQ(membership_->Heartbeat(&context, heartbeat, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);

  v1::RegisterRequest server_without_address;
  server_without_address.set_role(v1::NODE_ROLE_SERVER);
  v1::RegisterResponse registered;
  grpc::ClientContext register_context;
  SetTimeout(register_context, absl::Seconds(10));
  EXPECT_EQ(membership_->Register(&register_context, server_without_address, &registered)
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorTest, AJobStartsWhenNodesRegisterAndTheirHeartbeatsCarryIt) {
  absl::StatusOr<std::string> id = Submit(kValid);
  ASSERT_TRUE(id.ok());
  const std::string server = Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  const std::string worker = Register(v1::NODE_ROLE_WORKER, "");
  absl::StatusOr<v1::Job> job = Get(*id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);

  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id(worker);
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  ASSERT_TRUE(membership_->Heartbeat(&context, heartbeat, &response).ok());
  ASSERT_EQ(response.worker_jobs_size(), 1);
  EXPECT_EQ(response.worker_jobs(0).job_id(), *id);
  EXPECT_EQ(response.worker_jobs(0).server_addresses(0), "127.0.0.1:1");
  EXPECT_GT(response.worker_jobs(0).plan().chunks_size(), 0);
}

// Watchers that come and go while progress streams in leave the coordinator
// and the watchers that stay undisturbed.
TEST_F(CoordinatorTest, WatchersLeavingMidStreamDoNotDisturbTheOthers) {
  absl::StatusOr<std::string> id = Submit(kValid);
  ASSERT_TRUE(id.ok());
  Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  const std::string worker = Register(v1::NODE_ROLE_WORKER, "");
  ASSERT_EQ(Get(*id)->state(), v1::JOB_STATE_RUNNING);

  // The watcher that stays: it must see the job succeed.
  v1::JobState last_state = v1::JOB_STATE_UNSPECIFIED;
  std::thread full_watch([&] {
    v1::WatchJobRequest request;
    request.set_job_id(*id);
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(60));
    auto reader = control_->WatchJob(&context, request);
    v1::JobEvent event;
    while (reader->Read(&event)) {
      if (event.has_state()) last_state = event.state().state();
    }
    EXPECT_TRUE(reader->Finish().ok());
  });
  std::vector<std::thread> leavers;
  for (int i = 0; i < 30; ++i) {
    leavers.emplace_back([&, i] {
      v1::WatchJobRequest request;
      request.set_job_id(*id);
      grpc::ClientContext context;
      SetTimeout(context, absl::Seconds(60));
      auto reader = control_->WatchJob(&context, request);
      v1::JobEvent event;
      for (int n = 0; n < 1 + i % 5 && reader->Read(&event); ++n) {
      }
      context.TryCancel();
      while (reader->Read(&event)) {
      }
      reader->Finish();
    });
  }
  for (int i = 1; i <= 300; ++i) {
    v1::ReportProgressRequest report;
    report.set_node_id(worker);
    report.set_job_id(*id);
    report.set_worker(0);
    report.set_step(std::min(i, 10));
    report.set_loss(1.0f / i);
    report.set_samples(8);
    report.set_seconds(0.001);
    if (i == 300) {
      report.set_finished(true);
      report.set_evaluated(true);
      report.set_test_accuracy(0.5f);
    }
    v1::ReportProgressResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    ASSERT_TRUE(membership_->ReportProgress(&context, report, &response).ok());
  }
  for (std::thread& t : leavers) t.join();
  full_watch.join();
  EXPECT_EQ(last_state, v1::JOB_STATE_SUCCEEDED);
  absl::StatusOr<v1::Job> job = Get(*id);
  ASSERT_TRUE(job.ok());
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_FLOAT_EQ(job->result().test_accuracy(), 0.5f);
}

}  // namespace
}  // namespace pstrain::server
