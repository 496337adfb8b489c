// The short convolution on the device: the CPU tests' scenario (decode, verify + accept,
// prefill from the slot or from zeros, folds, padding, strides) against the fp64 reference;
// and the convolution joined to the decode step against the two plain calls, bit for bit, on
// each step kernel.
#include <gtest/gtest.h>

#include <string>

#include "src/launch_overrides.h"
#include "tests/conv_scenario.h"
#include "tests/joined_conv_scenario.h"

namespace replayssm::kernels::testing {
namespace {

TEST(CudaShortConv, MatchesTheReference) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  // L = 24: prefills of up to 48 tokens cross the kernel's 16-token chunks.
  ConvSweep(RSSM_BACKEND_CUDA, {1, 8, 24}, {8, 40, 520}, 100);
}

TEST(CudaJoinedConv, EqualsTheSeparateCallsOnEachStepKernel) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  using K = cuda::LaunchOverrides::StepKernel;
  for (K kernel : {K::kAuto, K::kTiled, K::kBulk}) {  // kAuto: small-batch replay (fp32 state)
    SCOPED_TRACE(kernel == K::kTiled ? "tiled" : kernel == K::kBulk ? "bulk" : "planned");
    cuda::LaunchOverrides forced;
    forced.step_kernel = kernel;
    JoinedConvSweep(
        RSSM_BACKEND_CUDA, [&](const rssm_decode_args* a) { return ReplayDecodeWith(a, forced); },
        200);
  }
  // The stream replay kernel forced (fp32 state, where its shape requirements hold): launched as
  // the convolution's programmatic dependent, its consumers wait for the grid before the tokens.
  SCOPED_TRACE("stream");
  cuda::LaunchOverrides stream;
  stream.stream_min_batch = 1;
  stream.stream_grid = 3;
  JoinedConvSweep(
      RSSM_BACKEND_CUDA, [&](const rssm_decode_args* a) { return ReplayDecodeWith(a, stream); },
      200);
}

}  // namespace
}  // namespace replayssm::kernels::testing
