// The dynamic loss scale's rule: halve on an overflow, double after
// growth_steps steps without one, a power of two in [1, 2^24].
#include "worker/loss_scale.h"

#include "gtest/gtest.h"

namespace pstrain::worker {
namespace {

TEST(DynamicLossScaleTest, HalvesOnAnOverflowAndGrowsAfterGoodSteps) {
  DynamicLossScale s(1024, /*growth_steps=*/3);
  s.Update(true);
  EXPECT_EQ(s.scale(), 512);
  s.Update(false);
  s.Update(false);
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.good_steps(), 2);
  s.Update(true);  // an overflow starts the count again
  EXPECT_EQ(s.scale(), 256);
  EXPECT_EQ(s.good_steps(), 0);
  for (int i = 0; i < 3; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 512);
  EXPECT_EQ(s.good_steps(), 0);
}

TEST(DynamicLossScaleTest, StaysAPowerOfTwoWithinItsBounds) {
  DynamicLossScale low(1, 1);
  low.Update(true);
  EXPECT_EQ(low.scale(), DynamicLossScale::kMin);
  DynamicLossScale high(DynamicLossScale::kMax, 1);
  high.Update(false);
  EXPECT_EQ(high.scale(), DynamicLossScale::kMax);
  // What a resume state could carry.
  EXPECT_EQ(DynamicLossScale(3000, 10).scale(), 2048);
  EXPECT_EQ(DynamicLossScale(1e30, 10).scale(), DynamicLossScale::kMax);
  EXPECT_EQ(DynamicLossScale(-5, 10).scale(), DynamicLossScale::kMin);
  EXPECT_EQ(DynamicLossScale(std::nan(""), 10).scale(), DynamicLossScale::kMin);
  EXPECT_EQ(DynamicLossScale(8, 10, /*good_steps=*/99).good_steps(), 9);
}

}  // namespace
}  // namespace pstrain::worker
