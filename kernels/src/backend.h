// Internal interface between the C ABI front (api.cc: validation, dispatch, error text) and
// the backends. Every function here receives arguments that api.cc has already validated
// (dims, dtypes, non-null pointers, strides resolved to non-zero values; on CPU also the
// values inside the index arrays). Backends report device failures through SetLastError.
#ifndef REPLAYSSM_KERNELS_SRC_BACKEND_H_
#define REPLAYSSM_KERNELS_SRC_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "../cuda/plan.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels {

// Sets the thread-local message returned by rssm_last_error().
void SetLastError(std::string message);

// A failure injected on the CPU for tests: the environment's REPLAYSSM_CPU_FAIL_CALLS (a
// comma-separated list) names `function` (kernels.h says which calls take it). memory.cc.
bool CpuFailureInjected(const char* function);

// The rssm_short_conv (APPEND, one token per row) that a decode call's joined convolution
// (args.conv, checked) stands for: in.mixed_qkv into conv->y (dense), the same rows (api.cc).
rssm_conv_args JoinedConvArgs(const rssm_decode_args& args);

namespace cpu {
rssm_status ReplayDecode(const rssm_decode_args& args);
rssm_status BaselineDecode(const rssm_decode_args& args);
rssm_status Fold(const rssm_fold_args& args);
rssm_status Prefill(const rssm_prefill_args& args);
rssm_status Verify(const rssm_verify_args& args);
rssm_status ShortConv(const rssm_conv_args& args);      // cpu/conv.cc
rssm_status ConvFold(const rssm_conv_fold_args& args);  // cpu/conv.cc
// rssm_count_nonfinite on host memory (cpu/conv.cc).
rssm_status CountNonfinite(const void* const* parts, size_t count, size_t part_elems,
                           int32_t dtype, uint32_t* result);
// rssm_segment_digests_parts: count * part_bytes > 0; `digests` host memory on CPU.
rssm_status SegmentDigests(const void* const* parts, size_t count, size_t part_bytes,
                           size_t segment_bytes, uint64_t* digests);
}  // namespace cpu

namespace cuda {
// Defined in kernels/cuda/ when built with REPLAYSSM_WITH_CUDA; otherwise stubs in api.cc
// answer RSSM_ERR_UNSUPPORTED. Every launch is planned by Plan() (cuda/plan.h) with
// `overrides` (checked by the caller: none on the serving path); the step calls write the
// launch that ran to *plan when plan is not null.
bool Available();
rssm_status ReplayDecode(const rssm_decode_args& args, const LaunchOverrides& overrides,
                         LaunchPlan* plan);
rssm_status BaselineDecode(const rssm_decode_args& args, const LaunchOverrides& overrides,
                           LaunchPlan* plan);
rssm_status Fold(const rssm_fold_args& args);
rssm_status Prefill(const rssm_prefill_args& args);
rssm_status Verify(const rssm_verify_args& args, const LaunchOverrides& overrides,
                   LaunchPlan* plan);
rssm_status ShortConv(const rssm_conv_args& args);      // cuda/conv.cu
rssm_status ConvFold(const rssm_conv_fold_args& args);  // cuda/conv.cu
// rssm_count_nonfinite queued on launch.stream (cuda/conv.cu).
rssm_status CountNonfinite(const rssm_launch& launch, const void* const* parts_device,
                           size_t count, size_t part_elems, int32_t dtype, uint32_t* result);
// As cpu::SegmentDigests, queued on launch.stream: `parts` is the table in device memory, the
// digests are written into device memory (kernels/cuda/backend.cu).
rssm_status SegmentDigests(const rssm_launch& launch, const void* const* parts, size_t count,
                           size_t part_bytes, size_t segment_bytes, uint64_t* digests);
// rssm_stream_raise_value32's kernel, queued on launch.stream (kernels/cuda/backend.cu; called
// only where the library is built with CUDA, so no stub).
rssm_status RaiseValue32(const rssm_launch& launch, uint32_t* addr, uint32_t value);
// rssm_stream_wait_value32_or's kernel: its arguments, as one (a recorded sequence's node
// has them rewritten per launch by SetWaitNode).
struct WaitArgs {
  const uint32_t* addr;
  const uint32_t* release;  // host memory the device reads
  uint32_t* outcome;        // host memory, 2 words, or null
  uint32_t value;
  uint32_t ticket;
};
// Queues it on launch.stream (kernels/cuda/backend.cu).
rssm_status WaitValue32Or(const rssm_launch& launch, const WaitArgs& args);
// Gives the instantiated sequence `exec`'s node `node` (a WaitValue32Or kernel as recorded)
// the arguments `args` (cudaGraphExecKernelNodeSetParams; both are the runtime's handles).
rssm_status SetWaitNode(void* exec, void* node, const WaitArgs& args);
// Launches the raise and wait kernels once each, doing nothing, on `stream`: their module is
// loaded now. Loaded lazily (CUDA_MODULE_LOADING=LAZY, the default), the first raise or wait
// would wait for the device's work, which a doorbell wait holds for ever (it hung the release
// path on the H200). rssm_stream_create calls it once per device.
rssm_status PreloadDoorbellKernels(void* stream);
}  // namespace cuda

}  // namespace replayssm::kernels

#endif  // REPLAYSSM_KERNELS_SRC_BACKEND_H_
