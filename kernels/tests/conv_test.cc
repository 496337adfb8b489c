// The short convolution on the CPU backend against the fp64 reference of conv_scenario.cc,
// and its argument checks.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "conv_scenario.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {
namespace {

TEST(ShortConv, MatchesTheReferenceOverEveryDtypeWidthAndRing) {
  ConvSweep(RSSM_BACKEND_CPU, {1, 2, 8}, {8, 40, 264}, 1);
}

// A bad call writes nothing: every check runs before any work.
class ConvArgs : public ::testing::Test {
 protected:
  void SetUp() override {
    window_.assign(2 * 3 * 8, 1.f);
    ring_.assign(2 * 4 * 8, 2.f);
    x_.assign(8, 3.f);
    y_.assign(8, 4.f);
    a_.launch = {RSSM_BACKEND_CPU, nullptr};
    a_.shape = {8, 4, 4, RSSM_DTYPE_F32};
    a_.weight = weight_.data();
    a_.state = {window_.data(), ring_.data(), 2, 0, 0};
    a_.mode = RSSM_CONV_APPEND;
    a_.batch = 1;
    a_.slot_idx = &slot_;
    a_.write_pos = &pos_;
    a_.num_tokens = 1;
    a_.x = x_.data();
    a_.y = y_.data();
  }
  // Calls and expects INVALID_ARGUMENT naming `field`, with nothing written.
  void ExpectRefused(const std::string& field) {
    const std::vector<float> w0 = window_, r0 = ring_, y0 = y_;
    EXPECT_EQ(rssm_short_conv(&a_), RSSM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(rssm_last_error()).find(field), std::string::npos) << rssm_last_error();
    EXPECT_EQ(window_, w0);
    EXPECT_EQ(ring_, r0);
    EXPECT_EQ(y_, y0);
  }

  std::vector<float> weight_ = std::vector<float>(32, 0.5f), window_, ring_, x_, y_;
  int32_t slot_ = 1, pos_ = 0;
  rssm_conv_args a_{};
};

TEST_F(ConvArgs, AValidCallRuns) {
  EXPECT_EQ(rssm_short_conv(&a_), RSSM_OK) << rssm_last_error();
  EXPECT_EQ(ring_[4 * 8], 3.f);  // slot 1's record 0 is the input
}

TEST_F(ConvArgs, AppendPastTheRingIsRefused) {
  pos_ = 4;
  ExpectRefused("write_pos[0]");
  pos_ = 2;
  a_.num_tokens = 3;  // 2 + 3 > 4
  x_.assign(24, 3.f);
  y_.assign(24, 4.f);
  ExpectRefused("write_pos[0]");
}

TEST_F(ConvArgs, EachFieldIsChecked) {
  a_.shape.width = 9;
  ExpectRefused("shape.width");
  a_.shape.width = 4;
  a_.shape.channels = 12;
  ExpectRefused("shape.channels");
  a_.shape.channels = 8;
  a_.weight = nullptr;
  ExpectRefused("weight");
  a_.weight = weight_.data();
  a_.mode = 7;
  ExpectRefused("mode");
  a_.mode = RSSM_CONV_APPEND;
  slot_ = 2;
  ExpectRefused("slot_idx[0]");
  slot_ = 1;
  a_.y = y_.data();
  a_.x = y_.data();
  ExpectRefused("y");
  a_.x = x_.data();
  a_.state.window_slot_stride = 5;
  ExpectRefused("state.window_slot_stride");
  a_.state.window_slot_stride = 0;
  a_.mode = RSSM_CONV_PREFILL;
  const uint8_t two = 2;
  a_.initial = &two;
  ExpectRefused("initial[0]");
}

TEST(ConvFold, RefusesABadCursorAndWritesNothing) {
  std::vector<float> window(3 * 8, 1.f), ring(4 * 8, 2.f);
  const int32_t slot = 0, pos = 5;
  const rssm_conv_fold_args f{{RSSM_BACKEND_CPU, nullptr},
                              {8, 4, 4, RSSM_DTYPE_F32},
                              {window.data(), ring.data(), 1, 0, 0},
                              1,
                              &slot,
                              &pos};
  EXPECT_EQ(rssm_conv_fold(&f), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("write_pos[0]"), std::string::npos);
  EXPECT_EQ(window, std::vector<float>(3 * 8, 1.f));
}

}  // namespace
}  // namespace replayssm::kernels::testing

namespace replayssm::kernels::testing {
namespace {

TEST(CountNonfinite, CountsNaNAndInfOverEveryPartAndDtype) {
  for (rssm_dtype dt : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16}) {
    SCOPED_TRACE(rssm_dtype_name(dt));
    const size_t es = rssm_dtype_size(dt);
    // Two parts of 100 elements: all-zero bytes are finite; 0xff bytes are NaN in every dtype;
    // +Inf's pattern per dtype.
    std::vector<uint8_t> a(100 * es, 0), b(100 * es, 0);
    std::memset(a.data() + 3 * es, 0xff, es);
    std::memset(b.data() + 99 * es, 0xff, es);
    const uint32_t inf32 = 0x7f800000u;
    const uint16_t inf16 = dt == RSSM_DTYPE_BF16 ? 0x7f80 : 0x7c00;
    if (es == 4) {
      std::memcpy(b.data(), &inf32, 4);
    } else {
      std::memcpy(b.data(), &inf16, 2);
    }
    const void* parts[2] = {a.data(), b.data()};
    const rssm_launch cpu{RSSM_BACKEND_CPU, nullptr};
    uint32_t n = 77;
    ASSERT_EQ(rssm_count_nonfinite(&cpu, parts, parts, 2, 100, dt, &n), RSSM_OK)
        << rssm_last_error();
    EXPECT_EQ(n, 3u);
    ASSERT_EQ(rssm_count_nonfinite(&cpu, parts, parts, 1, 100, dt, &n), RSSM_OK);
    EXPECT_EQ(n, 1u);
    ASSERT_EQ(rssm_count_nonfinite(&cpu, parts, parts, 0, 100, dt, &n), RSSM_OK);
    EXPECT_EQ(n, 0u) << "no parts: nothing is non-finite";
  }
  uint32_t n = 0;
  const rssm_launch cpu{RSSM_BACKEND_CPU, nullptr};
  const void* none[1] = {nullptr};
  EXPECT_EQ(rssm_count_nonfinite(&cpu, none, none, 1, 4, RSSM_DTYPE_F32, &n),
            RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("parts[0]"), std::string::npos);
  EXPECT_EQ(rssm_count_nonfinite(&cpu, none, none, 1, 4, 9, &n), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("dtype"), std::string::npos);
}

}  // namespace
}  // namespace replayssm::kernels::testing
