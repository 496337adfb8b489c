// Explicit instantiations of the step and prefill kernels for f32 state (one file per state
// dtype, so they compile in parallel).
#include "launch.cuh"

namespace replayssm::kernels::cuda {

cudaError_t LaunchStepF32(StepParams p, cudaStream_t stream) {
  return LaunchStepFor<float>(p, stream);
}
cudaError_t LaunchPrefillF32(PrefillParams p, cudaStream_t stream) {
  return LaunchPrefillFor<float>(p, stream);
}

}  // namespace replayssm::kernels::cuda
