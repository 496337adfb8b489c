// rssm_ipc_open / close, the doorbell stream operations and MPS detection: the CPU side here,
// the CUDA side through the runtime (and the driver's stream memory operations, reached
// through the runtime's entry-point query so that nothing links libcuda) when built with it.
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "calls.h"

namespace replayssm::kernels {
namespace {

rssm_status CheckLaunch(const char* fn, const rssm_launch* launch) {
  if (launch != nullptr &&
      (launch->backend == RSSM_BACKEND_CPU || launch->backend == RSSM_BACKEND_CUDA)) {
    return RSSM_OK;
  }
  return Invalid(fn, "launch: expected a CPU or CUDA launch");
}

rssm_status CheckWord(const char* fn, const void* addr) {
  if (addr != nullptr && reinterpret_cast<uintptr_t>(addr) % 4 == 0) return RSSM_OK;
  return Invalid(fn, addr == nullptr ? std::string("addr: expected a pointer, got NULL")
                                     : "addr: expected a 4-byte aligned pointer, got one " +
                                           std::to_string(reinterpret_cast<uintptr_t>(addr) % 4) +
                                           " bytes past it");
}

// The cyclic comparison of CU_STREAM_WAIT_VALUE_GEQ.
bool Reached(uint32_t word, uint32_t value) {
  return static_cast<int32_t>(word - value) >= 0;
}

// CPU: polls with a short spin, then yields, then sleeps (a doorbell may take milliseconds).
// With a release, also until its word reaches the ticket (then the wait's own word is read once
// more, and the outcome written if it is still short).
void WaitOnHost(const uint32_t* addr, uint32_t value, const rssm_release* release = nullptr) {
  std::atomic_ref<const uint32_t> word(*addr);
  for (int64_t i = 0; !Reached(word.load(std::memory_order_acquire), value); ++i) {
    if (release != nullptr &&
        Reached(std::atomic_ref<const uint32_t>(*release->word).load(std::memory_order_acquire),
                release->ticket)) {
      if (!Reached(word.load(std::memory_order_acquire), value) && release->outcome != nullptr) {
        std::atomic_ref<uint32_t>(release->outcome[release->ticket & 1u])
            .store(release->ticket, std::memory_order_release);
      }
      return;
    }
    if (i < 1000) continue;
    if (i < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
}

#ifdef REPLAYSSM_WITH_CUDA
using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using WriteValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

// The driver's stream memory operations, looked up once (null when the driver has none).
struct StreamMemOps {
  WaitValueFn wait = nullptr;
  WriteValueFn write = nullptr;
  AddressRangeFn range = nullptr;
};

const StreamMemOps& MemOps() {
  static const StreamMemOps ops{LookupDriver<WaitValueFn>("cuStreamWaitValue32"),
                                LookupDriver<WriteValueFn>("cuStreamWriteValue32"),
                                LookupDriver<AddressRangeFn>("cuMemGetAddressRange")};
  return ops;
}
#endif

}  // namespace
}  // namespace replayssm::kernels

using namespace replayssm::kernels;  // NOLINT: the C ABI below is a thin shell

extern "C" {

rssm_status rssm_ipc_open(int32_t backend, const void* handle, size_t handle_bytes,
                          int32_t device, void** out, size_t* out_bytes) {
  const char* fn = "rssm_ipc_open";
  if (out == nullptr || out_bytes == nullptr) {
    return Invalid(fn, "out, out_bytes: expected non-null pointers, got NULL");
  }
  *out = nullptr;
  *out_bytes = 0;
  if (handle == nullptr || handle_bytes != RSSM_IPC_HANDLE_BYTES) {
    return Invalid(fn, "handle: expected " + std::to_string(RSSM_IPC_HANDLE_BYTES) +
                           " bytes of a cudaIpcMemHandle_t, got " +
                           (handle == nullptr ? std::string("NULL")
                                              : std::to_string(handle_bytes) + " bytes"));
  }
  if (backend == RSSM_BACKEND_CPU) {
    SetLastError(std::string(fn) +
                 ": CUDA IPC regions need the CUDA backend (this server runs on the CPU; "
                 "register POSIX shared memory instead)");
    return RSSM_ERR_UNSUPPORTED;
  }
  if (backend != RSSM_BACKEND_CUDA) {
    return Invalid(fn, "backend: expected 0 (CPU) or 1 (CUDA), got " + std::to_string(backend));
  }
#ifdef REPLAYSSM_WITH_CUDA
  int current = -1;
  if (const rssm_status st = CudaCheck(cudaGetDevice(&current), fn); st != RSSM_OK) return st;
  if (device != current) {
    return Invalid(fn, "device: expected " + std::to_string(current) +
                           " (the device this server runs on), got " + std::to_string(device));
  }
  cudaIpcMemHandle_t h;
  static_assert(sizeof(h) == RSSM_IPC_HANDLE_BYTES);
  std::memcpy(&h, handle, sizeof(h));
  if (const rssm_status st = CudaCheck(cudaIpcOpenMemHandle(out, h, cudaIpcMemLazyEnablePeerAccess),
                                      fn);
      st != RSSM_OK) {
    return st;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  const rssm_status st =
      MemOps().range == nullptr
          ? RSSM_ERR_UNSUPPORTED
          : DriverCheck(MemOps().range(&base, &size, reinterpret_cast<CUdeviceptr>(*out)), fn);
  if (st != RSSM_OK) {
    if (MemOps().range == nullptr) SetLastError(std::string(fn) + ": no cuMemGetAddressRange");
    cudaIpcCloseMemHandle(*out);
    *out = nullptr;
    return st;
  }
  *out_bytes = size - (reinterpret_cast<CUdeviceptr>(*out) - base);
  return RSSM_OK;
#else
  (void)device;
  return NoCuda(fn);
#endif
}

rssm_status rssm_ipc_close(int32_t backend, void* ptr) {
  if (ptr == nullptr) return RSSM_OK;
  if (backend != RSSM_BACKEND_CUDA) {
    return Invalid("rssm_ipc_close", "backend: expected 1 (CUDA), got " + std::to_string(backend));
  }
#ifdef REPLAYSSM_WITH_CUDA
  return CudaCheck(cudaIpcCloseMemHandle(ptr), "rssm_ipc_close");
#else
  return NoCuda("rssm_ipc_close");
#endif
}

rssm_status rssm_stream_wait_value32(const rssm_launch* launch, const uint32_t* addr,
                                     uint32_t value) {
  const char* fn = "rssm_stream_wait_value32";
  if (const rssm_status st = CheckLaunch(fn, launch); st != RSSM_OK) return st;
  if (const rssm_status st = CheckWord(fn, addr); st != RSSM_OK) return st;
  if (launch->backend == RSSM_BACKEND_CPU) {
    WaitOnHost(addr, value);
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  if (MemOps().wait == nullptr) {
    SetLastError(std::string(fn) + ": the driver has no cuStreamWaitValue32");
    return RSSM_ERR_UNSUPPORTED;
  }
  return DriverCheck(MemOps().wait(static_cast<CUstream>(launch->stream),
                                   reinterpret_cast<CUdeviceptr>(addr), value,
                                   CU_STREAM_WAIT_VALUE_GEQ),
                     fn);
#else
  return NoCuda(fn);
#endif
}

rssm_status rssm_stream_wait_value32_or(const rssm_launch* launch, const uint32_t* addr,
                                        uint32_t value, const rssm_release* release) {
  const char* fn = "rssm_stream_wait_value32_or";
  if (const rssm_status st = CheckLaunch(fn, launch); st != RSSM_OK) return st;
  if (const rssm_status st = CheckWord(fn, addr); st != RSSM_OK) return st;
  if (release == nullptr) return Invalid(fn, "release: expected a pointer, got NULL");
  if (release->word == nullptr || reinterpret_cast<uintptr_t>(release->word) % 4 != 0) {
    return Invalid(fn, "release.word: expected a 4-byte aligned pointer to host memory, got " +
                           std::string(release->word == nullptr ? "NULL" : "a misaligned one"));
  }
  if (reinterpret_cast<uintptr_t>(release->outcome) % 4 != 0) {
    return Invalid(fn,
                   "release.outcome: expected NULL or a 4-byte aligned pointer, got a "
                   "misaligned one");
  }
  if (launch->backend == RSSM_BACKEND_CPU) {
    WaitOnHost(addr, value, release);
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  const cuda::WaitArgs args{addr, release->word, release->outcome, value, release->ticket};
  if (const rssm_status st = cuda::WaitValue32Or(*launch, args); st != RSSM_OK) return st;
  return NoteRecordedWait(static_cast<cudaStream_t>(launch->stream), args, fn);
#else
  return NoCuda(fn);
#endif
}

rssm_status rssm_stream_write_value32(const rssm_launch* launch, uint32_t* addr,
                                      uint32_t value) {
  const char* fn = "rssm_stream_write_value32";
  if (const rssm_status st = CheckLaunch(fn, launch); st != RSSM_OK) return st;
  if (const rssm_status st = CheckWord(fn, addr); st != RSSM_OK) return st;
  if (launch->backend == RSSM_BACKEND_CPU) {
    std::atomic_ref<uint32_t>(*addr).store(value, std::memory_order_release);
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  if (MemOps().write == nullptr) {
    SetLastError(std::string(fn) + ": the driver has no cuStreamWriteValue32");
    return RSSM_ERR_UNSUPPORTED;
  }
  return DriverCheck(MemOps().write(static_cast<CUstream>(launch->stream),
                                    reinterpret_cast<CUdeviceptr>(addr), value,
                                    CU_STREAM_WRITE_VALUE_DEFAULT),
                     fn);
#else
  return NoCuda(fn);
#endif
}

rssm_status rssm_stream_raise_value32(const rssm_launch* launch, uint32_t* addr, uint32_t value) {
  const char* fn = "rssm_stream_raise_value32";
  if (const rssm_status st = CheckLaunch(fn, launch); st != RSSM_OK) return st;
  if (const rssm_status st = CheckWord(fn, addr); st != RSSM_OK) return st;
  if (launch->backend == RSSM_BACKEND_CPU) {
    std::atomic_ref<uint32_t> word(*addr);
    uint32_t old = word.load(std::memory_order_acquire);
    // A failed exchange reloads `old`: a ring that got there first is judged again.
    while (!Reached(old, value) &&
           !word.compare_exchange_weak(old, value, std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
    }
    return RSSM_OK;
  }
#ifdef REPLAYSSM_WITH_CUDA
  if (const rssm_status st = UseStreamDevice(launch, fn); st != RSSM_OK) return st;
  return cuda::RaiseValue32(*launch, addr, value);
#else
  return NoCuda(fn);
#endif
}

int rssm_mps_active(void) {
  const char* dir = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string control = std::string(dir != nullptr && *dir ? dir : "/tmp/nvidia-mps") +
                              "/control";
  struct stat st {};
  return stat(control.c_str(), &st) == 0 && (S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode)) ? 1
                                                                                          : 0;
}

}  // extern "C"
