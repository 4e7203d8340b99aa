// The store's pushes whose payload is borrowed (a shared-memory pipe's,
// which the peer may rewrite once the call returns): each is either summed
// during the call or copied, so that what the peer writes afterwards
// changes nothing, and the result is the bits of pushes held as received.
// And frames that name a worker outside the job, of every kind, refused.
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "common/chunk_codec.h"
#include "common/job_spec.h"
#include "common/partition.h"
#include "gtest/gtest.h"
#include "server/shard_store.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/test_util.h"

namespace pstrain::server {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

v1::ChunkHeader PushHeader(uint32_t chunk, int64_t step, uint32_t worker, uint32_t size) {
  v1::ChunkHeader h;
  h.set_kind(v1::FRAME_KIND_PUSH);
  h.set_job_id("job");
  h.set_generation(1);  // fuzz::SmallJobAssignment's
  h.set_worker(worker);
  h.set_step(step);
  h.set_version(step);
  h.set_chunk(chunk);
  h.set_dtype(v1::DTYPE_FP32);
  h.set_num_elements(size);
  return h;
}

v1::ChunkHeader StepEnd(uint32_t chunk, int64_t step, uint32_t worker) {
  v1::ChunkHeader h = PushHeader(chunk, step, worker, 0);
  h.set_kind(v1::FRAME_KIND_STEP_END);
  h.set_gradient_max_abs(1.0f);
  return h;
}

// A frame's bytes in memory the test owns and rewrites, as a peer rewrites
// its pipe.
class PeerMemory {
 public:
  // The frame of `header` and `values`, parsed where it lies.
  Frame Write(const v1::ChunkHeader& header, const std::vector<float>& values) {
    std::vector<grpc::Slice> slices;
    PSTRAIN_EXPECT_OK(EncodeFrame(header, values.data()).Dump(&slices));
    bytes_.clear();
    for (const grpc::Slice& s : slices) bytes_.insert(bytes_.end(), s.begin(), s.end());
    payload_bytes_ = values.size() * sizeof(float);
    grpc::Slice borrowed(bytes_.data(), bytes_.size(), grpc::Slice::STATIC_SLICE);
    return *Frame::Parse(grpc::ByteBuffer(&borrowed, 1));
  }
  // The peer reuses the memory: every value becomes a NaN.
  void Scribble() {
    std::memset(bytes_.data() + bytes_.size() - payload_bytes_, 0xff, payload_bytes_);
  }

 private:
  std::vector<unsigned char> bytes_;
  size_t payload_bytes_ = 0;
};

// Two stores of one job (server 0 of fuzz::SmallJobAssignment, sync, Adam)
// given the same pushes and step ends: one holds each push as received,
// the other gets it borrowed.
class BorrowedPushTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const v1::ServerAssignment a = fuzz::SmallJobAssignment("job", "sync");
    PSTRAIN_ASSERT_OK(owned_.AddJob(a));
    PSTRAIN_ASSERT_OK(borrowed_.AddJob(a));
    for (const v1::ChunkInfo& c : a.plan().chunks()) {
      if (c.server() == 0) chunks_.push_back(c);
    }
    ASSERT_FALSE(chunks_.empty());
  }

  static std::vector<float> Gradient(const v1::ChunkInfo& c, int64_t step, uint32_t worker) {
    std::vector<float> g(c.size());
    for (size_t i = 0; i < g.size(); ++i) {
      g[i] = 0.001f * static_cast<float>((i * 7 + worker * 3 + step) % 11) - 0.005f;
    }
    return g;
  }

  // Worker `worker`'s pushes of `step` (every chunk; `poison` in the middle
  // of the first if set) to both stores; the borrowed one's memory is
  // scribbled over as each call returns.
  void PushBoth(int64_t step, uint32_t worker, float poison = 0) {
    for (const v1::ChunkInfo& c : chunks_) {
      const v1::ChunkHeader h = PushHeader(c.id(), step, worker, static_cast<uint32_t>(c.size()));
      std::vector<float> g = Gradient(c, step, worker);
      if (poison != 0 && c.id() == chunks_[0].id()) g[g.size() / 2] = poison;
      const absl::Status owned = owned_.Push(*Frame::Parse(EncodeFrame(h, g.data())), nullptr);
      PSTRAIN_ASSERT_OK(owned);
      const absl::Status borrowed =
          borrowed_.Push(peer_.Write(h, g), nullptr, /*payload_borrowed=*/true);
      PSTRAIN_ASSERT_OK(borrowed);
      peer_.Scribble();
    }
  }
  void EndBoth(int64_t step, uint32_t worker) {
    for (ShardStore* store : {&owned_, &borrowed_}) {
      const absl::Status s = store->EndStep(StepEnd(chunks_[0].id(), step, worker));
      PSTRAIN_ASSERT_OK(s);
    }
  }
  std::vector<std::vector<float>> Values(const ShardStore& store, int64_t version) const {
    std::vector<std::vector<float>> values;
    for (const v1::ChunkInfo& c : chunks_) {
      const auto chunk = store.ReadChunk("job", c.id());
      PSTRAIN_EXPECT_OK(chunk);
      if (!chunk.ok()) return {};
      EXPECT_EQ(chunk->version, version) << "chunk " << c.id();
      values.push_back(chunk->values);
    }
    return values;
  }
  // Both stores at `version`, with bitwise the same values.
  void ExpectTheSame(int64_t version) {
    const auto owned = Values(owned_, version), borrowed = Values(borrowed_, version);
    ASSERT_EQ(owned.size(), borrowed.size());
    for (size_t i = 0; i < owned.size(); ++i) {
      ASSERT_EQ(owned[i].size(), borrowed[i].size());
      EXPECT_EQ(std::memcmp(owned[i].data(), borrowed[i].data(), owned[i].size() * sizeof(float)),
                0)
          << "chunk " << chunks_[i].id();
    }
  }

  ShardStore owned_{{}};
  ShardStore borrowed_{{}};
  PeerMemory peer_;
  std::vector<v1::ChunkInfo> chunks_;
};

TEST_F(BorrowedPushTest, APushIsSummedDuringTheCallOrCopied) {
  const auto initial = Values(borrowed_, 0);
  // Step 0: worker 0's pushes wait for worker 1's (copied); worker 1's
  // complete them before any step end (each summed from where it lies into
  // the staged update).
  PushBoth(0, 0);
  PushBoth(0, 1);
  EndBoth(0, 0);
  EndBoth(0, 1);
  ExpectTheSame(1);
  // Step 1: the step ends come first; the last pushes complete the step
  // (summed, checked and published during the call).
  EndBoth(1, 0);
  EndBoth(1, 1);
  PushBoth(1, 1);
  PushBoth(1, 0);
  ExpectTheSame(2);
  EXPECT_NE(Values(borrowed_, 2), initial);  // the steps were applied
}

TEST_F(BorrowedPushTest, ANonFiniteBorrowedPushSkipsTheStep) {
  const auto initial = Values(borrowed_, 0);
  // Summed where they lie, never scanned on their own: the check of the
  // sum finds the NaN before the step end, and the infinity after it.
  PushBoth(0, 0);
  PushBoth(0, 1, kNaN);
  EndBoth(0, 0);
  EndBoth(0, 1);
  EndBoth(1, 0);
  EndBoth(1, 1);
  PushBoth(1, 0);
  PushBoth(1, 1, std::numeric_limits<float>::infinity());
  ExpectTheSame(2);
  const auto after = Values(borrowed_, 2);
  // Only the first chunk had a poisoned push: it kept its values; the
  // others were updated.
  EXPECT_EQ(after[0], initial[0]);
  if (after.size() > 1) {
    EXPECT_NE(after[1], initial[1]);
  }
}

class CountingWaiter final : public ChunkWaiter {
 public:
  void OnValues(const v1::ChunkHeader&, const ChunkValues&) override { ++answered; }
  void OnAbort(const absl::Status&) override {}
  bool Abandoned() const override { return false; }
  int answered = 0;
};

// A peer's frame indexes per-worker state by its worker: one outside the
// job is refused whatever its kind (a pull of worker 2^32 - 1 once parked a
// wait that the next step end read out of bounds), and changes nothing.
TEST(ShardStoreTest, FramesOfAWorkerOutsideTheJobAreRefused) {
  const v1::ServerAssignment a = fuzz::SmallJobAssignment("job", "sync");
  ASSERT_EQ(a.num_workers(), 2u);
  ShardStore store({});
  PSTRAIN_ASSERT_OK(store.AddJob(a));
  const auto chunk = absl::c_find_if(a.plan().chunks(),
                                     [](const v1::ChunkInfo& c) { return c.server() == 0; });
  ASSERT_NE(chunk, a.plan().chunks().end());
  const auto waiter = std::make_shared<CountingWaiter>();
  const std::vector<float> g(chunk->size(), 0.5f);
  for (const uint32_t worker : {2u, 0xffffffffu}) {
    v1::ChunkHeader pull = PushHeader(chunk->id(), 0, worker, 0);
    pull.set_kind(v1::FRAME_KIND_PULL);
    pull.set_version(1);
    const v1::ChunkHeader push =
        PushHeader(chunk->id(), 0, worker, static_cast<uint32_t>(chunk->size()));
    for (const absl::Status& s :
         {store.Pull(pull, waiter), store.Push(*Frame::Parse(EncodeFrame(push, g.data())), waiter),
          store.EndStep(StepEnd(chunk->id(), 0, worker))}) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find("outside [0, 2)"), std::string::npos) << s;
    }
  }
  // Nothing was parked or counted: the job's own workers' step goes on.
  for (const uint32_t worker : {0u, 1u}) {
    const v1::ChunkHeader push =
        PushHeader(chunk->id(), 0, worker, static_cast<uint32_t>(chunk->size()));
    PSTRAIN_ASSERT_OK(store.Push(*Frame::Parse(EncodeFrame(push, g.data())), waiter));
    PSTRAIN_ASSERT_OK(store.EndStep(StepEnd(chunk->id(), 0, worker)));
  }
  EXPECT_EQ(waiter->answered, 2);
  EXPECT_EQ(store.ReadChunk("job", chunk->id())->version, 1);
}

// A buffer of an external model: its chunk keeps worker 0's push bit for
// bit — words that are not finite floats included, which a gradient's
// checks would refuse — while a parameter beside it is trained; a push of
// it in a 16-bit dtype is refused.
TEST(ShardStoreTest, ABuffersChunkKeepsWorker0sPushBitForBit) {
  absl::StatusOr<v1::JobSpec> spec = ParseJobSpecYaml(
      "model: {type: external, tensors: [{name: w, shape: [4]},\n"
      "  {name: count, shape: [2], buffer: true, dtype: int64}]}\n"
      "optimizer: {type: sgd, learning_rate: 0.5}\nbatch_size: 8\nsteps: 4\n"
      "num_servers: 1\nnum_workers: 2\n");
  PSTRAIN_ASSERT_OK(spec);
  spec = NormalizeJobSpec(*spec);
  PSTRAIN_ASSERT_OK(spec);
  absl::StatusOr<v1::PartitionPlan> plan = ComputePartitionPlan(JobTensors(*spec), 4096, 1);
  PSTRAIN_ASSERT_OK(plan);
  ASSERT_EQ(plan->chunks_size(), 2);
  ASSERT_TRUE(plan->tensors(1).buffer());
  ASSERT_EQ(plan->chunks(1).size(), 4) << "2 int64s: 4 words";
  v1::ServerAssignment a;
  a.set_job_id("job");
  *a.mutable_spec() = *spec;
  *a.mutable_plan() = *plan;
  a.set_generation(1);
  a.set_num_workers(2);
  a.add_worker_nodes("worker-0");
  a.add_worker_nodes("worker-1");
  ShardStore store({});
  PSTRAIN_ASSERT_OK(store.AddJob(a));

  // Words of every kind: a NaN, an infinity, a denormal, a negative zero.
  std::vector<float> worker0_words(4), worker1_words(4, 1.0f);
  for (const auto& [i, bits] : {std::pair{0, 0xffffffffu}, {1, 0x7f800000u}, {2, 0x00000001u},
                               {3, 0x80000000u}}) {
    std::memcpy(&worker0_words[i], &bits, 4);
  }
  const std::vector<float> w0 = {1, 2, 3, 4};
  for (const auto& [chunk, values] : {std::pair{0u, &w0}, {1u, &worker1_words}}) {
    v1::ChunkHeader init = PushHeader(chunk, 0, 0, 4);
    init.set_kind(v1::FRAME_KIND_INIT);
    PSTRAIN_ASSERT_OK(store.Init(*Frame::Parse(EncodeFrame(init, values->data()))));
  }
  const std::vector<float> g = {0.5f, 0.5f, 0.5f, 0.5f};
  for (const uint32_t worker : {1u, 0u}) {
    const std::vector<float>& words = worker == 0 ? worker0_words : worker1_words;
    PSTRAIN_ASSERT_OK(store.Push(*Frame::Parse(EncodeFrame(PushHeader(0, 0, worker, 4), g.data())),
                                 nullptr));
    PSTRAIN_ASSERT_OK(
        store.Push(*Frame::Parse(EncodeFrame(PushHeader(1, 0, worker, 4), words.data())), nullptr));
    PSTRAIN_ASSERT_OK(store.EndStep(StepEnd(0, 0, worker)));
  }
  const auto buffer = store.ReadChunk("job", 1);
  PSTRAIN_ASSERT_OK(buffer);
  EXPECT_EQ(buffer->version, 1);
  EXPECT_EQ(std::memcmp(buffer->values.data(), worker0_words.data(), 16), 0);
  const auto w = store.ReadChunk("job", 0);
  PSTRAIN_ASSERT_OK(w);
  EXPECT_EQ(w->values, (std::vector<float>{0.5f, 1.5f, 2.5f, 3.5f}));  // w - 0.5 * (0.5 + 0.5)

  v1::ChunkHeader half = PushHeader(1, 1, 0, 4);
  half.set_dtype(v1::DTYPE_BF16);
  const std::vector<uint16_t> halves(4, 0);
  const absl::Status refused = store.Push(*Frame::Parse(EncodeFrame(half, halves.data())), nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("buffer"), std::string::npos) << refused;
}

}  // namespace
}  // namespace pstrain::server
