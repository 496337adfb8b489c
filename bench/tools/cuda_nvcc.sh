# Sourced by the bench/tools/cuda_*.sh scripts: kernels_nvcc ROOT ARGS... runs nvcc on the
# CUDA sources of the checkout at ROOT with the flags of kernels/cuda/CMakeLists.txt (keep
# them in step), plus ARGS.
kernels_nvcc() {
  local root=$1
  shift
  nvcc -arch=sm_90 -O3 --expt-relaxed-constexpr -std=c++17 -I"$root/kernels/cuda" \
    -I"$root/kernels/include" "$@"
}
