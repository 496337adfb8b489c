// Explicit instantiations of the step and prefill kernels for f32 state and ring (one file
// per (state, ring) dtype pair, so they compile in parallel).
#include "launch.cuh"

namespace replayssm::kernels::cuda {

cudaError_t LaunchStepF32(const LaunchPlan& plan, int device, const StepParams& p,
                          cudaStream_t stream) {
  return LaunchStepFor<float, float>(plan, device, p, stream);
}
cudaError_t LaunchPrefillF32(const LaunchPlan& plan, int device, const PrefillParams& p,
                             cudaStream_t stream) {
  return LaunchPrefillFor<float, float>(plan, device, p, stream);
}

}  // namespace replayssm::kernels::cuda
