// Helpers of the C ABI's memory, stream, doorbell and graph calls (memory.cc,
// shared_memory.cc, graph.cc): the error they report, and the CUDA runtime and driver calls
// checked into an rssm_status. The driver is reached through the runtime's entry-point query,
// so that nothing links libcuda.
#ifndef REPLAYSSM_KERNELS_SRC_CALLS_H_
#define REPLAYSSM_KERNELS_SRC_CALLS_H_

#include <string>

#include "backend.h"
#include "replayssm/kernels.h"

#ifdef REPLAYSSM_WITH_CUDA
#include <cuda.h>
#include <cuda_runtime_api.h>
#endif

namespace replayssm::kernels {

inline rssm_status Invalid(const std::string& fn, const std::string& what) {
  SetLastError(fn + ": " + what);
  return RSSM_ERR_INVALID_ARGUMENT;
}

// Makes the device of launch->stream (a stream of rssm_stream_create) the calling thread's
// current one, so that work queued on it runs there whichever thread queues it. A no-op on CPU,
// for NULL (the current device's legacy stream) and for streams the ABI did not create.
rssm_status UseStreamDevice(const rssm_launch* launch, const char* fn);

#ifdef REPLAYSSM_WITH_CUDA
inline rssm_status CudaCheck(cudaError_t e, const char* fn) {
  if (e == cudaSuccess) return RSSM_OK;
  SetLastError(std::string(fn) + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
  return RSSM_ERR_DEVICE;
}

inline rssm_status DriverCheck(CUresult r, const char* fn) {
  if (r == CUDA_SUCCESS) return RSSM_OK;
  SetLastError(std::string(fn) + ": driver error " + std::to_string(static_cast<int>(r)));
  return RSSM_ERR_DEVICE;
}

// Notes a rssm_stream_wait_value32_or kernel just queued on `stream` while it records
// (kernels/src/graph.cc): rssm_capture_end hands the recording its node, so that each launch
// sets the node's value and ticket. RSSM_OK when the stream is not recording.
rssm_status NoteRecordedWait(cudaStream_t stream, const cuda::WaitArgs& args, const char* fn);

// A driver function of CUDA 12.0's signature, or null when the driver has none.
template <typename Fn>
Fn LookupDriver(const char* symbol) {
  cudaDriverEntryPointQueryResult q{};
  void* fn = nullptr;
  if (cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}
#else
inline rssm_status NoCuda(const char* fn) {
  SetLastError(std::string(fn) + ": the CUDA backend is not built into this library");
  return RSSM_ERR_UNSUPPORTED;
}
#endif

}  // namespace replayssm::kernels

#endif  // REPLAYSSM_KERNELS_SRC_CALLS_H_
