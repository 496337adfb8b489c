// Device helpers shared by the CUDA kernels: dtype conversion, 16-byte chunk loads/stores of
// the state, activation loads by runtime dtype, warp reductions, and the register-tile
// geometry of one CTA (TileCfg).
#ifndef REPLAYSSM_KERNELS_CUDA_COMMON_CUH_
#define REPLAYSSM_KERNELS_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "layout.h"

namespace replayssm::kernels::cuda {

// ---- scalar conversions -------------------------------------------------------------------
__device__ __forceinline__ float ToF(float x) { return x; }
__device__ __forceinline__ float ToF(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToF(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ float FromF<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half FromF<__half>(float x) {
  return __float2half_rn(x);
}

// x rounded to T and back: what a stored value reads as.
template <typename T>
__device__ __forceinline__ float RoundTo(float x) {
  return ToF(FromF<T>(x));
}

// Activation dtypes are a runtime switch (activations are a few hundred bytes per head).
enum ActDtype : int { kActF32 = 0, kActBf16 = 1, kActF16 = 2 };

__device__ __forceinline__ float LoadAct(const void* base, int64_t i, int dt) {
  if (dt == kActF32) return static_cast<const float*>(base)[i];
  if (dt == kActBf16) return ToF(static_cast<const __nv_bfloat16*>(base)[i]);
  return ToF(static_cast<const __half*>(base)[i]);
}
__device__ __forceinline__ void StoreAct(void* base, int64_t i, int dt, float x) {
  if (dt == kActF32) {
    static_cast<float*>(base)[i] = x;
  } else if (dt == kActBf16) {
    static_cast<__nv_bfloat16*>(base)[i] = FromF<__nv_bfloat16>(x);
  } else {
    static_cast<__half*>(base)[i] = FromF<__half>(x);
  }
}

// x[t] to base[i0 + t * stride] for t < n (<= N): one dtype switch for the N values.
template <int N>
__device__ __forceinline__ void StoreActs(void* base, int64_t i0, int64_t stride, int dt,
                                          const float (&x)[N], int n) {
  if (dt == kActBf16) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
      if (t < n) static_cast<__nv_bfloat16*>(base)[i0 + t * stride] = FromF<__nv_bfloat16>(x[t]);
    }
  } else if (dt == kActF32) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
      if (t < n) static_cast<float*>(base)[i0 + t * stride] = x[t];
    }
  } else {
#pragma unroll
    for (int t = 0; t < N; ++t) {
      if (t < n) static_cast<__half*>(base)[i0 + t * stride] = FromF<__half>(x[t]);
    }
  }
}

// ---- reductions -----------------------------------------------------------------------------
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int s = 16; s >= 1; s >>= 1) x += __shfl_xor_sync(0xffffffffu, x, s);
  return x;
}

// A token's q and k, KC channels per lane of one warp (already loaded): both divided by their
// norm sqrt(Σx² + 1e-6) when ly.l2norm, q then scaled by ly.scale; returns k·q. The one
// definition of the kernels that hold a token across a warp's registers (bulk, baseline,
// small replay), so that their results agree bit for bit.
template <int KC, typename Layer>
__device__ __forceinline__ float NormalizeQk(const Layer& ly, float (&q)[KC], float (&kk)[KC]) {
  if (ly.l2norm) {
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int e = 0; e < KC; ++e) sq += q[e] * q[e], sk += kk[e] * kk[e];
    sq = WarpSum(sq);
    sk = WarpSum(sk);
    const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
    for (int e = 0; e < KC; ++e) q[e] *= iq, kk[e] *= ik;
  }
  float dkq = 0.f;
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    q[e] *= ly.scale;
    dkq += kk[e] * q[e];
  }
  return WarpSum(dkq);
}

// Reduces N values per lane across aligned groups of G lanes (N, G powers of two) with the
// transposed butterfly: each step halves the values a lane carries, so N values cost
// N-1 shuffles instead of N*log2(G). On return v[0..max(N/G,1)) hold totals; value v[i] of
// lane l is the total of index (l % G) * (N / G) + i when N >= G, else (l % G) / (G / N).
template <int N, int S>
struct TransposeReduce {
  static __device__ __forceinline__ void Run(float* v, int lane) {
    if constexpr (S >= 1) {
      if constexpr (N > 1) {
        const bool upper = (lane & S) != 0;
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
          const float send = upper ? v[i] : v[i + N / 2];
          const float keep = upper ? v[i + N / 2] : v[i];
          v[i] = keep + __shfl_xor_sync(0xffffffffu, send, S);
        }
        TransposeReduce<N / 2, S / 2>::Run(v, lane);
      } else {
        v[0] += __shfl_xor_sync(0xffffffffu, v[0], S);
        TransposeReduce<1, S / 2>::Run(v, lane);
      }
    }
  }
};

// ---- gates ----------------------------------------------------------------------------------
__device__ __forceinline__ float Softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float Sigmoid(float x) { return 1.f / (1.f + expf(-x)); }
// A head's decay rate -exp(A_log), which its gates scale.
__device__ __forceinline__ float GateDecay(float a_log) { return -expf(a_log); }
// A token's gate g = -exp(A_log) * softplus(a + dt_bias), from decay = GateDecay(A_log).
__device__ __forceinline__ float TokenGate(float decay, float a, float dt_bias) {
  return decay * Softplus(a + dt_bias);
}
// beta = sigmoid(b), rounded to the act dtype where the layer asks (rssm_layer_params.round_beta).
__device__ __forceinline__ float Beta(float b, int act_dtype, int32_t round_beta) {
  const float beta = Sigmoid(b);
  if (round_beta == 0 || act_dtype == kActF32) return beta;
  return act_dtype == kActBf16 ? RoundTo<__nv_bfloat16>(beta) : RoundTo<__half>(beta);
}

// ---- register tile geometry -----------------------------------------------------------------
// One CTA of kThreads threads holds a tile of VT state rows x KMAX key channels in registers.
// A row is NCH 16-byte chunks, spread over G lanes (CPL chunks each); a warp covers RPW rows
// per pass and a thread R rows, so R * CPL 16-byte loads per thread are in flight at once.
template <typename T, int KMAX>
struct TileCfg {
  static constexpr int kThreads = kTiledThreads;
  static constexpr int kWarps = kThreads / 32;
  static constexpr int E = 16 / sizeof(T);
  static constexpr int NCH = KMAX / E;
  static constexpr int G = NCH < 32 ? NCH : 32;
  static constexpr int CPL = NCH / G;
  static constexpr int RPW = 32 / G;
  static constexpr int R = CPL >= 8 ? 1 : 8 / CPL;
  static constexpr int VT = R * kWarps * RPW;
  static_assert(VT == TiledTileRows(sizeof(T), KMAX), "the planner's tile rows (layout.h)");
  // Row of the tile held in slot i by warp `warp`, lane `lane`.
  static __device__ __forceinline__ int Row(int i, int warp, int lane) {
    return (i * kWarps + warp) * RPW + lane / G;
  }
  // First key channel of chunk ch held by lane `lane`.
  static __device__ __forceinline__ int Chan(int ch, int lane) { return (ch * G + lane % G) * E; }
};

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_COMMON_CUH_
