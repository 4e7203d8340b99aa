// The hot-key sketch: exact below its capacity, bounded and close beyond.
#include "server/hot_keys.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <vector>

#include "common/random.h"
#include "gtest/gtest.h"

namespace pstrain::server {
namespace {

TEST(HotKeysTest, ExactBelowItsCapacity) {
  HotKeys hot;
  for (uint64_t key = 0; key < 1000; ++key) hot.Add(key, 1);
  hot.Add(7, 1000);
  EXPECT_EQ(hot.DistinctKeys(), 1000);
  EXPECT_EQ(hot.total(), 2000u);
  // The hottest 1% of 1000 keys: key 7 (1001) and nine keys of count 1.
  EXPECT_DOUBLE_EQ(hot.HotShare(), 1010.0 / 2000);
  hot.Reset();
  EXPECT_EQ(hot.HotShare(), 0);
  EXPECT_EQ(hot.DistinctKeys(), 0);
  hot.Add(3, 5);
  EXPECT_DOUBLE_EQ(hot.HotShare(), 1.0);  // one key: at least one key is the hottest 1%
}

// A stream far beyond the capacity, against exact counts.
// Returns the exact share.
double ExpectCloseToExact(const std::function<uint64_t(uint64_t)>& draw, double share_tolerance) {
  HotKeys hot;
  std::map<uint64_t, uint64_t> exact;
  uint64_t state = 42;
  uint64_t total = 0;
  for (int i = 0; i < 300000; ++i) {
    const uint64_t key = draw(SplitMix64(state));
    const uint64_t count = 1 + (i % 3);
    hot.Add(key, count);
    exact[key] += count;
    total += count;
  }
  std::vector<uint64_t> counts;
  for (const auto& [key, count] : exact) counts.push_back(count);
  std::sort(counts.begin(), counts.end(), std::greater<>());
  const size_t hottest = static_cast<size_t>(std::ceil(counts.size() / 100.0));
  uint64_t hot_total = 0;
  for (size_t i = 0; i < hottest; ++i) hot_total += counts[i];
  const double exact_share = static_cast<double>(hot_total) / static_cast<double>(total);

  EXPECT_EQ(hot.total(), total);
  EXPECT_NEAR(hot.DistinctKeys() / static_cast<double>(counts.size()), 1.0, 0.05);
  // Guaranteed counts: the estimate may fall short, within the tolerance.
  EXPECT_LE(hot.HotShare(), exact_share + 0.005) << exact_share;
  EXPECT_GE(hot.HotShare(), exact_share - share_tolerance) << exact_share;
  return exact_share;
}

TEST(HotKeysTest, AUniformStreamHasNoHotSpot) {
  // About 3 sightings a key: the hottest 1% only by chance.
  EXPECT_LT(ExpectCloseToExact([](uint64_t word) { return BelowN(word, 100000); }, 0.03), 0.05);
}

TEST(HotKeysTest, ASkewedStreamsHotSpotIsFound) {
  // Log-uniform ranks over 10^6 keys (a Zipf law of exponent 1): the
  // hottest 1% take about half the traffic.
  EXPECT_GT(ExpectCloseToExact(
                [](uint64_t word) {
                  return static_cast<uint64_t>(std::exp(UnitDouble(word) * std::log(1e6)));
                },
                0.05),
            0.4);
}

}  // namespace
}  // namespace pstrain::server
