#include "worker/slice_layout.h"

#include <algorithm>

namespace pstrain::worker {

SliceLayout SliceLayout::Create(const v1::PartitionPlan& plan, int first_chunk, int last_chunk,
                                int ranks) {
  SliceLayout layout;
  int64_t total = 0;
  for (int c = first_chunk; c < last_chunk; ++c) total += plan.chunks(c).size();
  // Cut after the chunk that reaches each k/ranks of the floats.
  int c = first_chunk;
  int64_t done = 0;
  for (int k = 0; k < ranks; ++k) {
    Slice s;
    s.first_chunk = c;
    s.flat_offset = c < last_chunk ? plan.chunks(c).offset() : 0;
    const int64_t target = total * (k + 1) / ranks;
    while (c < last_chunk && (done < target || k == ranks - 1)) {
      s.floats += plan.chunks(c).size();
      done += plan.chunks(c).size();
      ++c;
    }
    s.last_chunk = c;
    layout.slice_floats = std::max(layout.slice_floats, s.floats);
    layout.slices.push_back(s);
  }
  return layout;
}

absl::Status SliceLayout::Pack(kernels::Device& device, const float* flat, float* padded) const {
  for (size_t k = 0; k < slices.size(); ++k) {
    absl::Status s = device.CopyOnDevice(padded + k * slice_floats, flat + slices[k].flat_offset,
                                         slices[k].floats * sizeof(float));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SliceLayout::UnpackSlice(kernels::Device& device, int k, const float* slice,
                                      float* flat) const {
  return device.CopyOnDevice(flat + slices[k].flat_offset, slice,
                             slices[k].floats * sizeof(float));
}

std::vector<std::pair<int, int>> LayerChunkRanges(const v1::PartitionPlan& plan) {
  // Tensors come in (weight, bias) pairs per layer, and chunks in tensor order.
  const int layers = plan.tensors_size() / 2;
  std::vector<std::pair<int, int>> ranges(layers, {0, 0});
  for (int l = 0; l < layers; ++l) {
    int first = plan.chunks_size(), last = 0;
    for (const v1::ChunkInfo& c : plan.chunks()) {
      if (static_cast<int>(c.tensor()) / 2 != l) continue;
      first = std::min(first, static_cast<int>(c.id()));
      last = std::max(last, static_cast<int>(c.id()) + 1);
    }
    ranges[l] = {first, last};
  }
  return ranges;
}

}  // namespace pstrain::worker
