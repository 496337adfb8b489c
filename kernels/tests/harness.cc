#include "harness.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "../src/dtype.h"
#include "reference.h"

namespace replayssm::kernels::testing {

double StateTolerance(rssm_dtype dtype) {
  switch (dtype) {
    case RSSM_DTYPE_F32: return 2e-5;
    case RSSM_DTYPE_F16: return 2e-3;
    case RSSM_DTYPE_BF16: return 1.5e-2;
  }
  return 0.0;
}

double OutputTolerance(rssm_dtype state_dtype, rssm_dtype act_dtype) {
  double act = 2e-5;
  if (act_dtype == RSSM_DTYPE_F16) act = 1e-3;
  if (act_dtype == RSSM_DTYPE_BF16) act = 8e-3;
  return act + StateTolerance(state_dtype);
}

double StateTolerance(const Config& c) {
  return std::max(StateTolerance(c.state_dtype), StateTolerance(c.Ring()));
}

double OutputTolerance(const Config& c) {
  return std::max(OutputTolerance(c.state_dtype, c.act_dtype),
                  OutputTolerance(c.Ring(), c.act_dtype));
}

float Buffer::Get(int64_t i) const {
  return LoadAs(dtype_, &bytes_[i * rssm_dtype_size(dtype_)]);
}

void Buffer::Set(int64_t i, float v) { StoreAs(dtype_, v, &bytes_[i * rssm_dtype_size(dtype_)]); }

void Buffer::FillNaN() {
  for (int64_t i = 0; i < n_; ++i) Set(i, std::numeric_limits<float>::quiet_NaN());
}

std::string Config::Name() const {
  return std::string(gate == RSSM_GATE_GDN ? "gdn" : "kda") + "_s" + rssm_dtype_name(state_dtype) +
         (ring_dtype >= 0 ? std::string("_r") + rssm_dtype_name(ring_dtype) : "") + "_a" +
         rssm_dtype_name(act_dtype) + "_H" + std::to_string(h) + "_HV" + std::to_string(hv) + "_K" +
         std::to_string(k) + "_V" + std::to_string(v) + "_L" + std::to_string(l) +
         (l2norm ? "" : "_nonorm") + (round_beta ? "_rbeta" : "") + (long_memory ? "_long" : "") +
         (slot_pad ? "_strided" : "");
}

Layer::Layer(const Config& c, int slots, std::mt19937_64& rng) : cfg(c), num_slots(slots) {
  const int32_t ring_code =
      c.ring_dtype < 0 ? RSSM_RING_DTYPE_STATE : RSSM_RING_DTYPE_F32 + c.ring_dtype;
  shape = rssm_layer_shape{c.gate, c.h, c.hv, c.k, c.v, c.l, c.state_dtype, c.act_dtype, ring_code};
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int per_g = c.gate == RSSM_GATE_KDA ? c.k : 1;
  if (c.long_memory) {  // exp(a_log) 0.0025..0.05, softplus(a + dt_bias) ~0.02..0.3
    for (int h = 0; h < c.hv; ++h) a_log.push_back(-4.5f + 1.5f * u(rng));
    for (int i = 0; i < c.hv * per_g; ++i) dt_bias.push_back(-3.f + u(rng));
  } else {
    for (int h = 0; h < c.hv; ++h) a_log.push_back(-0.25f + 0.75f * u(rng));  // exp: 0.47..1.65
    for (int i = 0; i < c.hv * per_g; ++i) dt_bias.push_back(u(rng));
  }
  scale = 1.f / std::sqrt(static_cast<float>(c.k));
  cp_stride = int64_t{c.hv} * c.v * c.k + c.slot_pad;
  d_stride = int64_t{c.hv} * c.l * c.v + c.slot_pad;
  k_stride = int64_t{c.h} * c.l * c.k + c.slot_pad;
  g_stride = int64_t{c.hv} * c.l * per_g + c.slot_pad;
  checkpoint = Buffer(c.state_dtype, cp_stride * slots);
  ring_d = Buffer(c.Ring(), d_stride * slots);
  ring_k = Buffer(c.Ring(), k_stride * slots);
  ring_g.assign(g_stride * slots, std::numeric_limits<float>::quiet_NaN());
  checkpoint.FillNaN();
  ring_d.FillNaN();
  ring_k.FillNaN();
}

rssm_layer_params Layer::Params() const {
  return rssm_layer_params{a_log.data(), dt_bias.data(), scale, cfg.l2norm ? 1 : 0,
                           cfg.round_beta ? 1 : 0};
}

rssm_state_pool Layer::Pool() {
  const bool dense = cfg.slot_pad == 0;
  return rssm_state_pool{checkpoint.data(), ring_d.data(), ring_k.data(), ring_g.data(),
                         num_slots,         dense ? 0 : cp_stride,        dense ? 0 : d_stride,
                         dense ? 0 : k_stride, dense ? 0 : g_stride};
}

void Layer::RandomCheckpoint(int s, std::mt19937_64& rng) {
  std::normal_distribution<float> n(0.f, 0.3f);
  for (int64_t i = 0, e = int64_t{cfg.hv} * cfg.v * cfg.k; i < e; ++i) {
    checkpoint.Set(s * cp_stride + i, n(rng));
  }
}

std::vector<double> Layer::CheckpointState(int s) const {
  const int64_t e = int64_t{cfg.hv} * cfg.v * cfg.k;
  std::vector<double> st(e);
  for (int64_t i = 0; i < e; ++i) st[i] = checkpoint.Get(s * cp_stride + i);
  return st;
}

std::vector<double> Layer::LogicalState(int s, int w) const {
  std::vector<double> st = CheckpointState(s);
  const int per_g = cfg.gate == RSSM_GATE_KDA ? cfg.k : 1;
  const int group = cfg.hv / cfg.h;
  for (int h = 0; h < cfg.hv; ++h) {
    for (int j = 0; j < w; ++j) {
      const int64_t d0 = s * d_stride + (int64_t{h} * cfg.l + j) * cfg.v;
      const int64_t k0 = s * k_stride + (int64_t{h / group} * cfg.l + j) * cfg.k;
      const int64_t g0 = s * g_stride + (int64_t{h} * cfg.l + j) * per_g;
      for (int vi = 0; vi < cfg.v; ++vi) {
        for (int c = 0; c < cfg.k; ++c) {
          double& x = st[(int64_t{h} * cfg.v + vi) * cfg.k + c];
          const double alpha = std::exp(static_cast<double>(ring_g[g0 + (per_g > 1 ? c : 0)]));
          x = x * alpha + static_cast<double>(ring_d.Get(d0 + vi)) * ring_k.Get(k0 + c);
        }
      }
    }
  }
  return st;
}

std::vector<uint8_t> Layer::SlotBytes(int s) const {
  std::vector<uint8_t> out;
  auto append = [&](const void* base, int64_t stride, size_t es) {
    const uint8_t* p = static_cast<const uint8_t*>(base) + s * stride * es;
    out.insert(out.end(), p, p + stride * es);
  };
  append(checkpoint.data(), cp_stride, rssm_dtype_size(cfg.state_dtype));
  append(ring_d.data(), d_stride, rssm_dtype_size(cfg.Ring()));
  append(ring_k.data(), k_stride, rssm_dtype_size(cfg.Ring()));
  append(ring_g.data(), g_stride, 4);
  return out;
}

rssm_decode_args Layer::DecodeArgs(int32_t batch, const int32_t* slots, const int32_t* write_pos,
                                   const Tokens& tok, Buffer& out, const uint8_t* force_fold) {
  rssm_decode_args a{};
  a.launch = {RSSM_BACKEND_CPU, nullptr};
  a.shape = shape;
  a.params = Params();
  a.pool = Pool();
  a.batch = batch;
  a.slot_idx = slots;
  a.write_pos = write_pos;
  a.force_fold = force_fold;
  a.in = tok.Inputs();
  a.out = {out.data(), 0};
  return a;
}

rssm_verify_args Layer::VerifyArgs(int32_t batch, int32_t num_draft, const int32_t* slots,
                                   const int32_t* write_pos, const Tokens& tok, Buffer& out) {
  rssm_verify_args v{};
  v.launch = {RSSM_BACKEND_CPU, nullptr};
  v.shape = shape;
  v.params = Params();
  v.pool = Pool();
  v.batch = batch;
  v.num_draft = num_draft;
  v.slot_idx = slots;
  v.write_pos = write_pos;
  v.in = tok.Inputs();
  v.out = {out.data(), 0};
  return v;
}

rssm_prefill_args Layer::PrefillArgs(int32_t batch, const int32_t* slots,
                                     const int32_t* cu_seqlens, int32_t max_seqlen,
                                     const Tokens& tok, Buffer& out, const uint8_t* initial,
                                     const int32_t* write_pos) {
  rssm_prefill_args p{};
  p.launch = {RSSM_BACKEND_CPU, nullptr};
  p.shape = shape;
  p.params = Params();
  p.pool = Pool();
  p.batch = batch;
  p.slot_idx = slots;
  p.cu_seqlens = cu_seqlens;
  p.initial = initial;
  p.write_pos = write_pos;
  p.max_seqlen = max_seqlen;
  p.in = tok.Inputs();
  p.out = {out.data(), 0};
  return p;
}

Tokens::Tokens(const Layer& layer, int count, std::mt19937_64& rng) : n(count) {
  const Config& c = layer.cfg;
  const int64_t qkv_w = 2LL * c.h * c.k + int64_t{c.hv} * c.v;
  const int64_t a_w = c.gate == RSSM_GATE_KDA ? int64_t{c.hv} * c.k : c.hv;
  qkv = Buffer(c.act_dtype, qkv_w * count);
  a = Buffer(c.act_dtype, a_w * count);
  b = Buffer(c.act_dtype, int64_t{c.hv} * count);
  std::normal_distribution<float> nd(0.f, 1.f);
  // Without l2norm, keep |k| near 1 so the delta rule stays stable.
  const float qk_sd = c.l2norm ? 1.f : 1.f / std::sqrt(static_cast<float>(c.k));
  for (int t = 0; t < count; ++t) {
    for (int64_t i = 0; i < qkv_w; ++i) {
      const bool is_qk = i < 2LL * c.h * c.k;
      qkv.Set(t * qkv_w + i, nd(rng) * (is_qk ? qk_sd : 1.f));
    }
    for (int64_t i = 0; i < a_w; ++i) a.Set(t * a_w + i, nd(rng));
    for (int i = 0; i < c.hv; ++i) b.Set(int64_t{t} * c.hv + i, nd(rng));
    // Now and then v-head 0's gate input past softplus's cut (x > 20: softplus(x) = x): that
    // head forgets nearly all it held at that token.
    if (c.long_memory && t % 9 == 4) a.Set(t * a_w, 24.f + nd(rng));
  }
}

rssm_token_inputs Tokens::Inputs() const {
  return rssm_token_inputs{qkv.data(), a.data(), b.data(), 0, 0, 0};
}

void Tokens::CopyTokenTo(int i, Tokens& dst, int j) const {
  auto copy = [&](const Buffer& s, Buffer& d) {
    const int64_t w = s.size() / n;
    for (int64_t e = 0; e < w; ++e) d.Set(j * w + e, s.Get(i * w + e));
  };
  copy(qkv, dst.qkv);
  copy(a, dst.a);
  copy(b, dst.b);
}

void Reference::Step(std::vector<double>& st, const Tokens& tok, int i,
                     std::vector<double>& o) const {
  const Config& c = layer->cfg;
  auto token_of = [i](const Buffer& buf, int n) {
    std::vector<float> v(buf.size() / n);
    for (size_t e = 0; e < v.size(); ++e) v[e] = buf.Get(i * static_cast<int64_t>(v.size()) + e);
    return v;
  };
  const std::vector<float> qkv = token_of(tok.qkv, tok.n), a = token_of(tok.a, tok.n),
                           b = token_of(tok.b, tok.n);
  o.assign(int64_t{c.hv} * c.v, 0.0);
  ReferenceStep(layer->shape, layer->a_log.data(), layer->dt_bias.data(), layer->scale, c.l2norm,
                c.round_beta, qkv.data(), a.data(), b.data(), st.data(), o.data());
}

double RelErr(const std::vector<double>& x, const std::vector<double>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::isnan(x[i]) || std::isnan(ref[i])) return std::numeric_limits<double>::quiet_NaN();
    num += (x[i] - ref[i]) * (x[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

std::vector<double> OutputOf(const Buffer& out, int i, int hv, int v) {
  std::vector<double> o(int64_t{hv} * v);
  for (int64_t e = 0; e < static_cast<int64_t>(o.size()); ++e) o[e] = out.Get(i * o.size() + e);
  return o;
}

}  // namespace replayssm::kernels::testing
