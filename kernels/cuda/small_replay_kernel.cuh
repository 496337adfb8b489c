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
// The phases are SmallReplayCta's methods, in this order in the kernel (the fold stays in its
// body: see there). Every operation is the bulk kernel's replay decode, in its order (its record
// dots, Contract, AddRingTerms, FinishRows, FoldBatch; which warp computes a value changes none of
// them): the two kernels give the same bits, and at w = 0 both are the baseline kernel's.
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

// One CTA of the kernel, as its warps see it: where it sits, its row's slot and cursor, and
// the phases of the step (the comment at the top, in order). The rows, the token's raw loads
// and the partials live in the kernel's frame and pass by reference.
template <typename R, typename A, bool KDA, int KC, int RPW>
struct SmallReplayCta {
  using T = float;
  static constexpr int NV = 2 * RPW;  // values per row butterfly: ·(A∘k), ·(A∘q) per row
  static constexpr int SPREAD = 32 / NV;
  static constexpr int NW = kSmallReplayWarps;
  static constexpr int RB = kSmallReplayRecordBlock;  // records per block of the chain
  static constexpr int MO = RB / NW;        // a warp's records per block (u and p: 2 * MO values)
  static constexpr int GS = 32 / (2 * MO);  // lanes per total after their butterfly
  static constexpr int CR = NW * RPW;       // the CTA's rows
  static_assert(NV <= 32, "2 * RPW values must fit one butterfly");
  static_assert(RB % NW == 0 && 2 * MO <= 32, "whole record blocks per warp");
  static constexpr unsigned kAll = 0xffffffffu;

  const SmallReplayParams& p;
  const LayerDesc& ly;
  int lane, warp, r, h, tile, K, V, H, L, vc, v0, hq, c0, row_l;
  bool rows_on, lead, has_c;
  // The row's slot and cursor (ReadMeta).
  bool pad, fold;
  int64_t slot;
  int w;
  R *ring_d, *ring_k;
  float* ring_g;
  R *ks, *ds;
  float *gs, *kws, *us, *ps;
  T* s0;

  __device__ __forceinline__ SmallReplayCta(const SmallReplayParams& params)
      : p(params), ly(params.ly) {
    lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    r = blockIdx.y;
    h = blockIdx.x / p.tiles, tile = blockIdx.x - h * p.tiles;
    K = ly.K, V = ly.V, H = ly.H, L = ly.L;
    vc = tile * CR;                 // the CTA's first row
    v0 = vc + warp * RPW;           // the warp's first row
    rows_on = v0 < V;               // a last CTA's warps past V do record dots only
    lead = tile == 0 && warp == 0;  // the warp that appends k and g
    hq = h / ly.group;
    c0 = lane * KC;
    has_c = c0 < K;
    row_l = lane % RPW;  // the row whose d, o this lane finishes
  }

  // The metadata first (every address waits for it), and the addresses.
  __device__ __forceinline__ void ReadMeta(unsigned char* smem) {
    const int slot_i = p.slot_idx[r];
    const int wraw = p.write_pos[r];
    const int ffold = p.force_fold != nullptr ? p.force_fold[r] : 0;
    pad = slot_i < 0 || slot_i >= ly.num_slots;
    slot = pad ? 0 : slot_i;
    w = min(max(wraw, 0), L);
    fold = w + 1 >= L || ffold != 0;
    ring_d = static_cast<R*>(ly.ring_d) + slot * ly.d_stride + int64_t{h} * L * V;
    ring_k = static_cast<R*>(ly.ring_k) + slot * ly.k_stride + int64_t{hq} * L * K;
    ring_g = ly.ring_g + slot * ly.g_stride + int64_t{h} * L * (KDA ? K : 1);
    ks = reinterpret_cast<R*>(smem + p.o_k);        // [Lb][K]
    gs = reinterpret_cast<float*>(smem + p.o_g);    // [Lb][kg]
    ds = reinterpret_cast<R*>(smem + p.o_d);        // [L][CR] the CTA's rows
    kws = reinterpret_cast<float*>(smem + p.o_kw);  // [L][K] W_j∘k_j (fold)
    us = reinterpret_cast<float*>(smem + p.o_u);    // [L]
    ps = reinterpret_cast<float*>(smem + p.o_p);    // [L]
    s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V + v0) * K + c0;
  }

  // The records and S0 in flight (nothing of the convolution's is read here). Record j is warp
  // (j mod NW)'s: it copies j's k (and KDA's g) and the CTA's d rows of j, and does j's dots.
  __device__ __forceinline__ void IssueState(Vec<T, KC> (&x)[RPW]) const {
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
  }

  // The record dots' per-block values (the kernel's frame holds them, as it holds every array:
  // arrays of an inlined method sit ahead of the kernel's own, which reorders ptxas's input).
  struct DotBlock {
    float gb[RB][KDA ? KC : 1];  // the block's gates
    float ao[MO][KC];            // acc at the warp's records of the block
    float v[2 * MO];             // their u, p
    Vec<float, KC> kw[MO];       // their W_j∘k_j
  };

  // The record dots, from the top record down: acc = g_P + Σ_{i>j} g_i, W_j = exp(acc). Per
  // block of RB records every warp runs the chain (the adds, no branch: the loads of the whole
  // block are in flight at once) and keeps acc at its own records j ≡ warp (mod NW); then their
  // weights and dots, independent of each other, and one butterfly. On return acc is the whole
  // chain (A = exp(acc)); the u_j, p_j (and the fold's W_j∘k_j) are in shared memory, visible
  // after the next CTA barrier.
  __device__ __forceinline__ void RecordDots(const float (&q)[KC], const float (&kk)[KC],
                                             float (&acc)[KC], DotBlock& b) const {
    const int cl = has_c ? c0 : 0;  // a lane past K reads channel 0's (and drops its values)
    for (int jb = (w - 1) / RB * RB; w > 0 && jb >= 0; jb -= RB) {
      // The block's gates, loaded before the chain needs them (no load waits on an add); a
      // record past w adds +0 where the CPU skips it, which changes no bit of any result: the
      // chain's sums only ever enter exp, and x + 0 differs from x at most in a zero's sign.
#pragma unroll
      for (int jj = 0; jj < RB; ++jj) {
        if constexpr (KDA) {
          Vec<float, KC> kg_j;
          kg_j.LoadShared(gs + (jb + jj) * K + cl);
#pragma unroll
          for (int e = 0; e < KC; ++e) b.gb[jj][e] = has_c && jb + jj < w ? kg_j.Get(e) : 0.f;
        } else if (jj % 4 == 0) {
          const float4 g4 = *reinterpret_cast<const float4*>(gs + jb + jj);
          b.gb[jj][0] = jb + jj < w ? g4.x : 0.f;
          b.gb[jj + 1][0] = jb + jj + 1 < w ? g4.y : 0.f;
          b.gb[jj + 2][0] = jb + jj + 2 < w ? g4.z : 0.f;
          b.gb[jj + 3][0] = jb + jj + 3 < w ? g4.w : 0.f;
        }
      }
#pragma unroll
      for (int jj = RB - 1; jj >= 0; --jj) {
        if (jj % NW == warp) {
#pragma unroll
          for (int e = 0; e < KC; ++e) b.ao[jj / NW][e] = acc[e];
        }
#pragma unroll
        for (int e = 0; e < KC; ++e) acc[e] += b.gb[jj][KDA ? e : 0];
      }
      // The warp's records: their weights and dots, independent of each other (no branch).
#pragma unroll
      for (int m = 0; m < MO; ++m) {
        const int j = jb + NW * m + warp;
        const float wj = KDA ? 0.f : expf(b.ao[m][0]);  // GDN: one weight per record
        Vec<R, KC> kr_j;
        kr_j.LoadShared(ks + j * K + cl);
        float su = 0.f, sp = 0.f;
#pragma unroll
        for (int e = 0; e < KC; ++e) {
          const float xw = (KDA ? expf(b.ao[m][e]) : wj) * kr_j.Get(e);
          su += xw * kk[e];
          sp += xw * q[e];
          b.kw[m].Set(e, xw);
        }
        b.v[m] = has_c ? su : 0.f;
        b.v[MO + m] = has_c ? sp : 0.f;
      }
      if (fold && has_c) {
#pragma unroll
        for (int m = 0; m < MO; ++m) {
          const int j = jb + NW * m + warp;
          if (j < w) b.kw[m].StoreShared(kws + j * K + c0);
        }
      }
      TransposeReduce<2 * MO, 16>::Run(b.v, lane);  // lane l: index l / GS
      const int idx = lane / GS;
      const int j = jb + NW * (idx % MO) + warp;
      if (lane % GS == 0 && j < w) (idx < MO ? us : ps)[j] = b.v[0];
    }
  }

  // S0·(A∘k), S0·(A∘q) per row in the lane's partials.
  __device__ __forceinline__ void Contract(const Vec<T, KC> (&x)[RPW], const float (&ka)[KC],
                                           const float (&qa)[KC], float (&racc)[NV]) const {
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
  }

  // The ring terms d_j·u_j, d_j·p_j (lane j holds record j: dl), then one butterfly for all
  // rows.
  __device__ __forceinline__ void AddRingTerms(const Vec<R, RPW>& dl, float (&racc)[NV]) const {
    const R* const dw = ds + warp * RPW;  // the warp's rows of each record's d
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
  }

  // The record's k (once per qk-head group) and g (once per head), when the row does not fold.
  __device__ __forceinline__ void AppendKG(const float (&kk)[KC], const float (&gt)[KC]) const {
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
  }
};

// Grid (HV * tiles, B), NW = kSmallReplayWarps warps per CTA, dynamic shared memory
// SmallReplaySmem::total (d rows: the CTA's NW * RPW; k and g padded to whole record blocks).
template <typename R, typename A, bool KDA, int KC, int RPW, bool AFTER_CONV>
__global__ void __launch_bounds__(kSmallReplayWarps * 32)
    SmallReplayKernel(const __grid_constant__ SmallReplayParams p) {
  using Cta = SmallReplayCta<R, A, KDA, KC, RPW>;
  using T = float;
  constexpr int SPREAD = Cta::SPREAD;
  constexpr unsigned kAll = Cta::kAll;
  extern __shared__ __align__(16) unsigned char smem[];
  Cta cta(p);
  const LayerDesc& ly = p.ly;
  cta.ReadMeta(smem);
  const int lane = cta.lane, r = cta.r, h = cta.h, K = cta.K, V = cta.V, H = cta.H;
  const int v0 = cta.v0, c0 = cta.c0, row_l = cta.row_l, w = cta.w;
  const bool has_c = cta.has_c, rows_on = cta.rows_on, fold = cta.fold;

  Vec<T, KC> x[RPW];
  if constexpr (AFTER_CONV) {
    cta.IssueState(x);
    asm volatile("griddepcontrol.wait;" ::: "memory");
  }
  // The token: q, k, gates, beta, v.
  const A* const qkv = static_cast<const A*>(ly.qkv) + int64_t{r} * ly.qkv_stride;
  A qr[KC], kr[KC], ar[KC];
  float db[KC];
  LoadStepToken<A, KDA, KC>(ly, qkv, r, h, cta.hq, K, H, c0, has_c, qr, kr, ar, db);
  const A b_raw = static_cast<const A*>(ly.b)[int64_t{r} * ly.b_stride + h];
  const float alog = ly.a_log[h];
  const A v_raw = rows_on ? qkv[int64_t{2 * H} * K + int64_t{h} * V + v0 + row_l] : A{};
  A* const orow = static_cast<A*>(ly.o) + int64_t{r} * ly.o_stride + int64_t{h} * V + v0;
  if (cta.pad) {  // a padding row (the whole CTA): zero outputs
    if (rows_on && lane < RPW) orow[lane] = FromF<A>(0.f);
    return;
  }
  if constexpr (!AFTER_CONV) cta.IssueState(x);

  // q and k normalized (q scaled), k·q.
  float q[KC], kk[KC];
  const float kq = StepTokenQk<A, KC>(ly, qr, kr, has_c, q, kk);
  // The token's gate (the records' chain starts from it) and beta.
  const float decay = GateDecay(alog);
  float acc[KC];
  const float g_gdn = KDA ? 0.f : TokenGate(decay, ToF(ar[0]), db[0]);
  float gt[KC];
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    gt[e] = KDA ? (has_c ? TokenGate(decay, ToF(ar[e]), db[e]) : 0.f) : g_gdn;
    acc[e] = gt[e];
  }
  const float beta = Beta(ToF(b_raw), ly.act_dtype, ly.round_beta);

  CopyAsyncWaitAll();
  __syncthreads();  // every thread's copies (the gates, k, d) visible to all
  typename Cta::DotBlock dots;
  cta.RecordDots(q, kk, acc, dots);
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

  // The rows: the lane's partials, the ring terms (lane j holds record j), one butterfly.
  const R* const dw = cta.ds + cta.warp * RPW;  // the warp's rows of each record's d
  float racc[Cta::NV];
  cta.Contract(x, ka, qa, racc);
  Vec<R, RPW> dl;
  if (rows_on && lane < w) dl.LoadShared(dw + lane * Cta::CR);
  __syncthreads();  // every record's u, p (and the fold's W_j∘k_j) visible to all
  if (!rows_on) return;
  cta.AddRingTerms(dl, racc);
  const float sk = __shfl_sync(kAll, racc[0], (row_l * 2) * SPREAD);
  const float sq = __shfl_sync(kAll, racc[0], (row_l * 2 + 1) * SPREAD);
  const float d = beta * (ToF(v_raw) - sk);
  const R dr = FromF<R>(d);
  const float dcur = ToF(dr);  // the fold adds the record as the ring would hold it
  const float o = sq + d * kq;
  if (lane < RPW) {
    orow[lane] = FromF<A>(o);
    if (!fold) cta.ring_d[int64_t{w} * V + v0 + lane] = dr;
  }
  if (!fold) {
    cta.AppendKG(kk, gt);
    return;
  }

  // The fold: S0·A, the records in order, the new d (the CPU's order per element). In the
  // kernel's body, not a method: any function boundary around it (a method, even a lambda
  // called in place) changes the block layout of the finish above (where the non-folding
  // rows' d store goes), which measured slower at B = 1, 2 (bench/results/kernels.md, "Phase
  // methods for the baseline and small-replay kernels, second try").
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
      dj.LoadShared(dw + j * Cta::CR);
      Vec<float, KC> kw;
      kw.LoadShared(cta.kws + j * K + c0);
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
    y.template Store<kCachePlain>(cta.s0 + int64_t{i} * K, true);
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_SMALL_REPLAY_KERNEL_CUH_
