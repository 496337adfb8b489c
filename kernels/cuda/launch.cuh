// Host launchers (templated on the state type): pick the register tile (KMAX 128 or 256) and
// the tokens per pass (TC: 1 for decode, 4 for verify), size shared memory, launch on the
// caller's stream and return the launch status. No synchronization, no allocation.
#ifndef REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_
#define REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#ifdef RSSM_BULK_TRACE
#include <vector>
#endif

#include "bulk_kernel.cuh"
#include "prefill_kernel.cuh"
#include "step_kernel.cuh"

namespace replayssm::kernels::cuda {

constexpr int kVerifyTokensPerPass = 4;

// The device facts the launchers need, read from the runtime once per device (every layer of
// every step launches: no attribute queries on that path).
struct DeviceFacts {
  int id = 0, sms = 0, smem_max = 0, smem_sm = 0;
};
constexpr int kMaxDevices = 64;
inline cudaError_t DeviceFactsOf(DeviceFacts* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  static std::mutex mu;
  static DeviceFacts cache[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached && ready[dev].load(std::memory_order_acquire)) {
    *out = cache[dev];
    return cudaSuccess;
  }
  DeviceFacts d;
  d.id = dev;
  if ((e = cudaDeviceGetAttribute(&d.smem_max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev)) !=
          cudaSuccess ||
      (e = cudaDeviceGetAttribute(&d.smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev)) !=
          cudaSuccess ||
      (e = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) {
    return e;
  }
  if (cached) {
    std::lock_guard<std::mutex> lock(mu);
    if (!ready[dev].load(std::memory_order_relaxed)) {  // never rewritten once readers may see it
      cache[dev] = d;
      ready[dev].store(true, std::memory_order_release);
    }
  }
  *out = d;
  return cudaSuccess;
}

// A kernel's function attributes for one device, set once, not per launch: the dynamic
// shared-memory limit (beyond the default 48 KB; the largest asked for so far: raised, never
// lowered, under a lock, so a concurrent launch never sees its limit shrink) and, when asked,
// the largest shared-memory carveout. One per kernel instantiation: a static in its launcher
// (kernels of one signature share a function-pointer type, so it cannot key on the type).
class FuncSmemLimit {
 public:
  template <typename Kernel>
  cudaError_t Allow(Kernel kernel, int dev, size_t bytes, bool max_shared_carveout) {
    const bool cached = dev >= 0 && dev < kMaxDevices;
    if (cached && allowed_[dev].load(std::memory_order_acquire) >= int64_t(bytes)) {
      return cudaSuccess;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t have = cached ? allowed_[dev].load(std::memory_order_relaxed) : 0;
    if (have >= int64_t(bytes)) return cudaSuccess;
    cudaError_t e = cudaSuccess;
    if (bytes > 48 * 1024) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes));
    }
    if (e == cudaSuccess && have == 0 && max_shared_carveout) {
      e = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared));
    }
    if (e == cudaSuccess && cached) allowed_[dev].store(int64_t(bytes), std::memory_order_release);
    return e;
  }

 private:
  std::mutex mu_;
  std::atomic<int64_t> allowed_[kMaxDevices]{};
};

// `kernel` allowed `bytes` of dynamic shared memory on the current device.
template <typename Kernel>
cudaError_t AllowOnDevice(FuncSmemLimit& limit, Kernel kernel, size_t bytes) {
  DeviceFacts dev;
  cudaError_t e = DeviceFactsOf(&dev);
  if (e != cudaSuccess) return e;
  return limit.Allow(kernel, dev.id, bytes, false);
}

inline cudaError_t Grid(int64_t rows, int heads, int vtiles, dim3* grid) {
  const int64_t n = rows * heads * vtiles;
  if (n <= 0 || n > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  *grid = dim3(static_cast<unsigned>(n));
  return cudaSuccess;
}

template <typename T, int KMAX, int TC>
cudaError_t LaunchStepT(StepParams p, cudaStream_t stream) {
  using Cfg = TileCfg<T, KMAX>;
  p.num_vtiles = (p.ly.V + Cfg::VT - 1) / Cfg::VT;
  p.sm = SmemLayout::Make(p.ly.K, p.ly.L, Cfg::VT, TC, p.ly.kda != 0);
  const size_t bytes = size_t(p.sm.total) * sizeof(float);
  dim3 grid;
  cudaError_t e = Grid(p.batch, p.ly.HV, p.num_vtiles, &grid);
  if (e != cudaSuccess) return e;
  static FuncSmemLimit limit;
  if ((e = AllowOnDevice(limit, StepKernel<T, KMAX, TC>, bytes)) != cudaSuccess) return e;
  StepKernel<T, KMAX, TC><<<grid, kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

// REPLAYSSM_CUDA_STEP forces one step kernel for every call: "legacy" = StepKernel (v4b,
// step_kernel.cuh), "bulk" = the bulk-staged warp kernel (v7, bulk_kernel.cuh). Unset: StepPath
// below. (The v5 pre-pass + streaming kernel and its workspace were deleted once v7 won fp32
// verify at B >= 64, its last default: kernels-h200-2026-11-30-v7i.md.)
enum StepKind { kStepDefault = -1, kStepLegacy = 0, kStepBulk = 4 };
inline StepKind StepChoice() {
  static const StepKind k = [] {
    const char* e = std::getenv("REPLAYSSM_CUDA_STEP");
    if (e == nullptr) return kStepDefault;
    if (std::strcmp(e, "bulk") == 0) return kStepBulk;
    return kStepLegacy;
  }();
  return k;
}

// The batch from which verify takes v7 (StepPath): REPLAYSSM_CUDA_BULK_MIN_B (16).
inline int64_t BulkMinBatch() {
  static const int64_t n = [] {
    const char* e = std::getenv("REPLAYSSM_CUDA_BULK_MIN_B");
    return e != nullptr ? std::atoll(e) : 16LL;
  }();
  return n;
}
// The default (no REPLAYSSM_CUDA_STEP), measured on the H200 against every candidate
// (bench/results/kernels-h200-2026-11-30-v7.md, ...-v7i.md): decode (baseline and replay)
// takes v7 at every batch — since v7h-v7l it wins at B = 1 too (bf16 baseline 10.4 -> 8.4 µs,
// replay 11.7 -> 8.5 µs; KDA fp32 within 3% of v4b; ...-v7l-b1-on-{v7,v4b}.json); verify takes
// v7 at B >= 16 (it beat v5 at fp32 B >= 64 by 19-27% and v4b at 16-bit B = 16 by 22-27%) and
// v4b below (v7 verify at B = 1 is 10-35% slower). Baseline and replay of one batch always
// share a path (the L = 1 bit identity).
enum StepPathKind { kPathLegacy, kPathBulk };
inline StepPathKind StepPath(const StepParams& p) {
  switch (StepChoice()) {
    case kStepLegacy: return kPathLegacy;
    case kStepBulk: return kPathBulk;
    case kStepDefault: break;
  }
  if (p.mode != kModeVerify) return kPathBulk;
  return p.batch >= BulkMinBatch() ? kPathBulk : kPathLegacy;
}
inline bool Verbose() {
  static const bool v = std::getenv("REPLAYSSM_CUDA_VERBOSE") != nullptr;
  return v;
}

inline bool Aligned16(const void* ptr, int64_t stride_elems, size_t elem) {
  return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0 && (stride_elems * int64_t(elem)) % 16 == 0;
}

// v7 (bulk_kernel.cuh): REPLAYSSM_CUDA_RPW (16..64, multiple of 16), REPLAYSSM_CUDA_NW (1..4)
// and REPLAYSSM_CUDA_NS (1..8) force the rows per warp, warps per CTA and S0 stages per warp;
// unset = chosen by LaunchBulkT.
inline int EnvInt(const char* name, int lo, int hi) {
  const char* e = std::getenv(name);
  const int v = e != nullptr ? std::atoi(e) : 0;
  return v >= lo && v <= hi ? v : 0;
}
inline int BulkRowsOverride() {
  static const int n = [] {
    const int v = EnvInt("REPLAYSSM_CUDA_RPW", 16, 64);
    return v % 16 == 0 ? v : 0;
  }();
  return n;
}
// REPLAYSSM_CUDA_BULK: which pieces may use the bulk copy engine (bits: 1 S0, 2 ring d,
// 4 ring k, 8 ring g; default 15); the others take the kernel's plain-load path.
inline int BulkMask() {
  static const int n = [] {
    const char* e = std::getenv("REPLAYSSM_CUDA_BULK");
    return e != nullptr ? std::atoi(e) & 15 : 15;
  }();
  return n;
}
inline int BulkStagesOverride() {
  static const int n = EnvInt("REPLAYSSM_CUDA_NS", 1, kBulkMaxStages);
  return n;
}
inline int BulkWarpsOverride() {
  static const int n = EnvInt("REPLAYSSM_CUDA_NW", 1, kBulkMaxWarps);
  return n;
}

// One CTA per (row, v-head, chunk of nw * rpw rows). Shrinks the stages, then nw, until the
// layout fits; *launched stays false when nothing fits (the caller falls back).
#ifdef RSSM_BULK_TRACE
// The number of this v7 launch in the process (diagnostic build: the timeline's trigger). An
// inline function's static, so one counter for every instantiation of the launcher.
inline int64_t TraceLaunchNumber() {
  static std::atomic<int64_t> calls{0};
  return calls.fetch_add(1, std::memory_order_relaxed);
}
#endif

template <typename T, int TT, int KC, int RB, bool KDA>
cudaError_t LaunchBulkT(const StepParams& sp, cudaStream_t stream, bool* launched) {
  *launched = false;
  BulkParams p{};
  p.ly = sp.ly;
  p.batch = sp.batch;
  p.num_draft = sp.num_draft;
  p.mode = sp.mode;
  p.slot_idx = sp.slot_idx;
  p.write_pos = sp.write_pos;
  p.force_fold = sp.force_fold;
  const LayerDesc& ly = p.ly;
  constexpr int sz = int(sizeof(T));
  p.lr = p.mode == kModeBaseline ? 0 : ly.L;
  DeviceFacts bdev;
  cudaError_t e = DeviceFactsOf(&bdev);
  if (e != cudaSuccess) return e;
  const int sms = bdev.sms, smem_max = bdev.smem_max, smem_sm = bdev.smem_sm;
  // Rows per warp: a CTA covers a whole head (the prologue once per (row, head)) when the
  // grid still fills the GPU, else 16 (more CTAs for small batches) with the warps halved
  // while the grid is short of 2 CTAs per SM, down to 2 (v7m, B = 1: 2 warps x 16 rows beat
  // 1 x 16 by 8-12% in the baseline and 13-18% in replay, keeping replay within 7% of the
  // baseline; 1 x 16 left KDA fp32 replay 14% behind;
  // kernels-h200-2026-11-30-v7m-b1-configs.txt). S0 streams through ns stages of RB rows per
  // warp.
  const int vpad = (ly.V + 15) / 16 * 16;
  int nw = BulkWarpsOverride() != 0 ? BulkWarpsOverride() : kBulkMaxWarps;
  auto per_warp = [&](int n) { return ((ly.V + n - 1) / n + 15) / 16 * 16; };
  int rpw = BulkRowsOverride();
  if (rpw == 0) {
    rpw = int64_t{p.batch} * ly.HV >= 2LL * sms ? per_warp(nw) : 16;
    if (BulkWarpsOverride() == 0 && rpw == 16) {
      auto ctas = [&](int n) {
        return int64_t{p.batch} * ly.HV * ((ly.V + n * 16 - 1) / (n * 16));
      };
      while (nw > 2 && ctas(nw) < 2LL * sms) nw /= 2;
    }
  }
  rpw = std::min(rpw, vpad);
  int ns = BulkStagesOverride() != 0 ? BulkStagesOverride() : 2;
  ns = std::min(ns, (rpw + RB - 1) / RB);
  // Stages give way to CTAs: without an override, ns shrinks while the layout would leave
  // fewer than kBulkMinCtas CTAs per SM (1 KB of each CTA's shared memory is the system's).
  // Measured (v7i.md): KDA replay at fp32 has 3 CTAs/SM with 2 stages, 4 with 1: 236 -> 224 us.
  const bool ns_free = BulkStagesOverride() == 0;
  BulkSmem sm;
  for (;;) {
    sm = BulkSmem::Make(ly.K, ly.L, p.lr, ly.kda != 0, p.num_draft, TT, nw, rpw, ns, RB, sz,
                        p.mode != kModeVerify);
    const bool few = ns_free && TT == 1 && smem_sm / (sm.total + 1024) < kBulkMinCtas;
    if (sm.total <= smem_max && !(few && ns > 1)) break;
    if (ns > 1) {
      --ns;
    } else if (nw > 1) {
      nw /= 2;
    } else {
      return cudaSuccess;  // does not fit: the caller's fallback runs
    }
  }
  p.nw = nw;
  p.rpw = rpw;
  p.ns = ns;
  p.nchunk = (ly.V + nw * rpw - 1) / (nw * rpw);
  p.o_s0 = sm.s0, p.o_d = sm.d, p.o_kr = sm.kr, p.o_kw = sm.kw, p.o_g = sm.g;
  p.o_tq = sm.tq, p.o_tk = sm.tk, p.o_tg = sm.tg, p.o_ka = sm.ka, p.o_qa = sm.qa;
  p.o_av = sm.av, p.o_kn = sm.kn, p.o_vs = sm.vs, p.o_u = sm.u, p.o_p = sm.p, p.o_sc = sm.sc, p.o_dd = sm.dd;
  const int64_t ck = ly.ckpt_stride != 0 ? ly.ckpt_stride : int64_t{ly.HV} * ly.V * ly.K;
  const int64_t ds = ly.d_stride != 0 ? ly.d_stride : int64_t{ly.HV} * ly.L * ly.V;
  const int64_t ks = ly.k_stride != 0 ? ly.k_stride : int64_t{ly.H} * ly.L * ly.K;
  const int64_t gs = ly.g_stride != 0 ? ly.g_stride : int64_t{ly.HV} * ly.L * (ly.kda ? ly.K : 1);
  const int mask = BulkMask();
  p.vec_s0 = Aligned16(ly.ckpt, ck, sz) ? 1 : 0;
  p.bulk_s0 = p.vec_s0 != 0 && (mask & 1) != 0 ? 1 : 0;
  p.bulk_d = Aligned16(ly.ring_d, ds, sz) && (mask & 2) != 0 ? 1 : 0;
  p.bulk_k = Aligned16(ly.ring_k, ks, sz) && (mask & 4) != 0 ? 1 : 0;
  // (GDN's g row goes in 16-byte units: only when every row starts 16-byte aligned)
  p.bulk_g = Aligned16(ly.ring_g, gs, 4) && (ly.kda || ly.L % 4 == 0) && (mask & 8) != 0 ? 1 : 0;
  // The ring's d rows of a whole-head CTA (records 0..w-1 contiguous then) come in one copy,
  // unpadded in shared memory, except for fp32 GDN decode (v7o, same-call A/B
  // kernels-h200-2026-11-30-v7o-ab-*.json): one copy instead of w takes ~0.4 us off the
  // prologue's issue, while the unpadded rows cost the ring terms 8-way bank conflicts; fp32 GDN
  // decode has the cheapest prologue and lost 0.3-1.7% with it, every other case gained 1-3%.
  const bool dense_ok = !(TT == 1 && sz == 4 && !KDA);
  p.d_dense = dense_ok && p.bulk_d != 0 && p.nchunk == 1 && nw * rpw == ly.V ? 1 : 0;
  p.dstride = p.d_dense != 0 ? ly.V : DStride(nw * rpw, sz);
  // grid (HV * nchunk, batch); a batch past the grid's y limit takes the caller's fallback
  const int64_t heads = int64_t{ly.HV} * p.nchunk;
  if (p.batch <= 0 || heads <= 0 || heads > 0x7fffffffLL) return cudaErrorInvalidConfiguration;
  if (p.batch > 65535) return cudaSuccess;
  const int64_t items = heads * p.batch;
  const size_t bytes = size_t(sm.total);
  auto kernel = BulkStepKernel<T, TT, KC, RB, KDA>;
  static FuncSmemLimit limit;  // one per instantiation
  if ((e = limit.Allow(kernel, bdev.id, bytes, true)) != cudaSuccess) return e;
  if (Verbose()) {
    int per_sm = 0;
    (void)cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, nw * 32, bytes);
    std::fprintf(stderr,
                 "bulk: mode %d T %d RB %d rpw %d ns %d nw %d nchunk %d smem %zu B, %d CTAs/SM, "
                 "grid %lld, bulk s0/d/k/g %d%d%d%d\n",
                 int(p.mode), p.num_draft, RB, rpw, ns, nw, p.nchunk, bytes, per_sm,
                 (long long)items, p.bulk_s0, p.bulk_d, p.bulk_k, p.bulk_g);
  }
#ifdef RSSM_BULK_TRACE
  // Diagnostic build: launch number REPLAYSSM_CUDA_TRACE_AT (counted over this process's v7
  // launches, every instantiation) records every CTA's timeline (bulk_kernel.cuh, kTraceWords)
  // and writes it to REPLAYSSM_CUDA_TRACE_FILE: 8 int32 (batch, heads, mode, nw, rpw, ns, SMs,
  // smem bytes), then the words. It synchronizes the stream: never in a serving build.
  const char* at = std::getenv("REPLAYSSM_CUDA_TRACE_AT");
  const char* file = std::getenv("REPLAYSSM_CUDA_TRACE_FILE");
  const bool trace = at != nullptr && file != nullptr && TraceLaunchNumber() == std::atoll(at);
  p.trace = nullptr;
  const size_t tbytes = size_t(items) * kTraceWords * 8;
  if (trace) {
    if ((e = cudaMalloc(&p.trace, tbytes)) != cudaSuccess) return e;
    if ((e = cudaMemsetAsync(p.trace, 0, tbytes, stream)) != cudaSuccess) return e;
  }
#endif
  kernel<<<dim3(static_cast<unsigned>(heads), static_cast<unsigned>(p.batch)), nw * 32, bytes, stream>>>(p);
  e = cudaGetLastError();
  *launched = e == cudaSuccess;
#ifdef RSSM_BULK_TRACE
  if (trace) {
    std::vector<unsigned long long> h(size_t(items) * kTraceWords);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e == cudaSuccess) e = cudaMemcpy(h.data(), p.trace, tbytes, cudaMemcpyDeviceToHost);
    cudaFree(p.trace);
    if (e != cudaSuccess) return e;
    if (FILE* f = std::fopen(file, "wb")) {
      const int32_t hdr[8] = {p.batch, int32_t(heads), p.mode, nw, rpw, ns, sms, int32_t(bytes)};
      std::fwrite(hdr, sizeof hdr, 1, f);
      std::fwrite(h.data(), 8, h.size(), f);
      std::fclose(f);
    }
  }
#endif
  return e;
}

template <typename T, bool KDA>
cudaError_t LaunchBulkGate(const StepParams& p, cudaStream_t stream, bool* launched) {
  const bool verify = p.mode == kModeVerify;
  if (p.ly.K <= 128) {
    return verify ? LaunchBulkT<T, kVerifyTokensPerPass, 4, 4, KDA>(p, stream, launched)
                  : LaunchBulkT<T, 1, 4, 8, KDA>(p, stream, launched);
  }
  return verify ? LaunchBulkT<T, kVerifyTokensPerPass, 8, 2, KDA>(p, stream, launched)
                : LaunchBulkT<T, 1, 8, 8, KDA>(p, stream, launched);
}

// The gate kind is a template parameter of v7 (the record-dot units' weights differ).
template <typename T>
cudaError_t LaunchBulkFor(const StepParams& p, cudaStream_t stream, bool* launched) {
  return p.ly.kda != 0 ? LaunchBulkGate<T, true>(p, stream, launched)
                       : LaunchBulkGate<T, false>(p, stream, launched);
}

template <typename T>
cudaError_t LaunchStepFor(StepParams p, cudaStream_t stream) {
  const bool verify = p.mode == kModeVerify;
  const StepPathKind path = StepPath(p);
  if (path == kPathBulk) {
    bool launched = false;
    const cudaError_t e = LaunchBulkFor<T>(p, stream, &launched);
    if (e != cudaSuccess || launched) return e;  // else: does not fit, StepKernel
  }
  if (p.ly.K <= 128) {
    return verify ? LaunchStepT<T, 128, kVerifyTokensPerPass>(p, stream)
                  : LaunchStepT<T, 128, 1>(p, stream);
  }
  return verify ? LaunchStepT<T, 256, kVerifyTokensPerPass>(p, stream)
                : LaunchStepT<T, 256, 1>(p, stream);
}

template <typename T, int KMAX>
cudaError_t LaunchPrefillT(PrefillParams p, cudaStream_t stream) {
  using Cfg = TileCfg<T, KMAX>;
  p.num_vtiles = (p.ly.V + Cfg::VT - 1) / Cfg::VT;
  p.sm = SmemLayout::Make(p.ly.K, p.ly.L, Cfg::VT, 1, p.ly.kda != 0);
  const size_t bytes = size_t(p.sm.total) * sizeof(float);
  dim3 grid;
  cudaError_t e = Grid(p.batch, p.ly.HV, p.num_vtiles, &grid);
  if (e != cudaSuccess) return e;
  static FuncSmemLimit limit;
  if ((e = AllowOnDevice(limit, PrefillKernel<T, KMAX>, bytes)) != cudaSuccess) return e;
  PrefillKernel<T, KMAX><<<grid, kThreads, bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchPrefillFor(PrefillParams p, cudaStream_t stream) {
  return p.ly.K <= 128 ? LaunchPrefillT<T, 128>(p, stream) : LaunchPrefillT<T, 256>(p, stream);
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_
