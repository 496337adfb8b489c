// Explicit instantiations of the step and prefill kernels for an f32 checkpoint with a bf16 ring
// (one file per (state, ring) pair, so they compile in parallel).
#include "launch.cuh"

namespace replayssm::kernels::cuda {

cudaError_t LaunchStepF32RingBf16(const LaunchPlan& plan, int device, const StepParams& p,
                                  cudaStream_t stream) {
  return LaunchStepFor<float, __nv_bfloat16>(plan, device, p, stream);
}
cudaError_t LaunchPrefillF32RingBf16(const LaunchPlan& plan, int device, const PrefillParams& p,
                                     cudaStream_t stream) {
  return LaunchPrefillFor<float, __nv_bfloat16>(plan, device, p, stream);
}

}  // namespace replayssm::kernels::cuda
