#include "service/tenants.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace replayssm::service {
namespace {

constexpr char kTokenA[] = "token-of-alice-0123456789";
constexpr char kTokenB[] = "token-of-bob-0123456789ab";

class TokenFile {
 public:
  TokenFile() : path_(absl::StrCat(::testing::TempDir(), "/tokens-", getpid(), "-", ++n_)) {}
  ~TokenFile() { std::remove(path_.c_str()); }
  // Writes through a new file renamed over the old one (a new inode, as Kubernetes does).
  void Write(const std::string& text) const {
    const std::string tmp = path_ + ".new";
    std::ofstream(tmp) << text;
    std::rename(tmp.c_str(), path_.c_str());
  }
  const std::string& path() const { return path_; }

 private:
  static inline int n_ = 0;
  std::string path_;
};

TEST(TokenStore, ParsesPairsCommentsAndBlankLines) {
  auto pairs =
      TokenStore::Parse(absl::StrCat("# tenants\n\nalice ", kTokenA, "  # rotated monthly\n  bob\t",
                                     kTokenB, "\nalice token-of-alice-second-one\n"),
                        "f");
  ASSERT_TRUE(pairs.ok()) << pairs.status();
  ASSERT_EQ(pairs->size(), 3u);
  EXPECT_EQ((*pairs)[1].first, "bob");
  EXPECT_EQ((*pairs)[1].second, kTokenB);
}

TEST(TokenStore, BadLinesNameTheLineAndNeverTheToken) {
  const struct {
    std::string text, message;
  } cases[] = {
      {"alice\n", "f:1: expected `tenant token`, got 1 field"},
      {"\nalice a b\n", "f:2: expected `tenant token`, got 3 fields"},
      {absl::StrCat("al/ice ", kTokenA), "f:1: tenant: expected 1..64 of [A-Za-z0-9._-], got"},
      {"alice short", "f:1: token: expected 16..256 printable ASCII characters, got 5"},
      {absl::StrCat("alice ", kTokenA, "\nbob ", kTokenA),
       "f:2: token: expected a token no "
       "other line has, got the token of "
       "tenant \"alice\" again"},
  };
  for (const auto& c : cases) {
    auto pairs = TokenStore::Parse(c.text, "f");
    ASSERT_FALSE(pairs.ok()) << c.text;
    EXPECT_EQ(pairs.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(pairs.status().message().find(c.message), std::string::npos)
        << pairs.status().message();
    EXPECT_EQ(pairs.status().message().find(kTokenA), std::string::npos) << "a token leaked";
  }
}

TEST(TokenStore, AuthenticatesBearerTokensToTenants) {
  TokenFile f;
  f.Write(absl::StrCat("alice ", kTokenA, "\nbob ", kTokenB, "\n"));
  auto store = TokenStore::Load(f.path());
  ASSERT_TRUE(store.ok()) << store.status();
  auto a = (*store)->Authenticate(absl::StrCat("Bearer ", kTokenA));
  auto b = (*store)->Authenticate(absl::StrCat("Bearer ", kTokenB));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE(*a, *b);
  EXPECT_NE(*a, kImplicitTenant);
  EXPECT_EQ((*store)->Name(*a), "alice");
  EXPECT_EQ((*store)->Find("bob"), *b);
  EXPECT_FALSE((*store)->Find("carol").has_value());
  AuthFailure why{};
  EXPECT_EQ((*store)->Authenticate(std::nullopt, &why).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(why, AuthFailure::kMissing);
  EXPECT_EQ((*store)->Authenticate(kTokenA, &why).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(why, AuthFailure::kMalformed);
  EXPECT_EQ((*store)->Authenticate("Bearer token-of-nobody-0123456", &why).status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ(why, AuthFailure::kUnknown);
}

TEST(TokenStore, ReloadsAChangedFileAndKeepsTokensWhenItBreaks) {
  TokenFile f;
  f.Write(absl::StrCat("alice ", kTokenA, "\n"));
  auto store = TokenStore::Load(f.path());
  ASSERT_TRUE(store.ok());
  const TenantId alice = *(*store)->Authenticate(absl::StrCat("Bearer ", kTokenA));
  f.Write(absl::StrCat("bob ", kTokenB, "\n"));
  // A token not known yet makes the store look at the file at once.
  auto bob = (*store)->Authenticate(absl::StrCat("Bearer ", kTokenB));
  ASSERT_TRUE(bob.ok()) << bob.status();
  EXPECT_NE(*bob, alice);
  EXPECT_FALSE((*store)->Authenticate(absl::StrCat("Bearer ", kTokenA)).ok()) << "removed";
  f.Write(absl::StrCat("alice ", kTokenA, "\nbob ", kTokenB, "\n"));
  ASSERT_TRUE((*store)->Reload(/*force=*/false).ok());
  EXPECT_EQ(*(*store)->Authenticate(absl::StrCat("Bearer ", kTokenA)), alice)
      << "a tenant keeps its id for the process's life";
  f.Write("alice\n");
  EXPECT_FALSE((*store)->Reload(/*force=*/false).ok());
  EXPECT_EQ((*store)->reload_failures(), 1);
  EXPECT_TRUE((*store)->Authenticate(absl::StrCat("Bearer ", kTokenB)).ok())
      << "a file that does not parse leaves the loaded tokens";
}

TEST(TokenStore, AMissingOrBadFileStopsTheStart) {
  EXPECT_EQ(TokenStore::Load("/nonexistent/tokens").status().code(),
            absl::StatusCode::kInvalidArgument);
  TokenFile f;
  f.Write("alice\n");
  auto store = TokenStore::Load(f.path());
  ASSERT_FALSE(store.ok());
  EXPECT_NE(store.status().message().find(f.path() + ":1:"), std::string::npos);
}

}  // namespace
}  // namespace replayssm::service
