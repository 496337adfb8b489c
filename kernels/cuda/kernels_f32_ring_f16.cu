// Explicit instantiations of the step and prefill kernels for an f32 checkpoint with a f16 ring
// (one file per (state, ring) pair, so they compile in parallel).
#include "launch.cuh"

namespace replayssm::kernels::cuda {

cudaError_t LaunchStepF32RingF16(const LaunchPlan& plan, int device, const StepParams& p,
                                 cudaStream_t stream) {
  return LaunchStepFor<float, __half>(plan, device, p, stream);
}
cudaError_t LaunchPrefillF32RingF16(const LaunchPlan& plan, int device, const PrefillParams& p,
                                    cudaStream_t stream) {
  return LaunchPrefillFor<float, __half>(plan, device, p, stream);
}

}  // namespace replayssm::kernels::cuda
