// rssm_alloc / free / memcpy / memset / synchronize: the CPU side here, the CUDA side through
// the CUDA runtime when built with it.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "calls.h"

namespace replayssm::kernels {
namespace {

bool KnownBackend(int32_t b) { return b == RSSM_BACKEND_CPU || b == RSSM_BACKEND_CUDA; }

// RSSM_OK for a known backend, else the error naming the field, what was expected and what came.
rssm_status CheckBackend(const char* fn, int32_t backend) {
  if (KnownBackend(backend)) return RSSM_OK;
  return Invalid(fn, "backend: expected 0 (CPU) or 1 (CUDA), got " + std::to_string(backend));
}

// RSSM_OK for a known backend and one of its devices (0 .. rssm_device_count - 1), else the
// error naming the field.
rssm_status CheckDevice(const char* fn, int32_t backend, int32_t device) {
  if (const rssm_status st = CheckBackend(fn, backend); st != RSSM_OK) return st;
  const int count = rssm_device_count(backend);
  if (device >= 0 && device < count) return RSSM_OK;
  return Invalid(
      fn, "device: expected 0.." + std::to_string(count - 1) + ", got " + std::to_string(device));
}

#ifdef REPLAYSSM_WITH_CUDA
// The device of every stream rssm_stream_create made (a lookup per launch: no runtime query).
std::mutex stream_devices_mu;
std::unordered_map<void*, int>& StreamDevices() {
  static auto* m = new std::unordered_map<void*, int>();
  return *m;
}

// A stream the CUDA runtime makes while doorbell waits run can wait until they end: the runtime
// grows its streams about 43 at a time, and a growth waits for the running kernels (on an H100
// the process's 36th, 164th, 207th and 250th did; the others returned at once:
// bench/results/gpu_tests.md). So a device's first rssm_stream_create makes
// kStreamReserve streams before any wait can be queued on it, rssm_stream_create hands out an
// idle one of those, and rssm_stream_destroy gives an idle stream back: the runtime makes a
// stream after start only while more than kStreamReserve are out at once on that device.
constexpr size_t kStreamReserve = 128;
struct DeviceStreams {
  bool prepared = false;
  std::vector<cudaStream_t> idle;
};
std::unordered_map<int, DeviceStreams>& Devices() {  // under stream_devices_mu
  static auto* m = new std::unordered_map<int, DeviceStreams>();
  return *m;
}

// Once per device, the calling thread's current one: the reserve, and the doorbell kernels
// loaded on its first stream (cuda::PreloadDoorbellKernels says why). Nothing is kept on a
// failure: the next rssm_stream_create tries again.
rssm_status PrepareDevice(DeviceStreams& d) {
  if (d.prepared) return RSSM_OK;
  std::vector<cudaStream_t> made;
  rssm_status st = RSSM_OK;
  while (st == RSSM_OK && made.size() < kStreamReserve) {
    cudaStream_t s = nullptr;
    st = CudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "rssm_stream_create");
    if (st == RSSM_OK) made.push_back(s);
    if (st == RSSM_OK && made.size() == 1) st = cuda::PreloadDoorbellKernels(s);
  }
  if (st != RSSM_OK) {
    for (cudaStream_t s : made) cudaStreamDestroy(s);
    return st;
  }
  d.idle = std::move(made);
  d.prepared = true;
  return RSSM_OK;
}

// Whether `s` can go back to the reserve: nothing queued on it (the ABI asks callers to
// synchronize first; a stream that still has work is destroyed instead) and not recording.
bool ReusableStream(cudaStream_t s) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &capture) != cudaSuccess ||
      capture != cudaStreamCaptureStatusNone) {
    return false;  // (a query would end the recording)
  }
  const cudaError_t q = cudaStreamQuery(s);
  if (q == cudaErrorNotReady) cudaGetLastError();  // not an error: kept from the next check
  return q == cudaSuccess;
}
#endif

}  // namespace

rssm_status UseStreamDevice(const rssm_launch* launch, const char* fn) {
#ifdef REPLAYSSM_WITH_CUDA
  if (launch == nullptr || launch->backend != RSSM_BACKEND_CUDA || launch->stream == nullptr) {
    return RSSM_OK;
  }
  int device = -1;
  {
    std::lock_guard<std::mutex> lock(stream_devices_mu);
    auto it = StreamDevices().find(launch->stream);
    if (it == StreamDevices().end()) return RSSM_OK;
    device = it->second;
  }
  int current = -1;
  if (const rssm_status st = CudaCheck(cudaGetDevice(&current), fn); st != RSSM_OK) return st;
  if (current == device) return RSSM_OK;
  return CudaCheck(cudaSetDevice(device), fn);
#else
  (void)launch;
  (void)fn;
  return RSSM_OK;
#endif
}

bool CpuFailureInjected(const char* function) {
  const char* calls = std::getenv("REPLAYSSM_CPU_FAIL_CALLS");
  if (calls == nullptr) return false;
  const std::string_view name(function);
  for (std::string_view rest(calls); !rest.empty();) {
    const size_t comma = rest.find(',');
    if (rest.substr(0, comma) == name) return true;
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
  return false;
}

}  // namespace replayssm::kernels

using namespace replayssm::kernels;  // NOLINT: the C ABI below is a thin shell

extern "C" {

rssm_status rssm_alloc(int32_t backend, size_t bytes, void** out) {
  if (out == nullptr) return Invalid("rssm_alloc", "out: expected a non-null pointer, got NULL");
  *out = nullptr;
  if (const rssm_status st = CheckBackend("rssm_alloc", backend); st != RSSM_OK) return st;
  if (bytes == 0) return RSSM_OK;
  if (backend == RSSM_BACKEND_CPU) {
    *out = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (*out == nullptr) {
      SetLastError("rssm_alloc: out of host memory for " + std::to_string(bytes) + " bytes");
      return RSSM_ERR_DEVICE;
    }
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  return CudaCheck(cudaMalloc(out, bytes), "rssm_alloc");
#else
  return NoCuda("rssm_alloc");
#endif
}

rssm_status rssm_free(int32_t backend, void* ptr) {
  if (const rssm_status st = CheckBackend("rssm_free", backend); st != RSSM_OK) return st;
  if (ptr == nullptr) return RSSM_OK;
  if (backend == RSSM_BACKEND_CPU) {
    std::free(ptr);
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  return CudaCheck(cudaFree(ptr), "rssm_free");
#else
  return NoCuda("rssm_free");
#endif
}

rssm_status rssm_memcpy(const rssm_launch* launch, void* dst, const void* src, size_t bytes,
                        int32_t kind) {
  if (launch == nullptr || !KnownBackend(launch->backend)) {
    return Invalid("rssm_memcpy", "launch: expected a CPU or CUDA launch");
  }
  if (kind < RSSM_COPY_HOST_TO_DEVICE || kind > RSSM_COPY_DEVICE_TO_DEVICE) {
    return Invalid("rssm_memcpy", "kind: expected 0..2, got " + std::to_string(kind));
  }
  if (bytes == 0) return RSSM_OK;
  if (dst == nullptr || src == nullptr) {
    return Invalid("rssm_memcpy", "dst/src: expected non-null pointers, got NULL");
  }
  if (launch->backend == RSSM_BACKEND_CPU) {
    std::memmove(dst, src, bytes);
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, "rssm_memcpy"); st != RSSM_OK) return st;
  const cudaMemcpyKind k = kind == RSSM_COPY_HOST_TO_DEVICE   ? cudaMemcpyHostToDevice
                           : kind == RSSM_COPY_DEVICE_TO_HOST ? cudaMemcpyDeviceToHost
                                                              : cudaMemcpyDeviceToDevice;
  return CudaCheck(cudaMemcpyAsync(dst, src, bytes, k, static_cast<cudaStream_t>(launch->stream)),
                   "rssm_memcpy");
#else
  return NoCuda("rssm_memcpy");
#endif
}

rssm_status rssm_memset(const rssm_launch* launch, void* dst, int32_t value, size_t bytes) {
  if (launch == nullptr || !KnownBackend(launch->backend)) {
    return Invalid("rssm_memset", "launch: expected a CPU or CUDA launch");
  }
  if (bytes == 0) return RSSM_OK;
  if (dst == nullptr) return Invalid("rssm_memset", "dst: expected a non-null pointer, got NULL");
  if (launch->backend == RSSM_BACKEND_CPU) {
    std::memset(dst, value, bytes);
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, "rssm_memset"); st != RSSM_OK) return st;
  return CudaCheck(cudaMemsetAsync(dst, value, bytes, static_cast<cudaStream_t>(launch->stream)),
                   "rssm_memset");
#else
  return NoCuda("rssm_memset");
#endif
}

rssm_status rssm_synchronize(const rssm_launch* launch) {
  if (launch == nullptr || !KnownBackend(launch->backend)) {
    return Invalid("rssm_synchronize", "launch: expected a CPU or CUDA launch");
  }
  if (launch->backend == RSSM_BACKEND_CPU) {
    if (CpuFailureInjected("rssm_synchronize")) {
      SetLastError("rssm_synchronize: cpu: a failure injected (REPLAYSSM_CPU_FAIL_CALLS)");
      return RSSM_ERR_DEVICE;
    }
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, "rssm_synchronize"); st != RSSM_OK) return st;
  return CudaCheck(cudaStreamSynchronize(static_cast<cudaStream_t>(launch->stream)),
                   "rssm_synchronize");
#else
  return NoCuda("rssm_synchronize");
#endif
}

rssm_status rssm_alloc_host(int32_t backend, size_t bytes, void** out) {
  if (out == nullptr) {
    return Invalid("rssm_alloc_host", "out: expected a non-null pointer, got NULL");
  }
  *out = nullptr;
  if (const rssm_status st = CheckBackend("rssm_alloc_host", backend); st != RSSM_OK) return st;
  if (bytes == 0) return RSSM_OK;
  if (backend == RSSM_BACKEND_CPU) return rssm_alloc(backend, bytes, out);
#ifdef REPLAYSSM_WITH_CUDA
  return CudaCheck(cudaHostAlloc(out, bytes, cudaHostAllocPortable | cudaHostAllocMapped),
                   "rssm_alloc_host");
#else
  return NoCuda("rssm_alloc_host");
#endif
}

rssm_status rssm_free_host(int32_t backend, void* ptr) {
  if (const rssm_status st = CheckBackend("rssm_free_host", backend); st != RSSM_OK) return st;
  if (ptr == nullptr) return RSSM_OK;
  if (backend == RSSM_BACKEND_CPU) return rssm_free(backend, ptr);
#ifdef REPLAYSSM_WITH_CUDA
  return CudaCheck(cudaFreeHost(ptr), "rssm_free_host");
#else
  return NoCuda("rssm_free_host");
#endif
}

rssm_status rssm_stream_create(int32_t backend, void** out) {
  if (out == nullptr) {
    return Invalid("rssm_stream_create", "out: expected a non-null pointer, got NULL");
  }
  *out = nullptr;
  if (const rssm_status st = CheckBackend("rssm_stream_create", backend); st != RSSM_OK) return st;
  if (backend == RSSM_BACKEND_CPU) return RSSM_OK;
#ifdef REPLAYSSM_WITH_CUDA
  int device = 0;
  rssm_status st = CudaCheck(cudaGetDevice(&device), "rssm_stream_create");
  if (st != RSSM_OK) return st;
  std::lock_guard<std::mutex> lock(stream_devices_mu);
  DeviceStreams& d = Devices()[device];
  if (st = PrepareDevice(d); st != RSSM_OK) return st;
  cudaStream_t s = nullptr;
  if (!d.idle.empty()) {
    s = d.idle.back();
    d.idle.pop_back();
  } else {
    st = CudaCheck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "rssm_stream_create");
    if (st != RSSM_OK) return st;
  }
  StreamDevices()[s] = device;
  *out = s;
  return RSSM_OK;
#else
  return NoCuda("rssm_stream_create");
#endif
}

rssm_status rssm_stream_destroy(int32_t backend, void* stream) {
  if (const rssm_status st = CheckBackend("rssm_stream_destroy", backend); st != RSSM_OK) return st;
  if (stream == nullptr) return RSSM_OK;
  if (backend == RSSM_BACKEND_CPU) {
    return Invalid("rssm_stream_destroy", "stream: expected NULL on the CPU backend, got a pointer");
  }
#ifdef REPLAYSSM_WITH_CUDA
  const rssm_launch on{backend, stream};
  if (const rssm_status st = UseStreamDevice(&on, "rssm_stream_destroy"); st != RSSM_OK) return st;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  {
    std::lock_guard<std::mutex> lock(stream_devices_mu);
    auto it = StreamDevices().find(stream);
    if (it != StreamDevices().end()) {
      DeviceStreams& d = Devices()[it->second];
      StreamDevices().erase(it);
      if (d.idle.size() < kStreamReserve && ReusableStream(s)) {
        d.idle.push_back(s);
        return RSSM_OK;
      }
    }
  }
  return CudaCheck(cudaStreamDestroy(s), "rssm_stream_destroy");
#else
  return NoCuda("rssm_stream_destroy");
#endif
}

rssm_status rssm_event_record(const rssm_launch* launch, void** out) {
  const char* fn = "rssm_event_record";
  if (out == nullptr) return Invalid(fn, "out: expected a non-null pointer, got NULL");
  *out = nullptr;
  if (launch == nullptr) return Invalid(fn, "launch: expected a non-null pointer, got NULL");
  if (const rssm_status st = CheckBackend(fn, launch->backend); st != RSSM_OK) return st;
  if (launch->backend == RSSM_BACKEND_CPU) return RSSM_OK;
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  cudaEvent_t e = nullptr;
  rssm_status st = CudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), fn);
  if (st != RSSM_OK) return st;
  st = CudaCheck(cudaEventRecord(e, static_cast<cudaStream_t>(launch->stream)), fn);
  if (st != RSSM_OK) {
    cudaEventDestroy(e);
    return st;
  }
  *out = e;
  return RSSM_OK;
#else
  return NoCuda(fn);
#endif
}

rssm_status rssm_event_query(int32_t backend, void* event, int* done) {
  const char* fn = "rssm_event_query";
  if (done == nullptr) return Invalid(fn, "done: expected a non-null pointer, got NULL");
  *done = 0;
  if (const rssm_status st = CheckBackend(fn, backend); st != RSSM_OK) return st;
  if (event == nullptr) {
    *done = 1;
    return RSSM_OK;
  }
  if (backend == RSSM_BACKEND_CPU) {
    return Invalid(fn, "event: expected NULL on the CPU backend, got a pointer");
  }
#ifdef REPLAYSSM_WITH_CUDA
  const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) {
    cudaGetLastError();  // not an error: kept from the next launch's check
    return RSSM_OK;
  }
  if (e == cudaSuccess) *done = 1;
  return CudaCheck(e, fn);
#else
  return NoCuda(fn);
#endif
}

rssm_status rssm_event_destroy(int32_t backend, void* event) {
  const char* fn = "rssm_event_destroy";
  if (const rssm_status st = CheckBackend(fn, backend); st != RSSM_OK) return st;
  if (event == nullptr) return RSSM_OK;
  if (backend == RSSM_BACKEND_CPU) {
    return Invalid(fn, "event: expected NULL on the CPU backend, got a pointer");
  }
#ifdef REPLAYSSM_WITH_CUDA
  return CudaCheck(cudaEventDestroy(static_cast<cudaEvent_t>(event)), fn);
#else
  return NoCuda(fn);
#endif
}

rssm_status rssm_set_device(int32_t backend, int32_t device) {
  if (const rssm_status st = CheckDevice("rssm_set_device", backend, device); st != RSSM_OK) {
    return st;
  }
  if (backend == RSSM_BACKEND_CPU) return RSSM_OK;
#ifdef REPLAYSSM_WITH_CUDA
  return CudaCheck(cudaSetDevice(device), "rssm_set_device");
#else
  return NoCuda("rssm_set_device");
#endif
}

rssm_status rssm_get_device(int32_t backend, int32_t* device) {
  if (const rssm_status st = CheckBackend("rssm_get_device", backend); st != RSSM_OK) return st;
  if (device == nullptr) return Invalid("rssm_get_device", "device: expected a pointer, got NULL");
  if (backend == RSSM_BACKEND_CPU) {
    *device = 0;
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  int current = 0;
  const rssm_status st = CudaCheck(cudaGetDevice(&current), "rssm_get_device");
  if (st == RSSM_OK) *device = current;
  return st;
#else
  return NoCuda("rssm_get_device");
#endif
}

rssm_status rssm_device_check(int32_t backend, int32_t device) {
  if (const rssm_status st = CheckDevice("rssm_device_check", backend, device); st != RSSM_OK) {
    return st;
  }
  if (backend == RSSM_BACKEND_CPU) {
    const char* fault = std::getenv("REPLAYSSM_CPU_FAULT_FILE");
    if (fault != nullptr && *fault != '\0' && access(fault, F_OK) == 0) {
      SetLastError(std::string("rssm_device_check: cpu: a device failure injected (") + fault +
                   " exists)");
      return RSSM_ERR_DEVICE;
    }
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  // A sticky error comes back from every call in the context; an event recorded on this
  // thread's default stream and queried needs no other work to finish. The device stays
  // current: restoring the one before would create a context there (cudaSetDevice does) on a
  // thread that never used it.
  rssm_status st = CudaCheck(cudaSetDevice(device), "rssm_device_check");
  cudaEvent_t ev = nullptr;
  if (st == RSSM_OK) {
    st = CudaCheck(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "rssm_device_check");
  }
  if (st == RSSM_OK) st = CudaCheck(cudaEventRecord(ev, cudaStreamPerThread), "rssm_device_check");
  if (st == RSSM_OK) {
    const cudaError_t q = cudaEventQuery(ev);
    if (q != cudaErrorNotReady) st = CudaCheck(q, "rssm_device_check");
  }
  if (ev != nullptr) cudaEventDestroy(ev);
  return st;
#else
  return NoCuda("rssm_device_check");
#endif
}

int rssm_device_count(int32_t backend) {
  if (backend == RSSM_BACKEND_CPU) return 1;
#ifdef REPLAYSSM_WITH_CUDA
  int n = 0;
  if (backend == RSSM_BACKEND_CUDA && cudaGetDeviceCount(&n) == cudaSuccess) return n;
#endif
  return 0;
}

}  // extern "C"
