// How a node's K devices split a range of the plan's chunks (a bucket: one
// layer's tensors, or the whole model) for a collective: K slices of whole
// chunks with nearly equal floats, each padded to the longest, because NCCL
// needs equal counts per rank while a chunk must reach one server whole.
// Device k pushes the chunks of slice k.
#ifndef PSTRAIN_WORKER_SLICE_LAYOUT_H_
#define PSTRAIN_WORKER_SLICE_LAYOUT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/device.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain::worker {

struct SliceLayout {
  struct Slice {
    int first_chunk = 0;  // [first_chunk, last_chunk) of the plan
    int last_chunk = 0;
    int64_t flat_offset = 0;  // where its chunks start in the flat space
    int64_t floats = 0;       // their total; the rest of the slice is padding
  };

  // Chunks [first_chunk, last_chunk) of `plan` over `ranks` slices.
  static SliceLayout Create(const v1::PartitionPlan& plan, int first_chunk, int last_chunk,
                            int ranks);

  int64_t slice_floats = 0;  // the padded length of every slice
  std::vector<Slice> slices;

  int64_t padded_floats() const { return slice_floats * static_cast<int64_t>(slices.size()); }
  // The chunks' floats over all slices, padding not counted.
  int64_t total_floats() const {
    int64_t n = 0;
    for (const Slice& s : slices) n += s.floats;
    return n;
  }

  // Copies slice k of the flat buffer `flat` to padded[k*slice_floats...],
  // for every k (zeros in the padding are left as they are). Both buffers
  // are in `device`'s memory.
  absl::Status Pack(kernels::Device& device, const float* flat, float* padded) const;
  // The reverse, for slice k only (others' chunks stay untouched).
  absl::Status UnpackSlice(kernels::Device& device, int k, const float* slice, float* flat) const;
};

// The chunks of each layer of the model (its weight and bias), as chunk
// ranges [first, last) in plan order; layer l's entry is index l.
std::vector<std::pair<int, int>> LayerChunkRanges(const v1::PartitionPlan& plan);

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_SLICE_LAYOUT_H_
