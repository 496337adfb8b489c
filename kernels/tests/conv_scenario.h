// Tests of the short convolution (rssm_short_conv, rssm_conv_fold) on any backend against an
// fp64 reference written here: every slot keeps the full list of inputs it has committed, and
// the expected output of a token is the convolution of that list (zeros before the first
// token) in fp64. Shared by the CPU tests and the CUDA tests (the same scenario on the device).
#ifndef REPLAYSSM_KERNELS_TESTS_CONV_SCENARIO_H_
#define REPLAYSSM_KERNELS_TESTS_CONV_SCENARIO_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {

struct ConvConfig {
  int32_t backend = RSSM_BACKEND_CPU;
  rssm_dtype act_dtype = RSSM_DTYPE_BF16;
  int channels = 40;
  int width = 4;
  int ring_len = 8;
  bool bias = true;
  int64_t slot_pad = 0;  // extra elements between slots (strides)
  int steps = 60;        // random operations
  uint64_t seed = 1;
};

struct ConvResult {
  double max_out_err = 0;  // max |y - ref| / (1 + |ref|) over every output
  int64_t outputs = 0;
  int64_t state_mismatches = 0;      // logical window entries that differ from the reference
  int64_t untouched_violations = 0;  // bytes of slots outside a call that changed
  std::string failure;               // a failed call's message, if any
};

// Runs `steps` random operations (decode steps, verify + accept(n), prefill from the slot's
// state or from zeros, folds, padding rows) over a small pool and checks every output and
// every slot's logical window after each operation.
ConvResult RunConvScenario(const ConvConfig& c);

// Tolerance for max_out_err: one rounding of y to the act dtype plus fp32 accumulation.
double ConvTolerance(rssm_dtype act_dtype);

// The scenario over every act dtype x width {2, 4, 8} x `rings` x `channels` on `backend`
// (bias and strided slots alternating, a seed per case from `seed`), as gtest expectations.
void ConvSweep(int32_t backend, std::initializer_list<int> rings,
               std::initializer_list<int> channels, uint64_t seed);

}  // namespace replayssm::kernels::testing

#endif  // REPLAYSSM_KERNELS_TESTS_CONV_SCENARIO_H_
