// Internal, not part of the C ABI: the CUDA step calls with launch overrides (cuda/plan.h),
// for the kernel benchmark (bench/kernels_bench.cu) and the GPU tests. Serving code calls the
// rssm_* functions, whose launches are always planned with no overrides.
#ifndef REPLAYSSM_KERNELS_SRC_LAUNCH_OVERRIDES_H_
#define REPLAYSSM_KERNELS_SRC_LAUNCH_OVERRIDES_H_

#include "../cuda/plan.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels {

// As rssm_replay_decode, rssm_baseline_decode and rssm_verify (every argument checked the same
// way) with launch.backend RSSM_BACKEND_CUDA only, launched with `overrides`: one out of range
// is RSSM_ERR_INVALID_ARGUMENT naming it, and nothing runs. When `plan` is not null it receives
// the launch that ran (left alone when nothing was launched).
rssm_status ReplayDecodeWith(const rssm_decode_args* args, const cuda::LaunchOverrides& overrides,
                             cuda::LaunchPlan* plan = nullptr);
rssm_status BaselineDecodeWith(const rssm_decode_args* args, const cuda::LaunchOverrides& overrides,
                               cuda::LaunchPlan* plan = nullptr);
rssm_status VerifyWith(const rssm_verify_args* args, const cuda::LaunchOverrides& overrides,
                       cuda::LaunchPlan* plan = nullptr);

}  // namespace replayssm::kernels

#endif  // REPLAYSSM_KERNELS_SRC_LAUNCH_OVERRIDES_H_
