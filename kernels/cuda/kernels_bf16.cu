// Explicit instantiations of the step and prefill kernels for bf16 state and ring (one file
// per (state, ring) dtype pair, so they compile in parallel).
#include "launch.cuh"

namespace replayssm::kernels::cuda {

cudaError_t LaunchStepBf16(const LaunchPlan& plan, int device, const StepParams& p,
                           cudaStream_t stream) {
  return LaunchStepFor<__nv_bfloat16, __nv_bfloat16>(plan, device, p, stream);
}
cudaError_t LaunchPrefillBf16(const LaunchPlan& plan, int device, const PrefillParams& p,
                              cudaStream_t stream) {
  return LaunchPrefillFor<__nv_bfloat16, __nv_bfloat16>(plan, device, p, stream);
}

}  // namespace replayssm::kernels::cuda
