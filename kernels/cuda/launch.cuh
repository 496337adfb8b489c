// Host launchers (templated on the state type T and the ring's type R): carry out a LaunchPlan
// (plan.h) — the kernel's instantiation, grid, CTA and shared memory — on the caller's stream and
// return the launch status. They decide nothing: every choice is the planner's. No synchronization,
// no allocation.
#ifndef REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_
#define REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_

#include <atomic>
#include <mutex>
#include <type_traits>

#include "baseline_kernel.cuh"
#include "bulk_step_kernel.cuh"
#include "prefill_kernel.cuh"
#include "small_replay_kernel.cuh"
#include "stream_replay_kernel.cuh"
#include "tiled_step_kernel.cuh"

namespace replayssm::kernels::cuda {

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
  static constexpr int kMaxDevices = 64;
  std::mutex mu_;
  std::atomic<int64_t> allowed_[kMaxDevices]{};
};

template <typename T, typename R, int KMAX, int TC>
cudaError_t LaunchTiledT(const LaunchPlan& plan, int device, StepParams p, cudaStream_t stream) {
  p.num_vtiles = plan.tiled.num_vtiles;
  p.sm = plan.tiled.smem;
  static FuncSmemLimit limit;
  const cudaError_t e =
      limit.Allow(TiledStepKernel<T, R, KMAX, TC>, device, plan.smem_bytes, false);
  if (e != cudaSuccess) return e;
  TiledStepKernel<T, R, KMAX, TC><<<plan.grid_x, plan.threads, plan.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename R, int TT, int KC, int RB, bool KDA, bool AFTER_CONV = false>
cudaError_t LaunchBulkT(const LaunchPlan& plan, int device, const StepParams& sp,
                        cudaStream_t stream) {
  const BulkConfig& c = plan.bulk;
  if (c.rows_per_batch != RB) return cudaErrorInvalidConfiguration;  // not this instantiation
  BulkParams p{};
  p.ly = sp.ly;
  p.batch = sp.batch;
  p.num_draft = sp.num_draft;
  p.mode = sp.mode;
  p.slot_idx = sp.slot_idx;
  p.write_pos = sp.write_pos;
  p.force_fold = sp.force_fold;
  p.nw = c.warps;
  p.rpw = c.rows_per_warp;
  p.ns = c.stages;
  p.nchunk = c.chunks;
  p.lr = c.ring_records;
  p.dstride = c.d_stride;
  const BulkSmem& sm = c.smem;
  p.o_s0 = sm.s0, p.o_d = sm.d, p.o_kr = sm.kr, p.o_kw = sm.kw, p.o_g = sm.g;
  p.o_tq = sm.tq, p.o_tk = sm.tk, p.o_tg = sm.tg, p.o_ka = sm.ka, p.o_qa = sm.qa;
  p.o_av = sm.av, p.o_kn = sm.kn, p.o_vs = sm.vs, p.o_u = sm.u, p.o_p = sm.p, p.o_sc = sm.sc;
  p.o_dd = sm.dd;
  p.vec_s0 = c.vec_s0, p.bulk_s0 = c.bulk_s0, p.bulk_d = c.bulk_d, p.bulk_k = c.bulk_k;
  p.bulk_g = c.bulk_g, p.d_dense = c.d_dense;
  p.o_late = c.late_stage ? sm.kr : -1;
  auto kernel = BulkStepKernel<T, R, TT, KC, RB, KDA, AFTER_CONV>;
  static FuncSmemLimit limit;  // one per instantiation
  const cudaError_t e = limit.Allow(kernel, device, plan.smem_bytes, true);
  if (e != cudaSuccess) return e;
  if constexpr (AFTER_CONV) {  // the programmatic dependent of the convolution just queued
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(plan.grid_x, plan.grid_y);
    cfg.blockDim = dim3(plan.threads);
    cfg.dynamicSmemBytes = plan.smem_bytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, p);
  }
  kernel<<<dim3(plan.grid_x, plan.grid_y), plan.threads, plan.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

// The gate kind is a template parameter of the bulk kernel (the record dots' weights differ).
template <typename T, typename R, bool KDA>
cudaError_t LaunchBulkGate(const LaunchPlan& plan, int device, const StepParams& p,
                           cudaStream_t stream) {
  const bool wide = plan.bulk.channels_per_lane == 8;
  if (plan.bulk.tokens_per_pass == 1 && p.after_conv != 0) {
    return wide ? LaunchBulkT<T, R, 1, 8, 8, KDA, true>(plan, device, p, stream)
                : LaunchBulkT<T, R, 1, 4, 8, KDA, true>(plan, device, p, stream);
  }
  if (plan.bulk.tokens_per_pass == 1) {
    return wide ? LaunchBulkT<T, R, 1, 8, 8, KDA>(plan, device, p, stream)
                : LaunchBulkT<T, R, 1, 4, 8, KDA>(plan, device, p, stream);
  }
  return wide ? LaunchBulkT<T, R, 4, 8, 2, KDA>(plan, device, p, stream)
              : LaunchBulkT<T, R, 4, 4, 4, KDA>(plan, device, p, stream);
}

template <typename T, typename R, typename A, bool KDA, int KC, int NW, int RPW, int CACHE>
cudaError_t LaunchBaselineT(const LaunchPlan& plan, const StepParams& sp, cudaStream_t stream) {
  BaselineParams p{};
  p.ly = sp.ly;
  p.tiles = plan.baseline.tiles;
  p.vec = plan.baseline.vec ? 1 : 0;
  p.slot_idx = sp.slot_idx;
  BaselineKernel<T, R, A, KDA, KC, NW, RPW, CACHE>
      <<<dim3(plan.grid_x, plan.grid_y), NW * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

// The baseline kernel's CTA shapes built: the planned ones (layout.h) for every type; for the
// kernel benchmark's overrides, the shapes and cache hints of issue 20's comparison on its
// types (bf16 activations, K <= 128, fp32 or bf16 state).
template <typename T, typename R, typename A, bool KDA, int KC>
cudaError_t LaunchBaselineShape(const LaunchPlan& plan, const StepParams& p, cudaStream_t stream) {
  const BaselineConfig& c = plan.baseline;
  auto is = [&c](int nw, int rpw, int cache) {
    return c.warps == nw && c.rows_per_warp == rpw && c.cache == cache;
  };
  constexpr int kNw = kBaselineWarps, kCache = kBaselineCache;
  constexpr int kRows = KC == 4 ? kBaselineRowsPerWarp : kBaselineRowsPerWarp / 2;
  constexpr int kWide = KC == 4 ? kBaselineRowsPerWarpWide : kBaselineRowsPerWarpWide / 2;
  if (is(kNw, kRows, kCache)) {
    return LaunchBaselineT<T, R, A, KDA, KC, kNw, kRows, kCache>(plan, p, stream);
  }
  if (is(kNw, kWide, kCache)) {
    return LaunchBaselineT<T, R, A, KDA, KC, kNw, kWide, kCache>(plan, p, stream);
  }
  constexpr bool kBenchState = std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16>;
  constexpr bool kBenchTypes =
      kBenchState && std::is_same_v<R, T> && std::is_same_v<A, __nv_bfloat16> && KC == 4;
  if constexpr (kBenchTypes) {
#define RSSM_BASELINE_SHAPE(nw, rpw, cache) \
  if (is(nw, rpw, cache)) return LaunchBaselineT<T, R, A, KDA, KC, nw, rpw, cache>(plan, p, stream)
    RSSM_BASELINE_SHAPE(2, 8, kCachePlain);
    RSSM_BASELINE_SHAPE(2, 16, kCachePlain);
    RSSM_BASELINE_SHAPE(4, 8, kCacheStream);
    RSSM_BASELINE_SHAPE(4, 4, kCachePlain);
    if constexpr (std::is_same_v<T, float>) {
      RSSM_BASELINE_SHAPE(2, 8, kCacheStream);
      RSSM_BASELINE_SHAPE(2, 16, kCacheStream);
      RSSM_BASELINE_SHAPE(2, 16, kCacheNoL1);
      RSSM_BASELINE_SHAPE(2, 16, kCacheStreamLoad);
      RSSM_BASELINE_SHAPE(2, 16, kCacheKeepStores);
      RSSM_BASELINE_SHAPE(2, 8, kCacheKeepStores);
    }
#undef RSSM_BASELINE_SHAPE
  }
  return cudaErrorInvalidConfiguration;  // a shape not built
}

template <typename T, typename R, typename A>
cudaError_t LaunchBaselineAct(const LaunchPlan& plan, const StepParams& p, cudaStream_t stream) {
  const bool kda = p.ly.kda != 0;
  if (plan.baseline.channels_per_lane == 4) {
    return kda ? LaunchBaselineShape<T, R, A, true, 4>(plan, p, stream)
               : LaunchBaselineShape<T, R, A, false, 4>(plan, p, stream);
  }
  return kda ? LaunchBaselineShape<T, R, A, true, 8>(plan, p, stream)
             : LaunchBaselineShape<T, R, A, false, 8>(plan, p, stream);
}

// The activations' dtype is a template parameter of the baseline kernel (its token loads).
template <typename T, typename R>
cudaError_t LaunchBaselineFor(const LaunchPlan& plan, const StepParams& p, cudaStream_t stream) {
  switch (p.ly.act_dtype) {
    case kActF32: return LaunchBaselineAct<T, R, float>(plan, p, stream);
    case kActBf16: return LaunchBaselineAct<T, R, __nv_bfloat16>(plan, p, stream);
    default: return LaunchBaselineAct<T, R, __half>(plan, p, stream);
  }
}

template <typename R, typename A, bool KDA, int RPW, bool AFTER_CONV>
cudaError_t LaunchSmallReplayT(const LaunchPlan& plan, int device, const StepParams& sp,
                               cudaStream_t stream) {
  const SmallReplayConfig& c = plan.small;
  SmallReplayParams p{};
  p.ly = sp.ly;
  p.tiles = c.tiles;
  p.o_k = c.smem.k, p.o_g = c.smem.g, p.o_d = c.smem.d, p.o_kw = c.smem.kw;
  p.o_u = c.smem.u, p.o_p = c.smem.p;
  p.slot_idx = sp.slot_idx;
  p.write_pos = sp.write_pos;
  p.force_fold = sp.force_fold;
  auto kernel = SmallReplayKernel<R, A, KDA, 4, RPW, AFTER_CONV>;
  static FuncSmemLimit limit;  // one per instantiation
  const cudaError_t e = limit.Allow(kernel, device, plan.smem_bytes, false);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(plan.grid_x, plan.grid_y);
  cfg.blockDim = dim3(plan.threads);
  cfg.dynamicSmemBytes = plan.smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};  // AFTER_CONV: the programmatic dependent of the convolution
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = AFTER_CONV ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <typename R, typename A, bool KDA>
cudaError_t LaunchSmallReplayRows(const LaunchPlan& plan, int device, const StepParams& p,
                                  cudaStream_t stream) {
  const bool after = p.after_conv != 0;
  switch (plan.small.rows_per_warp) {
    case 8:
      return after ? LaunchSmallReplayT<R, A, KDA, 8, true>(plan, device, p, stream)
                   : LaunchSmallReplayT<R, A, KDA, 8, false>(plan, device, p, stream);
    case 16:
      return after ? LaunchSmallReplayT<R, A, KDA, 16, true>(plan, device, p, stream)
                   : LaunchSmallReplayT<R, A, KDA, 16, false>(plan, device, p, stream);
  }
  return cudaErrorInvalidConfiguration;
}

// The small-batch replay kernel: an fp32 checkpoint only (the planner's), activations' dtype
// and gate as template parameters.
template <typename T, typename R>
cudaError_t LaunchSmallReplayFor(const LaunchPlan& plan, int device, const StepParams& p,
                                 cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    return cudaErrorInvalidConfiguration;
  } else {
    const bool kda = p.ly.kda != 0;
    switch (p.ly.act_dtype) {
      case kActF32:
        return kda ? LaunchSmallReplayRows<R, float, true>(plan, device, p, stream)
                   : LaunchSmallReplayRows<R, float, false>(plan, device, p, stream);
      case kActBf16:
        return kda ? LaunchSmallReplayRows<R, __nv_bfloat16, true>(plan, device, p, stream)
                   : LaunchSmallReplayRows<R, __nv_bfloat16, false>(plan, device, p, stream);
      default:
        return kda ? LaunchSmallReplayRows<R, __half, true>(plan, device, p, stream)
                   : LaunchSmallReplayRows<R, __half, false>(plan, device, p, stream);
    }
  }
}

template <typename R, bool KDA, int MINB>
cudaError_t LaunchStreamReplayT(const LaunchPlan& plan, int device, const StepParams& sp,
                                cudaStream_t stream) {
  const StreamConfig& c = plan.stream;
  StreamParams p{};
  p.ly = sp.ly;
  p.items = static_cast<int32_t>(int64_t{sp.batch} * sp.ly.HV);
  p.nsw = c.stages_per_warp;
  p.dst = c.d_stride;
  p.after_conv = sp.after_conv;
  p.sm = c.smem;
  p.slot_idx = sp.slot_idx;
  p.write_pos = sp.write_pos;
  p.force_fold = sp.force_fold;
  if (c.ctas_per_sm > MINB) return cudaErrorInvalidConfiguration;  // not this instantiation
  auto kernel = StreamReplayKernel<R, KDA, MINB>;
  static FuncSmemLimit limit;  // one per instantiation
  const cudaError_t e = limit.Allow(kernel, device, plan.smem_bytes, true);
  if (e != cudaSuccess) return e;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(plan.grid_x);
  cfg.blockDim = dim3(plan.threads);
  cfg.dynamicSmemBytes = plan.smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr{};  // after_conv: the programmatic dependent of the convolution
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = &attr;
  cfg.numAttrs = sp.after_conv != 0 ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// The stream replay kernel: an fp32 checkpoint only (the planner's).
template <typename T, typename R>
cudaError_t LaunchStreamReplayFor(const LaunchPlan& plan, int device, const StepParams& p,
                                  cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    return cudaErrorInvalidConfiguration;
  } else {
    // Registers for 3 CTAs per SM, or for 2 (fewer CTAs take the latter).
    if (plan.stream.ctas_per_sm == 3) {
      return p.ly.kda != 0 ? LaunchStreamReplayT<R, true, 3>(plan, device, p, stream)
                           : LaunchStreamReplayT<R, false, 3>(plan, device, p, stream);
    }
    return p.ly.kda != 0 ? LaunchStreamReplayT<R, true, 2>(plan, device, p, stream)
                         : LaunchStreamReplayT<R, false, 2>(plan, device, p, stream);
  }
}

template <typename T, typename R>
cudaError_t LaunchStepFor(const LaunchPlan& plan, int device, const StepParams& p,
                          cudaStream_t stream) {
  if (plan.role == KernelRole::kBaseline) return LaunchBaselineFor<T, R>(plan, p, stream);
  if (plan.role == KernelRole::kSmallReplay) {
    return LaunchSmallReplayFor<T, R>(plan, device, p, stream);
  }
  if (plan.role == KernelRole::kStreamReplay) {
    return LaunchStreamReplayFor<T, R>(plan, device, p, stream);
  }
  if (plan.role == KernelRole::kBulkStep) {
    return p.ly.kda != 0 ? LaunchBulkGate<T, R, true>(plan, device, p, stream)
                         : LaunchBulkGate<T, R, false>(plan, device, p, stream);
  }
  if (plan.role != KernelRole::kTiledStep) return cudaErrorInvalidConfiguration;
  const bool verify = plan.tiled.tokens_per_pass != 1;
  if (plan.tiled.kmax == 128) {
    return verify ? LaunchTiledT<T, R, 128, 4>(plan, device, p, stream)
                  : LaunchTiledT<T, R, 128, 1>(plan, device, p, stream);
  }
  return verify ? LaunchTiledT<T, R, 256, 4>(plan, device, p, stream)
                : LaunchTiledT<T, R, 256, 1>(plan, device, p, stream);
}

template <typename T, typename R, int KMAX>
cudaError_t LaunchPrefillT(const LaunchPlan& plan, int device, PrefillParams p,
                           cudaStream_t stream) {
  p.num_vtiles = plan.tiled.num_vtiles;
  p.sm = plan.tiled.smem;
  static FuncSmemLimit limit;
  const cudaError_t e = limit.Allow(PrefillKernel<T, R, KMAX>, device, plan.smem_bytes, false);
  if (e != cudaSuccess) return e;
  PrefillKernel<T, R, KMAX><<<plan.grid_x, plan.threads, plan.smem_bytes, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename R>
cudaError_t LaunchPrefillFor(const LaunchPlan& plan, int device, const PrefillParams& p,
                             cudaStream_t stream) {
  if (plan.role != KernelRole::kPrefill) return cudaErrorInvalidConfiguration;
  return plan.tiled.kmax == 128 ? LaunchPrefillT<T, R, 128>(plan, device, p, stream)
                                : LaunchPrefillT<T, R, 256>(plan, device, p, stream);
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_LAUNCH_CUH_
