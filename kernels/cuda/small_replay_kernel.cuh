// The small-batch replay decode kernel: replay decode in CTAs of NW = 4 of the baseline kernel's
// warps (baseline_kernel.cuh), for batches too small to fill the GPU with the bulk kernel's CTAs
// (one per row and head: latency-bound). Warp w of CTA (x, r) takes RPW rows of v-head x / tiles
// of batch row r in registers (lane l the key channels [KC * l, KC * l + KC); a last CTA's warps
// past V take none); record j is warp (j mod NW)'s. The warps copy the ring records the CTA
// reads (each its records' k and g and the CTA's rows of their d) into shared memory with
// cp.async, load their S0 rows, and while they fly normalize the token. Then:
//   the record dots, in blocks of 16 records from the top down: every warp runs the gates'
//     chain over the block (the CPU order; loads first, then adds alone, no branch) and keeps
//     its own records' sums; their weights W_j, u_j = (W_j∘k_j)·k, p_j = (W_j∘k_j)·q, all
//     independent, in one transposed butterfly (4 records a warp; the one-warp kernel's record
//     after record chain of 16 was its longest stretch); A = Π α; one CTA barrier;
//   the rows (each warp its own): S0·(A∘k), S0·(A∘q) plus the ring terms d_j·u_j, d_j·p_j, one
//     butterfly, the per-row finish; the new d appended (and k once per qk-head group, g once
//     per head), or, when the row folds, the new checkpoint rows S0·A + Σ_j d_j (W_j∘k_j)ᵀ + d kᵀ.
// Every operation is the bulk kernel's replay decode, in its order (its record dots, Contract,
// AddRingTerms, FinishRows, FoldBatch; which warp computes a value changes none of them): the
// two kernels give the same bits, and at w = 0 both are the baseline kernel's.
// Requirements (the planner's): fp32 checkpoint, K <= 32 * KC, V a multiple of RPW, every pool
// array 16-byte aligned (base and slot stride). Types: R the ring's d and k, A the activations'.
// AFTER_CONV: launched as the programmatic dependent of its convolution (rssm_decode_args.conv),
// whose outputs are its tokens: the metadata, records and S0 are issued before the grid
// dependency wait, the tokens after it (the bulk kernel's AFTER_CONV).
#ifndef REPLAYSSM_KERNELS_CUDA_SMALL_REPLAY_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_SMALL_REPLAY_KERNEL_CUH_

#include "async_copy.cuh"
#include "common.cuh"
#include "loads.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

struct SmallReplayParams {
  LayerDesc ly;
  int32_t tiles;  // CTAs per v-head: ceil(V / (NW * RPW))
  // Shared-memory offsets in bytes (SmallReplaySmem, layout.h).
  int32_t o_k, o_g, o_d, o_kw, o_u, o_p;
  const int32_t* slot_idx;    // [B]
  const int32_t* write_pos;   // [B]
  const uint8_t* force_fold;  // [B] or null
};

// cp.async of N bytes (4, 8 or 16; both addresses aligned to N) from global to shared memory.
template <int N>
__device__ __forceinline__ void CopyAsync(void* dst, const void* src) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async sizes");
  if constexpr (N == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(SmemAddr(dst)), "l"(src)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(SmemAddr(dst)), "l"(src), "n"(N)
                 : "memory");
  }
}
// N bytes (a multiple of 16, or 8 or 4) in pieces of up to 16.
template <int N>
__device__ __forceinline__ void CopyAsyncSpan(void* dst, const void* src) {
  if constexpr (N >= 16) {
    static_assert(N % 16 == 0, "16-byte pieces");
#pragma unroll
    for (int i = 0; i < N / 16; ++i) {
      CopyAsync<16>(static_cast<char*>(dst) + 16 * i, static_cast<const char*>(src) + 16 * i);
    }
  } else {
    CopyAsync<N>(dst, src);
  }
}
__device__ __forceinline__ void CopyAsyncWaitAll() {
  asm volatile("cp.async.wait_all;" ::: "memory");
}

// Grid (HV * tiles, B), NW = kSmallReplayWarps warps per CTA, dynamic shared memory
// SmallReplaySmem::total (d rows: the CTA's NW * RPW; k and g padded to whole record blocks).
template <typename R, typename A, bool KDA, int KC, int RPW, bool AFTER_CONV>
__global__ void __launch_bounds__(kSmallReplayWarps * 32)
    SmallReplayKernel(const __grid_constant__ SmallReplayParams p) {
  using T = float;
  constexpr int NV = 2 * RPW;  // values per row butterfly: ·(A∘k), ·(A∘q) per row
  constexpr int SPREAD = 32 / NV;
  constexpr int NW = kSmallReplayWarps;
  constexpr int RB = kSmallReplayRecordBlock;  // records per block of the chain
  constexpr int MO = RB / NW;        // a warp's records per block (u and p: 2 * MO values)
  constexpr int GS = 32 / (2 * MO);  // lanes per total after their butterfly
  static_assert(NV <= 32, "2 * RPW values must fit one butterfly");
  static_assert(RB % NW == 0 && 2 * MO <= 32, "whole record blocks per warp");
  constexpr unsigned kAll = 0xffffffffu;
  extern __shared__ __align__(16) unsigned char smem[];
  const LayerDesc& ly = p.ly;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int r = blockIdx.y;
  const int h = blockIdx.x / p.tiles, tile = blockIdx.x - h * p.tiles;
  const int K = ly.K, V = ly.V, H = ly.H, L = ly.L;
  constexpr int CR = NW * RPW;               // the CTA's rows
  const int vc = tile * CR;                  // the CTA's first row
  const int v0 = vc + warp * RPW;            // the warp's first row
  const bool rows_on = v0 < V;               // a last CTA's warps past V do record dots only
  const bool lead = tile == 0 && warp == 0;  // the warp that appends k and g
  const int hq = h / ly.group;
  const int c0 = lane * KC;
  const bool has_c = c0 < K;
  const int row_l = lane % RPW;  // the row whose d, o this lane finishes
  // The metadata first (every address waits for it).
  const int slot_i = p.slot_idx[r];
  const int wraw = p.write_pos[r];
  const int ffold = p.force_fold != nullptr ? p.force_fold[r] : 0;
  const bool pad = slot_i < 0 || slot_i >= ly.num_slots;
  const int64_t slot = pad ? 0 : slot_i;
  const int w = min(max(wraw, 0), L);
  const bool fold = w + 1 >= L || ffold != 0;
  R* const ring_d = static_cast<R*>(ly.ring_d) + slot * ly.d_stride + int64_t{h} * L * V;
  R* const ring_k = static_cast<R*>(ly.ring_k) + slot * ly.k_stride + int64_t{hq} * L * K;
  float* const ring_g = ly.ring_g + slot * ly.g_stride + int64_t{h} * L * (KDA ? K : 1);
  R* const ks = reinterpret_cast<R*>(smem + p.o_k);            // [Lb][K]
  float* const gs = reinterpret_cast<float*>(smem + p.o_g);    // [Lb][kg]
  R* const ds = reinterpret_cast<R*>(smem + p.o_d);            // [L][CR] the CTA's rows
  float* const kws = reinterpret_cast<float*>(smem + p.o_kw);  // [L][K] W_j∘k_j (fold)
  float* const us = reinterpret_cast<float*>(smem + p.o_u);    // [L]
  float* const ps = reinterpret_cast<float*>(smem + p.o_p);    // [L]
  T* const s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V + v0) * K + c0;

  // The records and S0 in flight (nothing of the convolution's is read here). Record j is warp
  // (j mod NW)'s: it copies j's k (and KDA's g) and the CTA's d rows of j, and does j's dots.
  auto issue_state = [&](Vec<T, KC>(&x)[RPW]) {
    if (pad) return;
    constexpr int DE = 16 / int(sizeof(R));  // d elements per 16-byte piece
    const bool d_on = lane * DE < min(CR, V - vc);
    // Straight-line copies (a block's MO records per warp, each predicated): the S0 loads
    // below wait for no loop.
    for (int jb = 0; jb < w; jb += RB) {
      const R* kg = ring_k + int64_t{jb + warp} * K + c0;
      [[maybe_unused]] const float* gg = ring_g + int64_t{jb + warp} * K + c0;
      const R* dg = ring_d + int64_t{jb + warp} * V + vc + lane * DE;
#pragma unroll
      for (int m = 0; m < MO; ++m) {
        const int j = jb + NW * m + warp;
        if (j < w && has_c) {
          CopyAsyncSpan<KC* int(sizeof(R))>(ks + j * K + c0, kg + int64_t{NW * m} * K);
          if constexpr (KDA) CopyAsyncSpan<KC * 4>(gs + j * K + c0, gg + int64_t{NW * m} * K);
        }
        if (j < w && d_on) CopyAsync<16>(ds + j * CR + lane * DE, dg + int64_t{NW * m} * V);
      }
    }
    if constexpr (!KDA) {
      for (int j = threadIdx.x; j < w; j += NW * 32) CopyAsync<4>(gs + j, ring_g + j);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      if (has_c && rows_on) {
        x[i].template Load<kCachePlain>(s0 + int64_t{i} * K, true);
      } else {
        x[i].Zero();
      }
    }
  };
  Vec<T, KC> x[RPW];
  if constexpr (AFTER_CONV) {
    issue_state(x);
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  // The token: q, k, gates, beta, v (the baseline kernel's loads).
  const A* const qkv = static_cast<const A*>(ly.qkv) + int64_t{r} * ly.qkv_stride;
  const A* const ga = static_cast<const A*>(ly.a) + int64_t{r} * ly.a_stride;
  A qr[KC], kr[KC], ar[KC];
  float db[KC];
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    qr[e] = kr[e] = ar[e] = A{};
    db[e] = 0.f;
    if (has_c) {
      qr[e] = qkv[int64_t{hq} * K + c0 + e];
      kr[e] = qkv[int64_t{H + hq} * K + c0 + e];
      if constexpr (KDA) {
        ar[e] = ga[int64_t{h} * K + c0 + e];
        db[e] = ly.dt_bias[int64_t{h} * K + c0 + e];
      }
    }
  }
  if constexpr (!KDA) ar[0] = ga[h], db[0] = ly.dt_bias[h];
  const A b_raw = static_cast<const A*>(ly.b)[int64_t{r} * ly.b_stride + h];
  const float alog = ly.a_log[h];
  const A v_raw = rows_on ? qkv[int64_t{2 * H} * K + int64_t{h} * V + v0 + row_l] : A{};
  A* const orow = static_cast<A*>(ly.o) + int64_t{r} * ly.o_stride + int64_t{h} * V + v0;
  if (pad) {  // a padding row (the whole CTA): zero outputs
    if (rows_on && lane < RPW) orow[lane] = FromF<A>(0.f);
    return;
  }
  if constexpr (!AFTER_CONV) issue_state(x);

  // q and k normalized (q scaled), k·q: NormalizeQk, as the bulk kernel's NormDraft.
  float q[KC], kk[KC];
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    q[e] = has_c ? ToF(qr[e]) : 0.f;
    kk[e] = has_c ? ToF(kr[e]) : 0.f;
  }
  const float kq = NormalizeQk<KC>(ly, q, kk);
  // The token's gate (the records' chain starts from it) and beta.
  const float decay = -expf(alog);
  float acc[KC];
  const float g_gdn = KDA ? 0.f : decay * Softplus(ToF(ar[0]) + db[0]);
  float gt[KC];
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    gt[e] = KDA ? (has_c ? decay * Softplus(ToF(ar[e]) + db[e]) : 0.f) : g_gdn;
    acc[e] = gt[e];
  }
  const float beta = Beta(ToF(b_raw), ly.act_dtype, ly.round_beta);

  // The record dots, from the top record down: acc = g_P + Σ_{i>j} g_i, W_j = exp(acc). Per
  // block of RB records every warp runs the chain (the adds, no branch: the loads of the whole
  // block are in flight at once) and keeps acc at its own records j ≡ warp (mod NW); then their
  // weights and dots, independent of each other, and one butterfly.
  CopyAsyncWaitAll();
  __syncthreads();                // every thread's copies (the gates, k, d) visible to all
  const int cl = has_c ? c0 : 0;  // a lane past K reads channel 0's (and drops its values)
  for (int jb = (w - 1) / RB * RB; w > 0 && jb >= 0; jb -= RB) {
    // The block's gates, loaded before the chain needs them (no load waits on an add); a
    // record past w adds +0 where the CPU skips it, which changes no bit of any result: the
    // chain's sums only ever enter exp, and x + 0 differs from x at most in a zero's sign.
    float gb[RB][KDA ? KC : 1];
#pragma unroll
    for (int jj = 0; jj < RB; ++jj) {
      if constexpr (KDA) {
        Vec<float, KC> kg_j;
        kg_j.LoadShared(gs + (jb + jj) * K + cl);
#pragma unroll
        for (int e = 0; e < KC; ++e) gb[jj][e] = has_c && jb + jj < w ? kg_j.Get(e) : 0.f;
      } else if (jj % 4 == 0) {
        const float4 g4 = *reinterpret_cast<const float4*>(gs + jb + jj);
        gb[jj][0] = jb + jj < w ? g4.x : 0.f;
        gb[jj + 1][0] = jb + jj + 1 < w ? g4.y : 0.f;
        gb[jj + 2][0] = jb + jj + 2 < w ? g4.z : 0.f;
        gb[jj + 3][0] = jb + jj + 3 < w ? g4.w : 0.f;
      }
    }
    float ao[MO][KC];  // acc at the warp's records of the block
#pragma unroll
    for (int jj = RB - 1; jj >= 0; --jj) {
      if (jj % NW == warp) {
#pragma unroll
        for (int e = 0; e < KC; ++e) ao[jj / NW][e] = acc[e];
      }
#pragma unroll
      for (int e = 0; e < KC; ++e) acc[e] += gb[jj][KDA ? e : 0];
    }
    // The warp's records: their weights and dots, independent of each other (no branch).
    float v[2 * MO];
    Vec<float, KC> kw[MO];
#pragma unroll
    for (int m = 0; m < MO; ++m) {
      const int j = jb + NW * m + warp;
      const float wj = KDA ? 0.f : expf(ao[m][0]);  // GDN: one weight per record
      Vec<R, KC> kr_j;
      kr_j.LoadShared(ks + j * K + cl);
      float su = 0.f, sp = 0.f;
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        const float xw = (KDA ? expf(ao[m][e]) : wj) * kr_j.Get(e);
        su += xw * kk[e];
        sp += xw * q[e];
        kw[m].Set(e, xw);
      }
      v[m] = has_c ? su : 0.f;
      v[MO + m] = has_c ? sp : 0.f;
    }
    if (fold && has_c) {
#pragma unroll
      for (int m = 0; m < MO; ++m) {
        const int j = jb + NW * m + warp;
        if (j < w) kw[m].StoreShared(kws + j * K + c0);
      }
    }
    TransposeReduce<2 * MO, 16>::Run(v, lane);  // lane l: index l / GS
    const int idx = lane / GS;
    const int j = jb + NW * (idx % MO) + warp;
    if (lane % GS == 0 && j < w) (idx < MO ? us : ps)[j] = v[0];
  }
  // A = Π α, A∘k, A∘q, and the new k as the ring holds it (the fold's).
  float av[KC], ka[KC], qa[KC], kn[KC];
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    const float a = expf(acc[e]);
    av[e] = has_c ? a : 0.f;
    ka[e] = has_c ? a * kk[e] : 0.f;
    qa[e] = has_c ? a * q[e] : 0.f;
    kn[e] = has_c ? RoundTo<R>(kk[e]) : 0.f;
  }

  // The rows: S0·(A∘k), S0·(A∘q) per row in the lane's partials, the ring terms (lane j holds
  // record j), one butterfly for all rows.
  const R* const dw = ds + warp * RPW;  // the warp's rows of each record's d
  float racc[NV];
#pragma unroll
  for (int i = 0; i < NV; ++i) racc[i] = 0.f;
  if (has_c) {
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        const float s = x[i].Get(e);
        racc[2 * i] += s * ka[e];
        racc[2 * i + 1] += s * qa[e];
      }
    }
  }
  Vec<R, RPW> dl;
  if (rows_on && lane < w) dl.LoadShared(dw + lane * CR);
  __syncthreads();  // every record's u, p (and the fold's W_j∘k_j) visible to all
  if (!rows_on) return;
  if (lane < w) {
    const float ur = us[lane], pr = ps[lane];
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const float xd = dl.Get(i);
      racc[2 * i] += xd * ur;
      racc[2 * i + 1] += xd * pr;
    }
  }
  for (int j = lane + 32; j < w; j += 32) {  // rings longer than 32 records
    Vec<R, RPW> d2;
    d2.LoadShared(dw + j * CR);
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      racc[2 * i] += d2.Get(i) * us[j];
      racc[2 * i + 1] += d2.Get(i) * ps[j];
    }
  }
  TransposeReduce<NV, 16>::Run(racc, lane);
  const float sk = __shfl_sync(kAll, racc[0], (row_l * 2) * SPREAD);
  const float sq = __shfl_sync(kAll, racc[0], (row_l * 2 + 1) * SPREAD);
  const float d = beta * (ToF(v_raw) - sk);
  const R dr = FromF<R>(d);
  const float dcur = ToF(dr);  // the fold adds the record as the ring would hold it
  const float o = sq + d * kq;
  if (lane < RPW) {
    orow[lane] = FromF<A>(o);
    if (!fold) ring_d[int64_t{w} * V + v0 + lane] = dr;
  }

  if (!fold) {  // the record's k (once per qk-head group) and g (once per head)
    if (lead && has_c) {
      if (h % ly.group == 0) {
#pragma unroll
        for (int e = 0; e < KC; ++e) ring_k[int64_t{w} * K + c0 + e] = FromF<R>(kk[e]);
      }
      if constexpr (KDA) {
#pragma unroll
        for (int e = 0; e < KC; ++e) ring_g[int64_t{w} * K + c0 + e] = gt[e];
      }
    }
    if (!KDA && lead && lane == 0) ring_g[w] = gt[0];
    return;
  }

  // The fold: S0·A, the records in order, the new d (the CPU's order per element).
  float out[RPW][KC];
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
#pragma unroll
    for (int e = 0; e < KC; ++e) out[i][e] = x[i].Get(e) * av[e];
  }
  if (has_c) {
#pragma unroll 2
    for (int j = 0; j < w; ++j) {
      Vec<R, RPW> dj;
      dj.LoadShared(dw + j * CR);
      Vec<float, KC> kw;
      kw.LoadShared(kws + j * K + c0);
#pragma unroll
      for (int i = 0; i < RPW; ++i) {
        const float dd = dj.Get(i);
#pragma unroll
        for (int e = 0; e < KC; ++e) out[i][e] += dd * kw.Get(e);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < RPW; ++i) {
    const float di = __shfl_sync(kAll, dcur, i);
    if (!has_c) continue;
    Vec<T, KC> y;
#pragma unroll
    for (int e = 0; e < KC; ++e) y.Set(e, out[i][e] + di * kn[e]);
    y.template Store<kCachePlain>(s0 + int64_t{i} * K, true);
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_SMALL_REPLAY_KERNEL_CUH_
