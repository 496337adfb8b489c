// The per-(row, v-head) arithmetic of the CPU backend, in fp32. One token's step, the fold,
// and the loading of records and activations. Every CPU operation (replay, baseline, fold,
// prefill, verify) is built from these functions, so they share one arithmetic order: a
// baseline step IS a replay step with no records that folds.
#ifndef REPLAYSSM_KERNELS_CPU_HEAD_MATH_H_
#define REPLAYSSM_KERNELS_CPU_HEAD_MATH_H_

#include <cmath>
#include <cstdint>
#include <vector>

#include "../src/dtype.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels::cpu {

// Dimensions of one head.
struct HeadDims {
  int k;       // K
  int v;       // V
  int l;       // L
  bool kda;    // g per key channel
  int32_t ring = RSSM_DTYPE_F32;  // rssm_dtype of the records' d and k
};

// fp32 copies of a head's records 0..n-1, as stored (already rounded to the ring dtype).
// g is expanded to K values per record for GDN as well.
struct Records {
  std::vector<float> d;  // [L, V]
  std::vector<float> k;  // [L, K]
  std::vector<float> g;  // [L, K]
  int n = 0;
  void Reserve(const HeadDims& h, int capacity) {
    d.resize(static_cast<size_t>(capacity) * h.v);
    k.resize(static_cast<size_t>(capacity) * h.k);
    g.resize(static_cast<size_t>(capacity) * h.k);
  }
};

// One token's inputs for one v-head, in fp32: q and k normalized and scaled, g expanded.
struct TokenHead {
  std::vector<float> q, k, v, g;  // [K], [K], [V], [K]
  float beta = 0.f;
};

// Scratch for one step: weights and contractions.
struct StepScratch {
  std::vector<float> a_k, a_q;  // [K]: A∘k, A∘q
  std::vector<float> a;         // [K]: A = exp(sum of g)
  std::vector<float> wk;        // [L, K]: W_j ∘ k_j
  std::vector<float> u, p;      // [L]: (W_j∘k_j)·k, (W_j∘k_j)·q
  std::vector<float> dr, kr;    // [V], [K]: a folding step's d and k as the ring would hold them
  void Reserve(const HeadDims& h) {
    dr.resize(h.v);
    kr.resize(h.k);
    a_k.resize(h.k);
    a_q.resize(h.k);
    a.resize(h.k);
    wk.resize(static_cast<size_t>(h.l + 1) * h.k);
    u.resize(h.l + 1);
    p.resize(h.l + 1);
  }
};

// Sum of a[i] * b[i] in a fixed order (four interleaved partial sums, then combined).
inline float Dot(const float* a, const float* b, int n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  for (int i = 0; i < n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  return (s0 + s1) + (s2 + s3);
}

inline float Softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }
inline float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }

// x <- x / sqrt(sum x^2 + 1e-6).
inline void L2Normalize(float* x, int n) {
  const float inv = 1.f / std::sqrt(Dot(x, x, n) + 1e-6f);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

// Weights for a token with decay g_t after records 0..n-1 (all [K]): wk[j] = W_j ∘ k_j with
// W_j = exp(g_{j+1} + ... + g_{n-1} + g_t), and A = exp(g_0 + ... + g_{n-1} + g_t),
// the sums taken from the newest record backwards.
inline void Weights(const HeadDims& h, const Records& r, const float* g_t, StepScratch& s) {
  for (int c = 0; c < h.k; ++c) {
    float acc = g_t[c];
    for (int j = r.n - 1; j >= 0; --j) {
      s.wk[static_cast<size_t>(j) * h.k + c] = std::exp(acc) * r.k[static_cast<size_t>(j) * h.k + c];
      acc += r.g[static_cast<size_t>(j) * h.k + c];
    }
    s.a[c] = std::exp(acc);
  }
}

// state[v,c] <- state[v,c]·A[c] + Σ_j d_j[v]·(W_j∘k_j)[c] (+ d_t[v]·k_t[c] when given), with
// A and W_j∘k_j already in `s` (Weights). In place: each element depends only on itself.
inline void FoldInto(const HeadDims& h, float* state, const Records& r, const StepScratch& s,
                     const float* d_t, const float* k_t) {
  for (int vi = 0; vi < h.v; ++vi) {
    float* row = state + static_cast<size_t>(vi) * h.k;
    for (int c = 0; c < h.k; ++c) {
      float acc = row[c] * s.a[c];
      for (int j = 0; j < r.n; ++j) {
        acc += r.d[static_cast<size_t>(j) * h.v + vi] * s.wk[static_cast<size_t>(j) * h.k + c];
      }
      row[c] = d_t != nullptr ? acc + d_t[vi] * k_t[c] : acc;
    }
  }
}

// One token on one head. `state` [V, K] fp32 is S0; `r` the records since it. Writes the
// output o [V] and the record's d [V] (unrounded). When `fold`, state becomes
// S0·diag(A) + Σ_j d_j (W_j∘k_j)ᵀ + R(d) R(k)ᵀ (FoldInto): the token's own record enters the
// state as the ring would hold it (R: rounded to the ring dtype), like every record before it.
inline void StepHead(const HeadDims& h, float* state, const Records& r, const TokenHead& t,
                     bool fold, StepScratch& s, float* o, float* d) {
  Weights(h, r, t.g.data(), s);
  for (int c = 0; c < h.k; ++c) {
    s.a_k[c] = s.a[c] * t.k[c];
    s.a_q[c] = s.a[c] * t.q[c];
  }
  for (int j = 0; j < r.n; ++j) {
    const float* wk = &s.wk[static_cast<size_t>(j) * h.k];
    s.u[j] = Dot(wk, t.k.data(), h.k);
    s.p[j] = Dot(wk, t.q.data(), h.k);
  }
  const float kq = Dot(t.k.data(), t.q.data(), h.k);
  for (int vi = 0; vi < h.v; ++vi) {
    const float* row = state + static_cast<size_t>(vi) * h.k;
    float sk = Dot(row, s.a_k.data(), h.k);
    float sq = Dot(row, s.a_q.data(), h.k);
    for (int j = 0; j < r.n; ++j) {
      const float dj = r.d[static_cast<size_t>(j) * h.v + vi];
      sk += dj * s.u[j];
      sq += dj * s.p[j];
    }
    d[vi] = t.beta * (t.v[vi] - sk);
    o[vi] = sq + d[vi] * kq;
  }
  if (fold) {
    for (int vi = 0; vi < h.v; ++vi) s.dr[vi] = RoundAs(h.ring, d[vi]);
    for (int c = 0; c < h.k; ++c) s.kr[c] = RoundAs(h.ring, t.k[c]);
    FoldInto(h, state, r, s, s.dr.data(), s.kr.data());
  }
}

// Folds records 0..n-1 into `state` with no new token (fold op, prefill's initial state).
inline void FoldRecords(const HeadDims& h, float* state, const Records& r, StepScratch& s) {
  if (r.n == 0) return;
  const std::vector<float> zero(h.k, 0.f);  // no current token: g_t = 0, weight 1
  Weights(h, r, zero.data(), s);
  FoldInto(h, state, r, s, nullptr, nullptr);
}

}  // namespace replayssm::kernels::cpu

#endif  // REPLAYSSM_KERNELS_CPU_HEAD_MATH_H_
