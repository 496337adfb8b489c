// Memory of a kernel backend (rssm_alloc: host memory on CPU, device memory on CUDA) holding a
// host buffer's bytes, for tests that run the same scenario on either backend.
#ifndef REPLAYSSM_KERNELS_TESTS_BACKEND_BUFFER_H_
#define REPLAYSSM_KERNELS_TESTS_BACKEND_BUFFER_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {

class BackendBuffer {
 public:
  // `bytes` of backend memory, filled from `host` when it is not null.
  BackendBuffer(int32_t backend, size_t bytes, const void* host = nullptr)
      : backend_(backend), bytes_(bytes) {
    rssm_alloc(backend, std::max<size_t>(bytes, 16), &ptr_);
    if (host != nullptr) Put(host, bytes);
  }
  ~BackendBuffer() { rssm_free(backend_, ptr_); }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;

  // The first n bytes from / to host memory (synchronous: queued work is waited for).
  void Put(const void* host, size_t n) {
    const rssm_launch l{backend_, nullptr};
    rssm_synchronize(&l);
    rssm_memcpy(&l, ptr_, host, n, RSSM_COPY_HOST_TO_DEVICE);
    rssm_synchronize(&l);
  }
  void Get(void* host, size_t n) const {
    const rssm_launch l{backend_, nullptr};
    rssm_synchronize(&l);
    rssm_memcpy(&l, host, ptr_, n, RSSM_COPY_DEVICE_TO_HOST);
    rssm_synchronize(&l);
  }
  std::vector<uint8_t> Bytes() const {
    std::vector<uint8_t> out(bytes_);
    Get(out.data(), bytes_);
    return out;
  }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  int32_t backend_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

}  // namespace replayssm::kernels::testing

#endif  // REPLAYSSM_KERNELS_TESTS_BACKEND_BUFFER_H_
