// The devices a worker drives, from --devices: "cpu:4" (four CPU devices,
// threads with one BLAS thread each) or "cuda:0,cuda:1" (those GPUs).
#ifndef PSTRAIN_WORKER_DEVICES_H_
#define PSTRAIN_WORKER_DEVICES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/device.h"
#include "kernels/reducer.h"

namespace pstrain::worker {

struct DeviceList {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  std::vector<int> indices;  // CPU: 0..n-1; CUDA: the GPUs' ordinals
};

// INVALID_ARGUMENT naming what is wrong: an unknown kind, a bad count or
// ordinal, a repeated GPU, a mix of CPU and CUDA.
absl::StatusOr<DeviceList> ParseDevices(const std::string& spec);

// The devices, ready to compute. FAILED_PRECONDITION for CUDA devices when
// the binary was built without CUDA or no GPU is usable (the message says
// which, with CUDA's reason).
absl::StatusOr<std::vector<std::unique_ptr<kernels::Device>>> CreateDevices(
    const DeviceList& list);

// The node reducer for these devices: a CpuReducer for CPU devices, an
// NcclReducer for GPUs.
absl::StatusOr<std::unique_ptr<kernels::Reducer>> CreateReducer(const DeviceList& list);

}  // namespace pstrain::worker

#endif  // PSTRAIN_WORKER_DEVICES_H_
