// Test support: the cluster's peer token (--peer-token) as a file, and the proofs of it that
// peer messages carry, computed here as docs/transfer.md ("Peer proofs") specifies them, not
// with the server's code: "v2:" and the hex HMAC-SHA256, keyed with the token, of
// "replayssm-peer-proof-v2\n" and the method, transfer id, tenant and content, each
// <decimal length>:<bytes>; the content the message's fields, each the same way.
#ifndef REPLAYSSM_TESTS_PEER_PROOFS_H_
#define REPLAYSSM_TESTS_PEER_PROOFS_H_

#include <string>

#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/v1/transfer.pb.h"

namespace replayssm::testing {

// The metadata key of a peer call's proof of the peer token.
inline constexpr char kPeerProofKey[] = "replayssm-peer-proof";

// <decimal length>:<bytes>.
std::string ProofField(absl::string_view bytes);
// The proof of `token` for one message; `method` is "<Rpc>" or "<Rpc>/reply".
std::string PeerProof(absl::string_view token, absl::string_view method, absl::string_view id,
                      absl::string_view tenant, absl::string_view content);

// Each message's content, as docs/transfer.md lists its fields.
std::string ReserveContent(const v1::ReserveTransferRequest& r);
std::string ReserveReplyContent(absl::string_view nonce, const v1::ReserveTransferResponse& r);
std::string CommitContent(const v1::CommitTransferRequest& r);
std::string CommitReplyContent(absl::string_view nonce, const v1::CommitTransferResponse& r);
std::string AbortContent(const v1::AbortTransferRequest& r);
std::string AbortReplyContent(absl::string_view nonce, const v1::AbortTransferResponse& r);

// The cluster's peer token (--peer-token), owner-readable only.
class PeerTokenFile {
 public:
  PeerTokenFile();
  ~PeerTokenFile();
  std::string Flag() const { return "--peer-token=" + path_; }
  static constexpr char kPeerToken[] = "peer-token-0123456789abcdef";
  // What a server holding the token sends with a peer call.
  static void Prove(grpc::ClientContext& c, const std::string& method, const std::string& id,
                    const std::string& tenant, const std::string& content);
  // The requests, proven (a nonce drawn when they have none).
  static void Prove(grpc::ClientContext& c, v1::ReserveTransferRequest& r);
  static void Prove(grpc::ClientContext& c, v1::CommitTransferRequest& r);
  static void Prove(grpc::ClientContext& c, v1::AbortTransferRequest& r);

 private:
  std::string path_;
};

}  // namespace replayssm::testing

#endif  // REPLAYSSM_TESTS_PEER_PROOFS_H_
