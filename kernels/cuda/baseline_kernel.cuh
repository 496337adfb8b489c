// The baseline decode kernel (rssm_baseline_decode): read a head's state, apply one gated delta
// step, write it back. A grid of small CTAs, each holding NW * RPW of a head's state rows in
// registers (no shared memory, no barriers): warp w of CTA (x, r) takes rows
// [(tile * NW + w) * RPW, + RPW) of v-head x / tiles of batch row r, lane l the key channels
// [KC * l, KC * l + KC) of each (a warp reads a row in one coalesced access). Every warp loads
// its row's token and normalizes q and k itself, and issues all its state loads before any
// arithmetic: many independent CTAs keep the state's bytes in flight (the bulk kernel's one CTA
// per head was latency-bound on this op: bench/results/kernels.md).
//
// Its phases are BaselineWarp's methods (token, rows, gates, contraction, fold), called in that
// order by the kernel; the arrays they fill live in the kernel's frame (the fold's accumulators
// too: declared inside the method, they changed every instantiation's machine code).
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

// One warp of the kernel: where it sits and the phases of its step — the token, the rows, the
// gates, the contraction and finish, the fold. Everything held per value (the token's raw
// loads, the rows, the partials) lives in the kernel's frame and passes by reference.
template <typename T, typename R, typename A, bool KDA, int KC, int NW, int RPW, int CACHE>
struct BaselineWarp {
  static constexpr int NV = 2 * RPW;  // values per transposed butterfly: ·(A∘k), ·(A∘q) per row
  static constexpr int SPREAD = 32 / NV;
  static_assert(NV <= 32, "2 * RPW values must fit one butterfly");
  static constexpr unsigned kAll = 0xffffffffu;

  const LayerDesc& ly;
  int lane, warp, r, h, tile, K, V, H, v0;

  __device__ __forceinline__ explicit BaselineWarp(const BaselineParams& p) : ly(p.ly) {
    lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    r = blockIdx.y;
    h = blockIdx.x / p.tiles, tile = blockIdx.x - h * p.tiles;
    K = ly.K, V = ly.V, H = ly.H;
    v0 = (tile * NW + warp) * RPW;  // the warp's first row
  }

  // The warp's nrows state rows from s0 (the lane's channels), zero past them and past K.
  __device__ __forceinline__ void LoadRows(Vec<T, KC> (&x)[RPW], const T* s0, bool has_c, int nrows,
                                           bool vec) const {
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
      if (has_c && i < nrows) {
        x[i].template Load<CACHE>(s0 + int64_t{i} * K, vec);
      } else {
        x[i].Zero();
      }
    }
  }

  // The decay A = exp(g) from the token's gate, A∘k, A∘q and the new k as the ring would hold
  // it (the fold's).
  __device__ __forceinline__ void Gates(float alog, const A (&ar)[KC], const float (&db)[KC],
                                        const float (&q)[KC], const float (&kk)[KC], bool has_c,
                                        float (&av)[KC], float (&ka)[KC], float (&qa)[KC],
                                        float (&kn)[KC]) const {
    const float decay = GateDecay(alog);
    const float g_gdn = KDA ? 0.f : TokenGate(decay, ToF(ar[0]), db[0]);
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      const float g = KDA ? (has_c ? TokenGate(decay, ToF(ar[e]), db[e]) : 0.f) : g_gdn;
      const float a = expf(g);
      av[e] = has_c ? a : 0.f;
      ka[e] = has_c ? a * kk[e] : 0.f;
      qa[e] = has_c ? a * q[e] : 0.f;
      kn[e] = has_c ? RoundTo<R>(kk[e]) : 0.f;
    }
  }

  // S0·(A∘k), S0·(A∘q) per row: the lane's partials, then one butterfly for all rows.
  __device__ __forceinline__ void Contract(const Vec<T, KC> (&x)[RPW], const float (&ka)[KC],
                                           const float (&qa)[KC], float (&acc)[NV]) const {
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
  }

  // The new rows: S0·A + R(d) R(k)ᵀ, the bulk kernel's FoldBatch at w = 0 (dcur: the lane's
  // row's d as the ring would hold it).
  __device__ __forceinline__ void Fold(const Vec<T, KC> (&x)[RPW], const float (&av)[KC],
                                       const float (&kn)[KC], float dcur, T* s0, bool has_c,
                                       int nrows, bool vec, float (&out)[RPW][KC]) const {
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
  using Warp = BaselineWarp<T, R, A, KDA, KC, NW, RPW, CACHE>;
  constexpr int SPREAD = Warp::SPREAD;
  constexpr unsigned kAll = Warp::kAll;
  const Warp wp(p);
  const LayerDesc& ly = p.ly;
  const int lane = wp.lane, r = wp.r, h = wp.h, K = wp.K, V = wp.V, H = wp.H, v0 = wp.v0;
  if (v0 >= V) return;  // a last tile's idle warp (no CTA barrier here)
  const int nrows = min(RPW, V - v0);
  // The slot first (the state's address waits for it), then every token load.
  const int slot_i = p.slot_idx[r];
  const int hq = h / ly.group;
  const int c0 = lane * KC;
  const bool has_c = c0 < K;
  const int row_l = lane % RPW;  // the row whose d, o this lane finishes
  const A* const qkv = static_cast<const A*>(ly.qkv) + int64_t{r} * ly.qkv_stride;
  A qr[KC], kr[KC], ar[KC];
  float db[KC];
  LoadStepToken<A, KDA, KC>(ly, qkv, r, h, hq, K, H, c0, has_c, qr, kr, ar, db);
  const A b_raw = static_cast<const A*>(ly.b)[int64_t{r} * ly.b_stride + h];
  const float alog = ly.a_log[h];
  const bool row_on = row_l < nrows;
  const A v_raw = row_on ? qkv[int64_t{2 * H} * K + int64_t{h} * V + v0 + row_l] : A{};
  A* const orow = static_cast<A*>(ly.o) + int64_t{r} * ly.o_stride + int64_t{h} * V + v0;
  if (slot_i < 0 || slot_i >= ly.num_slots) {  // a padding row: zero outputs
    if (lane < nrows) orow[lane] = FromF<A>(0.f);
    return;
  }
  T* const s0 =
      static_cast<T*>(ly.ckpt) + int64_t{slot_i} * ly.ckpt_stride + (int64_t{h} * V + v0) * K + c0;
  const bool vec = p.vec != 0;
  Vec<T, KC> x[RPW];
  wp.LoadRows(x, s0, has_c, nrows, vec);

  // q and k normalized (q scaled), k·q.
  float q[KC], kk[KC];
  const float kq = StepTokenQk<A, KC>(ly, qr, kr, has_c, q, kk);
  float av[KC], ka[KC], qa[KC], kn[KC];
  wp.Gates(alog, ar, db, q, kk, has_c, av, ka, qa, kn);
  const float beta = StepBeta<A>(ly, b_raw);

  // S0·(A∘k), S0·(A∘q) per row: the lane's partials, then one butterfly for all rows.
  float acc[Warp::NV];
  wp.Contract(x, ka, qa, acc);
  const float sk = __shfl_sync(kAll, acc[0], (row_l * 2) * SPREAD);
  const float sq = __shfl_sync(kAll, acc[0], (row_l * 2 + 1) * SPREAD);
  const float d = beta * (ToF(v_raw) - sk);
  const float dcur = ToF(FromF<R>(d));  // the new d as the ring would hold it (the fold's)
  const float o = sq + d * kq;
  if (lane < nrows) orow[lane] = FromF<A>(o);

  float out[RPW][KC];
  wp.Fold(x, av, kn, dcur, s0, has_c, nrows, vec, out);
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_BASELINE_KERNEL_CUH_
