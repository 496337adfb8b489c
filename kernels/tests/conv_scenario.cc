#include "conv_scenario.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../src/dtype.h"
#include "backend_buffer.h"

namespace replayssm::kernels::testing {
namespace {

struct SlotModel {
  std::vector<float> inputs;  // every committed input, [n, C] (already rounded)
  int w = 0;                  // cursor
};

}  // namespace

double ConvTolerance(rssm_dtype act_dtype) {
  // y is rounded once to the act dtype (half an ulp relative: bf16 2^-9, fp16 2^-12) after an
  // fp32 sum of <= 9 terms (~1e-6); the error is measured as |y - ref| / (1 + |ref|).
  if (act_dtype == RSSM_DTYPE_BF16) return 4e-3;
  if (act_dtype == RSSM_DTYPE_F16) return 5e-4;
  return 1e-5;
}

ConvResult RunConvScenario(const ConvConfig& cfg) {
  ConvResult res;
  std::mt19937_64 rng(cfg.seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int C = cfg.channels, W = cfg.width, H = W - 1, L = cfg.ring_len;
  const rssm_dtype dt = cfg.act_dtype;
  const size_t es = rssm_dtype_size(dt);
  const int S = 5;
  const int64_t wstride = int64_t{H} * C + cfg.slot_pad, rstride = int64_t{L} * C + cfg.slot_pad;
  std::vector<float> weight(static_cast<size_t>(C) * W), bias(C);
  for (float& v : weight) v = 0.5f * nd(rng);
  for (float& v : bias) v = 0.25f * nd(rng);
  std::vector<uint8_t> win_host(S * wstride * es), ring_host(S * rstride * es);
  // Garbage in every byte: zeros are not the only history (a fresh slot's window is zeroed by
  // its owner: here, by the first prefill from zeros or by a zeroed window).
  for (auto& b : win_host) b = static_cast<uint8_t>(rng() & 0x3f);
  for (auto& b : ring_host) b = static_cast<uint8_t>(rng() & 0x3f);
  std::vector<SlotModel> slots(S);
  for (int s = 0; s < S; ++s) {
    std::memset(win_host.data() + s * wstride * es, 0, static_cast<size_t>(H) * C * es);
  }
  BackendBuffer d_win(cfg.backend, win_host.size()), d_ring(cfg.backend, ring_host.size());
  BackendBuffer d_weight(cfg.backend, weight.size() * 4), d_bias(cfg.backend, bias.size() * 4);
  d_win.Put(win_host.data(), win_host.size());
  d_ring.Put(ring_host.data(), ring_host.size());
  d_weight.Put(weight.data(), weight.size() * 4);
  d_bias.Put(bias.data(), bias.size() * 4);
  const rssm_conv_shape shape{C, W, L, dt};
  const rssm_conv_state state{d_win.get(), d_ring.get(), S, wstride, rstride};

  // The expected output of an input appended to `seq` (fp64, zeros before the first).
  auto expect = [&](const std::vector<float>& seq, int64_t n, int c) {
    double acc = cfg.bias ? bias[c] : 0.0;
    for (int i = 0; i < W; ++i) {
      const int64_t t = n - H + i;  // token index; n is the new token's
      if (t >= 0) acc += double{weight[c * W + i]} * seq[t * C + c];
    }
    return acc / (1.0 + std::exp(-acc));
  };
  // The logical window of a slot from the backend's bytes: the last H of window ++ ring[0..w).
  auto check_state = [&](const std::vector<uint8_t>& win, const std::vector<uint8_t>& ring) {
    for (int s = 0; s < S; ++s) {
      const SlotModel& m = slots[s];
      const int64_t n = static_cast<int64_t>(m.inputs.size()) / C;
      for (int e = 0; e < H; ++e) {
        const int p = m.w + e;
        const int64_t t = n - H + e;
        for (int c = 0; c < C; ++c) {
          const uint8_t* src = p < H ? win.data() + (s * wstride + int64_t{p} * C + c) * es
                                     : ring.data() + (s * rstride + int64_t{p - H} * C + c) * es;
          const float got = LoadAs(dt, src);
          const float want = t >= 0 ? m.inputs[t * C + c] : 0.f;
          if (std::memcmp(&got, &want, 4) != 0 && !(got == 0.f && want == 0.f)) {
            ++res.state_mismatches;
          }
        }
      }
    }
  };

  for (int step = 0; step < cfg.steps && res.failure.empty(); ++step) {
    const int op = static_cast<int>(rng() % 5);  // 0,1 decode, 2 verify, 3 prefill, 4 fold
    // Rows: a random subset of slots in random order, plus a padding row.
    std::vector<int32_t> order(S);
    for (int s = 0; s < S; ++s) order[s] = s;
    std::shuffle(order.begin(), order.end(), rng);
    const int rows = 1 + static_cast<int>(rng() % S);
    std::vector<int32_t> idx(order.begin(), order.begin() + rows);
    idx.insert(idx.begin() + static_cast<int64_t>(rng() % (rows + 1)), -1);
    const int B = static_cast<int>(idx.size());
    std::vector<int32_t> pos(B, 0);
    std::vector<uint8_t> untouched_before_win = win_host, untouched_before_ring = ring_host;
    if (op == 4) {
      for (int r = 0; r < B; ++r) pos[r] = idx[r] < 0 ? 0 : slots[idx[r]].w;
      BackendBuffer d_idx(cfg.backend, B * 4), d_pos(cfg.backend, B * 4);
      d_idx.Put(idx.data(), B * 4);
      d_pos.Put(pos.data(), B * 4);
      const rssm_conv_fold_args f{{cfg.backend, nullptr},
                                  shape,
                                  state,
                                  B,
                                  static_cast<const int32_t*>(d_idx.get()),
                                  static_cast<const int32_t*>(d_pos.get())};
      if (rssm_conv_fold(&f) != RSSM_OK) res.failure = rssm_last_error();
      for (int32_t s : idx) {
        if (s >= 0) slots[s].w = 0;
      }
    } else {
      // Tokens per row: decode 1, verify T (room: w + T <= L, else fold the row first in the
      // model: the scenario folds on the host side by choosing rows with room), prefill 0..2L.
      int T = 1;
      if (op == 2) T = 1 + static_cast<int>(rng() % L);
      std::vector<int32_t> cu(B + 1, 0);
      std::vector<uint8_t> initial(B, 1);
      for (int r = 0; r < B; ++r) {
        int n = T;
        if (op == 3) {
          n = static_cast<int>(rng() % (2 * L + 1));
          initial[r] = static_cast<uint8_t>(rng() % 4 != 0);
        }
        if (idx[r] >= 0 && op != 3 && slots[idx[r]].w + T > L) {
          idx[r] = -1;  // no room: padding this time
        }
        pos[r] = idx[r] < 0 ? 0 : slots[idx[r]].w;
        cu[r + 1] = cu[r] + n;
      }
      const int64_t N = cu[B];
      int32_t longest = 0;
      for (int r = 0; r < B; ++r) longest = std::max(longest, cu[r + 1] - cu[r]);
      std::vector<float> xf(static_cast<size_t>(N) * C);
      std::vector<uint8_t> xb(N * C * es + 16), yb(N * C * es + 16);
      for (int64_t i = 0; i < N * C; ++i) {
        xf[i] = RoundAs(dt, nd(rng));
        StoreAs(dt, xf[i], xb.data() + i * es);
      }
      BackendBuffer d_x(cfg.backend, xb.size()), d_y(cfg.backend, yb.size());
      BackendBuffer d_idx(cfg.backend, B * 4), d_pos(cfg.backend, B * 4),
          d_cu(cfg.backend, (B + 1) * 4), d_init(cfg.backend, B);
      d_x.Put(xb.data(), xb.size());
      d_idx.Put(idx.data(), B * 4);
      d_pos.Put(pos.data(), B * 4);
      d_cu.Put(cu.data(), (B + 1) * 4);
      d_init.Put(initial.data(), B);
      rssm_conv_args a{};
      a.launch = {cfg.backend, nullptr};
      a.shape = shape;
      a.weight = static_cast<const float*>(d_weight.get());
      a.bias = cfg.bias ? static_cast<const float*>(d_bias.get()) : nullptr;
      a.state = state;
      a.mode = op == 3 ? RSSM_CONV_PREFILL : RSSM_CONV_APPEND;
      a.batch = B;
      a.slot_idx = static_cast<const int32_t*>(d_idx.get());
      a.write_pos = static_cast<const int32_t*>(d_pos.get());
      const bool varlen = op == 3 || rng() % 2 == 0;
      a.cu_seqlens = varlen ? static_cast<const int32_t*>(d_cu.get()) : nullptr;
      a.num_tokens = varlen ? longest : T;
      a.initial = op == 3 ? static_cast<const uint8_t*>(d_init.get()) : nullptr;
      a.x = d_x.get();
      a.y = d_y.get();
      if (rssm_short_conv(&a) != RSSM_OK) {
        res.failure = rssm_last_error();
        break;
      }
      const rssm_launch sync{cfg.backend, nullptr};
      rssm_synchronize(&sync);
      d_y.Get(yb.data(), yb.size());
      // Accepted tokens per row: decode all, verify a random n <= T, prefill all.
      for (int r = 0; r < B; ++r) {
        const int64_t t0 = cu[r], n = cu[r + 1] - cu[r];
        if (idx[r] < 0) {
          for (int64_t i = t0 * C; i < (t0 + n) * C; ++i) {
            if (LoadAs(dt, yb.data() + i * es) != 0.f) res.max_out_err = 1e9;
          }
          continue;
        }
        SlotModel& m = slots[idx[r]];
        std::vector<float> seq = (op == 3 && !initial[r]) ? std::vector<float>() : m.inputs;
        for (int64_t t = 0; t < n; ++t) {
          const int64_t at = static_cast<int64_t>(seq.size()) / C;
          seq.insert(seq.end(), xf.begin() + (t0 + t) * C, xf.begin() + (t0 + t + 1) * C);
          for (int c = 0; c < C; ++c) {
            const double want = expect(seq, at, c);
            const double got = LoadAs(dt, yb.data() + ((t0 + t) * C + c) * es);
            res.max_out_err =
                std::max(res.max_out_err, std::abs(got - want) / (1 + std::abs(want)));
            ++res.outputs;
          }
        }
        if (op == 3) {
          m.inputs = seq;
          m.w = 0;
        } else {
          const int64_t keep = op == 2 ? static_cast<int64_t>(rng() % (n + 1)) : n;
          m.inputs.insert(m.inputs.end(), xf.begin() + t0 * C, xf.begin() + (t0 + keep) * C);
          m.w += static_cast<int>(keep);
        }
      }
    }
    d_win.Get(win_host.data(), win_host.size());
    d_ring.Get(ring_host.data(), ring_host.size());
    check_state(win_host, ring_host);
    // Slots outside the call keep every byte.
    std::vector<bool> in_call(S, false);
    for (int32_t s : idx) {
      if (s >= 0) in_call[s] = true;
    }
    for (int s = 0; s < S; ++s) {
      if (in_call[s]) continue;
      for (int64_t i = s * wstride * int64_t(es); i < (s + 1) * wstride * int64_t(es); ++i) {
        if (win_host[i] != untouched_before_win[i]) ++res.untouched_violations;
      }
      for (int64_t i = s * rstride * int64_t(es); i < (s + 1) * rstride * int64_t(es); ++i) {
        if (ring_host[i] != untouched_before_ring[i]) ++res.untouched_violations;
      }
    }
  }
  return res;
}

void ConvSweep(int32_t backend, std::initializer_list<int> rings,
               std::initializer_list<int> channels, uint64_t seed) {
  for (rssm_dtype dt : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16}) {
    for (int width : {2, 4, 8}) {
      for (int ring : rings) {
        for (int c : channels) {
          ConvConfig cfg;
          cfg.backend = backend;
          cfg.act_dtype = dt;
          cfg.width = width;
          cfg.ring_len = ring;
          cfg.channels = c;
          cfg.bias = seed % 2 == 0;
          // Slots 8 elements apart (16-byte packs still fit), 1 apart (the kernels' element
          // path) or dense.
          cfg.slot_pad = seed % 3 == 0 ? 8 : seed % 3 == 1 ? 1 : 0;
          cfg.seed = seed++;
          const ConvResult r = RunConvScenario(cfg);
          SCOPED_TRACE(std::string(rssm_dtype_name(dt)) + " W=" + std::to_string(width) +
                       " L=" + std::to_string(ring) + " C=" + std::to_string(c));
          ASSERT_EQ(r.failure, "");
          EXPECT_GT(r.outputs, 0);
          EXPECT_LE(r.max_out_err, ConvTolerance(dt));
          EXPECT_EQ(r.state_mismatches, 0);
          EXPECT_EQ(r.untouched_violations, 0);
        }
      }
    }
  }
}

}  // namespace replayssm::kernels::testing
