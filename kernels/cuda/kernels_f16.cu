// Explicit instantiations of the step and prefill kernels for f16 state (one file per state
// dtype, so they compile in parallel).
#include "launch.cuh"

namespace replayssm::kernels::cuda {

cudaError_t LaunchStepF16(StepParams p, cudaStream_t stream) {
  return LaunchStepFor<__half>(p, stream);
}
cudaError_t LaunchPrefillF16(PrefillParams p, cudaStream_t stream) {
  return LaunchPrefillFor<__half>(p, stream);
}

}  // namespace replayssm::kernels::cuda
