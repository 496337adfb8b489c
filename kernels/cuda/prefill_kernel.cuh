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

// T: the checkpoint's storage type; Ring: the ring's d and k (read when a row starts from its
// slot).
template <typename T, typename Ring, int KMAX>
__global__ void __launch_bounds__(kThreads) PrefillKernel(const __grid_constant__ PrefillParams p) {
  using Cfg = TileCfg<T, KMAX>;
  constexpr int R = Cfg::R, CPL = Cfg::CPL, E = Cfg::E, VT = Cfg::VT;
  extern __shared__ float4 smem4[];
  float* s = reinterpret_cast<float*>(smem4);
  const LayerDesc& ly = p.ly;
  const SmemLayout& sm = p.sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int64_t bid = blockIdx.x;
  const int vt = static_cast<int>(bid % p.num_vtiles);
  bid /= p.num_vtiles;
  const int h = static_cast<int>(bid % ly.HV);
  const int r = static_cast<int>(bid / ly.HV);
  const int v0 = vt * VT;
  const int K = ly.K, V = ly.V, L = ly.L;
  const int64_t slot = p.slot_idx[r];
  int64_t begin = 0, end = 0;
  if (!p.fold_only) {
    begin = p.cu_seqlens[r];
    end = max(int64_t{p.cu_seqlens[r + 1]}, begin);
  }
  if (slot < 0 || slot >= ly.num_slots) {
    if (ly.o != nullptr) {
      for (int64_t i = tid; i < (end - begin) * VT; i += kThreads) {
        const int64_t n = begin + i / VT;
        const int row = static_cast<int>(i % VT);
        if (v0 + row < V) {
          StoreAct(ly.o, n * ly.o_stride + int64_t{h} * V + v0 + row, ly.act_dtype, 0.f);
        }
      }
    }
    return;
  }
  const bool initial = p.fold_only || (p.initial != nullptr && p.initial[r] != 0);
  const int w = initial && p.write_pos != nullptr ? min(max(p.write_pos[r], 0), L) : 0;
  if (p.fold_only && w == 0) return;  // nothing to fold: the checkpoint stays bit-identical

  T* s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V + v0) * K;
  const bool aligned = (reinterpret_cast<uintptr_t>(s0) & 15) == 0;
  float st[R][CPL][E];
  if (initial) {
    Chunk<T> raw[R][CPL];
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = Cfg::Row(i, warp, lane);
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch) {
        const int c = Cfg::Chan(ch, lane);
        if (v0 + row < V && c < K) {
          raw[i][ch] = LoadChunk(s0 + int64_t{row} * K + c, aligned);
        } else {
          raw[i][ch].raw = make_uint4(0, 0, 0, 0);
        }
      }
    }
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
  } else {
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch)
#pragma unroll
        for (int e = 0; e < E; ++e) st[i][ch][e] = 0.f;
  }

  for (int64_t n = begin; n < end; ++n) {
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

#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = Cfg::Row(i, warp, lane);
    if (v0 + row >= V) continue;
#pragma unroll
    for (int ch = 0; ch < CPL; ++ch) {
      const int c = Cfg::Chan(ch, lane);
      if (c >= K) continue;
      Chunk<T> out;
#pragma unroll
      for (int e = 0; e < E; ++e) out.Set(e, st[i][ch][e]);
      StoreChunk(s0 + int64_t{row} * K + c, out, aligned);
    }
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_PREFILL_KERNEL_CUH_
