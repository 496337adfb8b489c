// Secrets the server reads from files (the tenants' token file): their comparison in a time
// that does not depend on where they differ, and the check that nobody but the server's user
// can read them.
//
// Thread safety: the functions are thread-safe.
#ifndef REPLAYSSM_SERVICE_SECRETS_H_
#define REPLAYSSM_SERVICE_SECRETS_H_

#include <optional>
#include <string>

#include "absl/strings/string_view.h"

namespace replayssm::service {

// a == b, in a time that depends on the lengths only, never on the first byte that differs.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// A warning when the file at `path` (given as `flag`) may be read by its group or by others
// (its mode allows it); nullopt when only its owner may, or it cannot be looked at.
std::optional<std::string> ExposureWarning(absl::string_view flag, const std::string& path);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SECRETS_H_
