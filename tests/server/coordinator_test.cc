#include "server/coordinator.h"

#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/file_system.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/rpc.h"
#include "gtest/gtest.h"
#include "kernels/model.h"
#include "pstrain/v1/control.grpc.pb.h"
#include "pstrain/v1/membership.grpc.pb.h"
#include "tests/integration/integration_util.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

// The job file the tests submit, and vary.
constexpr const char* kValid = testing::kSmallJobYaml;

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(); }
  void TearDown() override { coordinator_->Shutdown(absl::Seconds(1)); }

  // (Re)starts the coordinator, with a state directory if given.
  void Start(const std::string& state_dir = "", absl::Duration lease = absl::Seconds(10),
             FileSystem* fs = nullptr) {
    if (coordinator_ != nullptr) coordinator_->Shutdown(absl::Seconds(1));
    coordinator_.reset();
    Coordinator::Options options;
    options.state_dir = state_dir;
    options.lease = lease;
    options.fs = fs;
    options.default_checkpoint_dir = default_checkpoint_dir_;
    options.limits = limits_;
    absl::StatusOr<std::unique_ptr<Coordinator>> c = Coordinator::Create(options);
    PSTRAIN_ASSERT_OK(c);
    coordinator_ = std::move(*c);
    control_ = v1::Control::NewStub(MakeChannel(coordinator_->address()));
    membership_ = v1::Membership::NewStub(MakeChannel(coordinator_->address()));
  }

  absl::StatusOr<std::string> Submit(const std::string& yaml) {
    return testing::SubmitJobYaml(*control_, yaml, absl::Seconds(10));
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

  // Registers a node as a new process, or (with the id it had) as the same
  // process again; returns its id.
  std::string Register(v1::NodeRole role, const std::string& address,
                       const std::string& previous_id = "") {
    v1::RegisterRequest request;
    request.set_role(role);
    request.set_address(address);
    request.set_node_id(previous_id);
    request.set_incarnation(previous_id.empty() ? ++last_incarnation_
                                                : incarnations_.at(previous_id));
    v1::RegisterResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    grpc::Status status = membership_->Register(&context, request, &response);
    PSTRAIN_EXPECT_OK(status);
    incarnations_[response.node_id()] = request.incarnation();
    return response.node_id();
  }

  v1::HeartbeatRequest HeartbeatOf(const std::string& node_id) {
    v1::HeartbeatRequest heartbeat;
    heartbeat.set_node_id(node_id);
    if (auto it = incarnations_.find(node_id); it != incarnations_.end()) {
      heartbeat.set_incarnation(it->second);
    }
    return heartbeat;
  }

  // The registered nodes as text, with "session" for those whose session is
  // open.
  std::string ListNodesText() {
    v1::ListNodesResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    PSTRAIN_EXPECT_OK(control_->ListNodes(&context, v1::ListNodesRequest(), &response));
    std::string text;
    for (const v1::Node& n : response.nodes()) {
      text += n.id() + (n.session_open() ? " session\n" : "\n");
    }
    return text;
  }

  // The ids of every job, newest first, listed in pages of `page_size`;
  // `between` runs after each page.
  std::vector<std::string> ListAllIds(int page_size, const std::function<void()>& between = {}) {
    std::vector<std::string> ids;
    v1::ListJobsRequest request;
    request.set_page_size(page_size);
    while (true) {
      v1::ListJobsResponse page;
      grpc::ClientContext context;
      SetTimeout(context, absl::Seconds(10));
      PSTRAIN_EXPECT_OK(control_->ListJobs(&context, request, &page));
      for (const v1::Job& job : page.jobs()) ids.push_back(job.id());
      if (between) between();
      if (page.next_page_token().empty()) return ids;
      request.set_page_token(page.next_page_token());
    }
  }

  int CountJobs() {
    v1::ListJobsRequest request;
    v1::ListJobsResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    PSTRAIN_EXPECT_OK(control_->ListJobs(&context, request, &response));
    return response.jobs_size();
  }

  // A kValid job running on a server and a worker: (its id, the worker).
  void StartJob(std::string* id, std::string* worker) {
    absl::StatusOr<std::string> submitted = Submit(kValid);
    PSTRAIN_ASSERT_OK(submitted);
    *id = *submitted;
    Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
    *worker = Register(v1::NODE_ROLE_WORKER, "");
    ASSERT_EQ(Get(*id)->state(), v1::JOB_STATE_RUNNING);
  }

  std::string default_checkpoint_dir_;  // for the next Start()
  Coordinator::Options::Limits limits_;  // for the next Start()
  std::unique_ptr<Coordinator> coordinator_;
  std::unique_ptr<v1::Control::Stub> control_;
  std::unique_ptr<v1::Membership::Stub> membership_;
  uint64_t last_incarnation_ = 1000;
  std::map<std::string, uint64_t> incarnations_;  // node id -> the process registered
};

TEST_F(CoordinatorTest, InvalidSpecsAreRejectedNamingTheFieldAndNothingIsQueued) {
  auto with = [](std::string from, std::string to) {
    std::string yaml = kValid;
    yaml.replace(yaml.find(from), from.size(), to);
    return yaml;
  };
  auto without = [&](std::string line) { return with(line + "\n", ""); };
  const std::pair<std::string, std::string> cases[] = {
      {"model: {type: mlp\n", "job spec"},                                   // does not parse
      {without("num_workers: 1"), "num_workers"},                             // missing field
      {without("optimizer: {type: sgd, learning_rate: 0.1}"), "optimizer.type"},
      {with("batch_size: 8", "batch_size: 0"), "batch_size"},                 // zero size
      {with("num_servers: 1", "num_servers: -2"), "num_servers"},             // negative
      {with("learning_rate: 0.1", "learning_rate: -1"), "optimizer.learning_rate"},
      {with("type: mlp", "type: resnet"), "model.type"},                      // unknown model
      {with("type: sgd", "type: rmsprop"), "optimizer.type"},                 // unknown optimizer
      {std::string(kValid) + "mode: eventual\n", "mode"},                     // unknown mode
      {with("hidden: [32]", "hidden: [32], input_dim: 100"), "model.input_dim"},  // data mismatch
      {with("hidden: [32]", "hidden: [32], num_classes: 12"), "model.num_classes"},
      {with("hidden: [32]", "hidden: [16384, 16384, 16384, 16384, 16384]"), "model.hidden"},
      {with("steps: 10", "steps: 10\nchunk_bytes: 128000000"), "chunk_bytes"},  // absurd
      {std::string(kValid) + "learning_rate: 1\n", "learning_rate: unknown field"},
      {std::string(kValid) + "steps: 11\n", "steps: duplicate key"},
      {with("batch_size: 8", "batch_size: eight"), "batch_size"},             // wrong type
      {with("hidden: [32]", "hidden: 32"), "model.hidden"},
  };
  for (const auto& [yaml, field] : cases) {
    absl::StatusOr<std::string> id = Submit(yaml);
    ASSERT_FALSE(id.ok()) << yaml;
    EXPECT_EQ(id.status().code(), absl::StatusCode::kInvalidArgument) << yaml;
    EXPECT_TRUE(absl::StartsWith(id.status().message(), field)) << id.status();
  }
  EXPECT_EQ(CountJobs(), 0);
}

// A deployment's checkpoint volume is where jobs that name no directory
// checkpoint; a job's own directory stays.
TEST_F(CoordinatorTest, JobsWithoutACheckpointDirGetTheDeploymentsOne) {
  default_checkpoint_dir_ = "/var/lib/pstrain/checkpoints";
  Start();
  const std::string job = kValid;
  absl::StatusOr<std::string> plain = Submit(job);
  PSTRAIN_ASSERT_OK(plain);
  absl::StatusOr<std::string> own = Submit(job + "checkpoint: {dir: /data/ckpt}\n");
  PSTRAIN_ASSERT_OK(own);
  EXPECT_EQ(Get(*plain)->spec().checkpoint().dir(), "/var/lib/pstrain/checkpoints");
  EXPECT_EQ(Get(*own)->spec().checkpoint().dir(), "/data/ckpt");
}

TEST_F(CoordinatorTest, ConcurrentSubmitsGetUniqueIdsThatSurviveARestart) {
  testing::TempDir dir;
  Start(dir.path());
  constexpr int kThreads = 8, kJobs = 50;
  std::vector<std::string> ids;
  absl::Mutex mu;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int j = t; j < kJobs; j += kThreads) {
        std::string yaml = kValid;
        yaml += "name: job-" + std::to_string(j) + "\n";
        absl::StatusOr<std::string> id = Submit(yaml);
        PSTRAIN_EXPECT_OK(id);
        absl::MutexLock lock(&mu);
        if (id.ok()) ids.push_back(*id);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  ASSERT_EQ(ids.size(), static_cast<size_t>(kJobs));
  EXPECT_EQ(std::set<std::string>(ids.begin(), ids.end()).size(), ids.size());
  EXPECT_EQ(CountJobs(), kJobs);

  Start(dir.path());  // a restart on the same state directory
  EXPECT_EQ(CountJobs(), kJobs);
  std::set<std::string> names;
  for (const std::string& id : ids) {
    absl::StatusOr<v1::Job> job = Get(id);
    PSTRAIN_ASSERT_OK(job) << id;
    EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
    names.insert(job->spec().name());
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(kJobs));
  // New ids continue after the recovered ones.
  absl::StatusOr<std::string> next = Submit(kValid);
  PSTRAIN_ASSERT_OK(next);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), *next), 0);
}

// After a restart, a running job waits for its nodes: one that registers
// again under its old id gets its work back; one that never returns is
// lost after a lease and, with no server to replace it, fails the job once
// its recovery.wait_timeout_seconds are over.
TEST_F(CoordinatorTest, ARunningJobWaitsForItsNodesAfterARestart) {
  testing::TempDir dir;
  Start(dir.path(), absl::Seconds(2));
  absl::StatusOr<std::string> first =
      Submit(std::string(kValid) + "recovery: {replace_after_seconds: 1, wait_timeout_seconds: 2}\n");
  PSTRAIN_ASSERT_OK(first);
  const std::string server = Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  const std::string worker = Register(v1::NODE_ROLE_WORKER, "");
  ASSERT_EQ(Get(*first)->state(), v1::JOB_STATE_RUNNING);

  Start(dir.path(), absl::Seconds(2));
  absl::StatusOr<v1::Job> job = Get(*first);
  PSTRAIN_ASSERT_OK(job);
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  // The worker comes back under its id; its heartbeat carries the job.
  EXPECT_EQ(Register(v1::NODE_ROLE_WORKER, "", worker), worker);
  v1::HeartbeatRequest heartbeat = HeartbeatOf(worker);
  heartbeat.add_held()->set_job_id(*first);
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(membership_->Heartbeat(&context, heartbeat, &response));
  ASSERT_EQ(response.worker_jobs_size(), 1);
  EXPECT_EQ(response.worker_jobs(0).job_id(), *first);
  // The server never does: the job fails, saying why.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (Get(*first)->state() == v1::JOB_STATE_RUNNING) {
    ASSERT_LT(absl::Now(), give_up);
    absl::SleepFor(absl::Milliseconds(50));
  }
  job = Get(*first);
  EXPECT_EQ(job->state(), v1::JOB_STATE_FAILED);
  EXPECT_TRUE(absl::StrContains(job->reason(), server)) << job->reason();
  EXPECT_TRUE(absl::StrContains(job->reason(), "not replaced within 2s")) << job->reason();
}

TEST_F(CoordinatorTest, ANodeKeepsTheIdItProposesAndAnotherProcessMustWaitForIt) {
  v1::RegisterRequest request;
  request.set_role(v1::NODE_ROLE_WORKER);
  request.set_node_id("worker-0");
  request.set_pid(42);
  request.set_hostname("h");
  request.set_incarnation(7);
  for (int attempt = 0; attempt < 2; ++attempt) {  // a retried registration
    v1::RegisterResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    PSTRAIN_ASSERT_OK(membership_->Register(&context, request, &response));
    EXPECT_EQ(response.node_id(), "worker-0");
  }
  // Another process asking for the id while this one is alive must wait.
  request.set_pid(43);
  request.set_incarnation(8);
  v1::RegisterResponse other;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  grpc::Status status = membership_->Register(&context, request, &other);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "held by a live process (pid 42"))
      << status.error_message();
  v1::ListNodesResponse nodes;
  grpc::ClientContext list_context;
  SetTimeout(list_context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(control_->ListNodes(&list_context, v1::ListNodesRequest(), &nodes));
  ASSERT_EQ(nodes.nodes_size(), 1);
  EXPECT_EQ(nodes.nodes(0).pid(), 42);
}

TEST_F(CoordinatorTest, PagesDoNotRepeatJobsSubmittedBetweenThem) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Start(dir.path()));  // ids job-000001, ...
  for (int i = 0; i < 5; ++i) PSTRAIN_ASSERT_OK(Submit(kValid));
  // Newer jobs arrive between pages.
  const std::vector<std::string> seen = ListAllIds(2, [&] { PSTRAIN_EXPECT_OK(Submit(kValid)); });
  EXPECT_EQ(seen, (std::vector<std::string>{"job-000005", "job-000004", "job-000003",
                                            "job-000002", "job-000001"}));
  v1::ListJobsRequest request;
  request.set_page_token("garbage");
  v1::ListJobsResponse page;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  EXPECT_EQ(control_->ListJobs(&context, request, &page).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorTest, JobsWaitForRoomOnTheServers) {
  v1::RegisterRequest small;
  small.set_incarnation(99);
  small.set_role(v1::NODE_ROLE_SERVER);
  small.set_address("127.0.0.1:1");
  small.set_max_memory_bytes(1000);  // far too small for the model
  v1::RegisterResponse registered;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(membership_->Register(&context, small, &registered));
  Register(v1::NODE_ROLE_WORKER, "");
  absl::StatusOr<std::string> id = Submit(kValid);
  PSTRAIN_ASSERT_OK(id);
  absl::StatusOr<v1::Job> job = Get(*id);
  EXPECT_EQ(job->state(), v1::JOB_STATE_PENDING);
  EXPECT_TRUE(absl::StrContains(job->reason(), "waiting for room")) << job->reason();
  Register(v1::NODE_ROLE_SERVER, "127.0.0.1:2");  // unlimited
  EXPECT_EQ(Get(*id)->state(), v1::JOB_STATE_RUNNING);
  EXPECT_EQ(Get(*id)->server_addresses(0), "127.0.0.1:2");
}

TEST_F(CoordinatorTest, JobWaitsForNodesAndCanBeCancelledAndWatched) {
  absl::StatusOr<std::string> id = Submit(kValid);
  PSTRAIN_ASSERT_OK(id);
  EXPECT_EQ(Get(*id)->state(), v1::JOB_STATE_PENDING);  // no nodes registered

  v1::CancelJobRequest cancel;
  cancel.set_job_id(*id);
  v1::Job cancelled;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(control_->CancelJob(&context, cancel, &cancelled));
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
  PSTRAIN_EXPECT_OK(reader->Finish());
}

TEST_F(CoordinatorTest, UnknownIdsAndBadRegistrations) {
  EXPECT_EQ(Get("job-404").status().code(), absl::StatusCode::kNotFound);

  v1::HeartbeatRequest heartbeat;
  heartbeat.set_node_id("worker-404");
  heartbeat.set_incarnation(1);
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  EXPECT_EQ(membership_->Heartbeat(&context, heartbeat, &response).error_code(),
            grpc::StatusCode::NOT_FOUND);

  v1::RegisterRequest server_without_address;
  server_without_address.set_role(v1::NODE_ROLE_SERVER);
  server_without_address.set_incarnation(5);
  v1::RegisterResponse registered;
  grpc::ClientContext register_context;
  SetTimeout(register_context, absl::Seconds(10));
  EXPECT_EQ(membership_->Register(&register_context, server_without_address, &registered)
                .error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(CoordinatorTest, AJobStartsWhenNodesRegisterAndTheirHeartbeatsCarryIt) {
  absl::StatusOr<std::string> id = Submit(kValid);
  PSTRAIN_ASSERT_OK(id);
  const std::string server = Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  const std::string worker = Register(v1::NODE_ROLE_WORKER, "");
  absl::StatusOr<v1::Job> job = Get(*id);
  PSTRAIN_ASSERT_OK(job);
  EXPECT_EQ(job->state(), v1::JOB_STATE_RUNNING);

  v1::HeartbeatRequest heartbeat = HeartbeatOf(worker);
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(membership_->Heartbeat(&context, heartbeat, &response));
  ASSERT_EQ(response.worker_jobs_size(), 1);
  EXPECT_EQ(response.worker_jobs(0).job_id(), *id);
  EXPECT_EQ(response.worker_jobs(0).server_addresses(0), "127.0.0.1:1");
  EXPECT_GT(response.worker_jobs(0).plan().chunks_size(), 0);
}

// A server that says a job cannot go on (its gradients stayed non-finite)
// fails the job with the server's reason; the server's own ids are
// checked as for every heartbeat.
TEST_F(CoordinatorTest, AServersErrorFailsTheJobWithItsReason) {
  absl::StatusOr<std::string> id = Submit(kValid);
  PSTRAIN_ASSERT_OK(id);
  const std::string server = Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  Register(v1::NODE_ROLE_WORKER, "");
  absl::StatusOr<v1::Job> job = Get(*id);
  PSTRAIN_ASSERT_OK(job);
  ASSERT_EQ(job->state(), v1::JOB_STATE_RUNNING);
  v1::HeartbeatRequest heartbeat = HeartbeatOf(server);
  v1::HeldJob* held = heartbeat.add_held();
  held->set_job_id(*id);
  held->set_generation(job->generation());
  held->set_error("10 steps in a row were skipped (max_skipped_steps)");
  v1::HeartbeatResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(membership_->Heartbeat(&context, heartbeat, &response));
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (job.ok() && job->state() == v1::JOB_STATE_RUNNING && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
    job = Get(*id);
  }
  PSTRAIN_ASSERT_OK(job);
  EXPECT_EQ(job->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(job->reason(),
            "server 0: 10 steps in a row were skipped (max_skipped_steps)");
}

// ---- Limits: each at and just past its value ----

// Without a state directory the job numbers start again at every start,
// but the ids do not repeat: nodes may still hold the old process's jobs.
TEST_F(CoordinatorTest, JobIdsAreNotReusedAcrossRestartsWithoutAStateDir) {
  absl::StatusOr<std::string> first = Submit(kValid);
  PSTRAIN_ASSERT_OK(first);
  ASSERT_NO_FATAL_FAILURE(Start());
  absl::StatusOr<std::string> second = Submit(kValid);
  PSTRAIN_ASSERT_OK(second);
  EXPECT_NE(*first, *second);
  EXPECT_TRUE(absl::EndsWith(*second, "-000001")) << *second;
}

TEST_F(CoordinatorTest, QueuedJobsAreLimited) {
  limits_.queued_jobs = 3;
  ASSERT_NO_FATAL_FAILURE(Start());
  for (int i = 0; i < 3; ++i) PSTRAIN_ASSERT_OK(Submit(kValid).status());
  absl::StatusOr<std::string> refused = Submit(kValid);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "--max_queued_jobs"))
      << refused.status();
  EXPECT_EQ(CountJobs(), 3);
  // Once one starts, there is room again.
  Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  Register(v1::NODE_ROLE_WORKER, "");
  PSTRAIN_EXPECT_OK(Submit(kValid).status());
  EXPECT_EQ(Submit(kValid).status().code(), absl::StatusCode::kResourceExhausted);
}

// Past limits.finished_jobs the oldest finished jobs are forgotten, also
// in the state directory; ids are not reused and pages still work.
TEST_F(CoordinatorTest, OnlyTheNewestFinishedJobsAreRemembered) {
  testing::TempDir dir;
  limits_.finished_jobs = 2;
  ASSERT_NO_FATAL_FAILURE(Start(dir.path()));
  std::vector<std::string> ids;
  for (int i = 0; i < 4; ++i) {
    absl::StatusOr<std::string> id = Submit(kValid);
    PSTRAIN_ASSERT_OK(id);
    ids.push_back(*id);
  }
  absl::StatusOr<std::string> pending = Submit(kValid);  // stays: not finished
  PSTRAIN_ASSERT_OK(pending);
  for (const std::string& id : ids) {
    v1::CancelJobRequest cancel;
    cancel.set_job_id(id);
    v1::Job job;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    PSTRAIN_ASSERT_OK(control_->CancelJob(&context, cancel, &job));
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (CountJobs() > 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(CountJobs(), 3);
  EXPECT_EQ(Get(ids[0]).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Get(ids[1]).status().code(), absl::StatusCode::kNotFound);
  PSTRAIN_EXPECT_OK(Get(ids[2]).status());
  PSTRAIN_EXPECT_OK(Get(ids[3]).status());
  PSTRAIN_EXPECT_OK(Get(*pending).status());

  ASSERT_NO_FATAL_FAILURE(Start(dir.path()));  // the forgotten stay forgotten
  EXPECT_EQ(CountJobs(), 3);
  EXPECT_EQ(Get(ids[1]).status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::string> next = Submit(kValid);
  PSTRAIN_ASSERT_OK(next);
  EXPECT_EQ(*next, "job-000006");

  EXPECT_EQ(ListAllIds(1), (std::vector<std::string>{"job-000006", "job-000005", "job-000004",
                                                      "job-000003"}));
}

// Five jobs on one server: the first heartbeat reply carries as many of
// their specs and plans as its budget holds (at least one); the others
// come with the next heartbeats, once the server holds the first ones.
TEST_F(CoordinatorTest, HeartbeatRepliesCarryNewJobsWithinTheirBudget) {
  const std::string spec = std::string(kValid) + "chunk_bytes: 4096\n";  // a plan of 25 chunks
  // Returns how many jobs each heartbeat of the server brings, holding
  // what the earlier ones brought.
  auto new_jobs_per_heartbeat = [&](int64_t budget) {
    limits_.heartbeat_reply_bytes = budget;
    Start();
    const std::string server = Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
    for (int i = 0; i < 5; ++i) {
      Register(v1::NODE_ROLE_WORKER, "");
      PSTRAIN_EXPECT_OK(Submit(spec));
    }
    std::vector<int> counts;
    v1::HeartbeatRequest heartbeat = HeartbeatOf(server);
    while (heartbeat.held_size() < 5 && counts.size() < 10) {
      v1::HeartbeatResponse response;
      grpc::ClientContext context;
      SetTimeout(context, absl::Seconds(10));
      PSTRAIN_EXPECT_OK(membership_->Heartbeat(&context, heartbeat, &response));
      int fresh = 0;
      for (const v1::ServerAssignment& a : response.server_jobs()) {
        if (!a.has_plan()) continue;
        ++fresh;
        v1::HeldJob* held = heartbeat.add_held();
        held->set_job_id(a.job_id());
        held->set_generation(a.generation());
      }
      counts.push_back(fresh);
    }
    return counts;
  };
  EXPECT_EQ(new_jobs_per_heartbeat(1), (std::vector<int>{1, 1, 1, 1, 1}));
  // One job's spec and plan, as the coordinator counts them.
  v1::ListJobsResponse jobs;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  PSTRAIN_ASSERT_OK(control_->ListJobs(&context, v1::ListJobsRequest(), &jobs));
  ASSERT_GT(jobs.jobs_size(), 0);
  const v1::JobSpec& normalized = jobs.jobs(0).spec();
  absl::StatusOr<v1::PartitionPlan> plan = ComputePartitionPlan(
      kernels::ModelTensors(ModelShapeOf(normalized)), normalized.chunk_bytes(), 1);
  PSTRAIN_ASSERT_OK(plan);
  const int64_t job_bytes = static_cast<int64_t>(normalized.ByteSizeLong() + plan->ByteSizeLong());
  EXPECT_EQ(new_jobs_per_heartbeat(2 * job_bytes), (std::vector<int>{2, 2, 1}));
  EXPECT_EQ(new_jobs_per_heartbeat(2 * job_bytes - 1), (std::vector<int>{1, 1, 1, 1, 1}));
}

// A model upload left open past limits.upload_timeout is cancelled, and
// worker 0 can upload again.
TEST_F(CoordinatorTest, AStalledUploadIsCancelledAndAnotherCanBegin) {
  limits_.upload_timeout = absl::Seconds(1);
  ASSERT_NO_FATAL_FAILURE(Start());
  Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  const std::string worker = Register(v1::NODE_ROLE_WORKER, "");
  absl::StatusOr<std::string> id = Submit(kValid);
  PSTRAIN_ASSERT_OK(id);
  ASSERT_EQ(Get(*id)->state(), v1::JOB_STATE_RUNNING);
  v1::UploadModelRequest first;
  first.set_node_id(worker);
  first.set_job_id(*id);
  first.set_data("PSTM");
  {
    v1::UploadModelResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(60));
    std::unique_ptr<grpc::ClientWriter<v1::UploadModelRequest>> stalled =
        membership_->UploadModel(&context, &response);
    ASSERT_TRUE(stalled->Write(first));
    // Never half-closed: only the coordinator can end it.
    EXPECT_EQ(stalled->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  v1::UploadModelResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(60));
  std::unique_ptr<grpc::ClientWriter<v1::UploadModelRequest>> again =
      membership_->UploadModel(&context, &response);
  ASSERT_TRUE(again->Write(first));
  ASSERT_TRUE(again->WritesDone());
  const grpc::Status status = again->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_TRUE(absl::StrContains(status.error_message(), "model file")) << status.error_message();
}

// A submit retried under its request id (its reply was lost) makes no
// second job, also after a restart; the id cannot name another spec.
TEST_F(CoordinatorTest, ASubmitRetriedUnderItsRequestIdMakesOneJob) {
  testing::TempDir dir;
  ASSERT_NO_FATAL_FAILURE(Start(dir.path() + "/state"));
  const auto submit = [&](const std::string& yaml, const std::string& request_id) {
    return testing::SubmitJobYaml(*control_, yaml, absl::Seconds(10), /*token=*/"", request_id);
  };
  absl::StatusOr<std::string> first = submit(kValid, "req-1");
  PSTRAIN_ASSERT_OK(first);
  EXPECT_EQ(submit(kValid, "req-1").value_or(""), *first);
  EXPECT_EQ(submit(std::string(kValid) + "seed: 9\n", "req-1").status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(submit(kValid, "req 2").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(submit(kValid, std::string(129, 'x')).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CountJobs(), 1);
  ASSERT_NO_FATAL_FAILURE(Start(dir.path() + "/state"));
  EXPECT_EQ(submit(kValid, "req-1").value_or(""), *first);
  absl::StatusOr<std::string> other = submit(kValid, "req-2");
  PSTRAIN_ASSERT_OK(other);
  EXPECT_NE(*other, *first);
  EXPECT_EQ(CountJobs(), 2);
}

// Watchers that come and go while progress streams in leave the coordinator
// and the watchers that stay undisturbed.
TEST_F(CoordinatorTest, WatchersLeavingMidStreamDoNotDisturbTheOthers) {
  std::string id, worker;
  ASSERT_NO_FATAL_FAILURE(StartJob(&id, &worker));

  // The watcher that stays: it must see the job succeed.
  v1::JobState last_state = v1::JOB_STATE_UNSPECIFIED;
  std::thread full_watch([&] {
    v1::WatchJobRequest request;
    request.set_job_id(id);
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(60));
    auto reader = control_->WatchJob(&context, request);
    v1::JobEvent event;
    while (reader->Read(&event)) {
      if (event.has_state()) last_state = event.state().state();
    }
    PSTRAIN_EXPECT_OK(reader->Finish());
  });
  std::vector<std::thread> leavers;
  for (int i = 0; i < 30; ++i) {
    leavers.emplace_back([&, i] {
      v1::WatchJobRequest request;
      request.set_job_id(id);
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
    report.set_incarnation(incarnations_.at(worker));
    report.set_generation(1);
    report.set_job_id(id);
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
    PSTRAIN_ASSERT_OK(membership_->ReportProgress(&context, report, &response));
  }
  for (std::thread& t : leavers) t.join();
  full_watch.join();
  EXPECT_EQ(last_state, v1::JOB_STATE_SUCCEEDED);
  absl::StatusOr<v1::Job> job = Get(id);
  PSTRAIN_ASSERT_OK(job);
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED);
  EXPECT_FLOAT_EQ(job->result().test_accuracy(), 0.5f);
}

// A report whose script metrics are not acceptable is refused whole: the
// worker's step and metrics stay as they were.
TEST_F(CoordinatorTest, AReportWithBadScriptMetricsIsRefusedAndChangesNothing) {
  std::string id, worker;
  ASSERT_NO_FATAL_FAILURE(StartJob(&id, &worker));
  auto report = [&](int64_t step, const std::string& name, double value) {
    v1::ReportProgressRequest r;
    r.set_node_id(worker);
    r.set_incarnation(incarnations_.at(worker));
    r.set_generation(1);
    r.set_job_id(id);
    r.set_worker(0);
    r.set_step(step);
    (*r.mutable_metrics())[name] = value;
    v1::ReportProgressResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    return FromGrpcStatus(membership_->ReportProgress(&context, r, &response));
  };
  PSTRAIN_ASSERT_OK(report(3, "mse", 0.5));
  for (const auto& [name, value] : {std::pair<std::string, double>{"no-dashes", 1.0},
                                    {"mse", std::numeric_limits<double>::infinity()}}) {
    const absl::Status refused = report(5, name, value);
    EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
    EXPECT_TRUE(absl::StrContains(refused.message(), "metrics")) << refused;
  }
  absl::StatusOr<v1::Job> job = Get(id);
  PSTRAIN_ASSERT_OK(job);
  EXPECT_EQ(job->workers(0).step(), 3);
  EXPECT_EQ(job->progress().metrics().at("mse"), 0.5);
  EXPECT_EQ(job->progress().metrics_size(), 1);
}

// The session a node keeps open: the coordinator asks for a heartbeat
// through it when the node's work changes, and once it closes another
// process may take the node's id at once, without waiting out the lease.
TEST_F(CoordinatorTest, ANodesSessionCarriesNudgesAndItsEndFreesTheId) {
  Start("", absl::Minutes(5));
  Register(v1::NODE_ROLE_SERVER, "127.0.0.1:1");
  const std::string worker = Register(v1::NODE_ROLE_WORKER, "");
  v1::SessionRequest request;
  request.set_node_id(worker);
  request.set_incarnation(incarnations_.at(worker));
  grpc::ClientContext context;
  auto reader = membership_->Session(&context, request);
  // Once the session is open, a job that starts on the worker nudges it.
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  while (!absl::StrContains(ListNodesText(), "session")) {
    ASSERT_LT(absl::Now(), give_up);
    absl::SleepFor(absl::Milliseconds(10));
  }
  PSTRAIN_ASSERT_OK(Submit(kValid));
  v1::SessionEvent event;
  EXPECT_TRUE(reader->Read(&event)) << "no nudge";
  context.TryCancel();  // as the process's death closes its connection
  reader->Finish();
  // A new process takes the id well within the 5-minute lease.
  v1::RegisterRequest again;
  again.set_role(v1::NODE_ROLE_WORKER);
  again.set_node_id(worker);
  again.set_incarnation(incarnations_.at(worker) + 1);
  while (true) {
    v1::RegisterResponse response;
    grpc::ClientContext c;
    SetTimeout(c, absl::Seconds(10));
    const grpc::Status s = membership_->Register(&c, again, &response);
    if (s.ok()) break;
    ASSERT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
    ASSERT_LT(absl::Now(), give_up) << "the id stayed held after the session closed";
    absl::SleepFor(absl::Milliseconds(20));
  }
  // The old process is fenced.
  v1::HeartbeatResponse response;
  grpc::ClientContext c;
  SetTimeout(c, absl::Seconds(10));
  EXPECT_EQ(membership_->Heartbeat(&c, HeartbeatOf(worker), &response).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

// Holds every sync of the job log until released.
class HoldingFileSystem final : public FileSystemWrapper {
 public:
  HoldingFileSystem() : FileSystemWrapper(PosixFileSystem()) {}

  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                              bool truncate) override {
    absl::StatusOr<std::unique_ptr<WritableFile>> inner = target()->OpenForAppend(path, truncate);
    if (!inner.ok() || !absl::StrContains(path, "jobs.log")) return inner;
    return std::unique_ptr<WritableFile>(new HeldFile(this, std::move(*inner)));
  }
  void Hold() {
    absl::MutexLock lock(&mu_);
    holding_ = true;
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    holding_ = false;
  }
  // Waits until a sync is being held.
  void AwaitHeldSync() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(+[](int* n) { return *n > 0; }, &held_));
  }

 private:
  class HeldFile final : public WritableFile {
   public:
    HeldFile(HoldingFileSystem* fs, std::unique_ptr<WritableFile> inner)
        : fs_(fs), inner_(std::move(inner)) {}
    absl::Status Append(absl::string_view data) override { return inner_->Append(data); }
    absl::Status Sync() override {
      {
        absl::MutexLock lock(&fs_->mu_);
        ++fs_->held_;
        fs_->mu_.Await(absl::Condition(+[](bool* holding) { return !*holding; }, &fs_->holding_));
        --fs_->held_;
      }
      return inner_->Sync();
    }
    absl::Status Truncate(int64_t size) override { return inner_->Truncate(size); }
    int64_t Size() const override { return inner_->Size(); }
    absl::Status Close() override { return inner_->Close(); }

   private:
    HoldingFileSystem* const fs_;
    const std::unique_ptr<WritableFile> inner_;
  };

  absl::Mutex mu_;
  bool holding_ ABSL_GUARDED_BY(mu_) = false;
  int held_ ABSL_GUARDED_BY(mu_) = 0;
};

// A write waits for the disk; reads never do: while a submission's sync
// hangs, GetJob, ListJobs and ListNodes answer, and the job being written
// is not shown before it is durable.
TEST_F(CoordinatorTest, ReadsDoNotWaitForTheDisk) {
  testing::TempDir dir;
  HoldingFileSystem fs;
  Start(dir.path(), absl::Seconds(10), &fs);
  absl::StatusOr<std::string> first = Submit(kValid);
  PSTRAIN_ASSERT_OK(first.status());
  fs.Hold();
  absl::StatusOr<std::string> second;
  std::thread submitter([&] { second = Submit(kValid); });
  fs.AwaitHeldSync();
  absl::StatusOr<v1::Job> job = Get(*first);
  PSTRAIN_EXPECT_OK(job.status());
  EXPECT_EQ(CountJobs(), 1) << "the job being written is not shown yet";
  v1::ListNodesResponse nodes;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(10));
  PSTRAIN_EXPECT_OK(control_->ListNodes(&context, v1::ListNodesRequest(), &nodes));
  fs.Release();
  submitter.join();
  PSTRAIN_ASSERT_OK(second.status());
  EXPECT_EQ(CountJobs(), 2);
}

// A full disk: writes are refused with UNAVAILABLE, reads are served,
// nothing acknowledged is lost, and writing resumes once there is room.
TEST_F(CoordinatorTest, AFullDiskRefusesWritesAndLosesNothingAcknowledged) {
  testing::TempDir dir;
  FaultInjectingFileSystem fs(PosixFileSystem());
  Start(dir.path(), absl::Seconds(10), &fs);
  absl::StatusOr<std::string> kept = Submit(kValid);
  PSTRAIN_ASSERT_OK(kept.status());
  for (FaultInjectingFileSystem::Fault fault :
       {FaultInjectingFileSystem::Fault::kNoSpace, FaultInjectingFileSystem::Fault::kIoError}) {
    fs.SetRule({.path_contains = "jobs.log", .fault = fault});
    absl::StatusOr<std::string> refused = Submit(kValid);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "cannot record"))
        << refused.status();
    v1::CancelJobRequest cancel;
    cancel.set_job_id(*kept);
    v1::Job cancelled;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(10));
    EXPECT_EQ(control_->CancelJob(&context, cancel, &cancelled).error_code(),
              grpc::StatusCode::UNAVAILABLE);
    EXPECT_EQ(Get(*kept)->state(), v1::JOB_STATE_PENDING) << "the refused cancel changed nothing";
    EXPECT_EQ(CountJobs(), 1);
  }
  fs.SetRule({});
  absl::StatusOr<std::string> later = Submit(kValid);
  PSTRAIN_ASSERT_OK(later.status());
  Start(dir.path());
  EXPECT_EQ(CountJobs(), 2);
  EXPECT_EQ(Get(*kept)->state(), v1::JOB_STATE_PENDING);
  PSTRAIN_EXPECT_OK(Get(*later));
}

// A job file of 64 MiB (a long data.dir, which gRPC's message limit lets
// through) is refused, and the coordinator restarts with every other job.
// A request larger than limits.request_bytes is refused before it is
// parsed; one of exactly that size is read (and refused for its content).
// The job file that once made the job log unreadable (64 MiB) cannot even
// be sent now; one just under the request limit is refused by the job
// file's own limit, and every other job survives a restart.
TEST_F(CoordinatorTest, AHugeJobFileIsRefusedAndEveryOtherJobSurvivesARestart) {
  testing::TempDir dir;
  Start(dir.path());
  absl::StatusOr<std::string> kept = Submit(kValid);
  PSTRAIN_ASSERT_OK(kept.status());
  const int limit = Coordinator::Options::Limits().request_bytes;
  auto submit_of_size = [&](size_t bytes) {
    v1::SubmitJobRequest request;
    request.set_spec_yaml(std::string(kValid) + "# " + std::string(bytes, 'x') + "\n");
    request.set_spec_yaml(std::string(kValid) + "# " +
                          std::string(bytes - (request.ByteSizeLong() - bytes), 'x') + "\n");
    EXPECT_EQ(request.ByteSizeLong(), bytes);
    v1::SubmitJobResponse response;
    grpc::ClientContext context;
    SetTimeout(context, absl::Seconds(30));
    return control_->SubmitJob(&context, request, &response);
  };
  const grpc::Status at = submit_of_size(limit);
  EXPECT_EQ(at.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << at.error_message();
  EXPECT_TRUE(absl::StartsWith(at.error_message(), "job spec:")) << at.error_message();
  EXPECT_EQ(submit_of_size(limit + 1).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(submit_of_size(64 << 20).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // A spec as a message with a path longer than any: refused by its field.
  v1::SubmitJobRequest request;
  *request.mutable_spec() = *ParseJobSpecYaml(kValid);
  request.mutable_spec()->mutable_data()->set_dir("/" + std::string(limit / 2, 'd'));
  v1::SubmitJobResponse response;
  grpc::ClientContext context;
  SetTimeout(context, absl::Seconds(30));
  const grpc::Status status = control_->SubmitJob(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StartsWith(status.error_message(), "data.dir")) << status.error_message();
  Start(dir.path());
  EXPECT_EQ(CountJobs(), 1);
  PSTRAIN_EXPECT_OK(Get(*kept));
}

}  // namespace
}  // namespace pstrain::server
