// The workspace of the v5 step (pre-pass vectors, stream_kernel.cuh): one buffer per (device,
// stream), grown on demand. See NOTES.md (v5) for the decision and its cost.
#include <algorithm>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "params.h"

namespace replayssm::kernels::cuda {

cudaError_t StepWorkspace(cudaStream_t stream, size_t bytes, float** out) {
  struct Buf {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Buf>* bufs = new std::map<std::pair<int, cudaStream_t>, Buf>;
  // Superseded buffers are never freed: kernels queued earlier may still use them, and a
  // free would have to synchronize. Growth is geometric, so they total less than the newest.
  static std::vector<void*>* retired = new std::vector<void*>;
  *out = nullptr;
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  std::lock_guard<std::mutex> lock(mu);
  Buf& b = (*bufs)[{dev, stream}];
  if (b.bytes >= bytes) {
    *out = static_cast<float*>(b.ptr);
    return cudaSuccess;
  }
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    (void)cudaGetLastError();
    return cudaSuccess;  // no allocation inside a capture: the caller falls back
  }
  size_t n = std::max(bytes, std::max(2 * b.bytes, size_t{4} << 20));
  void* p = nullptr;
  if (cudaMalloc(&p, n) != cudaSuccess) {
    (void)cudaGetLastError();
    return cudaSuccess;  // out of memory: fall back to the kernels that need no workspace
  }
  if (b.ptr != nullptr) retired->push_back(b.ptr);
  b.ptr = p;
  b.bytes = n;
  *out = static_cast<float*>(p);
  return cudaSuccess;
}

}  // namespace replayssm::kernels::cuda
