// Embedding tables through the shard store: sparse pushes of every worker
// applied together at the step's end in sync mode (one at a time in async),
// sparse pulls answered with the rows once the version is reached, and
// hostile sparse frames refused with nothing changed.
#include "server/sparse_shard.h"

#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "common/sparse_frames.h"
#include "common/status.h"
#include "gtest/gtest.h"
#include "server/shard_checkpoints.h"
#include "server/shard_store.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

constexpr char kJob[] = R"(
model: {type: external, tensors: [{name: w, shape: [3]}]}
optimizer: {type: sgd, learning_rate: 0.1}
batch_size: 4
steps: 10
num_servers: 1
num_workers: 2
seed: 3
tables:
  - {name: users, dim: 2, initializer: {type: zeros}, optimizer: {type: sgd, learning_rate: 0.5}}
  - {name: items, dim: 3, optimizer: {type: adagrad, learning_rate: 0.1}}
)";

v1::ServerAssignment Assignment(const std::string& mode, int64_t items_initial_rows = 0) {
  absl::StatusOr<v1::JobSpec> parsed = ParseJobSpecYaml(std::string(kJob) + "mode: " + mode + "\n");
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  parsed->mutable_tables(1)->set_initial_rows(items_initial_rows);
  absl::StatusOr<v1::JobSpec> spec = NormalizeJobSpec(*parsed);
  EXPECT_TRUE(spec.ok()) << spec.status();
  absl::StatusOr<v1::PartitionPlan> plan =
      ComputePartitionPlan(JobTensors(*spec), spec->chunk_bytes(), spec->num_servers());
  EXPECT_TRUE(plan.ok()) << plan.status();
  v1::ServerAssignment a;
  a.set_job_id("job");
  *a.mutable_spec() = *spec;
  *a.mutable_plan() = *plan;
  a.set_generation(1);
  a.set_num_workers(2);
  return a;
}

v1::ChunkHeader Header(v1::FrameKind kind, uint32_t worker, int64_t step) {
  v1::ChunkHeader h;
  h.set_kind(kind);
  h.set_job_id("job");
  h.set_generation(1);
  h.set_worker(worker);
  h.set_step(step);
  h.set_chunk(kNoChunk);
  h.set_dtype(v1::DTYPE_FP32);
  return h;
}

Frame SparseFrame(v1::FrameKind kind, uint32_t worker, int64_t step,
                  const std::vector<SparseSection>& sections, int64_t version = 0) {
  int64_t keys = 0;
  const std::string payload = EncodeSparsePayload(
      sections, kind == v1::FRAME_KIND_SPARSE_PUSH || kind == v1::FRAME_KIND_SPARSE_INIT, &keys);
  v1::ChunkHeader h = Header(kind, worker, step);
  h.set_num_keys(static_cast<uint32_t>(keys));
  h.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
  h.set_version(version);
  absl::StatusOr<Frame> frame = Frame::Parse(EncodeFrame(h, payload.data()));
  EXPECT_TRUE(frame.ok()) << frame.status();
  return *frame;
}

SparseSection Section(uint32_t table, std::vector<uint64_t> keys, float g, int dim) {
  SparseSection s;
  s.table = table;
  s.counts.assign(keys.size(), 1);
  s.grads.assign(keys.size() * dim, g);
  s.keys = std::move(keys);
  return s;
}

class RowsWaiter final : public ChunkWaiter {
 public:
  void OnValues(const v1::ChunkHeader& request, const ChunkValues& values) override {
    EXPECT_EQ(request.kind(), v1::FRAME_KIND_SPARSE_PULL);
    version = values.version;
    const float* v = static_cast<const float*>(values.data);
    rows.assign(v, v + values.num_values);
    ++answered;
  }
  void OnAbort(const absl::Status& s) override { aborted = s; }
  bool Abandoned() const override { return false; }
  int answered = 0;
  int64_t version = -1;
  std::vector<float> rows;
  absl::Status aborted;
};

// Worker `worker`'s step end of `step`, after its (zero) push of the dense
// model's chunk 0, which sync steps move through as well.
absl::Status EndStep(ShardStore& store, uint32_t worker, int64_t step, float max_abs = 1.0f) {
  v1::ChunkHeader push = Header(v1::FRAME_KIND_PUSH, worker, step);
  push.set_chunk(0);
  push.set_version(step);
  push.set_num_elements(3);
  const float zeros[3] = {0, 0, 0};
  PSTRAIN_RETURN_IF_ERROR(store.Push(*Frame::Parse(EncodeFrame(push, zeros)), nullptr));
  v1::ChunkHeader h = Header(v1::FRAME_KIND_STEP_END, worker, step);
  h.set_gradient_max_abs(max_abs);
  return store.EndStep(h);
}

class SparseShardTest : public ::testing::Test {
 protected:
  void Start(const std::string& mode, int64_t items_initial_rows = 0) {
    const v1::ServerAssignment a = Assignment(mode, items_initial_rows);
    PSTRAIN_ASSERT_OK(store_.AddJob(a));
    // The dense model's initial values (an external model's come from worker 0).
    for (const v1::ChunkInfo& c : a.plan().chunks()) {
      v1::ChunkHeader h = Header(v1::FRAME_KIND_INIT, 0, 0);
      h.set_chunk(c.id());
      h.set_num_elements(static_cast<uint32_t>(c.size()));
      const std::vector<float> zeros(c.size(), 0.0f);
      PSTRAIN_ASSERT_OK(store_.Init(*Frame::Parse(EncodeFrame(h, zeros.data()))));
    }
  }
  std::shared_ptr<RowsWaiter> Pull(uint32_t worker, int64_t step, int64_t version,
                                   const std::vector<SparseSection>& sections) {
    auto waiter = std::make_shared<RowsWaiter>();
    PSTRAIN_EXPECT_OK(store_.SparsePull(
        SparseFrame(v1::FRAME_KIND_SPARSE_PULL, worker, step, sections, version), waiter));
    return waiter;
  }
  ShardStore store_{{}};
};

TEST_F(SparseShardTest, SyncAppliesEveryWorkersPushAtTheStepsEndInWorkerOrder) {
  Start("sync");
  // Step 0: both workers push rows of both tables; key 7 of users from both.
  PSTRAIN_ASSERT_OK(store_.SparsePush(SparseFrame(
      v1::FRAME_KIND_SPARSE_PUSH, 0, 0, {Section(0, {7, 8}, 1.0f, 2), Section(1, {5}, 1.0f, 3)})));
  PSTRAIN_ASSERT_OK(EndStep(store_, 0, 0));
  const auto early = Pull(0, 1, 1, {Section(0, {7, 8, 9}, 0, 2)});
  EXPECT_EQ(early->answered, 0);  // step 0 waits for worker 1
  PSTRAIN_ASSERT_OK(
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 1, 0, {Section(0, {7}, 2.0f, 2)})));
  EXPECT_EQ(early->answered, 0);  // and its step end
  PSTRAIN_ASSERT_OK(EndStep(store_, 1, 0, 2.0f));
  ASSERT_EQ(early->answered, 1);
  EXPECT_EQ(early->version, 1);
  // Admitted at step 0's end from zeros, each with the step's update: key
  // 7 0.5 * (1 + 2) off zero, key 8 0.5 * 1; key 9 was never pushed.
  EXPECT_EQ(early->rows, (std::vector<float>{-1.5f, -1.5f, -0.5f, -0.5f, 0.0f, 0.0f}));

  // Step 1: key 7 again from both (0.5 * (1 + 2) more), key 8 from worker 1.
  PSTRAIN_ASSERT_OK(
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 0, 1, {Section(0, {7}, 1.0f, 2)})));
  PSTRAIN_ASSERT_OK(store_.SparsePush(
      SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 1, 1, {Section(0, {7, 8}, 2.0f, 2)})));
  // A repeated push is not summed again.
  PSTRAIN_ASSERT_OK(store_.SparsePush(
      SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 1, 1, {Section(0, {7, 8}, 2.0f, 2)})));
  PSTRAIN_ASSERT_OK(EndStep(store_, 0, 1));
  PSTRAIN_ASSERT_OK(EndStep(store_, 1, 1, 2.0f));
  const auto after = Pull(1, 2, 2, {Section(0, {7, 8}, 0, 2)});
  ASSERT_EQ(after->answered, 1);
  EXPECT_EQ(after->rows, (std::vector<float>{-3.0f, -3.0f, -1.5f, -1.5f}));
  // A push of a step already applied changes nothing.
  PSTRAIN_ASSERT_OK(store_.SparsePush(
      SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 0, 1, {Section(0, {7}, 100.0f, 2)})));
  EXPECT_EQ(Pull(1, 2, 2, {Section(0, {7, 8}, 0, 2)})->rows, after->rows);
  EXPECT_EQ(store_.OpenWaits(), 0);
}

// The rows of both tables after 20 sync steps of both workers' pushes,
// on a store of `apply_threads` threads.
std::vector<float> RowsAfterSteps(int apply_threads) {
  ShardStore::Options options;
  options.apply_threads = apply_threads;
  ShardStore store(options);
  const v1::ServerAssignment a = Assignment("sync");
  EXPECT_TRUE(store.AddJob(a).ok());
  for (const v1::ChunkInfo& c : a.plan().chunks()) {
    v1::ChunkHeader h = Header(v1::FRAME_KIND_INIT, 0, 0);
    h.set_chunk(c.id());
    h.set_num_elements(static_cast<uint32_t>(c.size()));
    const std::vector<float> zeros(c.size(), 0.0f);
    EXPECT_TRUE(store.Init(*Frame::Parse(EncodeFrame(h, zeros.data()))).ok());
  }
  std::vector<uint64_t> users, items;
  for (uint64_t k = 0; k < 200; ++k) (k % 3 == 0 ? users : items).push_back(k);
  for (int64_t step = 0; step < 20; ++step) {
    for (uint32_t w = 0; w < 2; ++w) {
      const float g = 0.1f * static_cast<float>(step + 1) * (w == 0 ? 1.0f : -0.5f);
      EXPECT_TRUE(store
                      .SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, w, step,
                                              {Section(0, users, g, 2), Section(1, items, g, 3)}))
                      .ok());
      EXPECT_TRUE(EndStep(store, w, step).ok());
    }
  }
  auto waiter = std::make_shared<RowsWaiter>();
  EXPECT_TRUE(store
                  .SparsePull(SparseFrame(v1::FRAME_KIND_SPARSE_PULL, 0, 20,
                                          {Section(0, users, 0, 2), Section(1, items, 0, 3)}, 20),
                              waiter)
                  .ok());
  EXPECT_EQ(waiter->answered, 1);
  return waiter->rows;
}

TEST(SparseShardThreadsTest, TablesSteppedOnSeveralThreadsGiveBitwiseTheSameRows) {
  const std::vector<float> one = RowsAfterSteps(1);
  ASSERT_EQ(one.size(), 67u * 2 + 133u * 3);
  EXPECT_EQ(RowsAfterSteps(2), one);
  EXPECT_EQ(RowsAfterSteps(4), one);
}

TEST_F(SparseShardTest, ATableOfInitialRowsWaitsForWorker0sRowsAndKeepsTheFirst) {
  Start("sync", /*items_initial_rows=*/4);
  EXPECT_EQ(InitialRowsHeld(Assignment("sync", 4).spec(), 0, 1), 4);
  const auto init = [&](uint32_t worker, std::vector<SparseSection> sections) {
    return store_.SparseInit(SparseFrame(v1::FRAME_KIND_SPARSE_INIT, worker, 0, sections));
  };
  // Until the rows are in, the job's sparse frames are UNAVAILABLE.
  absl::Status waiting =
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 0, 0, {Section(1, {1}, 1, 3)}));
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(waiting.message(), "0 chunks and 4 table rows")) << waiting;
  // Refused, with nothing changed: another worker, a key outside the
  // rows, a table without them, a value that is not finite.
  for (const auto& [worker, section, says] :
       {std::tuple{1u, Section(1, {0}, 1, 3), "only worker 0"},
        std::tuple{0u, Section(1, {4}, 1, 3), "outside [0, 4)"},
        std::tuple{0u, Section(0, {0}, 1, 2), "has no initial_rows"},
        std::tuple{0u, Section(1, {0}, std::numeric_limits<float>::infinity(), 3),
                   "not all finite"}}) {
    const absl::Status s = init(worker, {section});
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), says)) << s;
  }
  PSTRAIN_ASSERT_OK(init(0, {Section(1, {0, 1, 2}, 7.0f, 3)}));
  EXPECT_EQ(store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 0, 0, {}))
                .code(),
            absl::StatusCode::kUnavailable);  // key 3 to come
  // A repeat keeps the first rows.
  PSTRAIN_ASSERT_OK(init(0, {Section(1, {2, 3}, 9.0f, 3)}));
  const auto rows = Pull(0, 0, 0, {Section(1, {0, 2, 3}, 0, 3)});
  ASSERT_EQ(rows->answered, 1);
  EXPECT_EQ(rows->rows, (std::vector<float>{7, 7, 7, 7, 7, 7, 9, 9, 9}));
}

TEST_F(SparseShardTest, AStepWhoseStepEndsBoundANaNIsSkipped) {
  Start("sync");
  for (int64_t step : {0, 1}) {
    for (uint32_t w : {0u, 1u}) {
      PSTRAIN_ASSERT_OK(store_.SparsePush(
          SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, w, step, {Section(0, {7}, 1.0f, 2)})));
      PSTRAIN_ASSERT_OK(EndStep(
          store_, w, step, step == 1 && w == 1 ? std::numeric_limits<float>::infinity() : 1.0f));
    }
  }
  const auto rows = Pull(0, 2, 2, {Section(0, {7}, 0, 2)});
  ASSERT_EQ(rows->answered, 1);
  // Admitted at 0 with 0.5 * (1 + 1), step 1 skipped.
  EXPECT_EQ(rows->rows, (std::vector<float>{-1.0f, -1.0f}));
}

TEST_F(SparseShardTest, AsyncAppliesEachPushOnItsOwnOnceItsStepEndIsIn) {
  Start("async");
  PSTRAIN_ASSERT_OK(
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 1, 0, {Section(0, {7}, 1.0f, 2)})));
  const auto waiting = Pull(1, 1, 0, {Section(0, {7}, 0, 2)});
  EXPECT_EQ(waiting->answered, 0);  // its own push is not applied yet
  PSTRAIN_ASSERT_OK(EndStep(store_, 1, 0));
  ASSERT_EQ(waiting->answered, 1);  // worker 0 has pushed nothing: async does not wait
  EXPECT_EQ(waiting->rows, (std::vector<float>{-0.5f, -0.5f}));
  PSTRAIN_ASSERT_OK(
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 1, 1, {Section(0, {7}, 1.0f, 2)})));
  // A push of another step while one waits for its step end is refused.
  EXPECT_EQ(
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 1, 2, {Section(0, {7}, 1.0f, 2)}))
          .code(),
      absl::StatusCode::kInvalidArgument);
  PSTRAIN_ASSERT_OK(EndStep(store_, 1, 1));
  EXPECT_EQ(Pull(1, 2, 0, {Section(0, {7}, 0, 2)})->rows, (std::vector<float>{-1.0f, -1.0f}));
}

TEST_F(SparseShardTest, HostileSparseFramesAreRefusedWithNothingChanged) {
  Start("sync");
  PSTRAIN_ASSERT_OK(
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 0, 0, {Section(0, {7}, 1.0f, 2)})));
  const auto push = [&](const std::vector<SparseSection>& sections, int num_keys_delta = 0,
                        int words_delta = 0, uint32_t worker = 1, int64_t step = 0) {
    int64_t keys = 0;
    std::string payload = EncodeSparsePayload(sections, true, &keys);
    payload.resize(payload.size() + 4 * words_delta);
    v1::ChunkHeader h = Header(v1::FRAME_KIND_SPARSE_PUSH, worker, step);
    h.set_num_keys(static_cast<uint32_t>(keys + num_keys_delta));
    h.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
    return store_.SparsePush(*Frame::Parse(EncodeFrame(h, payload.data())));
  };
  SparseSection twice = Section(0, {7, 8, 7}, 1.0f, 2);
  SparseSection zero_count = Section(0, {7}, 1.0f, 2);
  zero_count.counts[0] = 0;
  SparseSection huge_count = Section(0, {7}, 1.0f, 2);
  huge_count.counts[0] = kMaxKeyCount + 1;
  const std::vector<std::pair<absl::Status, std::string>> cases = {
      {push({Section(0, {7}, 1.0f, 2)}, 1), "the header says"},
      {push({Section(0, {7}, 1.0f, 2)}, -1), "more keys than the header's"},
      {push({Section(0, {7}, 1.0f, 3)}), "ends inside"},  // a row of dim 3 in a table of dim 2
      {push({Section(0, {7}, 1.0f, 2)}, 0, 1), "ends inside a section"},
      {push({Section(2, {7}, 1.0f, 2)}), "table 2 is not one of the job's 2"},
      {push({Section(1, {7}, 1.0f, 3), Section(0, {7}, 1.0f, 2)}), "tables must ascend"},
      {push({Section(0, {}, 1.0f, 2)}), "an empty section"},
      {push({twice}), "key 7 twice"},
      {push({zero_count}), "counted 0 times"},
      {push({huge_count}), "a count is in [1, "},
      {push({Section(0, {7}, 1.0f, 2)}, 0, 0, 2), "worker 2 outside"},
      {push({Section(0, {7}, 1.0f, 2)}, 0, 0, 1, 1), "ahead of the tables"},
  };
  for (const auto& [status, message] : cases) {
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << message;
    EXPECT_TRUE(absl::StrContains(status.message(), message)) << status << " vs " << message;
  }
  // None of them counted as worker 1's push: its real one completes step 0.
  PSTRAIN_ASSERT_OK(
      store_.SparsePush(SparseFrame(v1::FRAME_KIND_SPARSE_PUSH, 1, 0, {Section(0, {7}, 1.0f, 2)})));
  PSTRAIN_ASSERT_OK(EndStep(store_, 0, 0));
  PSTRAIN_ASSERT_OK(EndStep(store_, 1, 0));
  EXPECT_EQ(Pull(0, 1, 1, {Section(0, {7}, 0, 2)})->answered, 1);
  // A worker with no keys for this server still pushes, with no section.
  EXPECT_EQ(
      store_
          .SparsePush(*Frame::Parse(EncodeFrame(Header(v1::FRAME_KIND_SPARSE_PUSH, 0, 1), nullptr)))
          .code(),
      absl::StatusCode::kOk);  // an empty push: no keys for this server this step
}

// A checkpoint reads its rows from the table itself: every row in key
// order as the snapshot found them, whatever steps came after; ABORTED if a
// recovery reloaded the table — never a mix.
TEST(SnapshotRowsTest, TheTableAsItWasOrNothing) {
  absl::StatusOr<std::unique_ptr<SparseShard>> made =
      NewSparseShard(Assignment("sync").spec(), 2);
  PSTRAIN_ASSERT_OK(made);
  std::shared_ptr<SparseShard> shard = std::move(*made);
  auto step = [&](int64_t s, std::vector<uint64_t> keys) {
    absl::MutexLock lock(&shard->mu);
    const std::vector<uint32_t> counts(keys.size(), 1);
    const std::vector<float> grads(keys.size() * 2, 1.0f);
    PSTRAIN_ASSERT_OK(shard->tables[0]->ApplyStep(s, {SparsePush{keys, counts, grads}}).status());
    shard->version = s + 1;
  };
  step(0, {9, 2, 5});
  std::vector<SparseTable::Row> before;
  TableCheckpoint::LiveRows::Reader read;
  {
    absl::MutexLock lock(&shard->mu);
    before = shard->tables[0]->Rows();
    std::optional<SparseTable::Snapshot> snapshot = shard->tables[0]->BeginSnapshot();
    ASSERT_TRUE(snapshot.has_value());
    read = SnapshotRowsOf(shard, 0, *std::move(snapshot));
  }
  step(1, {2, 7});  // after the snapshot: key 2 moves, key 7 is new
  std::vector<SparseTable::Row> seen;
  auto collect = [&](const SparseTable::Row& row) {
    seen.push_back(row);
    return absl::OkStatus();
  };
  PSTRAIN_ASSERT_OK(read(collect));
  ASSERT_EQ(seen.size(), before.size());
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].key, before[i].key);
    EXPECT_EQ(seen[i].values, before[i].values);
  }
  EXPECT_EQ(read(collect).code(), absl::StatusCode::kFailedPrecondition);  // read once

  {
    absl::MutexLock lock(&shard->mu);
    std::optional<SparseTable::Snapshot> snapshot = shard->tables[0]->BeginSnapshot();
    ASSERT_TRUE(snapshot.has_value());  // the first ended with its reading
    read = SnapshotRowsOf(shard, 0, *std::move(snapshot));
    PSTRAIN_ASSERT_OK(shard->tables[0]->Load(before, shard->tables[0]->filter()));
  }
  seen.clear();
  EXPECT_EQ(read(collect).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(seen.empty());
}

TEST(SparseFramesTest, AKeyOfAnotherServerIsRefused) {
  uint64_t other = 0;
  while (RowServer(0, other, 2) == 0) ++other;
  SparseSection s = Section(0, {other}, 1.0f, 2);
  int64_t keys = 0;
  const std::string payload = EncodeSparsePayload({s}, true, &keys);
  v1::ChunkHeader h = Header(v1::FRAME_KIND_SPARSE_PUSH, 0, 0);
  h.set_num_keys(1);
  h.set_num_elements(static_cast<uint32_t>(payload.size() / 4));
  absl::StatusOr<std::vector<SparseSection>> decoded =
      DecodeSparseFrame(*Frame::Parse(EncodeFrame(h, payload.data())), {2, 3}, 0, 2);
  EXPECT_EQ(decoded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(decoded.status().message(), "belongs to server 1"))
      << decoded.status();
}

}  // namespace
}  // namespace pstrain::server
