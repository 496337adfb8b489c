// The baseline decode kernel (rssm_baseline_decode): read a head's state, apply one gated delta
// step, write it back. A grid of small CTAs, each holding NW * RPW of a head's state rows in
// registers (no shared memory, no barriers): warp w of CTA (x, r) takes rows
// [(tile * NW + w) * RPW, + RPW) of v-head x / tiles of batch row r, lane l the key channels
// [KC * l, KC * l + KC) of each (a warp reads a row in one coalesced access). Every warp loads
// its row's token and normalizes q and k itself, and issues all its state loads before any
// arithmetic: many independent CTAs keep the state's bytes in flight (the bulk kernel's one CTA
// per head was latency-bound on this op: bench/results/kernels.md).
//
// The arithmetic is the bulk kernel's baseline (bulk_step_kernel.cuh at w = 0) operation for
// operation: the lane's partials in channel order, then a transposed butterfly over the 32
// lanes, whose sums are the same tree for any number of values; so replay at L = 1 (the bulk
// kernel) is still the baseline bit for bit. Types: T the checkpoint's storage, R the ring's
// (the new d and k enter the state rounded to it, as a folding replay's), A the activations'.
#ifndef REPLAYSSM_KERNELS_CUDA_BASELINE_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_BASELINE_KERNEL_CUH_

#include "common.cuh"
#include "loads.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

struct BaselineParams {
  LayerDesc ly;
  int32_t tiles;            // CTAs per v-head: ceil(V / (NW * RPW))
  int32_t vec;              // the checkpoint's base and slot stride are 16-byte aligned
  const int32_t* slot_idx;  // [B]
};

// A token's beta from its raw b (rounded to the act dtype where the layer asks, as the step
// kernels' token loads do): the one place the baseline computes it.
template <typename A>
__device__ __forceinline__ float StepBeta(const LayerDesc& ly, A b) {
  return Beta(ToF(b), ly.act_dtype, ly.round_beta);
}

// One warp of the kernel: where it sits and its rows, and its phases in the order the kernel
// runs them. Arrays live in the kernel's frame and pass by reference (registers).
template <typename T, typename R, typename A, bool KDA, int KC, int NW, int RPW, int CACHE>
struct BaselineWarp {
  static constexpr int NV = 2 * RPW;  // values per transposed butterfly: ·(A∘k), ·(A∘q) per row
  static constexpr int SPREAD = 32 / NV;
  static_assert(NV <= 32, "2 * RPW values must fit one butterfly");
  static constexpr unsigned kAll = 0xffffffffu;

  const BaselineParams& p;
  const LayerDesc& ly;
  int lane, warp, r, h, tile, K, V, H;
  int v0;     // the warp's first row
  int nrows;  // its rows (a last tile's may be fewer than RPW)
  int hq, c0;
  bool has_c;
  int row_l;  // the row whose d, o this lane finishes

  __device__ __forceinline__ explicit BaselineWarp(const BaselineParams& params)
      : p(params), ly(params.ly) {
    lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    r = blockIdx.y;
    h = blockIdx.x / p.tiles, tile = blockIdx.x - h * p.tiles;
    K = ly.K, V = ly.V, H = ly.H;
    v0 = (tile * NW + warp) * RPW;
  }
  // The rest, once the warp has rows (v0 < V).
  __device__ __forceinline__ void Place() {
    nrows = min(RPW, V - v0);
  }

  // The slot first (the state's address waits for it), then every token load; returns the
  // warp's outputs.
  __device__ __forceinline__ A* LoadToken(int& slot_i, StepToken<A, KC>& t) {
    slot_i = p.slot_idx[r];
    hq = h / ly.group;
    c0 = lane * KC;
    has_c = c0 < K;
    row_l = lane % RPW;
    return LoadStepToken<A, KDA, KC>(
        ly, TokenSite{K, H, V, r, h, hq, c0, has_c, row_l < nrows, v0, row_l}, t);
  }

  // The warp's state rows, every load issued before any arithmetic.
  __device__ __forceinline__ void LoadRows(T* s0, bool vec, Vec<T, KC> (&x)[RPW]) const {
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      if (has_c && i < nrows) {
        x[i].template Load<CACHE>(s0 + int64_t{i} * K, vec);
      } else {
        x[i].Zero();
      }
    }
  }

  // q and k normalized (q scaled), k·q (NormalizeQk, as the bulk kernel's NormDraft); the
  // decay A = exp(g), A∘k, A∘q and the new k as the ring would hold it (the fold's); beta.
  __device__ __forceinline__ void TokenMath(const StepToken<A, KC>& t, float (&av)[KC],
                                            float (&ka)[KC], float (&qa)[KC], float (&kn)[KC],
                                            float& kq, float& beta) const {
    float q[KC], kk[KC];
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      q[e] = has_c ? ToF(t.qr[e]) : 0.f;
      kk[e] = has_c ? ToF(t.kr[e]) : 0.f;
    }
    kq = NormalizeQk<KC>(ly, q, kk);
    const float decay = -expf(t.alog);
    const float g_gdn = KDA ? 0.f : decay * Softplus(ToF(t.ar[0]) + t.db[0]);
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      const float g = KDA ? (has_c ? decay * Softplus(ToF(t.ar[e]) + t.db[e]) : 0.f) : g_gdn;
      const float a = expf(g);
      av[e] = has_c ? a : 0.f;
      ka[e] = has_c ? a * kk[e] : 0.f;
      qa[e] = has_c ? a * q[e] : 0.f;
      kn[e] = has_c ? RoundTo<R>(kk[e]) : 0.f;
    }
    beta = StepBeta<A>(ly, t.b_raw);
  }

  // S0·(A∘k), S0·(A∘q) per row: the lane's partials, then one butterfly for all rows; o
  // stored. Returns the new d as the ring would hold it (the fold's).
  __device__ __forceinline__ float Rows(const Vec<T, KC> (&x)[RPW], const float (&ka)[KC],
                                        const float (&qa)[KC], float beta, float kq, A v_raw,
                                        A* orow) const {
    float acc[NV];
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = 0.f;
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        const float s = x[i].Get(e);
        acc[2 * i] += s * ka[e];
        acc[2 * i + 1] += s * qa[e];
      }
    }
    TransposeReduce<NV, 16>::Run(acc, lane);
    const float sk = __shfl_sync(kAll, acc[0], (row_l * 2) * SPREAD);
    const float sq = __shfl_sync(kAll, acc[0], (row_l * 2 + 1) * SPREAD);
    const float d = beta * (ToF(v_raw) - sk);
    const float dcur = ToF(FromF<R>(d));
    const float o = sq + d * kq;
    if (lane < nrows) orow[lane] = FromF<A>(o);
    return dcur;
  }

  // The new rows: S0·A + R(d) R(k)ᵀ, the bulk kernel's FoldBatch at w = 0.
  __device__ __forceinline__ void Fold(const Vec<T, KC> (&x)[RPW], const float (&av)[KC],
                                       const float (&kn)[KC], float dcur, T* s0,
                                       bool vec) const {
    float out[RPW][KC];
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
#pragma unroll
      for (int e = 0; e < KC; ++e) out[i][e] = x[i].Get(e) * av[e];
    }
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      const float di = __shfl_sync(kAll, dcur, i);
      if (!has_c || i >= nrows) continue;
      Vec<T, KC> y;
#pragma unroll
      for (int e = 0; e < KC; ++e) y.Set(e, out[i][e] + di * kn[e]);
      y.template Store<CACHE>(s0 + int64_t{i} * K, vec);
    }
  }
};

// Grid (HV * tiles, B), NW warps per CTA. Requirements: K <= 32 * KC, 2 * RPW <= 32.
template <typename T, typename R, typename A, bool KDA, int KC, int NW, int RPW, int CACHE>
__global__ void __launch_bounds__(NW * 32)
    BaselineKernel(const __grid_constant__ BaselineParams p) {
  BaselineWarp<T, R, A, KDA, KC, NW, RPW, CACHE> wp(p);
  if (wp.v0 >= wp.V) return;  // a last tile's idle warp (no CTA barrier here)
  wp.Place();
  int slot_i;
  StepToken<A, KC> t;
  A* const orow = wp.LoadToken(slot_i, t);
  if (slot_i < 0 || slot_i >= p.ly.num_slots) {  // a padding row: zero outputs
    if (wp.lane < wp.nrows) orow[wp.lane] = FromF<A>(0.f);
    return;
  }
  T* const s0 = static_cast<T*>(p.ly.ckpt) + int64_t{slot_i} * p.ly.ckpt_stride +
                (int64_t{wp.h} * wp.V + wp.v0) * wp.K + wp.c0;
  const bool vec = p.vec != 0;
  Vec<T, KC> x[RPW];
  wp.LoadRows(s0, vec, x);
  float av[KC], ka[KC], qa[KC], kn[KC], kq, beta;
  wp.TokenMath(t, av, ka, qa, kn, kq, beta);
  const float dcur = wp.Rows(x, ka, qa, beta, kq, t.v_raw, orow);
  wp.Fold(x, av, kn, dcur, s0, vec);
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_BASELINE_KERNEL_CUH_
