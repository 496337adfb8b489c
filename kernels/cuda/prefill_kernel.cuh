// Prefill (varlen) and the fold op: one kernel.
//
// Grid: one CTA per (row, v-head, V-tile), as the step kernel. The CTA keeps its [VT, K] tile
// of the state in fp32 registers for the whole row: it starts from zero or from the slot's
// logical state (S0 folded with records 0..w-1), runs the plain recurrence token by token
// with the arithmetic of a baseline step (contraction with A∘k and A∘q, then
// S <- S·A + d kᵀ with d, k rounded to the ring dtype, as every record), and rounds to the state
// dtype once, at the end. The fold op is this
// kernel with no tokens where every row starts from its slot (and w == 0 writes nothing).
#ifndef REPLAYSSM_KERNELS_CUDA_PREFILL_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_PREFILL_KERNEL_CUH_

#include "head_ops.cuh"

namespace replayssm::kernels::cuda {

// One CTA of the kernel: where it sits, its row's slot and tokens, and its phases (the
// records, tokens and weights are head_ops.cuh's). The fp32 tile lives in the kernel's frame
// and passes by reference. T: the checkpoint's storage type; Ring: the ring's d and k (read
// when a row starts from its slot).
template <typename T, typename Ring, int KMAX>
struct PrefillCta : TileCta<T, KMAX> {
  using Base = TileCta<T, KMAX>;
  using typename Base::Cfg;
  using Base::R, Base::CPL, Base::E, Base::VT;
  using Base::tid, Base::lane, Base::warp, Base::vt, Base::h, Base::r, Base::v0;
  using Tile = float[R][CPL][E];  // fp32 for the whole row

  const PrefillParams& p;
  const LayerDesc& ly;
  const SmemLayout& sm;
  float* s;
  int K, V, L;
  int64_t slot;
  int64_t begin, end;  // the row's tokens

  __device__ __forceinline__ PrefillCta(const PrefillParams& params, float* smem)
      : p(params), ly(params.ly), sm(params.sm), s(smem) {
    this->Place(p);
    K = ly.K, V = ly.V, L = ly.L;
    slot = p.slot_idx[r];
    begin = 0, end = 0;
    if (!p.fold_only) {
      begin = p.cu_seqlens[r];
      end = max(int64_t{p.cu_seqlens[r + 1]}, begin);
    }
  }

  // A padding row: zero outputs, touch no state.
  __device__ __forceinline__ void ZeroOutputs() const {
    if (ly.o == nullptr) return;
    for (int64_t i = tid; i < (end - begin) * VT; i += kThreads) {
      const int64_t n = begin + i / VT;
      const int row = static_cast<int>(i % VT);
      if (v0 + row < V) {
        StoreAct(ly.o, n * ly.o_stride + int64_t{h} * V + v0 + row, ly.act_dtype, 0.f);
      }
    }
  }

  // The slot's logical state into the tile: S0 folded with records 0..w-1 (in place of the
  // fold's write: S0·A + Σ_j d_j (W_j∘k_j)).
  __device__ __forceinline__ void FromSlot(Tile& st, const T* s0, bool aligned, int w) const {
    typename Base::Tile raw;
    this->ReadTile(raw, s0, aligned, K, V);
    if (w > 0) LoadRecords<Ring>(ly, sm, s, slot, h, w, v0, VT);
    __syncthreads();
    if (w > 0) Weights(ly, sm, s, w, 0, true, false);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = Cfg::Row(i, warp, lane);
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch) {
        const int c = Cfg::Chan(ch, lane);
#pragma unroll
        for (int e = 0; e < E; ++e) st[i][ch][e] = raw[i][ch].Get(e);
        if (w == 0 || c >= K || v0 + row >= V) continue;
#pragma unroll
        for (int e = 0; e < E; ++e) st[i][ch][e] *= s[sm.avec + c + e];
        for (int j = 0; j < w; ++j) {
          const float dj = s[sm.dext + j * VT + row];
#pragma unroll
          for (int e = 0; e < E; ++e) st[i][ch][e] += dj * s[sm.kw + j * K + c + e];
        }
      }
    }
    __syncthreads();
  }

  // Token n, a baseline step on the tile: the contraction with A∘k and A∘q, d and o per row
  // (thread per row), then S <- S·A + d kᵀ with d and k rounded as the ring holds them.
  __device__ __forceinline__ void Step(Tile& st, int64_t n) const {
    LoadToken(ly, sm, s, n, h, 0, 0, v0, VT);
    __syncthreads();
    NormalizeTokens<Ring>(ly, sm, s, 1, 0);
    __syncthreads();
    Weights(ly, sm, s, 0, 0, false, true);
    __syncthreads();
    float acc[R * 2];
#pragma unroll
    for (int i = 0; i < R * 2; ++i) acc[i] = 0.f;
#pragma unroll
    for (int ch = 0; ch < CPL; ++ch) {
      const int c = Cfg::Chan(ch, lane);
      if (c >= K) continue;
#pragma unroll
      for (int i = 0; i < R; ++i) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
          acc[2 * i] += st[i][ch][e] * s[sm.ka + c + e];
          acc[2 * i + 1] += st[i][ch][e] * s[sm.qa + c + e];
        }
      }
    }
    ReduceToSmem<Cfg, 1>(acc, sm, s);
    __syncthreads();
    if (tid < VT) {
      const int row = tid;
      const float d = s[sm.beta] * (s[sm.vs + row] - s[sm.skq + row * 2]);
      const float o = s[sm.skq + row * 2 + 1] + d * s[sm.kq];
      s[sm.dcur + row] = RoundTo<Ring>(d);  // the record enters the state as the ring holds it
      if (ly.o != nullptr && v0 + row < V) {
        StoreAct(ly.o, n * ly.o_stride + int64_t{h} * V + v0 + row, ly.act_dtype, o);
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = Cfg::Row(i, warp, lane);
      const float dt = s[sm.dcur + row];
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch) {
        const int c = Cfg::Chan(ch, lane);
        if (c >= K) continue;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          st[i][ch][e] = st[i][ch][e] * s[sm.avec + c + e] + dt * s[sm.kext + c + e];
        }
      }
    }
    __syncthreads();
  }

  // The tile to the checkpoint, rounded to T once.
  __device__ __forceinline__ void Store(const Tile& st, T* s0, bool aligned) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = Cfg::Row(i, warp, lane);
      if (v0 + row >= V) continue;
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch) {
        const int c = Cfg::Chan(ch, lane);
        if (c >= K) continue;
        Vec<T, E> out;
#pragma unroll
        for (int e = 0; e < E; ++e) out.Set(e, st[i][ch][e]);
        out.template Store<kCacheStream>(s0 + int64_t{row} * K + c, aligned);
      }
    }
  }
};

template <typename T, typename Ring, int KMAX>
__global__ void __launch_bounds__(kThreads) PrefillKernel(const __grid_constant__ PrefillParams p) {
  using Cta = PrefillCta<T, Ring, KMAX>;
  extern __shared__ float4 smem4[];
  Cta c(p, reinterpret_cast<float*>(smem4));
  const LayerDesc& ly = p.ly;
  if (c.slot < 0 || c.slot >= ly.num_slots) {
    c.ZeroOutputs();
    return;
  }
  const bool initial = p.fold_only || (p.initial != nullptr && p.initial[c.r] != 0);
  const int w = initial && p.write_pos != nullptr ? min(max(p.write_pos[c.r], 0), c.L) : 0;
  if (p.fold_only && w == 0) return;  // nothing to fold: the checkpoint stays bit-identical

  T* s0 = static_cast<T*>(ly.ckpt) + c.slot * ly.ckpt_stride + (int64_t{c.h} * c.V + c.v0) * c.K;
  const bool aligned = (reinterpret_cast<uintptr_t>(s0) & 15) == 0;
  typename Cta::Tile st;
  if (initial) {
    c.FromSlot(st, s0, aligned, w);
  } else {
#pragma unroll
    for (int i = 0; i < Cta::R; ++i)
#pragma unroll
      for (int ch = 0; ch < Cta::CPL; ++ch)
#pragma unroll
        for (int e = 0; e < Cta::E; ++e) st[i][ch][e] = 0.f;
  }
  for (int64_t n = c.begin; n < c.end; ++n) c.Step(st, n);
  c.Store(st, s0, aligned);
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_PREFILL_KERNEL_CUH_
