// replayssm-kernels-demo: what this build will serve, and a short self-check.
//
// Prints the backends, the tiny-gdn demo layer and the bytes one slot costs, then runs a few
// replay decode steps next to the baseline on the best available backend's reference (CPU)
// and reports the largest difference. The gRPC server (replayssm-server) replaces this as
// the README's main job once it exists.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "replayssm/kernels.h"

namespace {

constexpr int kLayers = 4;  // tiny-gdn: 4 linear-attention layers
constexpr rssm_layer_shape kTinyGdn{RSSM_GATE_GDN, 2, 4, 64, 64, 8, RSSM_DTYPE_F32,
                                    RSSM_DTYPE_F32};

int Run() {
  std::printf("replayssm kernels (ABI %d)\n", RSSM_ABI_VERSION);
  std::printf("  backends: cpu=%s cuda=%s\n", rssm_backend_available(RSSM_BACKEND_CPU) ? "yes" : "no",
              rssm_backend_available(RSSM_BACKEND_CUDA) ? "yes" : "no");
  const rssm_layer_shape& s = kTinyGdn;
  std::printf("  model tiny-gdn: %d layers, gate=GDN H=%d HV=%d K=%d V=%d L=%d state=%s act=%s\n",
              kLayers, s.num_qk_heads, s.num_v_heads, s.head_k, s.head_v, s.ring_len,
              rssm_dtype_name(s.state_dtype), rssm_dtype_name(s.act_dtype));
  std::printf("  one slot costs %lld bytes per layer, %lld for the model\n",
              static_cast<long long>(rssm_slot_layer_bytes(&s)),
              static_cast<long long>(kLayers * rssm_slot_layer_bytes(&s)));

  // Two copies of one slot: the baseline keeps the full state, replay a checkpoint + ring.
  const int64_t cp = rssm_checkpoint_elems(&s);
  std::vector<float> base(cp), ckpt(cp), ring_d(rssm_ring_d_elems(&s)), ring_k(rssm_ring_k_elems(&s)),
      ring_g(rssm_ring_g_elems(&s)), a_log(s.num_v_heads, -0.5f), dt_bias(s.num_v_heads, 0.1f);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int width = 2 * s.num_qk_heads * s.head_k + s.num_v_heads * s.head_v;
  std::vector<float> qkv(width), a(s.num_v_heads), b(s.num_v_heads);
  std::vector<float> o_base(s.num_v_heads * s.head_v), o_replay(o_base.size());
  const int32_t slot = 0;
  int32_t w = 0;
  double worst = 0.0;
  const int steps = 3 * s.ring_len + 1;
  for (int step = 0; step < steps; ++step) {
    for (float& x : qkv) x = nd(rng);
    for (float& x : a) x = nd(rng);
    for (float& x : b) x = nd(rng);
    rssm_decode_args args{};
    args.launch = {RSSM_BACKEND_CPU, nullptr};
    args.shape = s;
    args.params = {a_log.data(), dt_bias.data(), 0.125f, 1};
    args.batch = 1;
    args.slot_idx = &slot;
    args.write_pos = &w;
    args.in = {qkv.data(), a.data(), b.data(), 0, 0, 0};
    args.pool = {base.data(), nullptr, nullptr, nullptr, 1, 0, 0, 0, 0};
    args.out = {o_base.data(), 0};
    if (rssm_baseline_decode(&args) != RSSM_OK) {
      std::fprintf(stderr, "baseline: %s\n", rssm_last_error());
      return 1;
    }
    args.pool = {ckpt.data(), ring_d.data(), ring_k.data(), ring_g.data(), 1, 0, 0, 0, 0};
    args.out = {o_replay.data(), 0};
    if (rssm_replay_decode(&args) != RSSM_OK) {
      std::fprintf(stderr, "replay: %s\n", rssm_last_error());
      return 1;
    }
    for (size_t i = 0; i < o_base.size(); ++i) {
      worst = std::fmax(worst, std::fabs(o_base[i] - o_replay[i]));
    }
    w = w + 1 >= s.ring_len ? 0 : w + 1;
  }
  std::printf("  self-check: %d decode steps, replay vs baseline max |diff| = %.3g (%s)\n", steps,
              worst, worst < 1e-4 ? "ok" : "MISMATCH");
  std::printf("the gRPC server (replayssm-server) is not built yet: see docs/ and the issues\n");
  return worst < 1e-4 ? 0 : 1;
}

}  // namespace

int main() { return Run(); }
