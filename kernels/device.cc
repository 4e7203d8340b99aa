#include "kernels/device.h"

namespace pstrain::kernels {

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (device_ != nullptr && data_ != nullptr) device_->Free(data_);
    device_ = other.device_;
    data_ = other.data_;
    bytes_ = other.bytes_;
    other.device_ = nullptr;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (device_ != nullptr && data_ != nullptr) device_->Free(data_);
}

}  // namespace pstrain::kernels
