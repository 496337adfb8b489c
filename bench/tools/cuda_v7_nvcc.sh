# Sourced by bench/tools/cuda_regs.sh and cuda_prologue.sh: v7_nvcc DIR ARGS... compiles a file
# (DIR/v7.cu) that instantiates every v7 step kernel (LaunchBulkFor<float> and
# <__nv_bfloat16>), with nvcc flags that follow kernels/cuda/CMakeLists.txt (keep them in step)
# plus $EXTRA and ARGS. Needs $root (the repository) set by the caller.
v7_nvcc() {
  local dir=$1
  shift
  cat > "$dir/v7.cu" <<'CU'
#include "launch.cuh"
namespace replayssm::kernels::cuda {
template cudaError_t LaunchBulkFor<float>(const StepParams&, cudaStream_t, bool*);
template cudaError_t LaunchBulkFor<__nv_bfloat16>(const StepParams&, cudaStream_t, bool*);
}
CU
  nvcc -arch=sm_90 -O3 --expt-relaxed-constexpr -std=c++17 -I"$root/kernels/cuda" \
    -I"$root/kernels/include" ${EXTRA:-} "$@" "$dir/v7.cu"
}
