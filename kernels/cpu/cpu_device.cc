// The CPU device: host memory and the OpenBLAS kernels.
#include <cstdlib>
#include <cstring>
#include <string>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/device.h"

namespace pstrain::kernels {
namespace {

class CpuDevice final : public Device {
 public:
  explicit CpuDevice(int index) : index_(index) {}

  std::string name() const override { return "cpu:" + std::to_string(index_); }
  bool host_memory() const override { return true; }

  absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) override {
    void* data = std::calloc(bytes == 0 ? 1 : bytes, 1);
    if (data == nullptr) {
      return absl::ResourceExhaustedError("out of host memory allocating " +
                                          std::to_string(bytes) + " bytes");
    }
    return DeviceBuffer(this, data, bytes);
  }
  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    if (dst != src) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return CopyToDevice(dst, src, bytes);
  }
  absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) override {
    return CopyToDevice(dst, src, bytes);
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::StatusOr<std::unique_ptr<ModelKernels>> CreateModelKernels(const ModelShape& shape,
                                                                   int max_batch,
                                                                   Precision precision) override {
    return CreateCpuModelKernels(shape, max_batch, precision);
  }

 protected:
  void Free(void* data) override { std::free(data); }

 private:
  const int index_;
};

}  // namespace

std::unique_ptr<Device> CreateCpuDevice(int index) { return std::make_unique<CpuDevice>(index); }

}  // namespace pstrain::kernels
