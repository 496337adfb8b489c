// Block-level pieces of one (row, v-head, V-tile) CTA shared by the step and prefill kernels:
// loading records and tokens into shared memory, the weights W_j ∘ k_j and A (same order as
// the CPU reference, head_math.h), and the u/p dot products.
#ifndef REPLAYSSM_KERNELS_CUDA_HEAD_OPS_CUH_
#define REPLAYSSM_KERNELS_CUDA_HEAD_OPS_CUH_

#include "common.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
// CTAs per SM the step kernel is register-budgeted for: the step is latency-bound, so more
// resident CTAs keep more S0 bytes in flight (NOTES.md).
#ifndef RSSM_STEP_MIN_BLOCKS
#define RSSM_STEP_MIN_BLOCKS 6
#endif
constexpr int kStepMinBlocks = RSSM_STEP_MIN_BLOCKS;

// Records 0..w-1 of (slot, h) into shared memory: k [w, K], g [w, Kg], d [w, VT] (tile rows).
template <typename T>
__device__ __forceinline__ void LoadRecords(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                            int64_t slot, int h, int w, int v0, int VT) {
  const int K = ly.K, L = ly.L, V = ly.V;
  const int hq = h / ly.group;
  const T* rk = static_cast<const T*>(ly.ring_k) + slot * ly.k_stride + int64_t{hq} * L * K;
  for (int i = threadIdx.x; i < w * K; i += kThreads) s[sm.kext + i] = ToF(rk[i]);
  const float* rg = ly.ring_g + slot * ly.g_stride;
  if (ly.kda) {
    rg += int64_t{h} * L * K;
    for (int i = threadIdx.x; i < w * K; i += kThreads) s[sm.gext + i] = rg[i];
  } else {
    rg += int64_t{h} * L;
    for (int i = threadIdx.x; i < w; i += kThreads) s[sm.gext + i] = rg[i];
  }
  const T* rd = static_cast<const T*>(ly.ring_d) + slot * ly.d_stride + int64_t{h} * L * V + v0;
  for (int i = threadIdx.x; i < w * VT; i += kThreads) {
    const int j = i / VT, row = i % VT;
    s[sm.dext + i] = v0 + row < V ? ToF(rd[int64_t{j} * V + row]) : 0.f;
  }
}

// Token n for v-head h into draft slot t: q, k raw; v of the tile rows; g (into gext row P);
// beta. Normalization follows in NormalizeToken after a barrier.
__device__ __forceinline__ void LoadToken(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                          int64_t n, int h, int t, int P, int v0, int VT) {
  const int K = ly.K, V = ly.V, H = ly.H;
  const int hq = h / ly.group;
  const int64_t row = n * ly.qkv_stride;
  for (int c = threadIdx.x; c < K; c += kThreads) {
    s[sm.qs + t * K + c] = LoadAct(ly.qkv, row + int64_t{hq} * K + c, ly.act_dtype);
    s[sm.ks + t * K + c] = LoadAct(ly.qkv, row + int64_t{H + hq} * K + c, ly.act_dtype);
  }
  for (int r = threadIdx.x; r < VT; r += kThreads) {
    s[sm.vs + t * VT + r] =
        v0 + r < V ? LoadAct(ly.qkv, row + 2LL * H * K + int64_t{h} * V + v0 + r, ly.act_dtype)
                   : 0.f;
  }
  const float decay = -expf(ly.a_log[h]);
  if (ly.kda) {
    for (int c = threadIdx.x; c < K; c += kThreads) {
      const int64_t i = int64_t{h} * K + c;
      s[sm.gext + P * K + c] =
          decay * Softplus(LoadAct(ly.a, n * ly.a_stride + i, ly.act_dtype) + ly.dt_bias[i]);
    }
  } else if (threadIdx.x == 0) {
    s[sm.gext + P] =
        decay * Softplus(LoadAct(ly.a, n * ly.a_stride + h, ly.act_dtype) + ly.dt_bias[h]);
  }
  if (threadIdx.x == 0) {
    s[sm.beta + t] = Sigmoid(LoadAct(ly.b, n * ly.b_stride + h, ly.act_dtype));
  }
}

// Dot of two shared-memory vectors by one warp, 4 interleaved partials per lane.
__device__ __forceinline__ float WarpDot(const float* x, const float* y, int n, int lane) {
  float acc = 0.f;
  for (int c = lane; c < n; c += 32) acc += x[c] * y[c];
  return WarpSum(acc);
}

// Normalizes q, k of draft slots 0..nt-1 in place (q scaled), computes kq = k·q, and stores the
// k as the record will hold it into kext row P0 + t. Two barriers inside.
template <typename T>
__device__ __forceinline__ void NormalizeTokens(const LayerDesc& ly, const SmemLayout& sm,
                                                float* s, int nt, int P0) {
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
__device__ __forceinline__ void Weights(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                        int P, int t, bool gcur_zero, bool with_token) {
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
  for (int j = warp; j < P; j += kWarps) {
    const float* kw = s + sm.kw + j * K;
    float su = 0.f, sp = 0.f;
    for (int c = lane; c < K; c += 32) {
      su += kw[c] * k[c];
      sp += kw[c] * q[c];
    }
    su = WarpSum(su);
    sp = WarpSum(sp);
    if (lane == 0) {
      s[sm.u + t * L1 + j] = su;
      s[sm.pp + t * L1 + j] = sp;
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
