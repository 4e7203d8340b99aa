// Collectives across the K devices of one node: the node's gradient is
// reduce-scattered (device k ends up with the sum of slice k), each device
// pushes its slice, and the new parameters are all-gathered. Two
// implementations with the same semantics: CpuReducer (host memory, device
// threads) and NcclReducer (GPUs, kernels/cuda).
#ifndef PSTRAIN_KERNELS_REDUCER_H_
#define PSTRAIN_KERNELS_REDUCER_H_

#include <chrono>
#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"

namespace pstrain::kernels {

class Reducer {
 public:
  virtual ~Reducer() = default;

  virtual int ranks() const = 0;

  // Collective: every rank calls it once, from its own thread, with the
  // same count. send holds ranks*count floats (slice r at r*count); recv
  // gets count floats: the sum over ranks of their slice `rank`, added in
  // rank order. Buffers are in the rank's device memory and may be reused
  // when the call returns.
  virtual absl::Status ReduceScatter(int rank, const float* send, float* recv,
                                     int64_t count) = 0;

  // Collective: send holds count floats (this rank's slice); recv gets
  // ranks*count floats, rank r's slice at r*count.
  virtual absl::Status AllGather(int rank, const float* send, float* recv, int64_t count) = 0;

  // Ends every collective in progress or to come with CANCELLED (a rank
  // failed, or the job was stopped). Thread-safe.
  virtual void Abort() = 0;
};

// A CpuReducer for `ranks` threads sharing host memory. A rank waits at
// most `timeout` for the others; DEADLINE_EXCEEDED after that.
absl::StatusOr<std::unique_ptr<Reducer>> CreateCpuReducer(
    int ranks, std::chrono::milliseconds timeout = std::chrono::minutes(10));

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_REDUCER_H_
