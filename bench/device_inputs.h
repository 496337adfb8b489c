// Activations in backend memory for the cache-level benchmarks: T tokens of small random
// values, one set shared by every layer, with outputs beside them (forward_bench,
// host_tier_bench).
#ifndef REPLAYSSM_BENCH_DEVICE_INPUTS_H_
#define REPLAYSSM_BENCH_DEVICE_INPUTS_H_

#include <cstdint>
#include <random>
#include <vector>

#include "bench/check.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/kernels.h"

namespace replayssm::bench {

class DeviceInputs {
 public:
  DeviceInputs(int32_t backend, const cache::ModelSpec& m, int64_t t) : backend_(backend) {
    const size_t es = rssm_dtype_size(m.shape.act_dtype);
    cache::LayerIo io;
    io.memory = cache::IoMemory::kBackend;
    io.mixed_qkv = Upload(t * m.QkvWidth() * es);
    io.a = Upload(t * m.AWidth() * es);
    io.b = Upload(t * m.BWidth() * es);
    io.out = Upload(t * m.OutWidth() * es);
    layers.assign(m.num_layers, io);
  }
  ~DeviceInputs() {
    for (void* p : buffers_) rssm_free(backend_, p);
  }
  DeviceInputs(const DeviceInputs&) = delete;
  DeviceInputs& operator=(const DeviceInputs&) = delete;

  std::vector<cache::LayerIo> layers;

 private:
  // Random bytes whose 16-bit halves are small numbers in fp32, bf16 and fp16 alike.
  void* Upload(size_t bytes) {
    std::vector<uint16_t> host(bytes / 2);
    std::mt19937 rng(static_cast<uint32_t>(bytes));
    for (uint16_t& x : host) x = static_cast<uint16_t>(0x3000 + rng() % 0x0c00);
    void* p = nullptr;
    const rssm_launch l{backend_, nullptr};
    CheckRssm(rssm_alloc(backend_, bytes, &p), "alloc");
    CheckRssm(rssm_memcpy(&l, p, host.data(), bytes, RSSM_COPY_HOST_TO_DEVICE), "upload");
    CheckRssm(rssm_synchronize(&l), "upload");
    buffers_.push_back(p);
    return p;
  }
  int32_t backend_;
  std::vector<void*> buffers_;
};

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_DEVICE_INPUTS_H_
