#include "common/partition.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace pstrain {

absl::StatusOr<v1::PartitionPlan> ComputePartitionPlan(
    const std::vector<kernels::TensorDesc>& tensors, int64_t chunk_bytes, int num_servers) {
  if (chunk_bytes < 4) return absl::InvalidArgumentError("chunk_bytes must be >= 4");
  if (num_servers < 1) return absl::InvalidArgumentError("num_servers must be >= 1");
  if (tensors.empty()) return absl::InvalidArgumentError("model has no tensors");
  const int64_t chunk_floats = chunk_bytes / 4;

  v1::PartitionPlan plan;
  plan.set_chunk_bytes(chunk_bytes);
  plan.set_num_servers(num_servers);
  int64_t total = 0;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const kernels::TensorDesc& desc = tensors[t];
    v1::TensorInfo* info = plan.add_tensors();
    info->set_name(desc.name);
    for (int64_t d : desc.shape) info->add_shape(d);
    info->set_offset(desc.offset);
    info->set_size(desc.size);
    info->set_buffer(desc.buffer);
    for (int64_t begin = 0; begin < desc.size; begin += chunk_floats) {
      v1::ChunkInfo* chunk = plan.add_chunks();
      chunk->set_id(plan.chunks_size() - 1);
      chunk->set_tensor(t);
      chunk->set_offset(desc.offset + begin);
      chunk->set_size(std::min(chunk_floats, desc.size - begin));
    }
    total += desc.size;
  }
  plan.set_total_floats(total);

  std::vector<int> order(plan.chunks_size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
    return plan.chunks(a).size() > plan.chunks(b).size();
  });
  std::vector<int64_t> load(num_servers, 0);
  for (int c : order) {
    const int server = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    plan.mutable_chunks(c)->set_server(server);
    load[server] += plan.chunks(c).size();
  }
  return plan;
}

absl::Status ValidatePartitionPlan(const v1::PartitionPlan& plan, int64_t total_floats) {
  if (plan.total_floats() != total_floats) {
    return absl::InvalidArgumentError(absl::StrCat("plan covers ", plan.total_floats(),
                                                   " floats, the model has ", total_floats));
  }
  if (plan.num_servers() < 1) return absl::InvalidArgumentError("plan has no servers");
  if (plan.chunk_bytes() < 4) return absl::InvalidArgumentError("plan chunk_bytes < 4");
  int64_t next = 0;
  for (int i = 0; i < plan.chunks_size(); ++i) {
    const v1::ChunkInfo& c = plan.chunks(i);
    if (c.id() != static_cast<uint32_t>(i) || c.offset() != next || c.size() < 1 ||
        c.size() > plan.chunk_bytes() / 4 || c.size() > total_floats - next ||
        c.server() >= plan.num_servers()) {
      return absl::InvalidArgumentError(absl::StrCat("plan chunk ", i, " is malformed"));
    }
    next += c.size();
  }
  if (next != total_floats) {
    return absl::InvalidArgumentError("plan chunks do not cover the model");
  }
  return absl::OkStatus();
}

std::vector<int64_t> ServerLoads(const v1::PartitionPlan& plan) {
  std::vector<int64_t> load(plan.num_servers(), 0);
  for (const v1::ChunkInfo& c : plan.chunks()) load[c.server()] += c.size() * 4;
  return load;
}

}  // namespace pstrain
