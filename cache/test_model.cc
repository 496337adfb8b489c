#include "test_model.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "../kernels/src/dtype.h"
#include "reference.h"

namespace replayssm::cache::testing {
namespace {

using kernels::Bf16;
using kernels::F16;

using kernels::LoadAs;
using kernels::RoundAs;
using kernels::StoreAs;

}  // namespace

void Oracle::Inputs(Tok t, int layer, std::vector<float>& qkv, std::vector<float>& a,
                    std::vector<float>& b) const {
  std::mt19937_64 rng((static_cast<uint64_t>(t.id) * 0x9E3779B97F4A7C15ULL) ^
                      (static_cast<uint64_t>(t.pos) << 20) ^ static_cast<uint64_t>(layer));
  std::normal_distribution<float> nd(0.f, 1.f);
  const int32_t dt = m_.shape.act_dtype;
  qkv.resize(m_.QkvWidth());
  a.resize(m_.AWidth());
  b.resize(m_.BWidth());
  for (float& x : qkv) x = RoundAs(dt, nd(rng));
  for (float& x : a) x = RoundAs(dt, nd(rng));
  for (float& x : b) x = RoundAs(dt, nd(rng));
}

Batch Oracle::MakeBatch(const std::vector<Tok>& toks) const {
  const int32_t dt = m_.shape.act_dtype;
  const size_t es = rssm_dtype_size(dt);
  const int64_t n = static_cast<int64_t>(toks.size());
  Batch batch;
  batch.qkv.resize(m_.num_layers);
  batch.a.resize(m_.num_layers);
  batch.b.resize(m_.num_layers);
  batch.out.resize(m_.num_layers);
  std::vector<float> qkv, a, b;
  for (int l = 0; l < m_.num_layers; ++l) {
    batch.qkv[l].resize(n * m_.QkvWidth() * es);
    batch.a[l].resize(n * m_.AWidth() * es);
    batch.b[l].resize(n * m_.BWidth() * es);
    batch.out[l].assign(n * m_.OutWidth() * es, 0xff);  // poison: NaN in every dtype
    for (int64_t i = 0; i < n; ++i) {
      Inputs(toks[i], l, qkv, a, b);
      for (size_t e = 0; e < qkv.size(); ++e) StoreAs(dt, qkv[e], &batch.qkv[l][(i * qkv.size() + e) * es]);
      for (size_t e = 0; e < a.size(); ++e) StoreAs(dt, a[e], &batch.a[l][(i * a.size() + e) * es]);
      for (size_t e = 0; e < b.size(); ++e) StoreAs(dt, b[e], &batch.b[l][(i * b.size() + e) * es]);
    }
  }
  for (int l = 0; l < m_.num_layers; ++l) {
    batch.io.push_back(LayerIo{batch.qkv[l].data(), batch.a[l].data(), batch.b[l].data(),
                               batch.out[l].data()});
  }
  return batch;
}

std::vector<double> Batch::Output(const ModelSpec& m, int layer, int64_t i) const {
  const int32_t dt = m.shape.act_dtype;
  const size_t es = rssm_dtype_size(dt);
  std::vector<double> o(m.OutWidth());
  for (size_t e = 0; e < o.size(); ++e) o[e] = LoadAs(dt, &out[layer][(i * o.size() + e) * es]);
  return o;
}

Oracle::State Oracle::Zero() const {
  const int64_t window = m_.conv_width > 0 ? (m_.conv_width - 1) * m_.QkvWidth() : 0;
  return State(m_.num_layers, std::vector<double>(rssm_checkpoint_elems(&m_.shape) + window, 0.0));
}

void Oracle::Convolve(std::vector<double>& window, int layer, std::vector<float>& qkv) const {
  // y = silu(bias + sum_i weight[c, i] * x[t - W + 1 + i]) in fp64, rounded to the act dtype
  // (where the model rounds it); the window then slides by the (pre-convolution) input.
  const int64_t C = m_.QkvWidth();
  const int W = m_.conv_width, H = W - 1;
  const LayerParams& p = m_.layers[layer];
  for (int64_t c = 0; c < C; ++c) {
    double acc = p.conv_bias.empty() ? 0.0 : p.conv_bias[c];
    for (int i = 0; i < H; ++i) acc += double{p.conv_weight[c * W + i]} * window[i * C + c];
    acc += double{p.conv_weight[c * W + H]} * qkv[c];
    const double y = acc / (1.0 + std::exp(-acc));
    for (int i = 0; i + 1 < H; ++i) window[i * C + c] = window[(i + 1) * C + c];
    window[(H - 1) * C + c] = qkv[c];
    qkv[c] = RoundAs(m_.shape.act_dtype, static_cast<float>(y));
  }
}

Oracle::Outputs Oracle::Step(State& s, Tok t) const {
  Outputs out(m_.num_layers, std::vector<double>(m_.OutWidth()));
  std::vector<float> qkv, a, b;
  const int64_t ckpt = rssm_checkpoint_elems(&m_.shape);
  for (int l = 0; l < m_.num_layers; ++l) {
    Inputs(t, l, qkv, a, b);
    if (m_.conv_width > 0) {
      std::vector<double> window(s[l].begin() + ckpt, s[l].end());
      Convolve(window, l, qkv);
      std::copy(window.begin(), window.end(), s[l].begin() + ckpt);
    }
    const LayerParams& p = m_.layers[l];
    kernels::testing::ReferenceStep(m_.shape, p.a_log.data(), p.dt_bias.data(), p.scale,
                                    p.use_qk_l2norm, m_.round_beta, qkv.data(), a.data(), b.data(),
                                    s[l].data(), out[l].data());
  }
  return out;
}

Oracle::State Oracle::Run(const std::vector<int32_t>& tokens, int64_t n) const {
  State s = Zero();
  for (int64_t i = 0; i < n; ++i) Step(s, Tok{tokens[i], i});
  return s;
}

Oracle::State Oracle::FromExport(const ExportedState& e) const {
  State s = Zero();
  const int32_t dt = m_.shape.state_dtype;
  const size_t es = rssm_dtype_size(dt);
  const int64_t ckpt = rssm_checkpoint_elems(&m_.shape);
  const size_t as = rssm_dtype_size(m_.shape.act_dtype);
  for (int l = 0; l < m_.num_layers; ++l) {
    for (int64_t i = 0; i < ckpt; ++i) s[l][i] = LoadAs(dt, &e.checkpoints[l][i * es]);
    // The conv window follows the checkpoint (act dtype).
    for (size_t i = ckpt; i < s[l].size(); ++i) {
      s[l][i] = LoadAs(m_.shape.act_dtype, &e.checkpoints[l][ckpt * es + (i - ckpt) * as]);
    }
  }
  return s;
}

BackendBatch::BackendBatch(int32_t b, const Batch& host) : backend(b) {
  const rssm_launch l{backend, nullptr};
  auto copy_of = [&](const std::vector<uint8_t>& v) {
    void* p = nullptr;
    if (rssm_alloc(backend, v.size(), &p) != RSSM_OK ||
        rssm_memcpy(&l, p, v.data(), v.size(), RSSM_COPY_HOST_TO_DEVICE) != RSSM_OK) {
      std::fprintf(stderr, "BackendBatch: %s\n", rssm_last_error());
      std::abort();
    }
    buffers.push_back(p);
    return p;
  };
  for (size_t i = 0; i < host.io.size(); ++i) {
    LayerIo io;
    io.mixed_qkv = copy_of(host.qkv[i]);
    io.a = copy_of(host.a[i]);
    io.b = copy_of(host.b[i]);
    io.out = copy_of(host.out[i]);
    io.memory = IoMemory::kBackend;
    this->io.push_back(io);
  }
  rssm_synchronize(&l);
}

namespace {
void CheckedCall(rssm_status s, const char* what) {
  if (s == RSSM_OK) return;
  std::fprintf(stderr, "BackendWords: %s: %s\n", what, rssm_last_error());
  std::abort();
}
}  // namespace

BackendWords::BackendWords(int32_t backend, size_t n) : backend_(backend), n_(n) {
  CheckedCall(rssm_alloc(backend, n * 4, &p_), "alloc");
  Fill(0);
}

BackendWords::~BackendWords() { rssm_free(backend_, p_); }

void BackendWords::Fill(uint32_t v, size_t from, size_t to) {
  std::vector<uint32_t> w = Read();
  for (size_t i = from; i < std::min(to, n_); ++i) w[i] = v;
  const rssm_launch l{backend_, nullptr};
  CheckedCall(rssm_memcpy(&l, p_, w.data(), n_ * 4, RSSM_COPY_HOST_TO_DEVICE), "copy in");
  CheckedCall(rssm_synchronize(&l), "synchronize");
}

std::vector<uint32_t> BackendWords::Read() const {
  std::vector<uint32_t> w(n_);
  const rssm_launch l{backend_, nullptr};
  CheckedCall(rssm_memcpy(&l, w.data(), p_, n_ * 4, RSSM_COPY_DEVICE_TO_HOST), "copy out");
  CheckedCall(rssm_synchronize(&l), "synchronize");
  return w;
}

BackendBatch::~BackendBatch() {
  for (void* p : buffers) rssm_free(backend, p);
}

void BackendBatch::CopyOutputsTo(Batch& host) const {
  const rssm_launch l{backend, nullptr};
  for (size_t i = 0; i < io.size(); ++i) {
    rssm_memcpy(&l, host.out[i].data(), io[i].out, host.out[i].size(), RSSM_COPY_DEVICE_TO_HOST);
  }
  rssm_synchronize(&l);
}

void BackendBatch::CopyInputsFrom(const Batch& host) {
  const rssm_launch l{backend, nullptr};
  for (size_t i = 0; i < io.size(); ++i) {
    rssm_memcpy(&l, const_cast<void*>(io[i].mixed_qkv), host.qkv[i].data(), host.qkv[i].size(),
                RSSM_COPY_HOST_TO_DEVICE);
    rssm_memcpy(&l, const_cast<void*>(io[i].a), host.a[i].data(), host.a[i].size(),
                RSSM_COPY_HOST_TO_DEVICE);
    rssm_memcpy(&l, const_cast<void*>(io[i].b), host.b[i].data(), host.b[i].size(),
                RSSM_COPY_HOST_TO_DEVICE);
  }
  rssm_synchronize(&l);
}

ModelSpec TwoLayerTinyGdn(int32_t ring) {
  absl::StatusOr<ModelSpec> m = ModelPreset("tiny-gdn", RSSM_DTYPE_F32, ring);
  if (!m.ok()) std::abort();  // a preset of the repository: never
  m->num_layers = 2;
  m->layers.resize(2);
  return *std::move(m);
}

CacheOptions TestOptions(const ModelSpec& m, int64_t slots) {
  CacheOptions o;
  o.backend = TestBackend();
  o.memory_budget_bytes = slots * m.SlotBytes();
  return o;
}

int32_t TestBackend() {
  const char* env = std::getenv("REPLAYSSM_TEST_BACKEND");
  const bool cuda = env != nullptr && std::string(env) == "cuda";
  // The server's 32 work queues (service/main.cc), set before CUDA starts (the tests ask for
  // the backend first). With CUDA's 8, TpGroupTest's ReleaseWaitsNamesTheEarliestUnrungWait-
  // OfAnyRank never ended in two H100 runs of 2026-12-06 (its release's ring stopped behind
  // the unrung waits); at 32 it passed. Once: other threads read the environment meanwhile.
  static const bool queues_set = cuda && setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0) == 0;
  (void)queues_set;
  return cuda ? RSSM_BACKEND_CUDA : RSSM_BACKEND_CPU;
}

double RelErr(const std::vector<double>& x, const std::vector<double>& ref) {
  return RelErr(std::vector<std::vector<double>>{x}, std::vector<std::vector<double>>{ref});
}

double RelErr(const std::vector<std::vector<double>>& x,
              const std::vector<std::vector<double>>& ref) {
  double num = 0.0, den = 0.0;
  for (size_t l = 0; l < x.size(); ++l) {
    for (size_t i = 0; i < x[l].size(); ++i) {
      if (std::isnan(x[l][i]) || std::isnan(ref[l][i])) return std::numeric_limits<double>::quiet_NaN();
      num += (x[l][i] - ref[l][i]) * (x[l][i] - ref[l][i]);
      den += ref[l][i] * ref[l][i];
    }
  }
  return std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
}

}  // namespace replayssm::cache::testing
