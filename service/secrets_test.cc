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

TEST(Secrets, AFileItsGroupOrOthersMayReadIsReported) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/replayssm-secret-", getpid());
  std::ofstream(path) << "alice alice-token-0123456789abcdef\n";
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  EXPECT_EQ(ExposureWarning("auth-tokens", path), std::nullopt);
  ASSERT_EQ(chmod(path.c_str(), 0640), 0);
  std::optional<std::string> group = ExposureWarning("auth-tokens", path);
  ASSERT_TRUE(group.has_value());
  EXPECT_NE(group->find("--auth-tokens " + path + " may be read by its group (mode 0640)"),
            std::string::npos)
      << *group;
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  std::optional<std::string> both = ExposureWarning("auth-tokens", path);
  ASSERT_TRUE(both.has_value());
  EXPECT_NE(both->find("its group and others"), std::string::npos) << *both;
  EXPECT_EQ(both->find("alice-token"), std::string::npos) << "never the secret";
  std::remove(path.c_str());
  EXPECT_EQ(ExposureWarning("auth-tokens", path), std::nullopt) << "gone: nothing to say";
}

}  // namespace
}  // namespace replayssm::service
