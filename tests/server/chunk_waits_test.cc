// The one predicate that answers a chunk's waits, in each mode.
#include "server/chunk_waits.h"

#include <algorithm>
#include <vector>

#include "common/job_spec.h"
#include "gtest/gtest.h"

namespace pstrain::server {
namespace {

v1::ChunkHeader Request(uint32_t worker, int64_t step) {
  v1::ChunkHeader h;
  h.set_worker(worker);
  h.set_step(step);
  return h;
}

// StateOf for a chunk whose workers' clocks are `clock` (by worker).
WaitState StateOf(const ChunkWait& w, int64_t version, const std::vector<int64_t>& clock) {
  return StateOf(w, version, clock[w.request.worker()],
                 *std::min_element(clock.begin(), clock.end()));
}

TEST(ChunkWaitsTest, ASyncPushWaitsForTheStepOfEveryWorker) {
  const ChunkWait w = PushWait(v1::MODE_SYNC, 0, Request(0, 4), nullptr);
  // Sync applies a step of every worker at once: the clocks are the version.
  EXPECT_EQ(StateOf(w, 4, {4, 4}), WaitState::kHeldBySlowest);
  EXPECT_EQ(StateOf(w, 5, {5, 5}), WaitState::kAnswerable);
}

TEST(ChunkWaitsTest, AnSspPushWaitsForItsOwnStepAndTheSlowestWithinTheBound) {
  const ChunkWait w = PushWait(v1::MODE_SSP, 2, Request(1, 6), nullptr);
  EXPECT_EQ(StateOf(w, 20, {9, 6}), WaitState::kWaiting) << "its own push is not applied";
  EXPECT_EQ(StateOf(w, 20, {4, 7}), WaitState::kHeldBySlowest) << "worker 0 is 3 steps behind";
  EXPECT_EQ(StateOf(w, 20, {5, 7}), WaitState::kAnswerable) << "2 behind: within the bound";
}

TEST(ChunkWaitsTest, AnAsyncPushWaitsForItselfAlone) {
  const ChunkWait w = PushWait(v1::MODE_ASYNC, kUnboundedStaleness, Request(0, 100), nullptr);
  EXPECT_EQ(StateOf(w, 3, {100, 0}), WaitState::kWaiting);
  EXPECT_EQ(StateOf(w, 3, {101, 0}), WaitState::kAnswerable);
}

TEST(ChunkWaitsTest, APullWaitsForAVersionAndEveryWorkersSteps) {
  v1::ChunkHeader h = Request(0, 0);
  h.set_version(7);
  h.set_pushed_steps(3);
  const ChunkWait w = PullWait(h, nullptr);
  EXPECT_EQ(StateOf(w, 6, {9, 9}), WaitState::kWaiting);
  EXPECT_EQ(StateOf(w, 7, {9, 2}), WaitState::kHeldBySlowest);
  EXPECT_EQ(StateOf(w, 7, {3, 3}), WaitState::kAnswerable);
}

}  // namespace
}  // namespace pstrain::server
