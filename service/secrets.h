// Secrets the server reads from files (the tenants' token file, the cluster's peer token):
// their comparison in a time that does not depend on where they differ, the check that nobody
// but the server's user can read them, and the peer token file itself.
//
// The peer token (--peer-token FILE) authenticates servers to each other: SlotTransfer's
// peer methods (ReserveTransfer, CommitTransfer, AbortTransfer, AcknowledgeTransfer) must
// carry it as metadata `replayssm-peer-token`; a client's credentials (a tenant's bearer
// token, a client certificate) are never enough. The file holds one token per line (16..256
// printable ASCII characters without spaces; `#` comments, blank lines): the first is the one
// this server presents, every one is accepted (rotation: add the new token as a second line
// everywhere, then make it the first, then remove the old one).
//
// Thread safety: the functions are thread-safe; PeerTokens is immutable.
#ifndef REPLAYSSM_SERVICE_SECRETS_H_
#define REPLAYSSM_SERVICE_SECRETS_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace replayssm::service {

// The metadata key of the peer token (gRPC keys are lower case).
inline constexpr char kPeerTokenKey[] = "replayssm-peer-token";

// a == b, in a time that depends on the lengths only, never on the first byte that differs.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b);

// A warning when the file at `path` (given as `flag`) may be read by others, or by a group the
// server's user is not in (its mode allows it); nullopt when only the server's user and its
// own groups may (Kubernetes: a Secret's 0440 with the pod's fsGroup), or it cannot be looked
// at.
std::optional<std::string> ExposureWarning(absl::string_view flag, const std::string& path);

class PeerTokens {
 public:
  // Reads --peer-token's file; INVALID_ARGUMENT `<path>:<line>: ...` (never a token).
  static absl::StatusOr<std::unique_ptr<PeerTokens>> Load(const std::string& path);
  // The token this server presents to its peers (the file's first).
  const std::string& own() const { return tokens_.front(); }
  // Whether `token` is one of the file's: every one compared, in constant time.
  bool Accepts(absl::string_view token) const;

 private:
  explicit PeerTokens(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {}
  const std::vector<std::string> tokens_;  // at least one
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SECRETS_H_
