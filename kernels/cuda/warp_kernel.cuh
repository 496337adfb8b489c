// v6: the warp-streaming step (replay decode, baseline decode, speculative verify).
//
// Why (NOTES.md, v1..v5): every earlier kernel spent its issue slots on a per-CTA chain
// (token -> records -> weights -> record dots -> reductions -> per-row finish) with a barrier
// between each stage, ~1,000-1,800 instructions per thread per 16 KB of S0. Here a WARP is the
// unit of work and nothing crosses warps: one warp owns (row r, v-head h, a chunk of `vc` state
// rows); the warps of a CTA are independent items (no __syncthreads anywhere). Per warp:
//   1. issue the loads of its first batch of RB state rows (each lane owns KC key channels of
//      every row: one 16/8-byte streaming load per row), the ring d of record j = lane for
//      those rows, and the tokens' v;
//   2. prologue (while those bytes fly): the tokens' q, k (normalized), gates; the records'
//      k and g into warp-private shared memory; the weights and the record dots
//      u_j = (W_j∘k_j)·k, p_j = (W_j∘k_j)·q (16 records per transposed butterfly);
//      A∘k and A∘q in registers;
//   3. per batch: contract the RB rows with A∘k, A∘q AND add the ring terms d_j[row]·u_j,
//      d_j[row]·p_j in the same per-lane partials (lane j holds record j), so one transposed
//      butterfly yields S'k and S'q per row; finish d, o per row; prefetch the next batch;
//   4. a folding row folds the batch from registers: S0·A + Σ_j d_j (W_j∘k_j) + d k, the d_j
//      broadcast by shuffles from the lane that loaded them.
// Baseline = replay at w = 0 that always folds (same instantiation: bit-identical at L = 1).
// Verify = TT drafts per pass over the rows; the drafts' records (rounded as stored) feed the
// later drafts; with T > TT the earlier passes' d live in shared memory.
#ifndef REPLAYSSM_KERNELS_CUDA_WARP_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_WARP_KERNEL_CUH_

#include "common.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

constexpr int kWarpCtaThreads = 128;  // 4 independent warps per CTA (fewer when smem is short)
#ifndef RSSM_WARP_MINB
#define RSSM_WARP_MINB 4
#endif
#ifndef RSSM_VERIFY_MINB
#define RSSM_VERIFY_MINB 3
#endif

// N consecutive elements of T kept raw in registers (converted on use).
template <typename T, int N>
struct Slice {
  static constexpr int kBytes = N * int(sizeof(T));
  static constexpr int kWords = (kBytes + 3) / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ float Get(int e) const { return ToF(reinterpret_cast<const T*>(w)[e]); }
  __device__ __forceinline__ void Set(int e, float x) { reinterpret_cast<T*>(w)[e] = FromF<T>(x); }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }
};

// Loads N elements at p: vector loads when `vec` (p aligned to the slice's width), else
// element by element. STREAM: evict-first (state read once).
template <bool STREAM, typename T, int N>
__device__ __forceinline__ void LoadSlice(Slice<T, N>& s, const T* p, bool vec) {
  constexpr int B = Slice<T, N>::kBytes;
  if (vec) {
    if constexpr (B % 16 == 0) {
#pragma unroll
      for (int i = 0; i < B / 16; ++i) {
        const uint4* q = reinterpret_cast<const uint4*>(p) + i;
        const uint4 x = STREAM ? __ldcs(q) : __ldg(q);
        s.w[4 * i] = x.x, s.w[4 * i + 1] = x.y, s.w[4 * i + 2] = x.z, s.w[4 * i + 3] = x.w;
      }
      return;
    } else if constexpr (B % 8 == 0) {
#pragma unroll
      for (int i = 0; i < B / 8; ++i) {
        const uint2* q = reinterpret_cast<const uint2*>(p) + i;
        const uint2 x = STREAM ? __ldcs(q) : __ldg(q);
        s.w[2 * i] = x.x, s.w[2 * i + 1] = x.y;
      }
      return;
    }
  }
  T* d = reinterpret_cast<T*>(s.w);
#pragma unroll
  for (int e = 0; e < N; ++e) d[e] = p[e];
}

template <typename T, int N>
__device__ __forceinline__ void StoreSlice(T* p, const Slice<T, N>& s, bool vec) {
  constexpr int B = Slice<T, N>::kBytes;
  if (vec) {
    if constexpr (B % 16 == 0) {
#pragma unroll
      for (int i = 0; i < B / 16; ++i) {
        __stcs(reinterpret_cast<uint4*>(p) + i,
               make_uint4(s.w[4 * i], s.w[4 * i + 1], s.w[4 * i + 2], s.w[4 * i + 3]));
      }
      return;
    } else if constexpr (B % 8 == 0) {
#pragma unroll
      for (int i = 0; i < B / 8; ++i) {
        __stcs(reinterpret_cast<uint2*>(p) + i, make_uint2(s.w[2 * i], s.w[2 * i + 1]));
      }
      return;
    }
  }
  const T* d = reinterpret_cast<const T*>(s.w);
#pragma unroll
  for (int e = 0; e < N; ++e) p[e] = d[e];
}


// Records per transposed butterfly in the prologue's record dots (2 values each, <= 16).
#ifndef RSSM_WARP_DOT_GROUP
#define RSSM_WARP_DOT_GROUP 8
#endif
constexpr int kDotGroup = RSSM_WARP_DOT_GROUP;

// Rows per batch: the lane's S0 slices of a batch take at most 128 bytes of registers, and
// the 2·TT·RB contractions fit one 32-value transposed butterfly.
template <typename T, int TT, int KC, int SB>
__host__ __device__ constexpr int WarpRows() {
  const int by_regs = SB / (KC * int(sizeof(T)));
  const int by_reduce = 16 / TT;
  return by_regs < by_reduce ? by_regs : by_reduce;
}

struct WarpParams {
  LayerDesc ly;
  int32_t batch, num_draft, mode;
  int32_t vc;       // state rows per warp item (multiple of 16)
  int32_t nchunk;   // ceil(V / vc)
  int32_t wpb;      // warps (items) per CTA
  int32_t smem_per_warp;                // floats
  int32_t off_gs, off_u, off_p, off_dd, off_vs;  // floats; ks at 0
  int32_t vec_s0;   // S0 row slices are aligned for vector loads
  int32_t vec_d;    // ring d row slices likewise
  int32_t vec_k;    // ring k row slices likewise
  const int32_t* slot_idx;
  const int32_t* write_pos;
  const uint8_t* force_fold;
};

// Shared memory of one warp (floats): ks [L][K] records' k as stored (for a folding decode,
// overwritten in place by W_j∘k_j), gs [L][Kg] records' g, us/ps [TT][L] record dots,
// dd [T][vc] drafts' d of earlier passes (verify with T > TT only).
// vs [TT][vc] the tokens' v of the chunk rows (per pass).
struct WarpSmem {
  int gs, u, p, dd, vs, total;
  static WarpSmem Make(int K, int L, bool kda, int TT, int T, int vc) {
    WarpSmem s;
    int o = 0;
    auto take = [&o](int n) { const int at = o; o += (n + 3) & ~3; return at; };
    take(L * K);
    s.gs = take(L * (kda ? K : 1));
    s.u = take(TT * L);
    s.p = take(TT * L);
    s.dd = take(T > TT ? T * vc : 0);
    s.vs = take(TT * vc);
    s.total = o;
    return s;
  }
};

// Register budget: decode RSSM_WARP_MINB CTAs x 128 threads per SM, verify RSSM_VERIFY_MINB.
// SB: bytes of S0 per lane per batch (64 or 128; the rows per batch follow).
template <typename T, int TT, int KC, int SB>
__global__ void __launch_bounds__(kWarpCtaThreads, TT == 1 ? RSSM_WARP_MINB : RSSM_VERIFY_MINB)
    WarpStepKernel(const __grid_constant__ WarpParams p) {
  constexpr int RB = WarpRows<T, TT, KC, SB>();
  constexpr int NV = 2 * TT * RB;  // values per transposed butterfly (<= 32)
  constexpr int SPREAD = 32 / NV;  // lanes holding each total
  extern __shared__ float4 smem4[];
  const LayerDesc& ly = p.ly;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t item = int64_t(blockIdx.x) * p.wpb + warp;
  if (warp >= p.wpb || item >= int64_t(p.batch) * ly.HV * p.nchunk) return;
  float* const ks = reinterpret_cast<float*>(smem4) + warp * p.smem_per_warp;
  float* const gs = ks + p.off_gs;
  float* const us = ks + p.off_u;
  float* const ps = ks + p.off_p;
  float* const dds = ks + p.off_dd;
  float* const vsm = ks + p.off_vs;

  const int chunk = static_cast<int>(item % p.nchunk);
  const int h = static_cast<int>((item / p.nchunk) % ly.HV);
  const int r = static_cast<int>(item / (int64_t(p.nchunk) * ly.HV));
  const int K = ly.K, V = ly.V, L = ly.L, H = ly.H, T_ = p.num_draft;
  const bool kda = ly.kda != 0;
  const int hq = h / ly.group;
  const int v0 = chunk * p.vc;
  const int vend = min(V, v0 + p.vc);
  const int64_t tok0 = int64_t{r} * T_;
  const int c0 = lane * KC;
  const bool has_c = c0 < K;
  const int row_l = lane % RB;  // the row of a batch this lane finishes (lanes >= RB repeat)
  const int slot_i = p.slot_idx[r];

  if (slot_i < 0 || slot_i >= ly.num_slots) {  // padding row: zero outputs, touch no state
    for (int t = 0; t < T_; ++t) {
      for (int v = v0 + lane; v < vend; v += 32) {
        StoreAct(ly.o, (tok0 + t) * ly.o_stride + int64_t{h} * V + v, ly.act_dtype, 0.f);
      }
    }
    return;
  }
  const int64_t slot = slot_i;
  int w = 0;
  bool fold = true;
  if (p.mode != kModeBaseline) {
    w = min(max(p.write_pos[r], 0), L);
    if (p.mode == kModeVerify) {
      w = max(min(w, L - T_), 0);  // w + T <= L keeps every append inside the ring
      fold = false;
    } else {
      fold = w + 1 >= L || (p.force_fold != nullptr && p.force_fold[r] != 0);
    }
  }

  T* const s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V) * K + c0;
  T* const rd = static_cast<T*>(ly.ring_d) + slot * ly.d_stride + int64_t{h} * L * V;
  const T* const rk =
      static_cast<const T*>(ly.ring_k) + slot * ly.k_stride + int64_t{hq} * L * K;
  float* const rg = ly.ring_g + slot * ly.g_stride + int64_t{h} * L * (kda ? K : 1);
  const bool vec_s0 = p.vec_s0 != 0, vec_d = p.vec_d != 0, vec_k = p.vec_k != 0;

  // Batch b (RB rows) is loaded into registers while batch b - 1 is reduced and finished
  // (a cp.async variant with shared-memory stages measured slower: NOTES.md v6b).
  const int nbatch = (vend - v0) / RB;
  Slice<T, KC> st[RB];
  Slice<T, RB> dn;
  auto load_regs = [&](int b) {
    if (b >= nbatch) return;
    const int b0 = v0 + b * RB;
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      if (has_c) {
        LoadSlice<true>(st[i], s0 + int64_t(b0 + i) * K, vec_s0);
      } else {
        st[i].Zero();
      }
    }
    if (lane < w) {
      LoadSlice<false>(dn, rd + int64_t{lane} * V + b0, vec_d);
    } else {
      dn.Zero();
    }
  };
  const float decay = -expf(ly.a_log[h]);
  // Records 0..w-1 (k and g as stored) into the warp's shared memory; each lane writes and
  // later reads only its own key channels, except GDN's scalar g (shared: a __syncwarp).
  // kStage records per round: every load of a round is issued before its stores.
  constexpr int kStage = 8;
#pragma unroll 1
  for (int j0 = 0; j0 < w; j0 += kStage) {
    if (has_c) {
      Slice<T, KC> kr[kStage];
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
        if (j0 + u < w) LoadSlice<false>(kr[u], rk + int64_t(j0 + u) * K + c0, vec_k);
      }
      if (kda) {
        float gk[kStage][KC];
#pragma unroll
        for (int u = 0; u < kStage; ++u) {
#pragma unroll
          for (int e = 0; e < KC; ++e) {
            gk[u][e] = j0 + u < w ? rg[int64_t(j0 + u) * K + c0 + e] : 0.f;
          }
        }
#pragma unroll
        for (int u = 0; u < kStage; ++u) {
#pragma unroll
          for (int e = 0; e < KC; ++e) {
            if (j0 + u < w) gs[(j0 + u) * K + c0 + e] = gk[u][e];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kStage; ++u) {
#pragma unroll
        for (int e = 0; e < KC; ++e) {
          if (j0 + u < w) ks[(j0 + u) * K + c0 + e] = kr[u].Get(e);
        }
      }
    }
  }
  if (!kda) {
    for (int j = lane; j < w; j += 32) gs[j] = rg[j];
  }

  #pragma unroll 1
  for (int pass0 = 0; pass0 < T_; pass0 += TT) {
    const int nt = min(TT, T_ - pass0);
    load_regs(0);
    {  // the pass's tokens' v for the chunk rows (read in the finish by the row's lanes)
      const int nr = vend - v0;
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        float vv[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int rr = lane + 32 * u;
          vv[u] = (t < nt && rr < nr)
                      ? LoadAct(ly.qkv, (tok0 + pass0 + t) * ly.qkv_stride + 2LL * H * K +
                                            int64_t{h} * V + v0 + rr,
                                ly.act_dtype)
                      : 0.f;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (lane + 32 * u < nr) vsm[t * p.vc + lane + 32 * u] = vv[u];
        }
      }
    }
    __syncwarp();

    // ---- prologue of the pass: tokens, weights, record dots --------------------------------
    float ka[TT][KC], qa[TT][KC], kn0[KC], av[KC];  // kn0/av: token 0's k and A (fold)
    float beta[TT], kq[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      beta[t] = 0.f;
      kq[t] = 0.f;
#pragma unroll
      for (int e = 0; e < KC; ++e) ka[t][e] = qa[t][e] = 0.f;
    }
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      if (t < nt) {
      const int P = w + pass0 + t;  // this draft's ring index; records 0..P-1 precede it
      const int64_t n = tok0 + pass0 + t;
      const int64_t qrow = n * ly.qkv_stride;
      float q[KC], k[KC], g[KC];
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        q[e] = has_c ? LoadAct(ly.qkv, qrow + int64_t{hq} * K + c0 + e, ly.act_dtype) : 0.f;
        k[e] = has_c ? LoadAct(ly.qkv, qrow + int64_t{H + hq} * K + c0 + e, ly.act_dtype) : 0.f;
        g[e] = 0.f;
      }
      if (kda) {
#pragma unroll
        for (int e = 0; e < KC; ++e) {
          if (has_c) {
            const int64_t i = int64_t{h} * K + c0 + e;
            g[e] = decay * Softplus(LoadAct(ly.a, n * ly.a_stride + i, ly.act_dtype) + ly.dt_bias[i]);
          }
        }
      } else {
        const float gg =
            decay * Softplus(LoadAct(ly.a, n * ly.a_stride + h, ly.act_dtype) + ly.dt_bias[h]);
#pragma unroll
        for (int e = 0; e < KC; ++e) g[e] = gg;
      }
      beta[t] = Sigmoid(LoadAct(ly.b, n * ly.b_stride + h, ly.act_dtype));
      if (ly.l2norm) {
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int e = 0; e < KC; ++e) sq += q[e] * q[e], sk += k[e] * k[e];
        sq = WarpSum(sq);
        sk = WarpSum(sk);
        const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
        for (int e = 0; e < KC; ++e) q[e] *= iq, k[e] *= ik;
      }
      float dkq = 0.f;
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        q[e] *= ly.scale;
        dkq += k[e] * q[e];
      }
      kq[t] = WarpSum(dkq);
      // Weights from the top record down (the CPU order): acc = g_P + Σ_{i>j} g_i.
      float acc[KC];
#pragma unroll
      for (int e = 0; e < KC; ++e) acc[e] = g[e];
      const bool keep_kw = fold && TT == 1;  // a folding decode keeps W_j∘k_j for the fold
      #pragma unroll 1
      for (int jb = P - 1; jb >= 0; jb -= kDotGroup) {
        float v[2 * kDotGroup];
#pragma unroll
        for (int jj = 0; jj < kDotGroup; ++jj) {
          const int j = jb - jj;
          float su = 0.f, sp = 0.f;
          if (j >= 0 && has_c) {
            const float gj = kda ? 0.f : gs[j];
            const float wj = kda ? 0.f : expf(acc[0]);  // GDN: one weight per record
#pragma unroll
            for (int e = 0; e < KC; ++e) {
              const float kw = (kda ? expf(acc[e]) : wj) * ks[j * K + c0 + e];
              su += kw * k[e];
              sp += kw * q[e];
              if (keep_kw) ks[j * K + c0 + e] = kw;
              acc[e] += kda ? gs[j * K + c0 + e] : gj;
            }
          } else if (j >= 0 && !kda) {
            const float gj = gs[j];
#pragma unroll
            for (int e = 0; e < KC; ++e) acc[e] += gj;
          }
          v[jj] = su;
          v[kDotGroup + jj] = sp;
        }
        TransposeReduce<2 * kDotGroup, 16>::Run(v, lane);
        // Value i (u of record jb - i for i < G, p of record jb - (i - G)) is held by lanes
        // i * 32 / (2G) onwards.
        constexpr int kSpread = 32 / (2 * kDotGroup);
        const int i = lane / kSpread;
        const int j = jb - (i % kDotGroup);
        if (lane % kSpread == 0 && j >= 0) (i < kDotGroup ? us : ps)[t * L + j] = v[0];
      }
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        const float A = expf(acc[e]);
        ka[t][e] = A * k[e];
        qa[t][e] = A * q[e];
        if (t == 0) kn0[e] = k[e], av[e] = A;
      }
      // This draft's record as stored, for the later drafts (and the ring when not folding).
      if (has_c && P < L) {
#pragma unroll
        for (int e = 0; e < KC; ++e) ks[P * K + c0 + e] = RoundTo<T>(k[e]);
        if (kda) {
#pragma unroll
          for (int e = 0; e < KC; ++e) gs[P * K + c0 + e] = g[e];
        }
      }
      if (!kda && lane == 0 && P < L) gs[P] = g[0];
      if (!fold && chunk == 0 && P < L) {  // append k (once per qk-head group) and g
        if (has_c) {
          if (h % ly.group == 0) {
            T* kd = static_cast<T*>(ly.ring_k) + slot * ly.k_stride + (int64_t{hq} * L + P) * K + c0;
#pragma unroll
            for (int e = 0; e < KC; ++e) kd[e] = FromF<T>(k[e]);
          }
          if (kda) {
#pragma unroll
            for (int e = 0; e < KC; ++e) rg[int64_t{P} * K + c0 + e] = g[e];
          }
        }
        if (!kda && lane == 0) rg[P] = g[0];
      }
      }
      __syncwarp();
    }
    // Ring coefficients of record j = lane (records beyond 32 are added in the batch loop).
    float ur[TT], pr[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      ur[t] = (t < nt && lane < w) ? us[t * L + lane] : 0.f;
      pr[t] = (t < nt && lane < w) ? ps[t * L + lane] : 0.f;
    }

    // ---- the rows, RB at a time -------------------------------------------------------------
    #pragma unroll 1
    for (int b = 0; b < nbatch; ++b) {
      const int b0 = v0 + b * RB;
      float acc[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) acc[i] = 0.f;
#pragma unroll
      for (int i = 0; i < RB; ++i) {
#pragma unroll
        for (int e = 0; e < KC; ++e) {
          const float x = st[i].Get(e);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            acc[(t * RB + i) * 2] += x * ka[t][e];
            acc[(t * RB + i) * 2 + 1] += x * qa[t][e];
          }
        }
      }
      float dl[RB];  // ring d of record j = lane for the batch rows (kept for the fold)
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        dl[i] = dn.Get(i);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          acc[(t * RB + i) * 2] += dl[i] * ur[t];
          acc[(t * RB + i) * 2 + 1] += dl[i] * pr[t];
        }
      }
      for (int j = lane + 32; j < w; j += 32) {  // rings longer than 32 records
        Slice<T, RB> d2;
        LoadSlice<false>(d2, rd + int64_t{j} * V + b0, vec_d);
#pragma unroll
        for (int i = 0; i < RB; ++i) {
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            if (t < nt) {
              acc[(t * RB + i) * 2] += d2.Get(i) * us[t * L + j];
              acc[(t * RB + i) * 2 + 1] += d2.Get(i) * ps[t * L + j];
            }
          }
        }
      }
      float vcur[TT];
#pragma unroll
      for (int t = 0; t < TT; ++t) vcur[t] = vsm[t * p.vc + (b0 - v0) + row_l];
      if (!fold) load_regs(b + 1);  // S0 is not needed after the contraction

      TransposeReduce<NV, 16>::Run(acc, lane);
      float dd[TT], dcur = 0.f;
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        float sk = __shfl_sync(0xffffffffu, acc[0], ((t * RB + row_l) * 2) * SPREAD);
        float sq = __shfl_sync(0xffffffffu, acc[0], ((t * RB + row_l) * 2 + 1) * SPREAD);
        dd[t] = 0.f;
        if (t < nt) {
          const int P = w + pass0 + t;
          for (int t2 = 0; t2 < pass0; ++t2) {  // drafts of earlier passes
            const float x = dds[t2 * p.vc + (b0 - v0) + row_l];
            sk += x * us[t * L + w + t2];
            sq += x * ps[t * L + w + t2];
          }
#pragma unroll
          for (int t2 = 0; t2 < TT; ++t2) {  // drafts of this pass
            if (t2 < t) {
              sk += dd[t2] * us[t * L + w + pass0 + t2];
              sq += dd[t2] * ps[t * L + w + pass0 + t2];
            }
          }
          const float d = beta[t] * (vcur[t] - sk);
          const T dr = FromF<T>(d);
          dd[t] = ToF(dr);
          dcur = d;
          const float o = sq + d * kq[t];
          if (lane < RB) {
            StoreAct(ly.o, (tok0 + pass0 + t) * ly.o_stride + int64_t{h} * V + b0 + row_l,
                     ly.act_dtype, o);
            if (!fold) rd[int64_t{P} * V + b0 + row_l] = dr;
            if (T_ > TT) dds[(pass0 + t) * p.vc + (b0 - v0) + row_l] = dd[t];
          }
        }
      }
      if (fold) {  // decode only (TT == 1): the new checkpoint of the batch rows
        float di[RB];
#pragma unroll
        for (int i = 0; i < RB; ++i) di[i] = __shfl_sync(0xffffffffu, dcur, i);
        float out[RB][KC];
#pragma unroll
        for (int i = 0; i < RB; ++i) {
#pragma unroll
          for (int e = 0; e < KC; ++e) out[i][e] = st[i].Get(e) * av[e];
        }
        #pragma unroll 1
        for (int j = 0; j < w; ++j) {
          float kw[KC];
#pragma unroll
          for (int e = 0; e < KC; ++e) kw[e] = has_c ? ks[j * K + c0 + e] : 0.f;
#pragma unroll
          for (int i = 0; i < RB; ++i) {
            const float dj = j < 32 ? __shfl_sync(0xffffffffu, dl[i], j & 31)
                                    : ToF(rd[int64_t{j} * V + b0 + i]);
#pragma unroll
            for (int e = 0; e < KC; ++e) out[i][e] += dj * kw[e];
          }
        }
#pragma unroll
        for (int i = 0; i < RB; ++i) {
#pragma unroll
          for (int e = 0; e < KC; ++e) st[i].Set(e, out[i][e] + di[i] * kn0[e]);
          if (has_c) StoreSlice(s0 + int64_t(b0 + i) * K, st[i], vec_s0);
        }
        load_regs(b + 1);
      }
    }
    __syncwarp();
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_WARP_KERNEL_CUH_
