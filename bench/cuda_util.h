// The host side of the CUDA benchmarks that drive the kernel ABI from plain C++ (conv, graph):
// every CUDA call and ABI call checked (the program exits non-zero naming the call rather than
// print a figure it did not measure), and zeroed or uploaded device buffers.
#ifndef REPLAYSSM_BENCH_CUDA_UTIL_H_
#define REPLAYSSM_BENCH_CUDA_UTIL_H_

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "bench/check.h"
#include "replayssm/kernels.h"

#define CHECK_CUDA(x)                                                                          \
  do {                                                                                         \
    const cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

namespace replayssm::bench {

inline void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(e));
}

// `bytes` of device memory, zeroed.
inline void* DeviceAlloc(size_t bytes) {
  void* p = nullptr;
  CHECK_CUDA(cudaMalloc(&p, bytes));
  CHECK_CUDA(cudaMemset(p, 0, bytes));
  return p;
}

// A device copy of `v`.
template <typename T>
T* Upload(const std::vector<T>& v) {
  T* p = static_cast<T*>(DeviceAlloc(v.size() * sizeof(T)));
  CHECK_CUDA(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_CUDA_UTIL_H_
