// A compute device: a CPU thread or a GPU. A worker drives K of them; each
// holds its own copy of the parameters and computes on its share of the
// node's batch. The CPU device and the CUDA device (kernels/cuda) have the
// same interface, so the worker's code is the same for both.
#ifndef PSTRAIN_KERNELS_DEVICE_H_
#define PSTRAIN_KERNELS_DEVICE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/model.h"

namespace pstrain::kernels {

class Device;

// Memory on a device, freed with the object. Move-only.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, void* data, size_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();

  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

 private:
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

class Device {
 public:
  virtual ~Device() = default;

  // "cpu:0", "cuda:1".
  virtual std::string name() const = 0;
  // True if the device's memory is the host's (no copies needed).
  virtual bool host_memory() const = 0;

  // Zero-filled memory on the device. RESOURCE_EXHAUSTED if it runs out.
  virtual absl::StatusOr<DeviceBuffer> Allocate(size_t bytes) = 0;
  virtual absl::Status CopyToDevice(void* device_dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes) = 0;
  virtual absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) = 0;
  // Waits for everything queued on the device.
  virtual absl::Status Synchronize() = 0;

  // The model's kernels on this device, for batches of up to max_batch.
  virtual absl::StatusOr<std::unique_ptr<ModelKernels>> CreateModelKernels(
      const ModelShape& shape, int max_batch, Precision precision) = 0;

 protected:
  friend class DeviceBuffer;
  virtual void Free(void* data) = 0;
};

// CPU device `index` (a name only: CPU devices are threads of the process).
std::unique_ptr<Device> CreateCpuDevice(int index);

}  // namespace pstrain::kernels

#endif  // PSTRAIN_KERNELS_DEVICE_H_
