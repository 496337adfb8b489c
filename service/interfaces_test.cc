#include "service/interfaces.h"

#include "gtest/gtest.h"

namespace replayssm::service {
namespace {

TEST(Interfaces, TheHostOfAnAddressIsWhatPrecedesItsPort) {
  EXPECT_EQ(HostOfAddress("127.0.0.1:50051"), "127.0.0.1");
  EXPECT_EQ(HostOfAddress("[::1]:0"), "::1");
  EXPECT_EQ(HostOfAddress("0.0.0.0:50051"), "0.0.0.0");
  EXPECT_EQ(HostOfAddress("replayssm-0.replayssm:50051"), "replayssm-0.replayssm");
}

TEST(Interfaces, LoopbackAddressesAreOnTheLoopbackInterfaceAndWildcardsOnNone) {
  const std::optional<std::string> lo = InterfaceHolding("127.0.0.1");
  ASSERT_TRUE(lo.has_value()) << "every Linux host has a loopback interface";
  EXPECT_EQ(InterfaceHolding("localhost"), lo);
  EXPECT_EQ(InterfaceHolding("127.0.0.2"), lo) << "127/8 is loopback, held or not";
  EXPECT_EQ(InterfaceHolding("0.0.0.0"), std::nullopt);
  EXPECT_EQ(InterfaceHolding("::"), std::nullopt);
  EXPECT_EQ(InterfaceHolding(""), std::nullopt);
  EXPECT_EQ(InterfaceHolding("replayssm-0.replayssm"), std::nullopt) << "names: not resolved";
  EXPECT_EQ(InterfaceHolding("192.0.2.254"), std::nullopt) << "TEST-NET-1: no interface here";
}

}  // namespace
}  // namespace replayssm::service
