// Host launchers (templated on the state type): pick the register tile (KMAX 128 or 256) and
// the tokens per pass (TC: 1 for decode, 4 for verify), size shared memory, launch on the
// caller's stream and return the launch status. No allocation, no synchronization.
#ifndef REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_
#define REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_

#include "prefill_kernel.cuh"
#include "step_kernel.cuh"

namespace replayssm::kernels::cuda {

constexpr int kVerifyTokensPerPass = 4;  // TC of verify: 4 drafts per pass over the registers

// Raises a kernel's dynamic shared-memory limit when a launch needs more than 48 KB. Cheap and
// idempotent (no stream work), so it is simply called before such a launch.
template <typename Kernel>
cudaError_t AllowSmem(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              static_cast<int>(bytes));
}

inline cudaError_t Grid(int64_t rows, int heads, int vtiles, dim3* grid) {
  const int64_t n = rows * heads * vtiles;
  if (n <= 0 || n > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  *grid = dim3(static_cast<unsigned>(n));
  return cudaSuccess;
}

template <typename T, int KMAX, int TC>
cudaError_t LaunchStepT(StepParams p, cudaStream_t stream) {
  using Cfg = TileCfg<T, KMAX>;
  p.num_vtiles = (p.ly.V + Cfg::VT - 1) / Cfg::VT;
  p.sm = SmemLayout::Make(p.ly.K, p.ly.L, Cfg::VT, TC, p.ly.kda != 0);
  const size_t bytes = size_t(p.sm.total) * sizeof(float);
  dim3 grid;
  cudaError_t e = Grid(p.batch, p.ly.HV, p.num_vtiles, &grid);
  if (e != cudaSuccess) return e;
  e = AllowSmem(StepKernel<T, KMAX, TC>, bytes);
  if (e != cudaSuccess) return e;
  StepKernel<T, KMAX, TC><<<grid, kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchStepFor(StepParams p, cudaStream_t stream) {
  const bool verify = p.mode == kModeVerify;
  if (p.ly.K <= 128) {
    return verify ? LaunchStepT<T, 128, kVerifyTokensPerPass>(p, stream)
                  : LaunchStepT<T, 128, 1>(p, stream);
  }
  return verify ? LaunchStepT<T, 256, kVerifyTokensPerPass>(p, stream)
                : LaunchStepT<T, 256, 1>(p, stream);
}

template <typename T, int KMAX>
cudaError_t LaunchPrefillT(PrefillParams p, cudaStream_t stream) {
  using Cfg = TileCfg<T, KMAX>;
  p.num_vtiles = (p.ly.V + Cfg::VT - 1) / Cfg::VT;
  p.sm = SmemLayout::Make(p.ly.K, p.ly.L, Cfg::VT, 1, p.ly.kda != 0);
  const size_t bytes = size_t(p.sm.total) * sizeof(float);
  dim3 grid;
  cudaError_t e = Grid(p.batch, p.ly.HV, p.num_vtiles, &grid);
  if (e != cudaSuccess) return e;
  e = AllowSmem(PrefillKernel<T, KMAX>, bytes);
  if (e != cudaSuccess) return e;
  PrefillKernel<T, KMAX><<<grid, kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchPrefillFor(PrefillParams p, cudaStream_t stream) {
  return p.ly.K <= 128 ? LaunchPrefillT<T, 128>(p, stream) : LaunchPrefillT<T, 256>(p, stream);
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_
