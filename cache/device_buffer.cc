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

absl::Status EnqueueCopy(int32_t backend, void* dst, const void* src, size_t bytes,
                         int32_t kind) {
  const rssm_launch l{backend, nullptr};
  return KernelStatus(rssm_memcpy(&l, dst, src, bytes, kind), "copy");
}

namespace {
absl::Status Copy(int32_t backend, void* dst, const void* src, size_t bytes, int32_t kind) {
  absl::Status s = EnqueueCopy(backend, dst, src, bytes, kind);
  if (!s.ok()) return s;
  return Synchronize(backend);
}
}  // namespace

absl::Status CopyToDevice(int32_t backend, void* dst, const void* src, size_t bytes) {
  return Copy(backend, dst, src, bytes, RSSM_COPY_HOST_TO_DEVICE);
}
absl::Status CopyToHost(int32_t backend, void* dst, const void* src, size_t bytes) {
  return Copy(backend, dst, src, bytes, RSSM_COPY_DEVICE_TO_HOST);
}
absl::Status CopyOnDevice(int32_t backend, void* dst, const void* src, size_t bytes) {
  return Copy(backend, dst, src, bytes, RSSM_COPY_DEVICE_TO_DEVICE);
}
absl::Status ZeroOnDevice(int32_t backend, void* dst, size_t bytes) {
  const rssm_launch l{backend, nullptr};
  absl::Status s = KernelStatus(rssm_memset(&l, dst, 0, bytes), "zero");
  if (!s.ok()) return s;
  return KernelStatus(rssm_synchronize(&l), "zero");
}
absl::Status Synchronize(int32_t backend) {
  const rssm_launch l{backend, nullptr};
  return KernelStatus(rssm_synchronize(&l), "synchronize");
}

}  // namespace replayssm::cache
