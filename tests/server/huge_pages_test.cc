#include "server/huge_pages.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "gtest/gtest.h"

namespace pstrain::server {
namespace {

TEST(HugePageAllocatorTest, LargeBlocksAreHugePageAlignedAndKeepTheirContentsThroughGrowth) {
  std::vector<uint32_t, HugePageAllocator<uint32_t>> values;
  // From the heap's small blocks to mapped ones and on through reallocations.
  for (uint32_t i = 0; i < (3u << 20); ++i) values.push_back(i);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(values.data()) % kHugePageBytes, 0u);
  std::vector<uint32_t> expected(values.size());
  std::iota(expected.begin(), expected.end(), 0u);
  EXPECT_TRUE(std::equal(values.begin(), values.end(), expected.begin()));
  values.resize(10);
  values.shrink_to_fit();  // back to a heap block
  EXPECT_EQ(values[9], 9u);
}

}  // namespace
}  // namespace pstrain::server
