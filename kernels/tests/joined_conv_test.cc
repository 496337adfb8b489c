// The convolution joined to the replay decode step (rssm_decode_args.conv) on the CPU
// backend: equal to the two plain calls (joined_conv_scenario.h), and its argument checks.
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "joined_conv_scenario.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {
namespace {

TEST(JoinedConv, EqualsTheSeparateCallsBitForBit) {
  JoinedConvSweep(RSSM_BACKEND_CPU, rssm_replay_decode, 1);
}

// A refused call writes nothing: outputs, the recurrent state and the convolution's.
class JoinedConvArgs : public ::testing::Test {
 protected:
  JoinedConvArgs() : rng_(3), layer_(Cfg(), 2, rng_), tok_(layer_, 1, rng_) {}
  static Config Cfg() {
    Config c;
    c.h = 1, c.hv = 1, c.k = 16, c.v = 16, c.l = 4;
    c.act_dtype = RSSM_DTYPE_F32;
    return c;
  }
  void SetUp() override {
    layer_.RandomCheckpoint(0, rng_);
    layer_.RandomCheckpoint(1, rng_);
    out_ = Buffer(RSSM_DTYPE_F32, 16);
    a_ = layer_.DecodeArgs(1, &slot_, &pos_, tok_, out_);
    conv_ = {4, weight_.data(), nullptr, {window_.data(), ring_x_.data(), 2, 0, 0}, y_.data()};
    a_.conv = &conv_;
  }
  void ExpectRefused(const std::string& field, bool baseline = false) {
    const auto cp = layer_.checkpoint.bytes();
    const auto w0 = window_, r0 = ring_x_;
    const auto o0 = out_.bytes();
    EXPECT_EQ(baseline ? rssm_baseline_decode(&a_) : rssm_replay_decode(&a_),
              RSSM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(rssm_last_error()).find(field), std::string::npos) << rssm_last_error();
    EXPECT_EQ(layer_.checkpoint.bytes(), cp);
    EXPECT_EQ(window_, w0);
    EXPECT_EQ(ring_x_, r0);
    EXPECT_EQ(out_.bytes(), o0);
  }

  static constexpr int kC = 2 * 16 + 16;  // q | k | v channels
  std::mt19937_64 rng_;
  Layer layer_;
  Tokens tok_;
  Buffer out_;
  int32_t slot_ = 1, pos_ = 0;
  std::vector<float> weight_ = std::vector<float>(kC * 4, 0.25f);
  std::vector<float> window_ = std::vector<float>(2 * 3 * kC, 1.f);
  std::vector<float> ring_x_ = std::vector<float>(2 * 4 * kC, 2.f);
  std::vector<float> y_ = std::vector<float>(kC, 0.f);
  rssm_decode_conv conv_{};
  rssm_decode_args a_{};
};

TEST_F(JoinedConvArgs, AValidCallAppendsTheInput) {
  pos_ = 2;
  ASSERT_EQ(rssm_replay_decode(&a_), RSSM_OK) << rssm_last_error();
  // Slot 1's ring_x[2] holds the raw input (channel 0 is q's first); y its convolution.
  EXPECT_EQ(ring_x_[(4 + 2) * kC], tok_.qkv.Get(0));
  EXPECT_NE(y_[0], 0.f);
}

TEST_F(JoinedConvArgs, EachFieldIsChecked) {
  ExpectRefused("conv", /*baseline=*/true);
  conv_.width = 9;
  ExpectRefused("conv->width");
  conv_.width = 4;
  conv_.weight = nullptr;
  ExpectRefused("conv->weight");
  conv_.weight = weight_.data();
  conv_.state.window = nullptr;
  ExpectRefused("conv->state.window");
  conv_.state.window = window_.data();
  conv_.state.ring_x_slot_stride = 3;
  ExpectRefused("conv->state.ring_x_slot_stride");
  conv_.state.ring_x_slot_stride = 0;
  conv_.state.num_slots = 1;
  ExpectRefused("conv->state.num_slots");
  conv_.state.num_slots = 2;
  conv_.y = nullptr;
  ExpectRefused("conv->y");
  conv_.y = const_cast<void*>(a_.in.mixed_qkv);
  ExpectRefused("conv->y");
  conv_.y = y_.data();
  pos_ = 4;  // w = L: no ring entry left for the input
  ExpectRefused("write_pos[0]");
}

}  // namespace
}  // namespace replayssm::kernels::testing
