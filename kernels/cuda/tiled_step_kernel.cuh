// The tiled step kernel: replay decode, baseline decode and speculative verify with the CTA's
// S0 tile in registers. The planner (plan.h) runs it for verify at small batches and wherever
// the bulk step kernel's layout does not fit.
//
// Grid: one CTA per (row r, v-head h, V-tile of VT state rows), flattened with the V-tile
// fastest so the CTAs that share a qk-head's k ring run together. A CTA:
//   1. reads slot and cursor, then issues all loads of its S0 tile [VT, K] into registers
//      (16-byte streaming loads) before anything else, so the DRAM stream overlaps steps 2-4;
//   2. loads records 0..w-1 (k, g, d of its rows) and the token(s) into shared memory;
//   3. per token: weights W_j∘k_j and A (thread per key channel), u_j, p_j (warp per record);
//   4. contracts the register tile with A∘k and A∘q (TC tokens at once), reduces over the
//      lanes of each row (transposed butterfly) and finishes d, o per row (thread per row);
//   5. folds in registers and writes the new S0 tile, or appends the record.
// Baseline = replay with w = 0 that always folds: same instantiation, same arithmetic.
// Verify = T tokens from the same registers: S0 is read once for all drafts; the drafts'
// records (rounded as stored) feed the later drafts, and nothing is folded.
#ifndef REPLAYSSM_KERNELS_CUDA_TILED_STEP_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_TILED_STEP_KERNEL_CUH_

#include "head_ops.cuh"

namespace replayssm::kernels::cuda {

// One CTA of the kernel: where it sits, its row's slot and cursor, and the phases 1-5 above
// (the records, tokens, weights and dots are head_ops.cuh's). The register tile and the
// partials live in the kernel's frame and pass by reference. T: the checkpoint's storage type;
// Ring: the ring's d and k (rounded to it where written).
template <typename T, typename Ring, int KMAX, int TC>
struct TiledCta : TileCta<T, KMAX> {
  using Base = TileCta<T, KMAX>;
  using typename Base::Cfg, typename Base::Tile;
  using Base::R, Base::CPL, Base::E, Base::VT;
  using Base::tid, Base::lane, Base::warp, Base::vt, Base::h, Base::r, Base::v0;

  const StepParams& p;
  const LayerDesc& ly;
  const SmemLayout& sm;
  float* s;
  int K, V, L, T_;
  int64_t tok0, slot;
  int w;
  bool fold;

  __device__ __forceinline__ TiledCta(const StepParams& params, float* smem)
      : p(params), ly(params.ly), sm(params.sm), s(smem) {
    this->Place(p);
    K = ly.K, V = ly.V, L = ly.L, T_ = p.num_draft;
    tok0 = int64_t{r} * T_;
    slot = p.slot_idx[r];
  }

  // A padding row: zero outputs, touch no state.
  __device__ __forceinline__ void ZeroOutputs() const {
    for (int i = tid; i < T_ * VT; i += kThreads) {
      const int t = i / VT, row = i % VT;
      if (v0 + row < V) {
        StoreAct(ly.o, (tok0 + t) * ly.o_stride + int64_t{h} * V + v0 + row, ly.act_dtype, 0.f);
      }
    }
  }

  // The cursor w and whether this step folds (baseline: w = 0, always; verify: never).
  __device__ __forceinline__ void ReadCursor() {
    w = 0;
    fold = true;
    if (p.mode != kModeBaseline) {
      w = min(max(p.write_pos[r], 0), L);
      if (p.mode == kModeVerify) {
        w = min(w, L - T_);  // w + T <= L keeps every append inside the ring
        fold = false;
      } else {
        fold = w + 1 >= L || (p.force_fold != nullptr && p.force_fold[r] != 0);
      }
    }
  }

  // 1. The S0 tile into registers; returns its base (aligned: 16-byte loads and stores).
  __device__ __forceinline__ T* LoadTile(Tile& st, bool& aligned) const {
    T* s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V + v0) * K;
    aligned = (reinterpret_cast<uintptr_t>(s0) & 15) == 0;
    this->ReadTile(st, s0, aligned, K, V);
    return s0;
  }

  // The appended records' k and g of the chunk's nt tokens from c0 (written once per qk-head
  // group / per head).
  __device__ __forceinline__ void Append(int c0, int nt, bool k_writer, int hq) const {
    for (int i = tid; i < nt * K; i += kThreads) {
      const int t = i / K, c = i % K, P = w + c0 + t;
      if (k_writer) {
        Ring* rk = static_cast<Ring*>(ly.ring_k) + slot * ly.k_stride + (int64_t{hq} * L + P) * K;
        rk[c] = FromF<Ring>(s[sm.ks + i]);
      }
      float* rg = ly.ring_g + slot * ly.g_stride;
      if (ly.kda) {
        rg[(int64_t{h} * L + P) * K + c] = s[sm.gext + P * K + c];
      } else if (c == 0) {
        rg[int64_t{h} * L + P] = s[sm.gext + P];
      }
    }
  }

  // 4. The register tile contracted with A∘k, A∘q of the chunk's tokens: the lane's partials.
  __device__ __forceinline__ void Contract(const Tile& st, float (&acc)[TC * R * 2]) const {
#pragma unroll
    for (int i = 0; i < TC * R * 2; ++i) acc[i] = 0.f;
#pragma unroll
    for (int ch = 0; ch < CPL; ++ch) {
      const int c = Cfg::Chan(ch, lane);
      if (c >= K) continue;
#pragma unroll
      for (int t = 0; t < TC; ++t) {
        float kav[E], qav[E];
#pragma unroll
        for (int e = 0; e < E; e += 4) {
          const float4 x = *reinterpret_cast<const float4*>(s + sm.ka + t * K + c + e);
          const float4 y = *reinterpret_cast<const float4*>(s + sm.qa + t * K + c + e);
          kav[e] = x.x, kav[e + 1] = x.y, kav[e + 2] = x.z, kav[e + 3] = x.w;
          qav[e] = y.x, qav[e + 1] = y.y, qav[e + 2] = y.z, qav[e + 3] = y.w;
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const float x = st[i][ch].Get(e);
            acc[(t * R + i) * 2] += x * kav[e];
            acc[(t * R + i) * 2 + 1] += x * qav[e];
          }
        }
      }
    }
  }

  // Per row (thread per row): ring terms, d, o of the chunk's tokens; the draft's d as stored
  // feeds the next drafts.
  __device__ __forceinline__ void FinishRows(int c0, int nt) const {
    if (tid >= VT) return;
    const int row = tid;
    const bool valid = v0 + row < V;
    for (int t = 0; t < nt; ++t) {
      const int P = w + c0 + t;
      float sk = s[sm.skq + (t * VT + row) * 2];
      float sq = s[sm.skq + (t * VT + row) * 2 + 1];
      const float* u = s + sm.u + t * (L + 1);
      const float* pq = s + sm.pp + t * (L + 1);
      for (int j = 0; j < P; ++j) {
        const float dj = s[sm.dext + j * VT + row];
        sk += dj * u[j];
        sq += dj * pq[j];
      }
      const float d = s[sm.beta + t] * (s[sm.vs + t * VT + row] - sk);
      const float o = sq + d * s[sm.kq + t];
      const Ring dr = FromF<Ring>(d);
      s[sm.dext + P * VT + row] = ToF(dr);
      s[sm.dcur + row] = ToF(dr);  // the fold adds the record as the ring would hold it
      if (valid) {
        StoreAct(ly.o, (tok0 + c0 + t) * ly.o_stride + int64_t{h} * V + v0 + row, ly.act_dtype,
                 o);
        if (!fold) {
          Ring* rd =
              static_cast<Ring*>(ly.ring_d) + slot * ly.d_stride + (int64_t{h} * L + P) * V;
          rd[v0 + row] = dr;
        }
      }
    }
  }

  // 5. The fold (decode only: T == 1, token 0): S0·A + Σ_j d_j (W_j∘k_j) + d k, from
  // registers, the token's d and k rounded as the ring would hold them (dcur, kext row w).
  __device__ __forceinline__ void Fold(const Tile& st, T* s0, bool aligned) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = Cfg::Row(i, warp, lane);
      if (v0 + row >= V) continue;
      const float dt = s[sm.dcur + row];
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch) {
        const int c = Cfg::Chan(ch, lane);
        if (c >= K) continue;
        float a[E];
#pragma unroll
        for (int e = 0; e < E; ++e) a[e] = st[i][ch].Get(e) * s[sm.avec + c + e];
        for (int j = 0; j < w; ++j) {
          const float dj = s[sm.dext + j * VT + row];
          const float* kw = s + sm.kw + j * K + c;
#pragma unroll
          for (int e = 0; e < E; e += 4) {
            const float4 x = *reinterpret_cast<const float4*>(kw + e);
            a[e] += dj * x.x;
            a[e + 1] += dj * x.y;
            a[e + 2] += dj * x.z;
            a[e + 3] += dj * x.w;
          }
        }
        Vec<T, E> out;
#pragma unroll
        for (int e = 0; e < E; ++e) out.Set(e, a[e] + dt * s[sm.kext + w * K + c + e]);
        out.template Store<kCacheStream>(s0 + int64_t{row} * K + c, aligned);
      }
    }
  }
};

template <typename T, typename Ring, int KMAX, int TC>
__global__ void __launch_bounds__(kThreads, TC == 1 ? kStepMinBlocks : kVerifyMinBlocks)
    TiledStepKernel(const __grid_constant__ StepParams p) {
  using Cta = TiledCta<T, Ring, KMAX, TC>;
  extern __shared__ float4 smem4[];
  float* s = reinterpret_cast<float*>(smem4);
  Cta c(p, s);
  const LayerDesc& ly = p.ly;
  const SmemLayout& sm = p.sm;
  if (c.slot < 0 || c.slot >= ly.num_slots) {
    c.ZeroOutputs();
    return;
  }
  c.ReadCursor();
  typename Cta::Tile st;
  bool aligned;
  T* const s0 = c.LoadTile(st, aligned);  // 1.
  // 2. Records.
  if (c.w > 0) LoadRecords<Ring>(ly, sm, s, c.slot, c.h, c.w, c.v0, Cta::VT);
  const bool k_writer = (c.h % ly.group) == 0 && c.vt == 0;
  const int hq = c.h / ly.group;

  for (int c0 = 0; c0 < c.T_; c0 += TC) {
    const int nt = min(TC, c.T_ - c0);
    for (int t = 0; t < nt; ++t) {
      LoadToken(ly, sm, s, c.tok0 + c0 + t, c.h, t, c.w + c0 + t, c.v0, Cta::VT);
    }
    __syncthreads();
    NormalizeTokens<Ring>(ly, sm, s, nt, c.w + c0);
    if (!c.fold && c.vt == 0) c.Append(c0, nt, k_writer, hq);
    __syncthreads();
    // 3. Weights and record dots, token by token (kw is reused).
    for (int t = 0; t < nt; ++t) {
      const int P = c.w + c0 + t;
      Weights(ly, sm, s, P, t, false, true);
      __syncthreads();
      RecordDots(ly, sm, s, P, t);
      if (t + 1 < nt) __syncthreads();
    }
    // 4. Contraction, reduced over the lanes of each row (transposed butterfly).
    float acc[TC * Cta::R * 2];
    c.Contract(st, acc);
    ReduceToSmem<typename Cta::Cfg, TC>(acc, sm, s);
    __syncthreads();
    c.FinishRows(c0, nt);
    __syncthreads();
  }
  if (!c.fold) return;
  c.Fold(st, s0, aligned);  // 5.
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_TILED_STEP_KERNEL_CUH_
