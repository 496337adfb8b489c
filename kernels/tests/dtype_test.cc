#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "../src/dtype.h"

namespace replayssm::kernels {
namespace {

TEST(Dtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(FromFloat<Bf16>(1.0f).bits, 0x3f80);
  EXPECT_EQ(FromFloat<Bf16>(-2.0f).bits, 0xc000);
  EXPECT_EQ(ToFloat(Bf16{0x3f81}), 1.0078125f);
  EXPECT_EQ(FromFloat<Bf16>(1.00390625f).bits, 0x3f80);  // halfway: to even
  EXPECT_EQ(FromFloat<Bf16>(1.01171875f).bits, 0x3f82);  // halfway: to even (up)
  EXPECT_TRUE(std::isnan(ToFloat(FromFloat<Bf16>(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Dtype, F16RoundTripsAndRounds) {
  EXPECT_EQ(FromFloat<F16>(1.0f).bits, 0x3c00);
  EXPECT_EQ(FromFloat<F16>(-0.5f).bits, 0xb800);
  EXPECT_EQ(FromFloat<F16>(65504.f).bits, 0x7bff);
  EXPECT_EQ(FromFloat<F16>(1e6f).bits, 0x7c00);                // overflow to inf
  EXPECT_EQ(FromFloat<F16>(5.9604645e-8f).bits, 0x0001);       // smallest subnormal
  EXPECT_EQ(FromFloat<F16>(1.0f + 1.0f / 2048).bits, 0x3c00);  // halfway: to even
  for (uint32_t bits = 0; bits < 0x7c00; ++bits) {             // every finite half round-trips
    const F16 h{static_cast<uint16_t>(bits)};
    ASSERT_EQ(FromFloat<F16>(ToFloat(h)).bits, h.bits) << bits;
  }
  EXPECT_TRUE(std::isnan(ToFloat(FromFloat<F16>(std::numeric_limits<float>::quiet_NaN()))));
}

}  // namespace
}  // namespace replayssm::kernels
