#include "reference.h"

#include <cmath>
#include <vector>

#include "../src/dtype.h"

namespace replayssm::kernels::testing {

void ReferenceStep(const rssm_layer_shape& s, const float* a_log, const float* dt_bias,
                   double scale, bool l2norm, bool round_beta, const float* qkv, const float* a,
                   const float* b, double* state, double* o) {
  const int K = s.head_k, V = s.head_v, H = s.num_qk_heads, HV = s.num_v_heads;
  const int group = HV / H;
  const int per_g = s.gate == RSSM_GATE_KDA ? K : 1;
  const int32_t ring = rssm_ring_storage_dtype(&s);
  auto as_stored = [ring](double x) {
    return ring == RSSM_DTYPE_F32 ? x : RoundAs(ring, static_cast<float>(x));
  };
  std::vector<double> q(K), k(K), kr(K), alpha(K);
  for (int h = 0; h < HV; ++h) {
    const int hq = h / group;
    for (int x = 0; x < K; ++x) {
      q[x] = qkv[hq * K + x];
      k[x] = qkv[(H + hq) * K + x];
    }
    if (l2norm) {
      for (auto* vec : {&q, &k}) {
        double ss = 1e-6;
        for (double x : *vec) ss += x * x;
        for (double& x : *vec) x /= std::sqrt(ss);
      }
    }
    for (double& x : q) x *= scale;
    for (int x = 0; x < K; ++x) kr[x] = as_stored(k[x]);
    double kq = 0.0;
    for (int x = 0; x < K; ++x) kq += k[x] * q[x];
    for (int x = 0; x < K; ++x) {
      const int gi = h * per_g + (per_g > 1 ? x : 0);
      const double z = static_cast<double>(a[gi]) + dt_bias[gi];
      const double softplus = z > 20.0 ? z : std::log1p(std::exp(z));
      alpha[x] = std::exp(-std::exp(static_cast<double>(a_log[h])) * softplus);
    }
    double beta = 1.0 / (1.0 + std::exp(-static_cast<double>(b[h])));
    if (round_beta) beta = RoundAs(s.act_dtype, static_cast<float>(beta));
    for (int vi = 0; vi < V; ++vi) {
      double* row = state + (static_cast<long>(h) * V + vi) * K;
      double sk = 0.0;
      for (int x = 0; x < K; ++x) {
        row[x] *= alpha[x];
        sk += row[x] * k[x];
      }
      const double d = beta * (static_cast<double>(qkv[2 * H * K + h * V + vi]) - sk);
      const double dr = as_stored(d);
      double sq = 0.0;
      for (int x = 0; x < K; ++x) {
        sq += row[x] * q[x];
        row[x] += dr * kr[x];
      }
      o[static_cast<long>(h) * V + vi] = sq + d * kq;  // S'q + d (k.q)
    }
  }
}

}  // namespace replayssm::kernels::testing
