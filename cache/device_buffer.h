// RAII ownership of backend memory (kernel ABI rssm_alloc/rssm_free), and the few copy
// helpers the cache needs. Never branches on the backend: the kernel ABI does.
#ifndef REPLAYSSM_CACHE_DEVICE_BUFFER_H_
#define REPLAYSSM_CACHE_DEVICE_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "replayssm/cache/kernel_status.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  static absl::StatusOr<DeviceBuffer> Allocate(int32_t backend, size_t bytes);
  ~DeviceBuffer() { Reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      backend_ = o.backend_;
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return ptr_; }
  size_t size() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void Reset() {
    if (ptr_ != nullptr) rssm_free(backend_, ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  int32_t backend_ = RSSM_BACKEND_CPU;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// Copies host memory into backend memory on the default stream and waits: for setup only
// (operations use their lane, lane.h).
absl::Status CopyToDevice(int32_t backend, void* dst, const void* src, size_t bytes);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_DEVICE_BUFFER_H_
