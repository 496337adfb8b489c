// Secrets the server reads from files (the tenants' token file, the cluster's peer token):
// their comparison in a time that does not depend on where they differ, the check that nobody
// but the server's user can read them, and the peer token file itself.
//
// The peer token (--peer-token FILE) authenticates servers to each other, both ways. Each of
// SlotTransfer's peer methods (ReserveTransfer, CommitTransfer, AbortTransfer,
// AcknowledgeTransfer) must carry a proof of it as metadata `replayssm-peer-proof`; a client's
// credentials (a tenant's bearer token, a client certificate) are never enough. And the replies
// the sender acts on (a reservation's addresses, a commit's or an abort's decision) carry the
// receiver's proof over their own fields and a nonce the sender drew for the call: a fake
// peer cannot make the sender write where it likes, or believe a decision nobody made.
// The token itself never leaves the server: a sender dials whatever peer_address a client
// names (without --transfer-peers), so whatever it sends there a client may read. A proof is
// an HMAC-SHA256 keyed with the token over the method, the transfer id, the tenant and the
// message's content (docs/transfer.md, "Peer proofs"): read by a fake peer, it opens only that
// call, with exactly that content, of the caller's own tenant, which the caller could make
// anyway. The file holds one token per line (16..256 printable ASCII characters without
// spaces; `#` comments, blank lines): the first is the one this server proves, every one is
// accepted (rotation: add the new token as a second line everywhere, then make it the first,
// then remove the old one).
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

// The metadata key of the proof of the peer token (gRPC keys are lower case).
inline constexpr char kPeerProofKey[] = "replayssm-peer-proof";

// The proof of `token` for one peer message ("" if HMAC failed: no proof at all): "v2:" and 64
// hex digits, the HMAC-SHA256 keyed with the token of "replayssm-peer-proof-v2\n" followed by
// PeerProofField of each of method, transfer_id, tenant and content. `method` is the RPC's
// name, or its name and "/reply" for the receiver's proof of a reply; `tenant` the one the
// call names ("" for calls that name none: all but ReserveTransfer and its reply); `content`
// the message's fields as docs/transfer.md lists them per message, each a PeerProofField.
std::string PeerProof(absl::string_view token, absl::string_view method,
                      absl::string_view transfer_id, absl::string_view tenant,
                      absl::string_view content);
// `bytes` as a proof's message holds it: <decimal length>:<bytes>.
std::string PeerProofField(absl::string_view bytes);
// 32 hex digits from the system's random source ("" if it failed): a peer call's nonce.
std::string PeerNonce();

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
  // The proof this server sends with a peer call: of its own token, the file's first.
  std::string Prove(absl::string_view method, absl::string_view transfer_id,
                    absl::string_view tenant, absl::string_view content) const;
  // Whether `proof` is the proof of one of the file's tokens for this call: every one
  // compared, in constant time.
  bool Accepts(absl::string_view proof, absl::string_view method, absl::string_view transfer_id,
               absl::string_view tenant, absl::string_view content) const;

 private:
  explicit PeerTokens(std::vector<std::string> tokens) : tokens_(std::move(tokens)) {}
  const std::vector<std::string> tokens_;  // at least one
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SECRETS_H_
