// The one mapping of a kernel ABI status (rssm_status, replayssm/kernels.h) to an
// absl::Status, carrying the kernel's message (rssm_last_error()). Everything that calls the
// kernel ABI maps its results with it: the cache, and the client's CPU reference.
#ifndef REPLAYSSM_CACHE_KERNEL_STATUS_H_
#define REPLAYSSM_CACHE_KERNEL_STATUS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {

// RSSM_OK -> OK; INVALID_ARGUMENT -> INVALID_ARGUMENT; UNSUPPORTED -> UNIMPLEMENTED; DEVICE
// (and anything unknown) -> INTERNAL. The message is "<what>: <the kernel's message>".
absl::Status KernelStatus(rssm_status s, absl::string_view what);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_KERNEL_STATUS_H_
