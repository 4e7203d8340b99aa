#include "common/partition.h"

#include <functional>
#include <random>
#include <set>

#include "common/job_spec.h"
#include "gtest/gtest.h"
#include "tests/test_util.h"

namespace pstrain {
namespace {

std::vector<kernels::TensorDesc> Tensors(const std::vector<int64_t>& sizes) {
  std::vector<kernels::TensorDesc> tensors;
  int64_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    kernels::TensorDesc t;
    t.name = "t" + std::to_string(i);
    t.shape = {sizes[i]};
    t.offset = offset;
    t.size = sizes[i];
    offset += sizes[i];
    tensors.push_back(t);
  }
  return tensors;
}

void CheckPlan(const std::vector<kernels::TensorDesc>& tensors, int64_t chunk_bytes,
               int servers) {
  SCOPED_TRACE(::testing::Message() << "chunk_bytes " << chunk_bytes << " servers " << servers);
  absl::StatusOr<v1::PartitionPlan> plan = ComputePartitionPlan(tensors, chunk_bytes, servers);
  PSTRAIN_ASSERT_OK(plan);
  int64_t total = 0;
  for (const auto& t : tensors) total += t.size;
  ASSERT_EQ(plan->total_floats(), total);
  // Every float in exactly one chunk: chunks tile the flat space in order.
  int64_t next = 0;
  int64_t largest = 0;
  for (int c = 0; c < plan->chunks_size(); ++c) {
    const v1::ChunkInfo& chunk = plan->chunks(c);
    ASSERT_EQ(chunk.id(), static_cast<uint32_t>(c));
    ASSERT_EQ(chunk.offset(), next);
    ASSERT_GE(chunk.size(), 1);
    ASSERT_LE(chunk.size() * 4, chunk_bytes);
    const kernels::TensorDesc& t = tensors[chunk.tensor()];
    ASSERT_GE(chunk.offset(), t.offset);
    ASSERT_LE(chunk.offset() + chunk.size(), t.offset + t.size) << "chunk spans two tensors";
    ASSERT_LT(chunk.server(), static_cast<uint32_t>(servers));
    next += chunk.size();
    largest = std::max(largest, chunk.size() * 4);
  }
  ASSERT_EQ(next, total);
  const std::vector<int64_t> loads = ServerLoads(*plan);
  const auto [lo, hi] = std::minmax_element(loads.begin(), loads.end());
  EXPECT_LE(*hi - *lo, largest) << "server loads differ by more than one chunk";
}

TEST(PartitionTest, RandomTensorSetsAndServers) {
  std::mt19937_64 rng(42);
  for (int round = 0; round < 60; ++round) {
    const int num_tensors = 1 + static_cast<int>(rng() % 12);
    // Sizes from 1 to 10^7 floats, log-uniform.
    std::vector<int64_t> sizes;
    for (int i = 0; i < num_tensors; ++i) {
      const double exponent = std::uniform_real_distribution<double>(0, 7)(rng);
      sizes.push_back(std::max<int64_t>(1, static_cast<int64_t>(std::pow(10.0, exponent))));
    }
    const int64_t chunk_bytes = int64_t{4} << (8 + rng() % 14);  // 1 KiB .. 8 MiB
    const int servers = 1 + static_cast<int>(rng() % 8);
    CheckPlan(Tensors(sizes), chunk_bytes, servers);
  }
}

TEST(PartitionTest, Extremes) {
  CheckPlan(Tensors({1}), 4, 1);
  CheckPlan(Tensors({1}), 4, 8);
  CheckPlan(Tensors({10000000}), 4 << 20, 8);
  CheckPlan(Tensors({10000000, 1, 3}), 1 << 20, 3);
  CheckPlan(Tensors({7, 7, 7}), 4, 2);
}

TEST(PartitionTest, RejectsBadArguments) {
  EXPECT_FALSE(ComputePartitionPlan(Tensors({10}), 3, 1).ok());
  EXPECT_FALSE(ComputePartitionPlan(Tensors({10}), 4, 0).ok());
  EXPECT_FALSE(ComputePartitionPlan({}, 4, 1).ok());
}

TEST(PartitionTest, ExampleJobSplitsEvenlyOverTwoServers) {
  kernels::ModelShape shape{784, {256, 128}, 10};
  absl::StatusOr<v1::PartitionPlan> plan =
      ComputePartitionPlan(kernels::ModelTensors(shape), 65536, 2);
  PSTRAIN_ASSERT_OK(plan);
  const std::vector<int64_t> loads = ServerLoads(*plan);
  const double total = static_cast<double>(loads[0] + loads[1]);
  for (int64_t load : loads) {
    EXPECT_GE(load / total, 0.40);
    EXPECT_LE(load / total, 0.60);
  }
  // The first layer's weight spans both servers.
  std::set<uint32_t> owners;
  for (const auto& c : plan->chunks()) {
    if (c.tensor() == 0) owners.insert(c.server());
  }
  EXPECT_EQ(owners.size(), 2u);
}

TEST(PartitionTest, ValidationRejectsEveryKindOfMalformedPlan) {
  const std::vector<kernels::TensorDesc> tensors = Tensors({1000, 10});
  const v1::PartitionPlan good = *ComputePartitionPlan(tensors, 400, 3);
  PSTRAIN_ASSERT_OK(ValidatePartitionPlan(good, 1010));
  EXPECT_FALSE(ValidatePartitionPlan(good, 1011).ok());
  std::vector<std::function<void(v1::PartitionPlan&)>> breakers = {
      [](v1::PartitionPlan& p) { p.mutable_chunks(1)->set_id(7); },
      [](v1::PartitionPlan& p) { p.mutable_chunks(1)->set_offset(5); },
      [](v1::PartitionPlan& p) { p.mutable_chunks(0)->set_size(101); },
      [](v1::PartitionPlan& p) { p.mutable_chunks(0)->set_size(0); },
      [](v1::PartitionPlan& p) { p.mutable_chunks(2)->set_server(3); },
      [](v1::PartitionPlan& p) { p.mutable_chunks()->RemoveLast(); },
      [](v1::PartitionPlan& p) { p.set_num_servers(0); },
      [](v1::PartitionPlan& p) { p.set_chunk_bytes(0); },
  };
  for (size_t i = 0; i < breakers.size(); ++i) {
    v1::PartitionPlan bad = good;
    breakers[i](bad);
    EXPECT_FALSE(ValidatePartitionPlan(bad, 1010).ok()) << "breaker " << i;
  }
}

}  // namespace
}  // namespace pstrain
