#include "device_buffer.h"

#include "absl/strings/str_cat.h"

namespace replayssm::cache {

absl::Status KernelStatus(rssm_status s, const char* what) {
  switch (s) {
    case RSSM_OK: return absl::OkStatus();
    case RSSM_ERR_INVALID_ARGUMENT:
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", rssm_last_error()));
    case RSSM_ERR_UNSUPPORTED:
      return absl::UnimplementedError(absl::StrCat(what, ": ", rssm_last_error()));
    case RSSM_ERR_DEVICE:
      return absl::InternalError(absl::StrCat(what, ": device error: ", rssm_last_error()));
  }
  return absl::InternalError(absl::StrCat(what, ": unknown kernel status ", s));
}

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
