// The convolution joined to the replay decode step (rssm_decode_args.conv) against the two
// plain calls it stands for: the same random steps run on two copies of a layer's state, one
// through rssm_short_conv (APPEND) + rssm_replay_decode on its outputs, the other through the
// joined call on the raw inputs; outputs, y and every byte of both states (checkpoint, ring d,
// k, g, window, ring_x) must agree after every step. Folding rows (w + 1 = L, force_fold) fold
// the window in both (rssm_conv_fold with w + 1). Shared by the CPU and the CUDA tests.
#ifndef REPLAYSSM_KERNELS_TESTS_JOINED_CONV_SCENARIO_H_
#define REPLAYSSM_KERNELS_TESTS_JOINED_CONV_SCENARIO_H_

#include <cstdint>
#include <functional>
#include <string>

#include "harness.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {

struct JoinedConvConfig {
  int32_t backend = RSSM_BACKEND_CPU;
  Config layer;  // shape and dtypes (K, V multiples of 16)
  int width = 4;
  bool bias = true;
  int steps = 14;  // enough to wrap an L = 8 ring
  uint64_t seed = 1;
};

struct JoinedConvResult {
  int64_t steps = 0, outputs = 0;
  int64_t output_mismatches = 0;  // steps whose outputs or y differ (or a padding row not 0)
  int64_t state_mismatches = 0;   // tensors that differ after a step
  std::string failure;            // a failed call's message
};

// The decode call under test: rssm_replay_decode, or a launch with forced overrides.
using DecodeFn = std::function<rssm_status(const rssm_decode_args*)>;

JoinedConvResult RunJoinedConvScenario(const JoinedConvConfig& c, const DecodeFn& decode);

// The scenario over both gates x fp32 / bf16 state x every act dtype x W {2, 4, 8} (rings of
// 8 and 4, bias and 1-element slot padding alternating), as gtest expectations.
void JoinedConvSweep(int32_t backend, const DecodeFn& decode, uint64_t seed);

}  // namespace replayssm::kernels::testing

#endif  // REPLAYSSM_KERNELS_TESTS_JOINED_CONV_SCENARIO_H_
