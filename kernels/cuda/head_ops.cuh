// Block-level pieces of one (row, v-head, V-tile) CTA shared by the tiled step and prefill
// kernels: loading records and tokens into shared memory, the weights W_j ∘ k_j and A (same
// order as the CPU reference, head_math.h), and the u/p dot products.
#ifndef REPLAYSSM_KERNELS_CUDA_HEAD_OPS_CUH_
#define REPLAYSSM_KERNELS_CUDA_HEAD_OPS_CUH_

#include "common.cuh"
#include "loads.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

constexpr int kThreads = kTiledThreads;
constexpr int kWarps = kThreads / 32;
// CTAs per SM the tiled step kernel's registers are budgeted for (decode 3 x 256 threads: 85
// registers; verify 2 x 256: 128): more resident CTAs keep more S0 bytes in flight.
constexpr int kStepMinBlocks = 3;
constexpr int kVerifyMinBlocks = 2;

// What the tiled step and prefill kernels' CTAs share: where one sits — one CTA per (batch row
// r, v-head h, V-tile vt of VT state rows), flattened with the V-tile fastest — and the load of
// its S0 tile [VT, K] into registers (Vec pieces of 16 bytes, streaming, E key channels each).
template <typename T, int KMAX>
struct TileCta {
  using Cfg = TileCfg<T, KMAX>;
  static constexpr int R = Cfg::R, CPL = Cfg::CPL, E = Cfg::E, VT = Cfg::VT;
  using Tile = Vec<T, E>[R][CPL];

  int tid, lane, warp, vt, h, r, v0;

  template <typename Params>
  __device__ __forceinline__ void Place(const Params& p) {
    tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int64_t bid = blockIdx.x;
    vt = static_cast<int>(bid % p.num_vtiles);
    bid /= p.num_vtiles;
    h = static_cast<int>(bid % p.ly.HV);
    r = static_cast<int>(bid / p.ly.HV);
    v0 = vt * VT;
  }

  // The tile's rows from s0 (the head's row v0; aligned: 16-byte loads), zero past V and K.
  __device__ __forceinline__ void ReadTile(Tile& st, const T* s0, bool aligned, int K,
                                           int V) const {
#pragma unroll
    for (int i = 0; i < R; ++i) {
      const int row = Cfg::Row(i, warp, lane);
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch) {
        const int c = Cfg::Chan(ch, lane);
        if (v0 + row < V && c < K) {
          st[i][ch].template Load<kCacheStream>(s0 + int64_t{row} * K + c, aligned);
        } else {
          st[i][ch].Zero();
        }
      }
    }
  }
};

// Copies n elements global -> shared (fp32), kLoadBatch loads in flight per thread before the
// first store: a load cannot pass an earlier shared store through a generic pointer, so a plain
// load/store loop would pay one memory round trip per iteration.
constexpr int kLoadBatch = 8;
template <typename T>
__device__ __forceinline__ void CopyToSmem(float* dst, const T* src, int n) {
  for (int i0 = threadIdx.x; i0 < n; i0 += kThreads * kLoadBatch) {
    T v[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int i = i0 + u * kThreads;
      if (i < n) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int i = i0 + u * kThreads;
      if (i < n) dst[i] = ToF(v[u]);
    }
  }
}

// Records 0..w-1 of (slot, h) into shared memory: k [w, K], g [w, Kg], d [w, VT] (tile rows).
// T: the ring's storage type of d and k.
template <typename T>
__device__ __forceinline__ void LoadRecords(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                            int64_t slot, int h, int w, int v0, int VT) {
  const int K = ly.K, L = ly.L, V = ly.V;
  const int hq = h / ly.group;
  const T* rk = static_cast<const T*>(ly.ring_k) + slot * ly.k_stride + int64_t{hq} * L * K;
  const float* rg = ly.ring_g + slot * ly.g_stride;
  const T* rd = static_cast<const T*>(ly.ring_d) + slot * ly.d_stride + int64_t{h} * L * V + v0;
  // d rows first (VT-wide rows at stride V), batched like CopyToSmem.
  for (int i0 = threadIdx.x; i0 < w * VT; i0 += kThreads * kLoadBatch) {
    T v[kLoadBatch];
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int i = i0 + u * kThreads, j = i / VT, row = i % VT;
      if (i < w * VT && v0 + row < V) v[u] = rd[int64_t{j} * V + row];
    }
#pragma unroll
    for (int u = 0; u < kLoadBatch; ++u) {
      const int i = i0 + u * kThreads, row = i % VT;
      if (i < w * VT) s[sm.dext + i] = v0 + row < V ? ToF(v[u]) : 0.f;
    }
  }
  CopyToSmem<T>(s + sm.kext, rk, w * K);
  if (ly.kda) {
    CopyToSmem<float>(s + sm.gext, rg + int64_t{h} * L * K, w * K);
  } else {
    CopyToSmem<float>(s + sm.gext, rg + int64_t{h} * L, w);
  }
}

// Token n for v-head h into draft slot t: q, k raw; v of the tile rows; g (into gext row P);
// beta. Normalization follows in NormalizeTokens after a barrier.
__device__ __forceinline__ void LoadToken(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                          int64_t n, int h, int t, int P, int v0, int VT) {
  // Every load first, then the stores (K <= 2 * kThreads, VT <= kThreads): one round trip.
  const int K = ly.K, V = ly.V, H = ly.H, tid = threadIdx.x;
  const int hq = h / ly.group;
  const int64_t row = n * ly.qkv_stride;
  const bool kda = ly.kda != 0;
  float qv[2] = {0.f, 0.f}, kv[2] = {0.f, 0.f}, av[2] = {0.f, 0.f}, dv[2] = {0.f, 0.f};
  float vv = 0.f, ga = 0.f, gd = 0.f, bb = 0.f;
  const float alog = ly.a_log[h];
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int c = tid + u * kThreads;
    if (c < K) {
      qv[u] = LoadAct(ly.qkv, row + int64_t{hq} * K + c, ly.act_dtype);
      kv[u] = LoadAct(ly.qkv, row + int64_t{H + hq} * K + c, ly.act_dtype);
      if (kda) {
        const int64_t i = int64_t{h} * K + c;
        av[u] = LoadAct(ly.a, n * ly.a_stride + i, ly.act_dtype);
        dv[u] = ly.dt_bias[i];
      }
    }
  }
  if (tid < VT && v0 + tid < V) {
    vv = LoadAct(ly.qkv, row + 2LL * H * K + int64_t{h} * V + v0 + tid, ly.act_dtype);
  }
  if (tid == 0) {
    if (!kda) {
      ga = LoadAct(ly.a, n * ly.a_stride + h, ly.act_dtype);
      gd = ly.dt_bias[h];
    }
    bb = LoadAct(ly.b, n * ly.b_stride + h, ly.act_dtype);
  }
  const float decay = GateDecay(alog);
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const int c = tid + u * kThreads;
    if (c < K) {
      s[sm.qs + t * K + c] = qv[u];
      s[sm.ks + t * K + c] = kv[u];
      if (kda) s[sm.gext + P * K + c] = TokenGate(decay, av[u], dv[u]);
    }
  }
  if (tid < VT) s[sm.vs + t * VT + tid] = vv;
  if (tid == 0) {
    if (!kda) s[sm.gext + P] = TokenGate(decay, ga, gd);
    s[sm.beta + t] = Beta(bb, ly.act_dtype, ly.round_beta);
  }
}

// Dot of two shared-memory vectors by one warp (a partial per lane, then a butterfly).
__device__ __forceinline__ float WarpDot(const float* x, const float* y, int n, int lane) {
  float acc = 0.f;
  for (int c = lane; c < n; c += 32) acc += x[c] * y[c];
  return WarpSum(acc);
}

// Normalizes q, k of draft slots 0..nt-1 in place (q scaled), computes kq = k·q, and stores the
// k as the record will hold it (rounded to the ring's type T) into kext row P0 + t. Two
// barriers inside.
template <typename T>
__device__ __forceinline__ void NormalizeTokens(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                                int nt, int P0) {
  const int K = ly.K;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (ly.l2norm) {
    for (int t = warp; t < nt; t += kWarps) {
      const float* q = s + sm.qs + t * K;
      const float* k = s + sm.ks + t * K;
      const float nq = WarpDot(q, q, K, lane), nk = WarpDot(k, k, K, lane);
      if (lane == 0) {
        s[sm.norm + 2 * t] = 1.f / sqrtf(nq + 1e-6f);
        s[sm.norm + 2 * t + 1] = 1.f / sqrtf(nk + 1e-6f);
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < nt * K; i += kThreads) {
    const int t = i / K;
    float q = s[sm.qs + i], k = s[sm.ks + i];
    if (ly.l2norm) {
      q *= s[sm.norm + 2 * t];
      k *= s[sm.norm + 2 * t + 1];
    }
    q *= ly.scale;
    s[sm.qs + i] = q;
    s[sm.ks + i] = k;
    s[sm.kext + P0 * K + i] = RoundTo<T>(k);
  }
  __syncthreads();
  for (int t = warp; t < nt; t += kWarps) {
    const float kq = WarpDot(s + sm.ks + t * K, s + sm.qs + t * K, K, lane);
    if (lane == 0) s[sm.kq + t] = kq;
  }
}

// Weights of a token at position P (current decay = gext row P, or zero when gcur_zero) after
// records 0..P-1: kw[j] = W_j ∘ k_j, A; then ka/qa of slot t = A∘k, A∘q (skipped when
// with_token is false). Thread per key channel; the order is the CPU reference's.
__device__ __forceinline__ void Weights(const LayerDesc& ly, const SmemLayout& sm, float* s, int P,
                                        int t, bool gcur_zero, bool with_token) {
  const int K = ly.K;
  const bool kda = ly.kda;
  for (int c = threadIdx.x; c < K; c += kThreads) {
    float acc = gcur_zero ? 0.f : (kda ? s[sm.gext + P * K + c] : s[sm.gext + P]);
    for (int j = P - 1; j >= 0; --j) {
      s[sm.kw + j * K + c] = expf(acc) * s[sm.kext + j * K + c];
      acc += kda ? s[sm.gext + j * K + c] : s[sm.gext + j];
    }
    const float A = expf(acc);
    s[sm.avec + c] = A;
    if (with_token) {
      s[sm.ka + t * K + c] = A * s[sm.ks + t * K + c];
      s[sm.qa + t * K + c] = A * s[sm.qs + t * K + c];
    }
  }
}

// u[t][j] = kw[j]·k_t, p[t][j] = kw[j]·q_t for j < P: a warp per record.
__device__ __forceinline__ void RecordDots(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                           int P, int t) {
  const int K = ly.K, L1 = ly.L + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* k = s + sm.ks + t * K;
  const float* q = s + sm.qs + t * K;
  // 4 records per warp at once: 8 independent butterflies interleave their shuffles (each
  // value is summed in the same order as one WarpSum of the lane partials).
  constexpr int NB = 4;
  for (int j0 = warp * NB; j0 < P; j0 += kWarps * NB) {
    float su[NB], sp[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) su[b] = sp[b] = 0.f;
    for (int c = lane; c < K; c += 32) {
      const float kc = k[c], qc = q[c];
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        if (j0 + b < P) {
          const float x = s[sm.kw + (j0 + b) * K + c];
          su[b] += x * kc;
          sp[b] += x * qc;
        }
      }
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        su[b] += __shfl_xor_sync(0xffffffffu, su[b], m);
        sp[b] += __shfl_xor_sync(0xffffffffu, sp[b], m);
      }
    }
    if (lane == 0) {
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        if (j0 + b < P) {
          s[sm.u + t * L1 + j0 + b] = su[b];
          s[sm.pp + t * L1 + j0 + b] = sp[b];
        }
      }
    }
  }
}

// Reduces the per-thread contraction partials acc[(t*R + i)*2 + {0: ·k, 1: ·q}] over the G
// lanes of each row and stores them into skq[t][row][2].
template <typename Cfg, int TC>
__device__ __forceinline__ void ReduceToSmem(float* acc, const SmemLayout& sm, float* s) {
  constexpr int N = TC * Cfg::R * 2;
  constexpr int G = Cfg::G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  TransposeReduce<N, G / 2>::Run(acc, lane);
  const int gl = lane % G;
  auto put = [&](int idx, float x) {
    const int t = idx / (2 * Cfg::R), i = (idx / 2) % Cfg::R, which = idx & 1;
    const int row = Cfg::Row(i, warp, lane);
    s[sm.skq + (t * Cfg::VT + row) * 2 + which] = x;
  };
  if constexpr (N >= G) {
#pragma unroll
    for (int i = 0; i < N / G; ++i) put(gl * (N / G) + i, acc[i]);
  } else {
    if (gl % (G / N) == 0) put(gl / (G / N), acc[0]);
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_HEAD_OPS_CUH_
