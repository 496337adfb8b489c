// The short convolution on the device: the CPU tests' scenario (decode, verify + accept,
// prefill from the slot or from zeros, folds, padding, strides) against the fp64 reference.
#include <gtest/gtest.h>

#include <string>

#include "tests/conv_scenario.h"

namespace replayssm::kernels::testing {
namespace {

TEST(CudaShortConv, MatchesTheReference) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  // L = 24: prefills of up to 48 tokens cross the kernel's 16-token chunks.
  ConvSweep(RSSM_BACKEND_CUDA, {1, 8, 24}, {8, 40, 520}, 100);
}

}  // namespace
}  // namespace replayssm::kernels::testing
