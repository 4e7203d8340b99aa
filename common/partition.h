// The partition plan: how the flat parameter space is cut into chunks and
// which server owns each chunk.
#ifndef PSTRAIN_COMMON_PARTITION_H_
#define PSTRAIN_COMMON_PARTITION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/model.h"
#include "pstrain/v1/job.pb.h"

namespace pstrain {

// Cuts every tensor into chunks of at most chunk_bytes (whole floats; a
// chunk never spans two tensors), then assigns chunks to servers so that
// their loads in bytes differ by at most one chunk: largest chunk first, each
// to the least-loaded server (ties: lowest index). Deterministic.
// INVALID_ARGUMENT on chunk_bytes < 4, num_servers < 1, or an empty model.
absl::StatusOr<v1::PartitionPlan> ComputePartitionPlan(
    const std::vector<kernels::TensorDesc>& tensors, int64_t chunk_bytes, int num_servers);

// Checks what a node must trust before using a plan it received: chunk ids
// are their indices, chunks tile [0, total_floats) in order without gaps,
// none exceeds chunk_bytes, every server index is below num_servers.
// INVALID_ARGUMENT saying what is wrong.
absl::Status ValidatePartitionPlan(const v1::PartitionPlan& plan, int64_t total_floats);

// Bytes held by each server under `plan`.
std::vector<int64_t> ServerLoads(const v1::PartitionPlan& plan);

}  // namespace pstrain

#endif  // PSTRAIN_COMMON_PARTITION_H_
