// Bad pushes over real gRPC: a clear INVALID_ARGUMENT, and nothing changes.
#include <cmath>

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

class ParameterServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    spec_ = MlpSpec(v1::OPTIMIZER_TYPE_SGD, 0.1f, 2, 8, 2, 10);
    plan_ = PlanFor(spec_);
    servers_ = std::make_unique<InProcessServers>(2, server::ShardStore::Options(), client_limits_);
    ASSERT_TRUE(servers_->AddJob("job-1", spec_, plan_).ok());
    transport_ = *worker::CreateGrpcTransport(servers_->addresses());
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
      EXPECT_TRUE(snap.ok());
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

TEST_F(ParameterServiceTest, BadPushesAreRejectedAndChangeNothing) {
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

TEST_F(ParameterServiceTest, PushAcksWithoutWaitingAndPullWaitsForTheVersion) {
  // Worker 0 pushes its step-0 gradient with Push: acknowledged at once.
  ExchangeResult pushed =
      Exchange(*transport_, 0, worker::ParameterMethod::kPush, {Frame(Push(own_chunk_))});
  ASSERT_TRUE(pushed.status.ok()) << pushed.status;
  ASSERT_EQ(pushed.replies.size(), 1u);
  EXPECT_EQ(pushed.replies[0].kind(), v1::FRAME_KIND_ACK);
  // A repeated push of the same step is acknowledged but not summed twice.
  ASSERT_TRUE(Exchange(*transport_, 0, worker::ParameterMethod::kPush, {Frame(Push(own_chunk_))})
                  .status.ok());
  EXPECT_EQ(servers_->server(0).store().ReadChunk("job-1", own_chunk_)->version, 0);

  // Worker 1's push-and-wait completes the step: version 1 comes back.
  ExchangeResult waited = Exchange(*transport_, 0, worker::ParameterMethod::kPushPull,
                                   {Frame(Push(own_chunk_, 0, 1))});
  ASSERT_TRUE(waited.status.ok()) << waited.status;
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

// A gradient with a NaN or an infinity, or workers' gradients whose sum
// could overflow, reaches no parameter: the chunk's step is skipped for
// every worker (the sync mean is never biased), and after
// max_skipped_steps skipped in a row the server reports that the job cannot
// go on (the coordinator fails it).
TEST_F(ParameterServiceTest, NonFiniteGradientsSkipTheStepAndPersistentOnesFailTheJob) {
  v1::JobSpec spec = spec_;
  spec.set_max_skipped_steps(3);
  ASSERT_TRUE(servers_->AddJob("job-nan", spec, plan_).ok());
  server::ShardStore& store = servers_->server(0).store();
  const auto push = [&](int64_t step, int worker, float odd_value) {
    v1::ChunkHeader h = Push(own_chunk_, step, worker);
    h.set_job_id("job-nan");
    std::vector<float> payload(h.num_elements(), 1.0f);
    payload[payload.size() / 2] = odd_value;
    return Exchange(*transport_, 0, worker::ParameterMethod::kPush,
                    {EncodeFrame(h, payload.data())})
        .status;
  };
  const auto error = [&] {
    for (const v1::HeldJob& held : store.Held()) {
      if (held.job_id() == "job-nan") return held.error();
    }
    return std::string("not held");
  };
  const std::vector<float> initial = store.ReadChunk("job-nan", own_chunk_)->values;

  // Step 0: worker 1's gradient has a NaN; neither worker's is applied.
  PSTRAIN_ASSERT_OK(push(0, 0, 1.0f));
  PSTRAIN_ASSERT_OK(push(0, 1, std::nanf("")));
  auto chunk = store.ReadChunk("job-nan", own_chunk_);
  EXPECT_EQ(chunk->version, 1);
  EXPECT_EQ(chunk->values, initial);
  // Step 1 is finite: applied.
  PSTRAIN_ASSERT_OK(push(1, 0, 1.0f));
  PSTRAIN_ASSERT_OK(push(1, 1, 1.0f));
  const std::vector<float> stepped = store.ReadChunk("job-nan", own_chunk_)->values;
  EXPECT_NE(stepped, initial);
  // Step 2's gradients are finite but their sum overflows fp32, step 3 has
  // an infinity: both skipped, the job goes on; the third in a row (step 4,
  // -infinity) fails it.
  for (int64_t step = 2; step <= 4; ++step) {
    EXPECT_EQ(error(), "") << "before step " << step;
    PSTRAIN_ASSERT_OK(push(step, 0, step == 2 ? 3e38f : step == 3 ? INFINITY : -INFINITY));
    PSTRAIN_ASSERT_OK(push(step, 1, step == 2 ? 3e38f : 1.0f));
  }
  chunk = store.ReadChunk("job-nan", own_chunk_);
  EXPECT_EQ(chunk->version, 5);
  EXPECT_EQ(chunk->values, stepped);
  EXPECT_TRUE(absl::StrContains(error(), "3 updates in a row (max_skipped_steps)")) << error();
}

TEST_F(ParameterServiceTest, ShutdownReleasesAWaitingPush) {
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
TEST_F(ParameterServiceTest, DestroyingAClientEndsItsUnfinishedExchanges) {
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
      *worker::CreateGrpcTransport(servers_->addresses());
  for (const v1::ChunkInfo& c : plan_.chunks()) {
    ASSERT_TRUE(Exchange(*other, c.server(), worker::ParameterMethod::kPush,
                         {Frame(Push(c.id(), 0, 1))})
                    .status.ok());
  }
  absl::SleepFor(absl::Milliseconds(200));
  for (float v : params) ASSERT_EQ(v, -7.0f);
}

// A plain Push that completes the barrier must wake the push-and-wait
// already parked there.
TEST_F(ParameterServiceTest, PushCompletingTheBarrierWakesParkedWaits) {
  auto parked = StartExchange(*transport_, 0, worker::ParameterMethod::kPushPull,
                              {Frame(Push(own_chunk_, 0, 0))});
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked());
  ASSERT_TRUE(Exchange(*transport_, 0, worker::ParameterMethod::kPush,
                       {Frame(Push(own_chunk_, 0, 1))})
                  .status.ok());
  const ExchangeResult result = parked->Await();
  EXPECT_TRUE(result.status.ok()) << result.status;
  ASSERT_EQ(result.replies.size(), 1u);
  EXPECT_EQ(result.replies[0].version(), 1);
}

TEST_F(ParameterServiceTest, RemovingTheJobEndsParkedWaitsWithAborted) {
  auto parked = StartExchange(*transport_, 0, worker::ParameterMethod::kPushPull,
                              {Frame(Push(own_chunk_))});
  ASSERT_NO_FATAL_FAILURE(WaitUntilParked());
  servers_->server(0).store().RemoveJob("job-1");
  EXPECT_EQ(parked->Await().status.code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(servers_->server(0).store().JobIds().empty());
}

// Far more requests than the stream buffers: reading pauses and resumes,
// and every request is answered.
TEST_F(ParameterServiceTest, ThousandsOfPullsOnOneStreamAreAllAnswered) {
  constexpr int kPulls = 5000;
  std::vector<grpc::ByteBuffer> frames;
  for (int i = 0; i < kPulls; ++i) {
    v1::ChunkHeader h = Push(own_chunk_);
    h.set_kind(v1::FRAME_KIND_PULL);
    h.set_num_elements(0);
    frames.push_back(EncodeFrame(h, nullptr));
  }
  ExchangeResult r = Exchange(*transport_, 0, worker::ParameterMethod::kPull, std::move(frames));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.replies.size(), static_cast<size_t>(kPulls));
}

// A client's streams and waits, at and just past their limits: refused
// with RESOURCE_EXHAUSTED before anything reaches the store.
class WaitsPerClientTest : public ParameterServiceTest {
 protected:
  WaitsPerClientTest() { client_limits_ = {.streams = 8, .owed_replies = 3}; }
};

TEST_F(WaitsPerClientTest, AtAndPastTheLimit) {
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
      *worker::CreateGrpcTransport(servers_->addresses());
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

TEST_F(StreamsPerClientTest, AtAndPastTheLimit) {
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

}  // namespace
}  // namespace pstrain::testing
