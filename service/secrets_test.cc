#include "service/secrets.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace replayssm::service {
namespace {

TEST(Secrets, ConstantTimeEqualsComparesWholeStrings) {
  EXPECT_TRUE(ConstantTimeEquals("", ""));
  EXPECT_TRUE(ConstantTimeEquals("alice-token-0123456789", "alice-token-0123456789"));
  EXPECT_FALSE(ConstantTimeEquals("alice-token-0123456789", "Alice-token-0123456789"));
  EXPECT_FALSE(ConstantTimeEquals("alice-token-0123456789", "alice-token-012345678X"));
  EXPECT_FALSE(ConstantTimeEquals("alice-token", "alice-token-0123456789")) << "a prefix";
  EXPECT_FALSE(ConstantTimeEquals("alice-token-0123456789", "alice-token"));
  EXPECT_FALSE(ConstantTimeEquals(std::string("ab\0", 3), "ab")) << "a trailing zero byte";
}

TEST(Secrets, AFileOthersOrAForeignGroupMayReadIsReported) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/replayssm-secret-", getpid());
  std::ofstream(path) << "alice alice-token-0123456789abcdef\n";
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  EXPECT_EQ(ExposureWarning("auth-tokens", path), std::nullopt);
  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  EXPECT_EQ(ExposureWarning("auth-tokens", path), std::nullopt)
      << "the file's group is the server's own (as a Kubernetes fsGroup)";
  ASSERT_EQ(chmod(path.c_str(), 0604), 0);
  std::optional<std::string> others = ExposureWarning("auth-tokens", path);
  ASSERT_TRUE(others.has_value());
  EXPECT_NE(others->find("--auth-tokens " + path + " may be read by others (mode 0604)"),
            std::string::npos)
      << *others;
  EXPECT_EQ(others->find("alice-token"), std::string::npos) << "never the secret";
  // A group the server is not in (only root can give the file one here).
  if (chown(path.c_str(), static_cast<uid_t>(-1), 54321) == 0) {
    ASSERT_EQ(chmod(path.c_str(), 0640), 0);
    std::optional<std::string> group = ExposureWarning("auth-tokens", path);
    ASSERT_TRUE(group.has_value());
    EXPECT_NE(group->find("may be read by another group (mode 0640)"), std::string::npos)
        << *group;
  }
  std::remove(path.c_str());
  EXPECT_EQ(ExposureWarning("auth-tokens", path), std::nullopt) << "gone: nothing to say";
}

TEST(PeerTokens, TheFirstIsProvedAndEveryOneAcceptedForItsCallOnly) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/replayssm-peer-", getpid());
  std::ofstream(path) << "# the cluster's peer tokens\nnew-peer-token-0123456789\n\n"
                         "old-peer-token-0123456789  # going\n";
  absl::StatusOr<std::unique_ptr<PeerTokens>> t = PeerTokens::Load(path);
  ASSERT_TRUE(t.ok()) << t.status();
  // The proof of the first token, as `printf 'replayssm-peer-proof-v2\n15:ReserveTransfer7:
  // move-175:alice5:3:abc' | openssl dgst -sha256 -hmac new-peer-token-0123456789` computes it
  // (the content "3:abc": one field).
  const std::string content = PeerProofField("abc");
  EXPECT_EQ(content, "3:abc");
  const std::string proof = (*t)->Prove("ReserveTransfer", "move-17", "alice", content);
  EXPECT_EQ(proof, "v2:161c4c1c44928875287d729b26e3d87c4549c322648994ee2c1e598d868009ad");
  EXPECT_EQ(proof.find("peer-token"), std::string::npos) << "never the token";
  EXPECT_TRUE((*t)->Accepts(proof, "ReserveTransfer", "move-17", "alice", content));
  // Every token of the file is accepted (rotation), for the very message it was made for only.
  const std::string old_commit =
      PeerProof("old-peer-token-0123456789", "CommitTransfer", "move-17", "", "");
  EXPECT_EQ(old_commit, "v2:f6977eae8255edc01ca1bfabf7f15771bcf0bab8509356c74d3bd5e197443cb4");
  EXPECT_TRUE((*t)->Accepts(old_commit, "CommitTransfer", "move-17", "", ""));
  EXPECT_FALSE((*t)->Accepts(proof, "ReserveTransfer", "move-17", "bob", content))
      << "another tenant";
  EXPECT_FALSE((*t)->Accepts(proof, "ReserveTransfer", "move-18", "alice", content))
      << "another id";
  EXPECT_FALSE((*t)->Accepts(proof, "AbortTransfer", "move-17", "alice", content))
      << "another method";
  EXPECT_FALSE((*t)->Accepts(proof, "ReserveTransfer/reply", "move-17", "alice", content))
      << "a request's proof is no reply's";
  EXPECT_FALSE((*t)->Accepts(proof, "ReserveTransfer", "move-17", "alice", PeerProofField("abd")))
      << "another content";
  EXPECT_FALSE((*t)->Accepts(
      PeerProof("new-peer-token-012345678", "ReserveTransfer", "move-17", "alice", content),
      "ReserveTransfer", "move-17", "alice", content))
      << "another token";
  EXPECT_FALSE(
      (*t)->Accepts("new-peer-token-0123456789", "ReserveTransfer", "move-17", "alice", content))
      << "the token itself is no proof";
  EXPECT_FALSE((*t)->Accepts("", "ReserveTransfer", "move-17", "alice", content));
  // The fields are length-prefixed: moving bytes between them changes the proof.
  EXPECT_NE(PeerProof("new-peer-token-0123456789", "ReserveTransfer", "move-1", "7alice", content),
            proof);
  EXPECT_NE(
      PeerProof("new-peer-token-0123456789", "ReserveTransfer", "move-17", "alice5:3:abc", ""),
      proof);
  // Nonces: 32 hex digits, never the same twice.
  const std::string n1 = PeerNonce(), n2 = PeerNonce();
  EXPECT_EQ(n1.size(), 32u);
  EXPECT_NE(n1, n2);
  std::ofstream(path) << "short\n";
  absl::StatusOr<std::unique_ptr<PeerTokens>> bad = PeerTokens::Load(path);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find(path + ":1: token: expected 16..256"), std::string::npos)
      << bad.status();
  EXPECT_EQ(bad.status().message().find("short"), std::string::npos) << "never the token";
  std::ofstream(path) << "# nothing\n";
  EXPECT_EQ(PeerTokens::Load(path).status().code(), absl::StatusCode::kInvalidArgument);
  std::remove(path.c_str());
  EXPECT_EQ(PeerTokens::Load(path).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace replayssm::service
