#include "replayssm/cache/kernel_status.h"

#include "absl/strings/str_cat.h"

namespace replayssm::cache {

absl::Status KernelStatus(rssm_status s, absl::string_view what) {
  switch (s) {
    case RSSM_OK:
      return absl::OkStatus();
    case RSSM_ERR_INVALID_ARGUMENT:
      return absl::InvalidArgumentError(absl::StrCat(what, ": ", rssm_last_error()));
    case RSSM_ERR_UNSUPPORTED:
      return absl::UnimplementedError(absl::StrCat(what, ": ", rssm_last_error()));
    case RSSM_ERR_DEVICE:
      return absl::InternalError(absl::StrCat(what, ": device error: ", rssm_last_error()));
  }
  return absl::InternalError(absl::StrCat(what, ": unknown kernel status ", static_cast<int>(s)));
}

}  // namespace replayssm::cache
