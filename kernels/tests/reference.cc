#include "reference.h"

#include <cmath>
#include <vector>

namespace replayssm::kernels::testing {

void ReferenceStep(const rssm_layer_shape& s, const float* a_log, const float* dt_bias,
                   double scale, bool l2norm, const float* qkv, const float* a, const float* b,
                   double* state, double* o) {
  const int K = s.head_k, V = s.head_v, H = s.num_qk_heads, HV = s.num_v_heads;
  const int group = HV / H;
  const int per_g = s.gate == RSSM_GATE_KDA ? K : 1;
  std::vector<double> q(K), k(K), alpha(K);
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
    for (int x = 0; x < K; ++x) {
      const int gi = h * per_g + (per_g > 1 ? x : 0);
      const double z = static_cast<double>(a[gi]) + dt_bias[gi];
      const double softplus = z > 20.0 ? z : std::log1p(std::exp(z));
      alpha[x] = std::exp(-std::exp(static_cast<double>(a_log[h])) * softplus);
    }
    const double beta = 1.0 / (1.0 + std::exp(-static_cast<double>(b[h])));
    for (int vi = 0; vi < V; ++vi) {
      double* row = state + (static_cast<long>(h) * V + vi) * K;
      double sk = 0.0;
      for (int x = 0; x < K; ++x) {
        row[x] *= alpha[x];
        sk += row[x] * k[x];
      }
      const double d = beta * (static_cast<double>(qkv[2 * H * K + h * V + vi]) - sk);
      double sq = 0.0;
      for (int x = 0; x < K; ++x) {
        row[x] += d * k[x];
        sq += row[x] * q[x];
      }
      o[static_cast<long>(h) * V + vi] = sq;
    }
  }
}

}  // namespace replayssm::kernels::testing
