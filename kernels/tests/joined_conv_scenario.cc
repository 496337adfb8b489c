#include "joined_conv_scenario.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "../src/dtype.h"
#include "backend_buffer.h"

namespace replayssm::kernels::testing {
namespace {

// One copy of a layer's recurrent and convolution state on the backend.
struct State {
  State(int32_t backend, const Layer& l, const std::vector<uint8_t>& win,
        const std::vector<uint8_t>& rx)
      : cp(backend, l.checkpoint.bytes().size(), l.checkpoint.data()),
        rd(backend, l.ring_d.bytes().size(), l.ring_d.data()),
        rk(backend, l.ring_k.bytes().size(), l.ring_k.data()),
        rg(backend, l.ring_g.size() * 4, l.ring_g.data()),
        window(backend, win.size(), win.data()),
        ring_x(backend, rx.size(), rx.data()) {}
  BackendBuffer cp, rd, rk, rg, window, ring_x;
};

}  // namespace

JoinedConvResult RunJoinedConvScenario(const JoinedConvConfig& fc, const DecodeFn& decode) {
  JoinedConvResult res;
  const Config& c = fc.layer;
  const int32_t be = fc.backend;
  std::mt19937_64 rng(fc.seed);
  const int S = 5, W = fc.width, L = c.l;
  Layer layer(c, S, rng);
  for (int s = 0; s < S; ++s) layer.RandomCheckpoint(s, rng);
  const int64_t C = 2LL * c.h * c.k + int64_t{c.hv} * c.v;
  const size_t es = rssm_dtype_size(c.act_dtype);
  const int64_t wstride = (W - 1) * C + c.slot_pad, rstride = L * C + c.slot_pad;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint8_t> win(S * wstride * es), rx(S * rstride * es);
  for (int64_t i = 0; i < S * wstride; ++i) StoreAs(c.act_dtype, nd(rng), win.data() + i * es);
  for (auto& b : rx) b = static_cast<uint8_t>(rng() & 0x3f);  // garbage past the cursors
  std::vector<float> weight(C * W), bias(C);
  for (float& v : weight) v = 0.5f * nd(rng);
  for (float& v : bias) v = 0.25f * nd(rng);
  const std::vector<float> a_log = layer.a_log, dt_bias = layer.dt_bias;
  BackendBuffer d_weight(be, weight.size() * 4, weight.data()),
      d_bias(be, bias.size() * 4, bias.data());
  BackendBuffer d_alog(be, a_log.size() * 4, a_log.data()),
      d_dt(be, dt_bias.size() * 4, dt_bias.data());
  State sep(be, layer, win, rx), joined(be, layer, win, rx);  // the two paths' states
  const bool dense = c.slot_pad == 0;
  auto pool = [&](State& st) {
    return rssm_state_pool{st.cp.as<void>(),
                           st.rd.as<void>(),
                           st.rk.as<void>(),
                           st.rg.as<float>(),
                           S,
                           dense ? 0 : layer.cp_stride,
                           dense ? 0 : layer.d_stride,
                           dense ? 0 : layer.k_stride,
                           dense ? 0 : layer.g_stride};
  };
  auto conv_state = [&](State& st) {
    return rssm_conv_state{st.window.as<void>(), st.ring_x.as<void>(), S, wstride, rstride};
  };
  const rssm_layer_params params{d_alog.as<const float>(), d_dt.as<const float>(), layer.scale,
                                 c.l2norm ? 1 : 0};
  const float* biasp = fc.bias ? d_bias.as<const float>() : nullptr;
  std::vector<int> cursor(S, 0);
  const rssm_launch launch{be, nullptr};
  for (int step = 0; step < fc.steps && res.failure.empty(); ++step) {
    // A random subset of slots in random order, with a padding row somewhere.
    std::vector<int32_t> idx(S);
    for (int s = 0; s < S; ++s) idx[s] = s;
    std::shuffle(idx.begin(), idx.end(), rng);
    idx.resize(1 + rng() % S);
    idx.insert(idx.begin() + static_cast<int64_t>(rng() % (idx.size() + 1)), -1);
    const int B = static_cast<int>(idx.size());
    std::vector<int32_t> pos(B, 0);
    std::vector<uint8_t> force(B, 0);
    for (int r = 0; r < B; ++r) {
      if (idx[r] < 0) continue;
      pos[r] = cursor[idx[r]];
      force[r] = static_cast<uint8_t>(rng() % 8 == 0);
    }
    Tokens tok(layer, B, rng);
    BackendBuffer d_idx(be, B * 4, idx.data()), d_pos(be, B * 4, pos.data()),
        d_force(be, B, force.data());
    BackendBuffer d_qkv(be, tok.qkv.bytes().size(), tok.qkv.data());
    BackendBuffer d_a(be, tok.a.bytes().size(), tok.a.data()),
        d_b(be, tok.b.bytes().size(), tok.b.data());
    BackendBuffer d_y(be, B * C * es, nullptr), d_y_joined(be, B * C * es, nullptr);
    BackendBuffer o_sep(be, B * c.hv * c.v * es, nullptr),
        o_joined(be, B * c.hv * c.v * es, nullptr);
    auto args = [&](State& st, const void* qkv, BackendBuffer& o) {
      rssm_decode_args a{};
      a.launch = launch;
      a.shape = layer.shape;
      a.params = params;
      a.pool = pool(st);
      a.batch = B;
      a.slot_idx = d_idx.as<const int32_t>();
      a.write_pos = d_pos.as<const int32_t>();
      a.force_fold = d_force.as<const uint8_t>();
      a.in = {qkv, d_a.as<void>(), d_b.as<void>(), 0, 0, 0};
      a.out = {o.as<void>(), 0};
      return a;
    };
    // The separate path: rssm_short_conv (APPEND) into y, then the step on y.
    rssm_conv_args ca{};
    ca.launch = launch;
    ca.shape = {static_cast<int32_t>(C), W, L, c.act_dtype};
    ca.weight = d_weight.as<const float>();
    ca.bias = biasp;
    ca.state = conv_state(sep);
    ca.mode = RSSM_CONV_APPEND;
    ca.batch = B;
    ca.slot_idx = d_idx.as<const int32_t>();
    ca.write_pos = d_pos.as<const int32_t>();
    ca.num_tokens = 1;
    ca.x = d_qkv.as<void>();
    ca.y = d_y.as<void>();
    rssm_decode_args as = args(sep, d_y.as<void>(), o_sep);
    if (rssm_short_conv(&ca) != RSSM_OK || decode(&as) != RSSM_OK) {
      res.failure = std::string("separate: ") + rssm_last_error();
      break;
    }
    // The joined call on the raw inputs.
    const rssm_decode_conv conv{W, d_weight.as<const float>(), biasp, conv_state(joined),
                                d_y_joined.as<void>()};
    rssm_decode_args af = args(joined, d_qkv.as<void>(), o_joined);
    af.conv = &conv;
    if (decode(&af) != RSSM_OK) {
      res.failure = std::string("joined: ") + rssm_last_error();
      break;
    }
    // Rows that folded (w + 1 >= L or forced): both paths fold the window (w + 1 inputs).
    std::vector<int32_t> fidx, fpos;
    for (int r = 0; r < B; ++r) {
      if (idx[r] < 0) continue;
      int& w = cursor[idx[r]];
      if (w + 1 >= L || force[r]) {
        fidx.push_back(idx[r]);
        fpos.push_back(w + 1);
        w = 0;
      } else {
        ++w;
      }
    }
    if (!fidx.empty()) {
      BackendBuffer d_fidx(be, fidx.size() * 4, fidx.data()),
          d_fpos(be, fpos.size() * 4, fpos.data());
      for (State* st : {&sep, &joined}) {
        const rssm_conv_fold_args f{launch,
                                    ca.shape,
                                    conv_state(*st),
                                    static_cast<int32_t>(fidx.size()),
                                    d_fidx.as<const int32_t>(),
                                    d_fpos.as<const int32_t>()};
        if (rssm_conv_fold(&f) != RSSM_OK) res.failure = rssm_last_error();
      }
    }
    ++res.steps;
    res.outputs += B;
    if (o_sep.Bytes() != o_joined.Bytes() || d_y.Bytes() != d_y_joined.Bytes()) {
      ++res.output_mismatches;
    }
    const std::vector<uint8_t> o = o_joined.Bytes();
    for (int r = 0; r < B; ++r) {
      if (idx[r] >= 0) continue;
      for (int64_t i = 0; i < int64_t{c.hv} * c.v; ++i) {
        if (LoadAs(c.act_dtype, o.data() + (r * c.hv * c.v + i) * es) != 0.f) {
          ++res.output_mismatches;  // a padding row's outputs are zeros
          break;
        }
      }
    }
    for (auto [a, b] :
         {std::pair{&sep.cp, &joined.cp}, std::pair{&sep.rd, &joined.rd},
          std::pair{&sep.rk, &joined.rk}, std::pair{&sep.rg, &joined.rg},
          std::pair{&sep.window, &joined.window}, std::pair{&sep.ring_x, &joined.ring_x}}) {
      if (a->Bytes() != b->Bytes()) ++res.state_mismatches;
    }
  }
  return res;
}

void JoinedConvSweep(int32_t backend, const DecodeFn& decode, uint64_t seed) {
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (rssm_dtype state : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16}) {
      for (rssm_dtype act : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16}) {
        for (int width : {2, 4, 8}) {
          JoinedConvConfig fc;
          fc.backend = backend;
          fc.layer.gate = gate;
          fc.layer.state_dtype = state;
          fc.layer.act_dtype = act;
          fc.layer.l = seed % 2 == 0 ? 8 : 4;
          fc.layer.slot_pad = seed % 3 == 0 ? 1 : 0;
          fc.width = width;
          fc.bias = seed % 2 == 1;
          fc.seed = seed++;
          SCOPED_TRACE(fc.layer.Name() + " W=" + std::to_string(width) + (fc.bias ? " bias" : ""));
          const JoinedConvResult r = RunJoinedConvScenario(fc, decode);
          ASSERT_EQ(r.failure, "");
          EXPECT_EQ(r.steps, fc.steps);
          EXPECT_EQ(r.output_mismatches, 0);
          EXPECT_EQ(r.state_mismatches, 0);
        }
      }
    }
  }
}

}  // namespace replayssm::kernels::testing
