// Test helpers for the CUDA doorbell and release-wait tests: words in device memory and in
// host memory the device reads and writes.
#ifndef REPLAYSSM_KERNELS_CUDA_TESTS_DEVICE_WORDS_H_
#define REPLAYSSM_KERNELS_CUDA_TESTS_DEVICE_WORDS_H_

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "replayssm/kernels.h"

#define ASSERT_RSSM(call) ASSERT_EQ((call), RSSM_OK) << rssm_last_error()

namespace replayssm::kernels::cuda::testing {

// `n` device words, read and written from the host on a stream of their own.
class DeviceWords {
 public:
  explicit DeviceWords(size_t n) : n_(n) {
    EXPECT_EQ(rssm_alloc(RSSM_BACKEND_CUDA, n * 4, &p_), RSSM_OK);
    EXPECT_EQ(rssm_stream_create(RSSM_BACKEND_CUDA, &side_.stream), RSSM_OK);
  }
  ~DeviceWords() {
    rssm_synchronize(&side_);
    rssm_stream_destroy(RSSM_BACKEND_CUDA, side_.stream);
    rssm_free(RSSM_BACKEND_CUDA, p_);
  }
  uint32_t* at(size_t i) const { return static_cast<uint32_t*>(p_) + i; }
  void Set(size_t i, uint32_t v) {
    ASSERT_RSSM(rssm_memcpy(&side_, at(i), &v, 4, RSSM_COPY_HOST_TO_DEVICE));
    ASSERT_RSSM(rssm_synchronize(&side_));
  }
  std::vector<uint32_t> Read() {
    std::vector<uint32_t> v(n_);
    EXPECT_EQ(rssm_memcpy(&side_, v.data(), p_, n_ * 4, RSSM_COPY_DEVICE_TO_HOST), RSSM_OK);
    EXPECT_EQ(rssm_synchronize(&side_), RSSM_OK);
    return v;
  }

 private:
  size_t n_;
  void* p_ = nullptr;
  rssm_launch side_{RSSM_BACKEND_CUDA, nullptr};
};

// Host words the device reads and writes (rssm_alloc_host): a release word and outcome pairs.
class HostWords {
 public:
  explicit HostWords(size_t n) : n_(n) {
    EXPECT_EQ(rssm_alloc_host(RSSM_BACKEND_CUDA, n * 4, &p_), RSSM_OK);
    std::memset(p_, 0, n * 4);
  }
  ~HostWords() { rssm_free_host(RSSM_BACKEND_CUDA, p_); }
  uint32_t* at(size_t i) const { return static_cast<uint32_t*>(p_) + i; }
  uint32_t Get(size_t i) const {
    return std::atomic_ref<uint32_t>(*at(i)).load(std::memory_order_acquire);
  }
  void Set(size_t i, uint32_t v) {
    std::atomic_ref<uint32_t>(*at(i)).store(v, std::memory_order_release);
  }

 private:
  size_t n_;
  void* p_ = nullptr;
};

}  // namespace replayssm::kernels::cuda::testing

#endif  // REPLAYSSM_KERNELS_CUDA_TESTS_DEVICE_WORDS_H_
