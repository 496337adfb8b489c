#include "peer_proofs.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace replayssm::testing {
namespace {

template <typename... V>
std::string Fields(const V&... v) {
  return absl::StrCat(ProofField(absl::StrCat(v))...);
}

std::string Hex(const unsigned char* p, unsigned int n) {
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(p), n));
}

int nonces = 0;

// A test's nonce: distinct per call, 32 characters.
std::string TestNonce() { return absl::StrCat("test-nonce-", getpid(), "-", ++nonces, "-padding"); }

}  // namespace

std::string ProofField(absl::string_view bytes) { return absl::StrCat(bytes.size(), ":", bytes); }

std::string PeerProof(absl::string_view token, absl::string_view method, absl::string_view id,
                      absl::string_view tenant, absl::string_view content) {
  const std::string message = absl::StrCat("replayssm-peer-proof-v2\n", ProofField(method),
                                           ProofField(id), ProofField(tenant), ProofField(content));
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac, &n);
  return absl::StrCat("v2:", Hex(mac, n));
}

std::string ReserveContent(const v1::ReserveTransferRequest& r) {
  const v1::StateFormat& f = r.format();
  return Fields(f.num_layers(), f.gate(), f.num_qk_heads(), f.num_v_heads(), f.head_k(), f.head_v(),
                f.state_dtype(), f.params_hash(), f.conv_width(), f.conv_dtype(), f.ring_dtype(),
                f.round_beta() ? 1 : 0, static_cast<int>(f.head_layout()), f.tp_size(), r.seq_len(),
                r.checksum_version(), r.budget_ms(), r.nonce());
}

std::string ReserveReplyContent(absl::string_view nonce, const v1::ReserveTransferResponse& r) {
  return Fields(nonce, r.worker_address(), r.remote_addr(), r.rkey(), r.bytes(), r.doorbell_addr());
}

std::string CommitContent(const v1::CommitTransferRequest& r) {
  std::string bytes;
  for (int32_t t : r.tokens()) {
    const auto u = static_cast<uint32_t>(t);
    const char le[4] = {static_cast<char>(u), static_cast<char>(u >> 8), static_cast<char>(u >> 16),
                        static_cast<char>(u >> 24)};
    bytes.append(le, 4);
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr);
  return Fields(r.tokens_size(), Hex(md, n), r.checksum(), r.nonce());
}

std::string CommitReplyContent(absl::string_view nonce, const v1::CommitTransferResponse& r) {
  return Fields(nonce, r.slot());
}

std::string AbortContent(const v1::AbortTransferRequest& r) { return Fields(r.nonce()); }

std::string AbortReplyContent(absl::string_view nonce, const v1::AbortTransferResponse& r) {
  return Fields(nonce, r.committed() ? 1 : 0, r.slot(), r.seq_len());
}

PeerTokenFile::PeerTokenFile()
    : path_(absl::StrCat(::testing::TempDir(), "/replayssm-peer-", getpid())) {
  std::ofstream(path_) << kPeerToken << "\n";
  chmod(path_.c_str(), 0600);
}

PeerTokenFile::~PeerTokenFile() { std::remove(path_.c_str()); }

void PeerTokenFile::Prove(grpc::ClientContext& c, const std::string& method, const std::string& id,
                          const std::string& tenant, const std::string& content) {
  c.AddMetadata(kPeerProofKey, PeerProof(kPeerToken, method, id, tenant, content));
}

void PeerTokenFile::Prove(grpc::ClientContext& c, v1::ReserveTransferRequest& r) {
  if (r.nonce().empty()) r.set_nonce(TestNonce());
  Prove(c, "ReserveTransfer", r.transfer_id(), r.tenant(), ReserveContent(r));
}

void PeerTokenFile::Prove(grpc::ClientContext& c, v1::CommitTransferRequest& r) {
  if (r.nonce().empty()) r.set_nonce(TestNonce());
  Prove(c, "CommitTransfer", r.transfer_id(), "", CommitContent(r));
}

void PeerTokenFile::Prove(grpc::ClientContext& c, v1::AbortTransferRequest& r) {
  if (r.nonce().empty()) r.set_nonce(TestNonce());
  Prove(c, "AbortTransfer", r.transfer_id(), "", AbortContent(r));
}

}  // namespace replayssm::testing
