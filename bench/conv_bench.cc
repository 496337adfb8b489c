// replayssm-bench-conv: what the short convolution adds to a decode step on the GPU — the
// replay decode kernel alone against the decode with its convolution joined to it
// (rssm_decode_args.conv: the step overlaps the convolution; what the cache runs) and against
// rssm_short_conv + the same decode as two plain calls (issue 19's target: <= 1.05x at
// B >= 64); and the finiteness scan of a shared slot (rssm_count_nonfinite). Method (the peer's,
// docs/gpu.md "The kernel benchmark"): each timed call alone between CUDA events, the L2 flushed
// before it (a 256 MiB memset), the GPU kept busy by a spin kernel while the host queues the
// launches, cursors random in [0, L-2] (no row folds: the cache folds before its decode kernels),
// the median of --iters calls. Shape: Qwen3-Next (HV=32 H=16 K=V=128 L=16, W=4), fp32 state, bf16
// activations.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda_util.h"
#include "bench/flags.h"
#include "bench/stats.h"
#include "replayssm/kernels.h"

cudaError_t LaunchSpin(long long cycles, cudaStream_t stream);

namespace {

using replayssm::bench::DeviceAlloc;
using replayssm::bench::Median;
using replayssm::bench::Upload;

struct Row {
  int64_t batch;
  double decode_us, conv_decode_us, conv_us, ratio, fused_us, fused_ratio;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  std::vector<int64_t> batches = {1, 64, 128, 256};
  int64_t iters = 208;
  replayssm::bench::Flags flags("replayssm-bench-conv",
                                "[--batch 1,64,...] [--iters N] [--json PATH]");
  flags.IntList("batch", 1, 4096, &batches);
  flags.Int("iters", 8, 100000, &iters);
  flags.String("json", &json);
  if (const int code = flags.ParseOrExitCode(argc, argv); code >= 0) return code;

  const rssm_layer_shape shape{RSSM_GATE_GDN,  16, 32, 128, 128, 16, RSSM_DTYPE_F32,
                               RSSM_DTYPE_BF16};
  const int W = 4;
  const int C = 2 * 16 * 128 + 32 * 128;
  const rssm_conv_shape conv_shape{C, W, shape.ring_len, RSSM_DTYPE_BF16};
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const size_t flush_bytes = size_t{256} << 20;
  void* flush = DeviceAlloc(flush_bytes);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::mt19937 rng(7);
  std::vector<Row> rows;
  for (const int64_t B : batches) {
    // Slots rotate through a pool of 2B (two disjoint sets), rows in random cursors.
    const int64_t S = 2 * B;
    const size_t es = 4, as = 2;
    const int64_t ckpt = rssm_checkpoint_elems(&shape);
    void* checkpoint = DeviceAlloc(S * ckpt * es);
    void* ring_d = DeviceAlloc(S * rssm_ring_d_elems(&shape) * es);
    void* ring_k = DeviceAlloc(S * rssm_ring_k_elems(&shape) * es);
    float* ring_g = static_cast<float*>(DeviceAlloc(S * rssm_ring_g_elems(&shape) * 4));
    void* window = DeviceAlloc(S * rssm_conv_window_elems(&conv_shape) * as);
    void* ring_x = DeviceAlloc(S * rssm_conv_ring_elems(&conv_shape) * as);
    std::vector<float> a_log(32, 0.3f), dt_bias(32, 0.1f), weight(size_t{C} * W, 0.25f);
    float* d_alog = Upload(a_log);
    float* d_dt = Upload(dt_bias);
    float* d_weight = Upload(weight);
    std::vector<uint16_t> xin(B * C, 0x3f80), ain(B * 32, 0x3f80), bin(B * 32, 0x3f80);
    uint16_t* d_x = Upload(xin);
    uint16_t* d_a = Upload(ain);
    uint16_t* d_b = Upload(bin);
    void* d_y = DeviceAlloc(B * C * as);
    void* d_o = DeviceAlloc(B * 32 * 128 * as);
    std::vector<std::vector<int32_t>> idx_sets(2), pos_sets(2);
    std::vector<int32_t*> d_idx(2), d_pos(2);
    for (int set = 0; set < 2; ++set) {
      for (int64_t r = 0; r < B; ++r) {
        idx_sets[set].push_back(static_cast<int32_t>(set * B + r));
        pos_sets[set].push_back(static_cast<int32_t>(rng() % (shape.ring_len - 1)));
      }
      d_idx[set] = Upload(idx_sets[set]);
      d_pos[set] = Upload(pos_sets[set]);
    }
    const rssm_state_pool pool{checkpoint, ring_d, ring_k, ring_g, S, 0, 0, 0, 0};
    const rssm_conv_state conv_state{window, ring_x, S, 0, 0};
    auto conv = [&](int set) {
      rssm_conv_args c{};
      c.launch = {RSSM_BACKEND_CUDA, stream};
      c.shape = conv_shape;
      c.weight = d_weight;
      c.state = conv_state;
      c.mode = RSSM_CONV_APPEND;
      c.batch = static_cast<int32_t>(B);
      c.slot_idx = d_idx[set];
      c.write_pos = d_pos[set];
      c.num_tokens = 1;
      c.x = d_x;
      c.y = d_y;
      CHECK_RSSM(rssm_short_conv(&c));
    };
    void* d_y2 = DeviceAlloc(B * C * as);
    const rssm_decode_conv fused{W, d_weight, nullptr, conv_state, d_y2};
    auto decode = [&](int set, bool with_conv, bool fuse) {
      rssm_decode_args a{};
      a.launch = {RSSM_BACKEND_CUDA, stream};
      a.shape = shape;
      a.params = {d_alog, d_dt, 0.088f, 1};
      a.pool = pool;
      a.batch = static_cast<int32_t>(B);
      a.slot_idx = d_idx[set];
      a.write_pos = d_pos[set];
      a.in = {with_conv ? d_y : d_x, d_a, d_b, 0, 0, 0};
      a.out = {d_o, 0};
      if (fuse) a.conv = &fused;
      if (with_conv) conv(set);
      CHECK_RSSM(rssm_replay_decode(&a));
    };
    // variant 0: decode, 1: conv + decode, 2: conv alone, 3: decode with the convolution
    // fused; interleaved call by call.
    std::vector<std::vector<float>> times(4);
    for (int64_t i = 0; i < iters + 8; ++i) {
      for (int variant = 0; variant < 4; ++variant) {
        const int set = static_cast<int>(i % 2);
        CHECK_CUDA(cudaMemsetAsync(flush, static_cast<int>(i & 0xff), flush_bytes, stream));
        // 20000 SM cycles (~10 us at the H200's 1980 MHz maximum clock): the launches queue
        // behind it.
        CHECK_CUDA(LaunchSpin(20000, stream));
        CHECK_CUDA(cudaEventRecord(start, stream));
        if (variant == 2) {
          conv(set);
        } else {
          decode(set, variant == 1, variant == 3);
        }
        CHECK_CUDA(cudaEventRecord(stop, stream));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 8) times[variant].push_back(ms * 1000.f);
      }
    }
    Row row{B, Median(times[0]), Median(times[1]), Median(times[2]), 0, Median(times[3]), 0};
    row.ratio = row.conv_decode_us / row.decode_us;
    row.fused_ratio = row.fused_us / row.decode_us;
    rows.push_back(row);
    std::printf(
        "B=%4lld  decode %8.1f us  joined %8.1f us (%.3fx)  conv+decode %8.1f us (%.3fx)  conv "
        "alone %6.1f us\n",
        static_cast<long long>(B), row.decode_us, row.fused_us, row.fused_ratio, row.conv_decode_us,
        row.ratio, row.conv_us);
    std::fflush(stdout);
    for (void* p :
         {checkpoint, ring_d, ring_k, static_cast<void*>(ring_g), window, ring_x,
          static_cast<void*>(d_alog), static_cast<void*>(d_dt), static_cast<void*>(d_weight),
          static_cast<void*>(d_x), static_cast<void*>(d_a), static_cast<void*>(d_b), d_y, d_y2, d_o,
          static_cast<void*>(d_idx[0]), static_cast<void*>(d_idx[1]), static_cast<void*>(d_pos[0]),
          static_cast<void*>(d_pos[1])}) {
      CHECK_CUDA(cudaFree(p));
    }
  }
  // The finiteness scan of a shared state (the cache's guard, issue 21): one Qwen3-Next slot,
  // 36 layers of 2 MiB checkpoints (fp32) as 36 parts, one launch, L2 flushed first.
  const size_t layers = 36, part_elems = size_t{32} * 128 * 128;
  float* slot = static_cast<float*>(DeviceAlloc(layers * part_elems * 4));
  std::vector<const void*> parts;
  for (size_t l = 0; l < layers; ++l) parts.push_back(slot + l * part_elems);
  const void** d_parts = static_cast<const void**>(DeviceAlloc(layers * sizeof(void*)));
  CHECK_CUDA(cudaMemcpy(d_parts, parts.data(), layers * sizeof(void*), cudaMemcpyHostToDevice));
  uint32_t* d_count = static_cast<uint32_t*>(DeviceAlloc(4));
  std::vector<float> scan_us;
  for (int64_t i = 0; i < 40; ++i) {
    CHECK_CUDA(cudaMemsetAsync(flush, static_cast<int>(i & 0xff), flush_bytes, stream));
    CHECK_CUDA(LaunchSpin(20000, stream));
    CHECK_CUDA(cudaEventRecord(start, stream));
    const rssm_launch launch{RSSM_BACKEND_CUDA, stream};
    CHECK_RSSM(rssm_count_nonfinite(&launch, parts.data(), d_parts, layers, part_elems,
                                    RSSM_DTYPE_F32, d_count));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (i >= 4) scan_us.push_back(ms * 1000.f);
  }
  const double scan = Median(scan_us);
  const double scan_bytes = static_cast<double>(layers * part_elems * 4);
  std::printf("finiteness scan of a 36-layer fp32 slot (%.1f MB): %.1f us (%.0f GB/s)\n",
              scan_bytes / 1e6, scan, scan_bytes / scan / 1e3);
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"device\": \"" << prop.name << "\",\n  \"method\": \"peer: alone between "
        << "events, L2 flushed, launches behind a spin kernel, median\",\n  \"iters\": " << iters
        << ",\n  \"shape\": \"GDN HV=32 H=16 K=V=128 L=16 W=4, fp32 state, bf16 act\",\n"
        << "  \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << "    {\"batch\": " << r.batch << ", \"decode_us\": " << r.decode_us
          << ", \"conv_decode_us\": " << r.conv_decode_us << ", \"conv_us\": " << r.conv_us
          << ", \"ratio\": " << r.ratio << ", \"fused_us\": " << r.fused_us
          << ", \"fused_ratio\": " << r.fused_ratio << "}" << (i + 1 < rows.size() ? "," : "")
          << "\n";
    }
    out << "  ],\n  \"nonfinite_scan\": {\"bytes\": " << scan_bytes << ", \"us\": " << scan
        << "}\n}\n";
  }
  return 0;
}
