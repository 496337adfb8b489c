#include "device_buffer.h"

namespace replayssm::cache {

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(int32_t backend, size_t bytes) {
  DeviceBuffer b;
  b.backend_ = backend;
  const rssm_status s = rssm_alloc(backend, bytes, &b.ptr_);
  if (s != RSSM_OK) return KernelStatus(s, "allocate");
  b.bytes_ = bytes;
  return b;
}

absl::Status CopyToDevice(int32_t backend, void* dst, const void* src, size_t bytes) {
  const rssm_launch l{backend, nullptr};
  absl::Status s = KernelStatus(rssm_memcpy(&l, dst, src, bytes, RSSM_COPY_HOST_TO_DEVICE), "copy");
  if (!s.ok()) return s;
  return KernelStatus(rssm_synchronize(&l), "synchronize");
}

}  // namespace replayssm::cache
