// The short convolution on the device: the CPU tests' scenario (decode, verify + accept,
// prefill from the slot or from zeros, folds, padding, strides) against the fp64 reference.
#include <gtest/gtest.h>

#include <string>

#include "tests/conv_scenario.h"

namespace replayssm::kernels::testing {
namespace {

TEST(CudaShortConv, MatchesTheReference) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  uint64_t seed = 100;
  for (rssm_dtype dt : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16}) {
    for (int width : {2, 4, 8}) {
      for (int ring : {1, 8}) {
        for (int channels : {8, 40, 520}) {
          ConvConfig c;
          c.backend = RSSM_BACKEND_CUDA;
          c.act_dtype = dt;
          c.width = width;
          c.ring_len = ring;
          c.channels = channels;
          c.bias = seed % 2 == 0;
          c.slot_pad = seed % 3 == 0 ? 8 : 0;
          c.seed = seed++;
          const ConvResult r = RunConvScenario(c);
          SCOPED_TRACE(std::string(rssm_dtype_name(dt)) + " W=" + std::to_string(width) +
                       " L=" + std::to_string(ring) + " C=" + std::to_string(channels));
          ASSERT_EQ(r.failure, "");
          EXPECT_GT(r.outputs, 0);
          EXPECT_LE(r.max_out_err, ConvTolerance(dt));
          EXPECT_EQ(r.state_mismatches, 0);
          EXPECT_EQ(r.untouched_violations, 0);
        }
      }
    }
  }
}

}  // namespace
}  // namespace replayssm::kernels::testing
