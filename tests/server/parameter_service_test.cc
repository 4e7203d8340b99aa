// Bad pushes over real gRPC: a clear INVALID_ARGUMENT, and nothing changes.
#include <array>
#include <cmath>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "common/chunk_codec.h"
#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/cluster_util.h"
#include "tests/test_util.h"
#include "worker/parameter_client.h"

namespace pstrain::testing {
namespace {

struct ExchangeResult {
  absl::Status status;
  std::vector<v1::ChunkHeader> replies;
};

// An exchange running in the background.
struct PendingExchange {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  ExchangeResult result ABSL_GUARDED_BY(mu);

  // The result once the exchange ends; fails the test after `patience`.
  ExchangeResult Await(absl::Duration patience = absl::Seconds(30)) {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(mu.AwaitWithTimeout(absl::Condition(&done), patience))
        << "the exchange did not end";
    return result;
  }
};

std::shared_ptr<PendingExchange> StartExchange(worker::ParameterTransport& transport, int server,
                                               worker::ParameterMethod method,
                                               std::vector<grpc::ByteBuffer> frames) {
  auto pending = std::make_shared<PendingExchange>();
  transport.StartExchange(
      server, /*channel=*/0, method, std::move(frames), absl::Now() + absl::Seconds(60), nullptr,
      [pending](const grpc::ByteBuffer& reply) {
        absl::StatusOr<Frame> frame = Frame::Parse(reply);
        absl::MutexLock lock(&pending->mu);
        if (frame.ok()) pending->result.replies.push_back(frame->header());
      },
      [pending](absl::Status status) {
        absl::MutexLock lock(&pending->mu);
        pending->result.status = status;
        pending->done = true;
      });
  return pending;
}

ExchangeResult Exchange(worker::ParameterTransport& transport, int server,
                        worker::ParameterMethod method, std::vector<grpc::ByteBuffer> frames) {
  return StartExchange(transport, server, method, std::move(frames))->Await();
}

// The data-plane suite runs over each way a worker reaches a server.
// kTcp: gRPC over TCP; kDirectTcp: pstrain's own TCP connections.
// kInProcess: server 0 is called directly, as a colocated worker calls the
// server of its own process (server 1 over TCP).
enum class Transport { kTcp, kDirectTcp, kSameMachineSocket, kSharedMemory, kInProcess };

std::string TransportName(const ::testing::TestParamInfo<Transport>& info) {
  switch (info.param) {
    case Transport::kTcp:
      return "Tcp";
    case Transport::kDirectTcp:
      return "DirectTcp";
    case Transport::kSameMachineSocket:
      return "SameMachineSocket";
    case Transport::kSharedMemory:
      return "SharedMemory";
    case Transport::kInProcess:
      return "InProcess";
  }
  return "";
}

const auto kEveryTransport =
    ::testing::Values(Transport::kTcp, Transport::kDirectTcp, Transport::kSameMachineSocket,
                      Transport::kSharedMemory, Transport::kInProcess);

class ParameterServiceTest : public ::testing::TestWithParam<Transport> {
 protected:
  worker::GrpcTransportOptions TransportOptions() const {
    worker::GrpcTransportOptions options;
    options.same_machine_sockets = GetParam() == Transport::kSameMachineSocket;
    options.shared_memory = GetParam() == Transport::kSharedMemory;
    options.direct_tcp = GetParam() == Transport::kDirectTcp;
    if (GetParam() == Transport::kInProcess) options.in_process = &servers_->server(0).in_process();
    return options;
  }
  std::unique_ptr<worker::ParameterTransport> NewTransport() const {
    return *worker::CreateGrpcTransport(servers_->addresses(), TransportOptions());
  }

  void SetUp() override {
    spec_ = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.1f, 2, 8, 2, 10);
    plan_ = PlanFor(spec_);
    servers_ = std::make_unique<InProcessServers>(2, server::ShardStore::Options(), client_limits_);
    PSTRAIN_ASSERT_OK(servers_->AddJob("job-1", spec_, plan_));
    const int mapped_before = SharedMemoryMappings();
    transport_ = NewTransport();
    // Shared memory is really used, not a silent fall back to a socket:
    // each connection (shm_connections to each server) maps its region
    // twice here (server and worker are in this process).
    EXPECT_EQ(SharedMemoryMappings() - mapped_before,
              GetParam() == Transport::kSharedMemory
                  ? 2 * 2 * worker::GrpcTransportOptions().shm_connections
                  : 0);
    // So are direct TCP connections: one to each server, both of its ends
    // in this process.
    for (int s = 0; s < 2; ++s) {
      const int port = servers_->server(s).direct_tcp_port();
      ASSERT_GT(port, 0);
      EXPECT_EQ(EstablishedTcpConnections(port), GetParam() == Transport::kDirectTcp ? 2 : 0)
          << "server " << s;
    }
    for (const v1::ChunkInfo& c : plan_.chunks()) {
      if (c.server() == 0 && own_chunk_ < 0) own_chunk_ = c.id();
      if (c.server() == 1 && other_chunk_ < 0) other_chunk_ = c.id();
    }
    ASSERT_GE(own_chunk_, 0);
    ASSERT_GE(other_chunk_, 0);
  }

  v1::ChunkHeader Pull(int chunk, int64_t version) {
    v1::ChunkHeader h = Push(chunk, version);
    h.set_kind(v1::FRAME_KIND_PULL);
    h.set_num_elements(0);
    return h;
  }

  v1::ChunkHeader Push(int chunk, int64_t step = 0, int worker = 0) {
    v1::ChunkHeader h;
    h.set_kind(v1::FRAME_KIND_PUSH);
    h.set_job_id("job-1");
    h.set_worker(worker);
    h.set_step(step);
    h.set_version(step);
    h.set_chunk(chunk);
    h.set_dtype(v1::DTYPE_FP32);
    h.set_num_elements(chunk < plan_.chunks_size() ? plan_.chunks(chunk).size() : 16);
    return h;
  }

  // Worker `worker` has pushed all of `step`, none of it above max_abs.
  v1::ChunkHeader StepEnd(int chunk, int64_t step, int worker, float max_abs = 1.0f) {
    v1::ChunkHeader h = Push(chunk, step, worker);
    h.set_kind(v1::FRAME_KIND_STEP_END);
    h.set_num_elements(0);
    h.set_gradient_max_abs(max_abs);
    return h;
  }

  // Both workers' step ends of `step`, to every server.
  void EndStep(worker::ParameterTransport& transport, int64_t step) {
    for (int server = 0; server < 2; ++server) {
      const int chunk = server == 0 ? own_chunk_ : other_chunk_;
      const ExchangeResult r =
          Exchange(transport, server, worker::ParameterMethod::kPush,
                   {Frame(StepEnd(chunk, step, 0)), Frame(StepEnd(chunk, step, 1))});
      PSTRAIN_ASSERT_OK(r.status);
      ASSERT_EQ(r.replies.size(), 2u);
      EXPECT_EQ(r.replies[0].kind(), v1::FRAME_KIND_ACK);
    }
  }

  // Workers 0 and 1 of a sync job, each with its own transport (a client
  // cancels its transport when it goes).
  struct Workers {
    std::vector<std::unique_ptr<worker::ParameterTransport>> transports;
    std::vector<std::unique_ptr<worker::ParameterClient>> clients;
  };
  Workers Connect(const std::string& job_id) {
    Workers workers;
    for (uint32_t w = 0; w < 2; ++w) {
      worker::ParameterClient::Options options;
      options.job_id = job_id;
      options.worker = w;
      options.plan = plan_;
      workers.transports.push_back(NewTransport());
      workers.clients.push_back(
          std::make_unique<worker::ParameterClient>(options, workers.transports[w].get()));
    }
    return workers;
  }

  // Both workers push `step`: `value` everywhere, except odd[w] at the first
  // value of chunk `odd_chunk` in worker w's gradient.
  void PushStep(Workers& workers, int64_t step, float value, int odd_chunk = 0,
                std::optional<std::array<float, 2>> odd = std::nullopt) {
    std::array<absl::Status, 2> status;
    std::vector<std::thread> threads;
    for (int w = 0; w < 2; ++w) {
      threads.emplace_back([&, w] {
        auto grad = std::make_shared<std::vector<float>>(plan_.total_floats(), value);
        if (odd.has_value()) (*grad)[plan_.chunks(odd_chunk).offset()] = (*odd)[w];
        std::vector<float> params(plan_.total_floats());
        status[w] = workers.clients[w]->PushPull(step, grad, params.data());
      });
    }
    for (std::thread& t : threads) t.join();
    PSTRAIN_EXPECT_OK(status[0]);
    PSTRAIN_EXPECT_OK(status[1]);
  }

  grpc::ByteBuffer Frame(const v1::ChunkHeader& h) {
    std::vector<float> payload(h.num_elements(), 1.0f);
    return EncodeFrame(h, payload.data());
  }

  // Waits until server 0 has `waits` pushes or pulls parked.
  void WaitUntilParked(int64_t waits = 1) {
    const absl::Time give_up = absl::Now() + absl::Seconds(20);
    while (servers_->server(0).store().OpenWaits() < waits) {
      ASSERT_LT(absl::Now(), give_up) << "nothing reached the barrier";
      absl::SleepFor(absl::Milliseconds(5));
    }
  }

  // Every chunk's version and values on both servers.
  std::vector<std::pair<int64_t, std::vector<float>>> Snapshot() {
    std::vector<std::pair<int64_t, std::vector<float>>> out;
    for (const v1::ChunkInfo& c : plan_.chunks()) {
      auto snap = servers_->server(c.server()).store().ReadChunk("job-1", c.id());
      PSTRAIN_EXPECT_OK(snap);
      out.emplace_back(snap->version, snap->values);
    }
    return out;
  }

  v1::JobSpec spec_;
  v1::PartitionPlan plan_;
  server::ClientLimits client_limits_;  // for SetUp
  std::unique_ptr<InProcessServers> servers_;
  std::unique_ptr<worker::ParameterTransport> transport_;
  int own_chunk_ = -1, other_chunk_ = -1;
};

TEST_P(ParameterServiceTest, BadPushesAreRejectedAndChangeNothing) {
  const auto before = Snapshot();
  struct Case {
    const char* what;
    grpc::ByteBuffer frame;
    absl::StatusCode code;
    const char* message;
  };
  v1::ChunkHeader short_push = Push(own_chunk_);
  short_push.set_num_elements(short_push.num_elements() - 1);
  v1::ChunkHeader other_job = Push(own_chunk_);
  other_job.set_job_id("job-nope");
  v1::ChunkHeader pull = Push(own_chunk_);
  pull.set_kind(v1::FRAME_KIND_PULL);
  pull.set_num_elements(0);
  grpc::Slice garbage("not a frame at all");
  std::vector<Case> cases;
  cases.push_back({"wrong size", Frame(short_push), absl::StatusCode::kInvalidArgument, "values"});
  cases.push_back({"unknown chunk", Frame(Push(100000)), absl::StatusCode::kInvalidArgument,
                   "unknown chunk"});
  cases.push_back({"chunk of another server", Frame(Push(other_chunk_)),
                   absl::StatusCode::kInvalidArgument, "not held"});
  cases.push_back({"step from the future", Frame(Push(own_chunk_, 5)),
                   absl::StatusCode::kInvalidArgument, "ahead of version"});
  cases.push_back({"worker out of range", Frame(Push(own_chunk_, 0, 7)),
                   absl::StatusCode::kInvalidArgument, "worker 7"});
  cases.push_back({"unknown job", Frame(other_job), absl::StatusCode::kNotFound, "job-nope"});
  cases.push_back({"pull on push-pull", EncodeFrame(pull, nullptr),
                   absl::StatusCode::kInvalidArgument, "not allowed"});
  cases.push_back({"garbage", grpc::ByteBuffer(&garbage, 1), absl::StatusCode::kInvalidArgument,
                   "frame"});
  for (Case& c : cases) {
    ExchangeResult r =
        Exchange(*transport_, 0, worker::ParameterMethod::kPushPull, {std::move(c.frame)});
    EXPECT_EQ(r.status.code(), c.code) << c.what << ": " << r.status;
    EXPECT_TRUE(absl::StrContains(r.status.message(), c.message)) << c.what << ": " << r.status;
  }
  EXPECT_EQ(Snapshot(), before);
}

TEST_P(ParameterServiceTest, PushAcksWithoutWaitingAndPullWaitsForTheVersion) {
  // Worker 0 pushes its step-0 gradient with Push: acknowledged at once.
  ExchangeResult pushed =
      Exchange(*transport_, 0, worker::ParameterMethod::kPush, {Frame(Push(own_chunk_))});
  PSTRAIN_ASSERT_OK(pushed.status);
  ASSERT_EQ(pushed.replies.size(), 1u);
  EXPECT_EQ(pushed.replies[0].kind(), v1::FRAME_KIND_ACK);
  // A repeated push of the same step is acknowledged but not summed twice.
  PSTRAIN_ASSERT_OK(
      Exchange(*transport_, 0, worker::ParameterMethod::kPush, {Frame(Push(own_chunk_))}).status);
  EXPECT_EQ(servers_->server(0).store().ReadChunk("job-1", own_chunk_)->version, 0);

  // Both workers' step ends may come before their pushes: applied nothing
  // yet, but the step waits for worker 1's push alone.
  ASSERT_NO_FATAL_FAILURE(EndStep(*transport_, 0));
  EXPECT_EQ(servers_->server(0).store().ReadChunk("job-1", own_chunk_)->version, 0);
  // Worker 1's push-and-wait completes the step: version 1 comes back.
  ExchangeResult waited = Exchange(*transport_, 0, worker::ParameterMethod::kPushPull,
                                   {Frame(Push(own_chunk_, 0, 1))});
  PSTRAIN_ASSERT_OK(waited.status);
  ASSERT_EQ(waited.replies.size(), 1u);
  EXPECT_EQ(waited.replies[0].kind(), v1::FRAME_KIND_VALUES);
  EXPECT_EQ(waited.replies[0].version(), 1);

  // Each worker's gradient of 1.0 was summed once: SGD moved every value by
  // learning_rate * 2.
  const auto after = servers_->server(0).store().ReadChunk("job-1", own_chunk_);
  std::vector<float> initial(plan_.chunks(own_chunk_).size());
  kernels::InitParams(ModelShapeOf(spec_), spec_.seed(), plan_.chunks(own_chunk_).offset(),
                      plan_.chunks(own_chunk_).offset() + initial.size(), initial.data());
  for (size_t i = 0; i < initial.size(); ++i) {
    ASSERT_FLOAT_EQ(after->values[i], initial[i] - 0.2f) << i;
  }
}

// The servers' errors for a job (empty where none), by server.
std::vector<std::string> JobErrors(InProcessServers& servers, const std::string& job_id) {
  std::vector<std::string> errors;
  for (int i = 0; i < 2; ++i) {
    errors.emplace_back("not held");
    for (const v1::HeldJob& held : servers.server(i).store().Held()) {
      if (held.job_id() == job_id) errors.back() = held.error();
    }
  }
  return errors;
}

// A step in which any worker's gradient has a NaN or an infinity anywhere,
// or whose gradients could overflow fp32 when summed, is skipped as a
// whole: no chunk of any server applies any worker's gradient of it (the
// sync mean is never biased), and after max_skipped_steps skipped in a row
// every server reports that the job cannot go on (the coordinator fails it).
TEST_P(ParameterServiceTest, ANonFiniteGradientSkipsTheStepOnEveryServer) {
  v1::JobSpec spec = spec_;
  spec.set_max_skipped_steps(3);
  PSTRAIN_ASSERT_OK(servers_->AddJob("job-nan", spec, plan_));
  Workers workers = Connect("job-nan");
  const auto step = [&](int64_t step, int odd_chunk, std::array<float, 2> odd) {
    PushStep(workers, step, 0.01f, odd_chunk, odd);
  };
  const auto versions = [&] {
    std::set<int64_t> v;
    for (const v1::ChunkInfo& c : plan_.chunks()) {
      v.insert(servers_->server(c.server()).store().ReadChunk("job-nan", c.id())->version);
    }
    return v;
  };
  const std::vector<float> initial = servers_->Gather("job-nan", plan_);

  // Step 0: worker 1's gradient has a NaN in one chunk of server 0; neither
  // worker's gradient is applied anywhere, server 1's chunks included.
  step(0, own_chunk_, {0.01f, std::nanf("")});
  EXPECT_EQ(versions(), std::set<int64_t>{1});
  EXPECT_EQ(servers_->Gather("job-nan", plan_), initial);
  // Step 1 is finite: applied on both servers.
  step(1, own_chunk_, {0.01f, 0.01f});
  const std::vector<float> stepped = servers_->Gather("job-nan", plan_);
  for (const v1::ChunkInfo& c : plan_.chunks()) {
    EXPECT_NE(stepped[c.offset()], initial[c.offset()]) << "chunk " << c.id();
  }
  // Step 2's gradients are finite but could overflow when summed, step 3
  // has an infinity (in a chunk of server 1): both skipped, the job goes on;
  // the third in a row (step 4, -infinity) fails it on both servers.
  for (int64_t s = 2; s <= 4; ++s) {
    EXPECT_EQ(JobErrors(*servers_, "job-nan"), std::vector<std::string>(2, "")) << "step " << s;
    step(s, other_chunk_,
         {s == 2 ? 3e38f : s == 3 ? INFINITY : -INFINITY, s == 2 ? 3e38f : 0.01f});
  }
  EXPECT_EQ(versions(), std::set<int64_t>{5});
  EXPECT_EQ(servers_->Gather("job-nan", plan_), stepped);
  for (const std::string& error : JobErrors(*servers_, "job-nan")) {
    EXPECT_TRUE(absl::StrContains(error, "3 steps in a row were skipped (max_skipped_steps)"))
        << error;
    EXPECT_TRUE(absl::StrContains(error, "worker 0's gradient of step 4")) << error;
  }
}

// Sync: a chunk whose pushes are all in computes its update before the
// step ends arrive (off the step's tail), but only they publish it — or
// drop it, values and optimizer state untouched, when the step is skipped.
// The same steps with the step ends first (nothing computed ahead) give
// bitwise the same parameters (Adam: its state carries over).
TEST_P(ParameterServiceTest, AnUpdateComputedAheadIsPublishedOnlyByTheStepEnds) {
  const v1::JobSpec spec = MlpSpec(v1::OPTIMIZER_TYPE_ADAM, 0.01f, 2, 8, 2, 10);
  ASSERT_EQ(PlanFor(spec).SerializeAsString(), plan_.SerializeAsString());
  for (const char* job : {"ahead", "after"}) PSTRAIN_ASSERT_OK(servers_->AddJob(job, spec, plan_));
  const auto read = [&](const std::string& job) {
    return *servers_->server(0).store().ReadChunk(job, own_chunk_);
  };
  // Both workers' pushes of `step` to every chunk of server 0.
  const auto push = [&](const std::string& job, int64_t step) {
    for (const v1::ChunkInfo& c : plan_.chunks()) {
      for (int w = 0; w < 2 && c.server() == 0; ++w) {
        v1::ChunkHeader h = Push(c.id(), step, w);
        h.set_job_id(job);
        std::vector<float> payload(h.num_elements());
        for (size_t i = 0; i < payload.size(); ++i) {
          payload[i] = 0.01f * static_cast<float>((i + w + step) % 7) - 0.03f;
        }
        PSTRAIN_ASSERT_OK(Exchange(*transport_, 0, worker::ParameterMethod::kPush,
                                   {EncodeFrame(h, payload.data())})
                              .status);
      }
    }
  };
  const auto end_step = [&](const std::string& job, int64_t step, float max_abs_1) {
    std::vector<grpc::ByteBuffer> ends;
    for (int w = 0; w < 2; ++w) {
      v1::ChunkHeader h = StepEnd(own_chunk_, step, w, w == 1 ? max_abs_1 : 1.0f);
      h.set_job_id(job);
      ends.push_back(Frame(h));
    }
    PSTRAIN_ASSERT_OK(Exchange(*transport_, 0, worker::ParameterMethod::kPush, ends).status);
  };
  const auto initial = read("ahead");
  for (int64_t step = 0; step < 3; ++step) {
    // Step 1 is skipped: worker 1's step end reports an infinity.
    const float max_abs_1 = step == 1 ? INFINITY : 1.0f;
    push("ahead", step);
    const auto staged = read("ahead");
    EXPECT_EQ(staged.version, step) << "step " << step;
    EXPECT_TRUE(staged.update_staged) << "step " << step;
    end_step("ahead", step, max_abs_1);
    end_step("after", step, max_abs_1);
    push("after", step);
    const auto ahead = read("ahead"), after = read("after");
    EXPECT_EQ(ahead.version, step + 1);
    EXPECT_FALSE(ahead.update_staged);
    EXPECT_FALSE(after.update_staged);
    EXPECT_EQ(ahead.values, after.values) << "step " << step;
    if (step == 0) {
      EXPECT_NE(ahead.values, initial.values);
    } else if (step == 1) {
      EXPECT_EQ(ahead.values, staged.values);  // skipped
    }
  }
}

// A push whose values exceed what its worker's step end said is not
// applied either: no value that is not finite reaches a parameter.
TEST_P(ParameterServiceTest, APushAboveItsStepEndIsNotApplied) {
  const auto before = servers_->server(0).store().ReadChunk("job-1", own_chunk_)->values;
  for (int w = 0; w < 2; ++w) {
    v1::ChunkHeader h = Push(own_chunk_, 0, w);
    std::vector<float> payload(h.num_elements(), 1.0f);
    if (w == 1) payload[0] = INFINITY;
    PSTRAIN_ASSERT_OK(Exchange(*transport_, 0, worker::ParameterMethod::kPush,
                               {EncodeFrame(h, payload.data()), Frame(StepEnd(own_chunk_, 0, w))})
                          .status);
  }
  const auto after = servers_->server(0).store().ReadChunk("job-1", own_chunk_);
  EXPECT_EQ(after->version, 1);
  EXPECT_EQ(after->values, before);
}

// Async: a worker's step with a NaN is skipped on every server; the other
// worker's steps are applied.
TEST_P(ParameterServiceTest, AsyncANonFiniteStepOfAWorkerIsSkippedOnEveryServer) {
  v1::JobSpec spec = spec_;
  spec.set_mode(v1::MODE_ASYNC);
  PSTRAIN_ASSERT_OK(servers_->AddJob("job-async", spec, plan_));
  std::vector<float> params(plan_.total_floats());
  const auto push = [&](uint32_t w, float odd) {
    worker::ParameterClient::Options options;
    options.job_id = "job-async";
    options.worker = w;
    options.mode = v1::MODE_ASYNC;
    options.plan = plan_;
    // (A client cancels its transport when it goes: one each.)
    std::unique_ptr<worker::ParameterTransport> transport =
        NewTransport();
    worker::ParameterClient client(options, transport.get());
    auto grad = std::make_shared<std::vector<float>>(plan_.total_floats(), 0.01f);
    (*grad)[plan_.chunks(own_chunk_).offset()] = odd;
    PSTRAIN_EXPECT_OK(client.PushPull(0, grad, params.data()));
  };
  const std::vector<float> initial = servers_->Gather("job-async", plan_);
  push(0, 0.01f);
  const std::vector<float> stepped = servers_->Gather("job-async", plan_);
  for (const v1::ChunkInfo& c : plan_.chunks()) {
    EXPECT_NE(stepped[c.offset()], initial[c.offset()]) << "chunk " << c.id();
  }
  push(1, std::nanf(""));
  EXPECT_EQ(servers_->Gather("job-async", plan_), stepped);
  for (const v1::ChunkInfo& c : plan_.chunks()) {
    EXPECT_EQ(servers_->server(c.server()).store().ReadChunk("job-async", c.id())->version, 2);
  }
}

// The servers apply the rate the job's schedule gives each step: with SGD
// and both workers pushing 1.0, every value moves by 2 * rate.
TEST_P(ParameterServiceTest, TheServersApplyTheScheduledRateOfEachStep) {
  v1::JobSpec spec = spec_;  // sgd at 0.1, 10 steps
  v1::LearningRateSchedule& schedule = *spec.mutable_optimizer()->mutable_schedule();
  schedule.set_type(v1::SCHEDULE_TYPE_STEP);
  schedule.set_warmup_steps(2);
  schedule.set_decay_every_steps(3);
  schedule.set_decay_factor(0.5f);
  PSTRAIN_ASSERT_OK(servers_->AddJob("job-lr", spec, plan_));
  Workers workers = Connect("job-lr");
  // Warm-up 0.05, 0.1; then 0.1 for three steps, 0.05 for three, 0.025.
  const double expected[] = {0.05, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025};
  for (int64_t step = 0; step < 9; ++step) {
    const std::vector<float> before = servers_->Gather("job-lr", plan_);
    PushStep(workers, step, 1.0f);
    const std::vector<float> after = servers_->Gather("job-lr", plan_);
    for (const v1::ChunkInfo& c : plan_.chunks()) {
      EXPECT_NEAR((before[c.offset()] - after[c.offset()]) / 2, expected[step], 1e-6)
          << "step " << step << ", chunk " << c.id();
    }
  }
}

TEST_P(ParameterServiceTest, ShutdownReleasesAWaitingPush) {
  // Only worker 0 pushes: the barrier never completes on its own.
  auto parked = StartExchange(*transport_, 0, worker::ParameterMethod::kPushPull,
                              {Frame(Push(own_chunk_))});
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked());
  servers_->server(0).Shutdown(absl::Seconds(5));
  EXPECT_EQ(parked->Await().status.code(), absl::StatusCode::kUnavailable);
}

// A client destroyed with an exchange never finished (a step that failed
// half-way) ends its streams: the barrier completing later writes nothing
// into the parameters, and nothing touches the destroyed client.
TEST_P(ParameterServiceTest, DestroyingAClientEndsItsUnfinishedExchanges) {
  worker::ParameterClient::Options options;
  options.job_id = "job-1";
  options.worker = 0;
  options.plan = plan_;
  auto client = std::make_unique<worker::ParameterClient>(options, transport_.get());
  std::vector<float> params(plan_.total_floats(), -7.0f);
  auto grad = std::make_shared<std::vector<float>>(plan_.total_floats(), 1.0f);
  auto unfinished = client->StartPushPull(0, grad, params.data());
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked());
  unfinished.reset();
  client.reset();

  // Worker 1 completes the barrier on both servers, over its own transport.
  std::unique_ptr<worker::ParameterTransport> other =
      NewTransport();
  for (const v1::ChunkInfo& c : plan_.chunks()) {
    PSTRAIN_ASSERT_OK(Exchange(*other, c.server(), worker::ParameterMethod::kPush,
                               {Frame(Push(c.id(), 0, 1))})
                          .status);
  }
  ASSERT_NO_FATAL_FAILURE(EndStep(*other, 0));
  absl::SleepFor(absl::Milliseconds(200));
  for (float v : params) ASSERT_EQ(v, -7.0f);
}

// A plain Push, and then the step ends, that complete the barrier must
// wake the push-and-wait already parked there.
TEST_P(ParameterServiceTest, PushCompletingTheBarrierWakesParkedWaits) {
  auto parked = StartExchange(*transport_, 0, worker::ParameterMethod::kPushPull,
                              {Frame(Push(own_chunk_, 0, 0))});
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked());
  PSTRAIN_ASSERT_OK(Exchange(*transport_, 0, worker::ParameterMethod::kPush,
                             {Frame(Push(own_chunk_, 0, 1))})
                        .status);
  EXPECT_EQ(servers_->server(0).store().OpenWaits(), 1);  // the step ends are to come
  ASSERT_NO_FATAL_FAILURE(EndStep(*transport_, 0));
  const ExchangeResult result = parked->Await();
  PSTRAIN_EXPECT_OK(result.status);
  ASSERT_EQ(result.replies.size(), 1u);
  EXPECT_EQ(result.replies[0].version(), 1);
}

TEST_P(ParameterServiceTest, RemovingTheJobEndsParkedWaitsWithAborted) {
  auto parked = StartExchange(*transport_, 0, worker::ParameterMethod::kPushPull,
                              {Frame(Push(own_chunk_))});
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked());
  servers_->server(0).store().RemoveJob("job-1");
  EXPECT_EQ(parked->Await().status.code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(servers_->server(0).store().JobIds().empty());
}

// Far more requests than the stream buffers: reading pauses and resumes,
// and every request is answered.
TEST_P(ParameterServiceTest, ThousandsOfPullsOnOneStreamAreAllAnswered) {
  constexpr int kPulls = 5000;
  std::vector<grpc::ByteBuffer> frames;
  for (int i = 0; i < kPulls; ++i) {
    v1::ChunkHeader h = Push(own_chunk_);
    h.set_kind(v1::FRAME_KIND_PULL);
    h.set_num_elements(0);
    frames.push_back(EncodeFrame(h, nullptr));
  }
  ExchangeResult r = Exchange(*transport_, 0, worker::ParameterMethod::kPull, std::move(frames));
  PSTRAIN_ASSERT_OK(r.status);
  EXPECT_EQ(r.replies.size(), static_cast<size_t>(kPulls));
}

// A client's streams and waits, at and just past their limits: refused
// with RESOURCE_EXHAUSTED before anything reaches the store.
class WaitsPerClientTest : public ParameterServiceTest {
 protected:
  WaitsPerClientTest() { client_limits_ = {.streams = 8, .owed_replies = 3}; }
};

TEST_P(WaitsPerClientTest, AtAndPastTheLimit) {
  // Three pulls of a version far ahead park (a stream sends two ahead of
  // its replies); a fourth is refused.
  auto parked = StartExchange(*transport_, 0, worker::ParameterMethod::kPull,
                              {Frame(Pull(own_chunk_, 100)), Frame(Pull(own_chunk_, 100))});
  auto parked_too = StartExchange(*transport_, 0, worker::ParameterMethod::kPull,
                                  {Frame(Pull(own_chunk_, 100))});
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked(3));
  ASSERT_EQ(servers_->server(0).store().OpenWaits(), 3);
  const ExchangeResult refused =
      Exchange(*transport_, 0, worker::ParameterMethod::kPull, {Frame(Pull(own_chunk_, 100))});
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_TRUE(absl::StrContains(refused.status.message(), "--max_waits_per_client"))
      << refused.status;
  EXPECT_EQ(servers_->server(0).store().OpenWaits(), 3);
  // Once the parked pulls are gone, the client has its budget back.
  transport_->CancelAll();
  EXPECT_EQ(parked->Await().status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(parked_too->Await().status.code(), absl::StatusCode::kCancelled);
  // (A transport is done once cancelled: a new one, of the same client.)
  std::unique_ptr<worker::ParameterTransport> again =
      NewTransport();
  ExchangeResult answered;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (absl::Now() < give_up) {
    answered = Exchange(*again, 0, worker::ParameterMethod::kPull,
                        {Frame(Pull(own_chunk_, 0)), Frame(Pull(own_chunk_, 0)),
                         Frame(Pull(own_chunk_, 0))});
    if (answered.status.code() != absl::StatusCode::kResourceExhausted) break;
    absl::SleepFor(absl::Milliseconds(20));  // the cancelled waits are still being dropped
  }
  PSTRAIN_EXPECT_OK(answered.status);
  EXPECT_EQ(answered.replies.size(), 3u);
}

class StreamsPerClientTest : public ParameterServiceTest {
 protected:
  StreamsPerClientTest() { client_limits_ = {.streams = 2, .owed_replies = 100}; }
};

TEST_P(StreamsPerClientTest, AtAndPastTheLimit) {
  auto first = StartExchange(*transport_, 0, worker::ParameterMethod::kPull,
                             {Frame(Pull(own_chunk_, 100))});
  auto second = StartExchange(*transport_, 0, worker::ParameterMethod::kPull,
                              {Frame(Pull(own_chunk_, 100))});
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked(2));
  ASSERT_EQ(servers_->server(0).store().OpenWaits(), 2);
  const ExchangeResult refused =
      Exchange(*transport_, 0, worker::ParameterMethod::kPull, {Frame(Pull(own_chunk_, 0))});
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_TRUE(absl::StrContains(refused.status.message(), "--max_streams_per_client"))
      << refused.status;
  EXPECT_EQ(servers_->server(0).store().OpenWaits(), 2);
  // The other server counts its own streams.
  PSTRAIN_EXPECT_OK(
      Exchange(*transport_, 1, worker::ParameterMethod::kPull, {Frame(Pull(other_chunk_, 0))})
          .status);
}

// Hello names the server's same-machine socket, which answers as the same
// process; without one (or with nobody there) the address stays as it is.
// (Whatever the transport: not one of the parameterised suite.)
TEST(SameMachineAddressTest, IsTheServersOwnSocket) {
  InProcessServers servers(2);
  const std::string local = worker::SameMachineAddress(servers.addresses()[0]);
  EXPECT_TRUE(absl::StartsWith(local, "unix-abstract:pstrain-server-")) << local;
  EXPECT_NE(local, worker::SameMachineAddress(servers.addresses()[1]));
  EXPECT_EQ(worker::SameMachineAddress("127.0.0.1:1", absl::Milliseconds(500)), "127.0.0.1:1");

  server::ParameterServer::Options tcp_only;
  tcp_only.local_socket = false;
  absl::StatusOr<std::unique_ptr<server::ParameterServer>> plain =
      server::ParameterServer::Create(tcp_only);
  PSTRAIN_ASSERT_OK(plain);
  EXPECT_EQ(worker::SameMachineAddress((*plain)->address()), (*plain)->address());
  (*plain)->Shutdown(absl::Seconds(1));
}

INSTANTIATE_TEST_SUITE_P(Transports, ParameterServiceTest, kEveryTransport, TransportName);
INSTANTIATE_TEST_SUITE_P(Transports, WaitsPerClientTest, kEveryTransport, TransportName);
INSTANTIATE_TEST_SUITE_P(Transports, StreamsPerClientTest, kEveryTransport, TransportName);

}  // namespace
}  // namespace pstrain::testing
