#include "service/secrets.h"

#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace replayssm::service {
namespace {

constexpr size_t kMinTokenBytes = 16;  // as a tenant's: a guessable token is no authentication
constexpr size_t kMaxTokenBytes = 256;

// Whether `gid` is the server's user's effective or a supplementary group.
bool InOwnGroups(gid_t gid) {
  if (gid == getegid()) return true;
  const int n = getgroups(0, nullptr);
  if (n <= 0) return false;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  groups.resize(static_cast<size_t>(std::max(getgroups(n, groups.data()), 0)));
  return std::find(groups.begin(), groups.end(), gid) != groups.end();
}

}  // namespace

bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  // Every byte of the longer one is looked at whatever the others hold; the accumulator is
  // volatile so that the compiler cannot stop at the first difference.
  volatile uint8_t diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const uint8_t x = i < a.size() ? static_cast<uint8_t>(a[i]) : 0;
    const uint8_t y = i < b.size() ? static_cast<uint8_t>(b[i]) : 0;
    diff = diff | static_cast<uint8_t>(x ^ y);
  }
  return diff == 0;
}

std::optional<std::string> ExposureWarning(absl::string_view flag, const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return std::nullopt;
  // A group the server's user is in is the server's own (Kubernetes: the pod's fsGroup).
  const bool group = (st.st_mode & S_IRGRP) != 0 && !InOwnGroups(st.st_gid);
  const bool others = (st.st_mode & S_IROTH) != 0;
  if (!group && !others) return std::nullopt;
  char mode[8];
  std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
  return absl::StrCat("--", flag, " ", path, " may be read by ",
                      group && others ? "another group and others"
                      : group         ? "another group"
                                      : "others",
                      " (mode ", mode, "): a secret should be readable by the server's user "
                      "(and its own groups) only: chmod 600");
}

absl::StatusOr<std::unique_ptr<PeerTokens>> PeerTokens::Load(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peer-token: expected a readable file, got \"", path, "\""));
  }
  std::vector<std::string> tokens;
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text.str(), '\n')) {
    ++n;
    if (size_t hash = line.find('#'); hash != absl::string_view::npos) line = line.substr(0, hash);
    line = absl::StripAsciiWhitespace(line);
    if (line.empty()) continue;
    bool printable = line.size() >= kMinTokenBytes && line.size() <= kMaxTokenBytes;
    for (char c : line) printable = printable && c > ' ' && c <= '~';
    if (!printable) {  // the token itself is never echoed
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", n, ": token: expected ", kMinTokenBytes, "..", kMaxTokenBytes,
          " printable ASCII characters without spaces, got ", line.size(),
          " characters or others"));
    }
    tokens.emplace_back(line);
  }
  if (tokens.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a peer token (one per line), got none"));
  }
  return std::unique_ptr<PeerTokens>(new PeerTokens(std::move(tokens)));
}

std::string PeerProofField(absl::string_view bytes) {
  return absl::StrCat(bytes.size(), ":", bytes);
}

std::string PeerProof(absl::string_view token, absl::string_view method,
                      absl::string_view transfer_id, absl::string_view tenant,
                      absl::string_view content) {
  const std::string message =
      absl::StrCat("replayssm-peer-proof-v2\n", PeerProofField(method), PeerProofField(transfer_id),
                   PeerProofField(tenant), PeerProofField(content));
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
           reinterpret_cast<const unsigned char*>(message.data()), message.size(), mac,
           &n) == nullptr ||
      n != 32) {
    return "";  // no proof: Accepts takes none, and "v2:" alone is never one
  }
  return absl::StrCat("v2:",
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(mac), n)));
}

std::string PeerNonce() {
  unsigned char bytes[16];
  if (RAND_bytes(bytes, sizeof(bytes)) != 1) return "";
  return absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(bytes), sizeof(bytes)));
}

std::string PeerTokens::Prove(absl::string_view method, absl::string_view transfer_id,
                              absl::string_view tenant, absl::string_view content) const {
  return PeerProof(tokens_.front(), method, transfer_id, tenant, content);
}

bool PeerTokens::Accepts(absl::string_view proof, absl::string_view method,
                         absl::string_view transfer_id, absl::string_view tenant,
                         absl::string_view content) const {
  bool accepted = false;
  for (const std::string& t : tokens_) {
    const std::string mine = PeerProof(t, method, transfer_id, tenant, content);
    accepted = (!mine.empty() && ConstantTimeEquals(mine, proof)) || accepted;
  }
  return accepted;
}

}  // namespace replayssm::service
