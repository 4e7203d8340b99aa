#include "worker/devices.h"

#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/cuda/cuda_api.h"

namespace pstrain::worker {

absl::StatusOr<DeviceList> ParseDevices(const std::string& spec) {
  DeviceList list;
  bool cpu = false, cuda = false;
  std::set<int> seen;
  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    const std::vector<std::string> parts = absl::StrSplit(item, ':');
    int n = -1;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[1], &n) || n < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("devices: '", item, "' is not cpu:N or cuda:ORDINAL"));
    }
    if (parts[0] == "cpu") {
      if (cpu || n < 1 || n > 256) {
        return absl::InvalidArgumentError("devices: give one cpu:N, N in [1, 256]");
      }
      cpu = true;
      for (int i = 0; i < n; ++i) list.indices.push_back(i);
    } else if (parts[0] == "cuda") {
      if (!seen.insert(n).second) {
        return absl::InvalidArgumentError(absl::StrCat("devices: cuda:", n, " is listed twice"));
      }
      cuda = true;
      list.kind = DeviceList::Kind::kCuda;
      list.indices.push_back(n);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("devices: unknown kind '", parts[0], "' (cpu or cuda)"));
    }
  }
  if (cpu && cuda) return absl::InvalidArgumentError("devices: mix of cpu and cuda");
  if (list.indices.empty()) return absl::InvalidArgumentError("devices: none given");
  return list;
}

absl::StatusOr<std::vector<std::unique_ptr<kernels::Device>>> CreateDevices(
    const DeviceList& list) {
  std::vector<std::unique_ptr<kernels::Device>> devices;
  for (int index : list.indices) {
    if (list.kind == DeviceList::Kind::kCpu) {
      devices.push_back(kernels::CreateCpuDevice(index));
      continue;
    }
    absl::StatusOr<std::unique_ptr<kernels::Device>> device = kernels::CreateCudaDevice(index);
    if (!device.ok()) return device.status();
    devices.push_back(std::move(*device));
  }
  return devices;
}

absl::StatusOr<std::unique_ptr<kernels::Reducer>> CreateReducer(const DeviceList& list) {
  if (list.kind == DeviceList::Kind::kCpu) {
    return kernels::CreateCpuReducer(static_cast<int>(list.indices.size()));
  }
  return kernels::CreateNcclReducer(list.indices);
}

}  // namespace pstrain::worker
