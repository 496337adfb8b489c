// replayssm-bench-cache: decode-forward throughput through the StateCache against bare kernel
// calls doing the same work (issue 4: the cache layer's overhead must stay under 5% at
// B >= 64).
//
//   replayssm-bench-cache [--model qwen3-next-80b-a3b] [--backend cuda|cpu] [--batch 1,64,256]
//                         [--io host,device] [--steps N] [--rounds R] [--warmup W]
//                         [--tp-size N] [--json PATH]
//
// --tp-size N: the cache path is a tensor-parallel group of N ranks (cache/tp_group.h) on this
// backend's devices round-robin (one GPU: all on it), its activations rank-major; the bare path
// stays one launch per layer for the whole model. On one GPU this is the group's own cost: the
// same bytes in N launches per layer on N streams, N ranks' host calls.
//
// Two data paths, each measured through the cache and bare:
//  - host:   activations in ordinary host memory (what the gRPC service hands over). Per layer:
//            copy the inputs into pinned staging, upload them, one replay-decode launch,
//            download the outputs into pinned staging, wait for the stream, copy them out.
//  - device: activations already in device memory (a co-located caller). Per layer: one
//            launch; one wait per step.
// Per step both paths first fold the rows whose ring is full (one rssm_fold per layer) and
// upload the rows' slots and cursors, all on a stream of their own with the same pinned
// staging, and synchronize only where the host path must read outputs and at the end of the
// step. What the cache path adds is the cache layer itself: id lookups, busy flags and cursor
// bookkeeping under its mutex, argument checks, its lane pool, Commit's policy (no snapshots:
// track interval 0). Rows start with cursors spread over 0..L-2 and advance every step.
//
// Method: per (data path, B) both paths are built once and warmed up (W steps each: every
// row folds at least once and every lazy allocation is made), then R rounds of N steps run
// alternately (cache-bare, bare-cache, ...). Reported: each path's median µs/step with its
// min and max over the rounds, and the paired overhead (cache round / bare round next to
// it - 1): median, quartiles, min, max. Verdict at B >= 64: "pass" when the upper quartile
// of the paired overheads is under 5%, "marginal" when only the median is, else "fail".
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/check.h"
#include "bench/flags.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {
namespace {

constexpr double kTarget = 0.05;  // issue 4: overhead under 5% at B >= 64
constexpr int kMinRounds = 5;     // fewer rounds have no quartiles worth a verdict

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void* Alloc(int32_t backend, size_t bytes) {
  void* p = nullptr;
  CHECK_RSSM(rssm_alloc(backend, bytes, &p));
  const rssm_launch l{backend, nullptr};
  CHECK_RSSM(rssm_memset(&l, p, 0, bytes));
  CHECK_RSSM(rssm_synchronize(&l));
  return p;
}

// One step's activations for every layer, random (never zeros), in host memory and, for the
// device path, copied once into backend memory. Both paths read the same buffers.
struct Activations {
  std::vector<std::vector<uint8_t>> qkv, a, b, out;  // host, [layers]
  std::vector<LayerIo> host, device;                 // [layers]
  int32_t backend;

  Activations(const ModelSpec& m, int32_t backend_, int64_t n, uint64_t seed) : backend(backend_) {
    const size_t es = rssm_dtype_size(m.shape.act_dtype);
    std::mt19937_64 rng(seed);
    auto fill = [&](std::vector<uint8_t>& v, int64_t elems) {
      v.resize(elems * es);
      for (size_t i = 0; i < v.size(); i += es) {
        const float x = static_cast<float>(rng() >> 40) * 0x1p-23f - 1.f;  // [-1, 1)
        uint32_t u;
        std::memcpy(&u, &x, 4);
        // bf16/fp16 bit patterns of small values: exact values do not matter here
        const uint16_t h = m.shape.act_dtype == RSSM_DTYPE_BF16 ? u >> 16 : 0x3000 | (u >> 22);
        std::memcpy(&v[i], es == 4 ? static_cast<const void*>(&x) : &h, es);
      }
    };
    const rssm_launch l{backend, nullptr};
    auto on_device = [&](const std::vector<uint8_t>& v) {
      void* p = Alloc(backend, v.size());
      CHECK_RSSM(rssm_memcpy(&l, p, v.data(), v.size(), RSSM_COPY_HOST_TO_DEVICE));
      return p;
    };
    qkv.resize(m.num_layers);
    a.resize(m.num_layers);
    b.resize(m.num_layers);
    out.resize(m.num_layers);
    for (int l = 0; l < m.num_layers; ++l) {
      fill(qkv[l], n * m.QkvWidth());
      fill(a[l], n * m.AWidth());
      fill(b[l], n * m.BWidth());
      out[l].resize(n * m.OutWidth() * es);
      host.push_back({qkv[l].data(), a[l].data(), b[l].data(), out[l].data(), IoMemory::kHost});
      device.push_back({on_device(qkv[l]), on_device(a[l]), on_device(b[l]), on_device(out[l]),
                        IoMemory::kBackend});
    }
    CHECK_RSSM(rssm_synchronize(&l));
  }
  ~Activations() {
    for (const LayerIo& io : device) {
      for (const void* p : {io.mixed_qkv, io.a, io.b, static_cast<const void*>(io.out)}) {
        rssm_free(backend, const_cast<void*>(p));
      }
    }
  }
  Activations(const Activations&) = delete;
  Activations& operator=(const Activations&) = delete;
};

// The cache path: BeginForward, RunLayer x layers, Commit.
class CachePath {
 public:
  // `spread` holds host activations of at least `batch` rows for every layer.
  CachePath(const ModelSpec& m, int32_t backend, int batch, const std::vector<LayerIo>& spread,
            int32_t tp) {
    CacheOptions o;
    o.backend = backend;
    o.tp_size = tp;
    for (int32_t r = 0; tp > 1 && r < tp; ++r) o.devices.push_back(r % rssm_device_count(backend));
    o.memory_budget_bytes = (batch + 2) * m.SlotBytes();
    o.track_interval = 0;
    o.max_batch = batch;
    absl::StatusOr<std::unique_ptr<StateCache>> c = StateCache::Create(m, o);
    CHECK_OK(c.status());
    cache_ = std::move(*c);
    for (int r = 0; r < batch; ++r) {
      absl::StatusOr<SlotId> s = cache_->Allocate();
      CHECK_OK(s.status());
      rows_.push_back({*s, 1});
    }
    // Spread the cursors over 0..L-2: round t decodes the rows with r % (L-1) > t.
    const int cycle = m.shape.ring_len - 1;
    for (int t = 0; t + 1 < cycle; ++t) {
      std::vector<DecodeRow> rows;
      for (int r = 0; r < batch; ++r) {
        if (r % cycle > t) rows.push_back(rows_[r]);
      }
      if (rows.empty()) break;
      Step(rows, spread);  // the first rows.size() rows of the activations
    }
  }
  void Step(const std::vector<LayerIo>& io) { Step(rows_, io); }

 private:
  void Step(const std::vector<DecodeRow>& rows, const std::vector<LayerIo>& io) {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward(rows);
    CHECK_OK(f.status());
    for (int l = 0; l < cache_->model().num_layers; ++l) CHECK_OK((*f)->RunLayer(l, io[l]));
    CHECK_OK((*f)->Commit());
  }
  std::unique_ptr<StateCache> cache_;
  std::vector<DecodeRow> rows_;
};

// The bare path over a pool of its own: the same folds, copies, launches and waits, with the
// same kind of stream and pinned staging as a cache lane, and nothing else. With the model's
// short convolution (every preset) each layer's decode joins it, and a fold folds its window,
// as the cache does.
class BarePath {
 public:
  BarePath(const ModelSpec& m, int32_t backend, int batch)
      : m_(m), backend_(backend), batch_(batch) {
    const rssm_layer_shape& s = m.shape;
    const size_t es = rssm_dtype_size(s.state_dtype), ae = rssm_dtype_size(s.act_dtype);
    const size_t rs = rssm_dtype_size(rssm_ring_storage_dtype(&s));
    for (int l = 0; l < m.num_layers; ++l) {
      Layer& y = layers_.emplace_back();
      y.pool = {Alloc(backend, batch * rssm_checkpoint_elems(&s) * es),
                Alloc(backend, batch * rssm_ring_d_elems(&s) * rs),
                Alloc(backend, batch * rssm_ring_k_elems(&s) * rs),
                static_cast<float*>(Alloc(backend, batch * rssm_ring_g_elems(&s) * 4)),
                batch,
                0,
                0,
                0,
                0};
      y.a_log = Upload(m.layers[l].a_log.data(), m.layers[l].a_log.size() * 4);
      y.dt_bias = Upload(m.layers[l].dt_bias.data(), m.layers[l].dt_bias.size() * 4);
      if (m.conv_width > 0) {
        const rssm_conv_shape cs = m.ConvShape();
        y.conv = {Alloc(backend, batch * rssm_conv_window_elems(&cs) * ae),
                  Alloc(backend, batch * rssm_conv_ring_elems(&cs) * ae), batch, 0, 0};
        y.conv_weight = Upload(m.layers[l].conv_weight.data(), m.layers[l].conv_weight.size() * 4);
        if (!m.layers[l].conv_bias.empty()) {
          y.conv_bias = Upload(m.layers[l].conv_bias.data(), m.layers[l].conv_bias.size() * 4);
        }
      }
    }
    for (auto [buf, bytes] : {std::pair{&qkv_, batch * m.QkvWidth() * ae},
                              {&a_, batch * m.AWidth() * ae},
                              {&b_, batch * m.BWidth() * ae},
                              {&out_, batch * m.OutWidth() * ae},
                              {&idx_, int64_t{batch} * 4},
                              {&pos_, int64_t{batch} * 4},
                              {&fold_idx_, int64_t{batch} * 4},
                              {&fold_pos_, int64_t{batch} * 4},
                              {&conv_y_, batch * m.QkvWidth() * ae}}) {
      *buf = Alloc(backend, bytes);
    }
    pinned_bytes_ =
        batch * (m.QkvWidth() + m.AWidth() + m.BWidth() + m.OutWidth()) * ae + 4 * 4 * batch + 4096;
    CHECK_RSSM(rssm_alloc_host(backend, pinned_bytes_, &pinned_));
    CHECK_RSSM(rssm_stream_create(backend, &stream_));
    for (int r = 0; r < batch; ++r) {
      idx_h_.push_back(r);
      pos_h_.push_back(r % (s.ring_len - 1));
    }
  }
  ~BarePath() {
    const rssm_launch l = Launch();
    rssm_synchronize(&l);
    for (Layer& y : layers_) {
      for (void* p :
           {y.pool.checkpoint, y.pool.ring_d, y.pool.ring_k, static_cast<void*>(y.pool.ring_g),
            y.a_log, y.dt_bias, y.conv.window, y.conv.ring_x, y.conv_weight, y.conv_bias}) {
        if (p != nullptr) rssm_free(backend_, p);
      }
    }
    for (void* p : {qkv_, a_, b_, out_, idx_, pos_, fold_idx_, fold_pos_, conv_y_}) {
      rssm_free(backend_, p);
    }
    rssm_free_host(backend_, pinned_);
    rssm_stream_destroy(backend_, stream_);
  }
  BarePath(const BarePath&) = delete;
  BarePath& operator=(const BarePath&) = delete;

  void Step(const std::vector<LayerIo>& io) {
    used_ = 0;
    FoldFullRings();
    Stage(idx_, idx_h_.data(), batch_ * 4);
    Stage(pos_, pos_h_.data(), batch_ * 4);
    const bool host = io[0].memory == IoMemory::kHost;
    const size_t ae = rssm_dtype_size(m_.shape.act_dtype);
    const size_t out_bytes = batch_ * m_.OutWidth() * ae;
    for (int l = 0; l < m_.num_layers; ++l) {
      rssm_decode_args d{};
      d.launch = Launch();
      d.shape = m_.shape;
      d.params = {static_cast<const float*>(layers_[l].a_log),
                  static_cast<const float*>(layers_[l].dt_bias), m_.layers[l].scale,
                  m_.layers[l].use_qk_l2norm ? 1 : 0, m_.round_beta ? 1 : 0};
      d.pool = layers_[l].pool;
      d.batch = batch_;
      d.slot_idx = static_cast<const int32_t*>(idx_);
      d.write_pos = static_cast<const int32_t*>(pos_);
      d.in = {io[l].mixed_qkv, io[l].a, io[l].b, 0, 0, 0};
      d.out = {io[l].out, 0};
      rssm_decode_conv conv{};
      if (m_.conv_width > 0) {
        conv = {m_.conv_width, static_cast<const float*>(layers_[l].conv_weight),
                static_cast<const float*>(layers_[l].conv_bias), layers_[l].conv, conv_y_};
        d.conv = &conv;
      }
      if (host) {
        Stage(qkv_, io[l].mixed_qkv, batch_ * m_.QkvWidth() * ae);
        Stage(a_, io[l].a, batch_ * m_.AWidth() * ae);
        Stage(b_, io[l].b, batch_ * m_.BWidth() * ae);
        d.in = {qkv_, a_, b_, 0, 0, 0};
        d.out = {out_, 0};
      }
      CHECK_RSSM(rssm_replay_decode(&d));
      if (host) {  // the outputs go back to the caller's memory before the next layer
        char* staged = Take(out_bytes);
        CHECK_RSSM(rssm_memcpy(&d.launch, staged, out_, out_bytes, RSSM_COPY_DEVICE_TO_HOST));
        CHECK_RSSM(rssm_synchronize(&d.launch));
        std::memcpy(io[l].out, staged, out_bytes);
        used_ = 0;
      }
    }
    if (!host) {  // the step is complete, as after Commit (host: the last layer waited)
      const rssm_launch l = Launch();
      CHECK_RSSM(rssm_synchronize(&l));
    }
    for (int32_t& w : pos_h_) ++w;
  }

 private:
  struct Layer {
    rssm_state_pool pool;
    void *a_log, *dt_bias;
    rssm_conv_state conv{};  // window, ring x (with a convolution)
    void *conv_weight = nullptr, *conv_bias = nullptr;
  };
  rssm_launch Launch() const { return {backend_, stream_}; }
  void* Upload(const void* src, size_t bytes) {
    void* p = Alloc(backend_, bytes);
    const rssm_launch l{backend_, nullptr};
    CHECK_RSSM(rssm_memcpy(&l, p, src, bytes, RSSM_COPY_HOST_TO_DEVICE));
    CHECK_RSSM(rssm_synchronize(&l));
    return p;
  }
  char* Take(size_t bytes) {  // the pinned staging is sized for a whole step: never full
    char* p = static_cast<char*>(pinned_) + used_;
    used_ += (bytes + 255) / 256 * 256;
    if (used_ > pinned_bytes_) std::abort();
    return p;
  }
  void Stage(void* dst, const void* src, size_t bytes) {
    char* staged = Take(bytes);
    std::memcpy(staged, src, bytes);
    const rssm_launch l = Launch();
    CHECK_RSSM(rssm_memcpy(&l, dst, staged, bytes, RSSM_COPY_HOST_TO_DEVICE));
  }
  void FoldFullRings() {  // as BeginForward: a ring that cannot take this step's record
    fold_idx_h_.clear();
    fold_pos_h_.clear();
    for (int r = 0; r < batch_; ++r) {
      if (pos_h_[r] + 1 >= m_.shape.ring_len) {
        fold_idx_h_.push_back(r);
        fold_pos_h_.push_back(pos_h_[r]);
        pos_h_[r] = 0;
      }
    }
    if (fold_idx_h_.empty()) return;
    const int n = static_cast<int>(fold_idx_h_.size());
    Stage(fold_idx_, fold_idx_h_.data(), n * 4);
    Stage(fold_pos_, fold_pos_h_.data(), n * 4);
    for (int l = 0; l < m_.num_layers; ++l) {
      const rssm_fold_args f{Launch(),
                             m_.shape,
                             layers_[l].pool,
                             n,
                             static_cast<const int32_t*>(fold_idx_),
                             static_cast<const int32_t*>(fold_pos_)};
      CHECK_RSSM(rssm_fold(&f));
      if (m_.conv_width > 0) {
        const rssm_conv_fold_args cf{Launch(),
                                     m_.ConvShape(),
                                     layers_[l].conv,
                                     n,
                                     static_cast<const int32_t*>(fold_idx_),
                                     static_cast<const int32_t*>(fold_pos_)};
        CHECK_RSSM(rssm_conv_fold(&cf));
      }
    }
  }

  const ModelSpec& m_;
  const int32_t backend_;
  const int batch_;
  std::vector<Layer> layers_;
  void *qkv_, *a_, *b_, *out_, *idx_, *pos_, *fold_idx_, *fold_pos_, *conv_y_;
  void* pinned_ = nullptr;
  size_t pinned_bytes_ = 0, used_ = 0;
  void* stream_ = nullptr;
  std::vector<int32_t> idx_h_, pos_h_, fold_idx_h_, fold_pos_h_;
};

struct Summary {
  double median, min, max, p25, p75;
};

Summary Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto q = [&](double f) {  // linear interpolation between order statistics
    const double x = f * (v.size() - 1);
    const size_t i = static_cast<size_t>(x);
    return i + 1 < v.size() ? v[i] + (x - i) * (v[i + 1] - v[i]) : v[i];
  };
  return {q(0.5), v.front(), v.back(), q(0.25), q(0.75)};
}

struct Result {
  std::string io;
  int batch;
  std::vector<double> cache_us, bare_us, overhead;  // per round
  Summary cache, bare, over;
  std::string verdict;
};

// "pass" when the upper quartile of the paired overheads is under the target, "marginal" when
// only the median is; none below B = 64 or from too few rounds to have quartiles.
std::string Verdict(int batch, int rounds, const Summary& over) {
  if (batch < 64) return "n/a (B < 64)";
  if (rounds < kMinRounds) {
    return absl::StrCat("n/a (", rounds, " rounds, fewer than ", kMinRounds, ")");
  }
  if (over.p75 < kTarget) return "pass";
  return over.median < kTarget ? "marginal" : "fail";
}

template <typename F>
double TimeSteps(int steps, F&& step) {
  const double t0 = Now();
  for (int i = 0; i < steps; ++i) step();
  return (Now() - t0) / steps * 1e6;
}

Result Measure(const ModelSpec& m, int32_t backend, int batch, bool device_io, int steps,
               int rounds, int warmup, int32_t tp) {
  Result r;
  r.io = device_io ? "device" : "host";
  r.batch = batch;
  const Activations act(m, backend, batch, 7);
  CachePath cache(m, backend, batch, act.host, tp);
  BarePath bare(m, backend, batch);
  const std::vector<LayerIo>& io = device_io ? act.device : act.host;
  auto cache_step = [&] { cache.Step(io); };
  auto bare_step = [&] { bare.Step(io); };
  TimeSteps(warmup, cache_step);
  TimeSteps(warmup, bare_step);
  for (int round = 0; round < rounds; ++round) {
    double c = 0, b = 0;
    if (round % 2 == 0) {
      c = TimeSteps(steps, cache_step);
      b = TimeSteps(steps, bare_step);
    } else {
      b = TimeSteps(steps, bare_step);
      c = TimeSteps(steps, cache_step);
    }
    r.cache_us.push_back(c);
    r.bare_us.push_back(b);
    r.overhead.push_back(c / b - 1.0);
  }
  r.cache = Summarize(r.cache_us);
  r.bare = Summarize(r.bare_us);
  r.over = Summarize(r.overhead);
  r.verdict = Verdict(batch, rounds, r.over);
  return r;
}

void PrintJsonArray(FILE* f, const char* name, const std::vector<double>& v, int digits) {
  std::fprintf(f, "\"%s\": [", name);
  for (size_t i = 0; i < v.size(); ++i) std::fprintf(f, "%s%.*f", i ? ", " : "", digits, v[i]);
  std::fprintf(f, "]");
}

void PrintJsonSummary(FILE* f, const char* name, const Summary& s, int digits) {
  std::fprintf(
      f, "\"%s\": {\"median\": %.*f, \"p25\": %.*f, \"p75\": %.*f, \"min\": %.*f, \"max\": %.*f}",
      name, digits, s.median, digits, s.p25, digits, s.p75, digits, s.min, digits, s.max);
}

bool WriteJson(const char* path, const ModelSpec& m, const std::string& backend, int steps,
               int rounds, int warmup, const std::vector<Result>& results) {
  FILE* f = std::fopen(path, "w");
  if (f == nullptr) return false;
  std::fprintf(
      f,
      "{\"bench\": \"cache\", \"model\": \"%s\", \"layers\": %d, \"backend\": \"%s\", "
      "\"steps\": %d, \"rounds\": %d, \"warmup\": %d, \"target_overhead\": %.2f,\n \"results\": [",
      m.name.c_str(), m.num_layers, backend.c_str(), steps, rounds, warmup, kTarget);
  for (size_t i = 0; i < results.size(); ++i) {
    const Result& r = results[i];
    std::fprintf(f, "%s\n  {\"io\": \"%s\", \"batch\": %d, ", i ? "," : "", r.io.c_str(), r.batch);
    PrintJsonSummary(f, "cache_us", r.cache, 2);
    std::fprintf(f, ", ");
    PrintJsonSummary(f, "bare_us", r.bare, 2);
    std::fprintf(f, ", ");
    PrintJsonSummary(f, "overhead", r.over, 5);
    std::fprintf(f, ", \"rows_layers_per_s\": %.4g, \"verdict\": \"%s\",\n   ",
                 r.batch * m.num_layers / (r.cache.median * 1e-6), r.verdict.c_str());
    PrintJsonArray(f, "cache_rounds_us", r.cache_us, 2);
    std::fprintf(f, ", ");
    PrintJsonArray(f, "bare_rounds_us", r.bare_us, 2);
    std::fprintf(f, "}");
  }
  std::fprintf(f, "\n]}\n");
  return std::fclose(f) == 0;
}

int Run(int argc, char** argv) {
  std::string model_name = "qwen3-next-80b-a3b", backend_name = "cuda", json;
  std::vector<int64_t> batches = {1, 64, 256};
  std::vector<std::string> ios = {"host", "device"};
  int32_t steps = 20, rounds = 11, warmup = -1, tp = 1;
  bench::Flags flags("replayssm-bench-cache",
                     "[--model M] [--backend cuda|cpu] [--batch 1,64,256] [--io host,device] "
                     "[--steps N] [--rounds R] [--warmup W] [--tp-size N] [--json PATH]");
  flags.Choice("model", ModelPresetNames(), &model_name);
  flags.Choice("backend", {"cuda", "cpu"}, &backend_name);
  flags.IntList("batch", 1, 1 << 16, &batches);
  flags.ChoiceList("io", {"host", "device"}, &ios);
  flags.Int("steps", 1, 1 << 20, &steps);
  flags.Int("rounds", 1, 1 << 20, &rounds);
  flags.Int("warmup", 0, 1 << 20, &warmup);
  flags.Int("tp-size", 1, 8, &tp);
  flags.String("json", &json);
  if (const int code = flags.ParseOrExitCode(argc, argv); code >= 0) return code;
  const int32_t backend = backend_name == "cpu" ? RSSM_BACKEND_CPU : RSSM_BACKEND_CUDA;
  absl::StatusOr<ModelSpec> m = ModelPreset(model_name);
  CHECK_OK(m.status());
  if (warmup < 0) warmup = m->shape.ring_len;  // every row folds at least once
  std::printf(
      "cache bench: %s (%d layers, HV=%d H=%d K=%d V=%d L=%d, state %s, act %s), backend %s, "
      "cache path TP %d\n"
      "%d rounds of %d steps per path, alternating, after %d warm-up steps; overhead = cache/bare "
      "- 1 per round pair\n",
      m->name.c_str(), m->num_layers, m->shape.num_v_heads, m->shape.num_qk_heads, m->shape.head_k,
      m->shape.head_v, m->shape.ring_len, rssm_dtype_name(m->shape.state_dtype),
      rssm_dtype_name(m->shape.act_dtype), backend_name.c_str(), tp, rounds, steps, warmup);
  std::vector<Result> results;
  for (const std::string& io_name : ios) {
    for (const int64_t batch : batches) {
      const Result r =
          Measure(*m, backend, static_cast<int>(batch), io_name == "device", steps, rounds, warmup,
                  tp);
      std::printf(
          "io=%-6s B=%-4d cache %9.1f us/step [%.1f..%.1f]  bare %9.1f us/step [%.1f..%.1f]  "
          "overhead median %+6.2f%% (IQR %+.2f%%..%+.2f%%, range %+.2f%%..%+.2f%%)  %s\n",
          r.io.c_str(), r.batch, r.cache.median, r.cache.min, r.cache.max, r.bare.median,
          r.bare.min, r.bare.max, 100 * r.over.median, 100 * r.over.p25, 100 * r.over.p75,
          100 * r.over.min, 100 * r.over.max, r.verdict.c_str());
      std::fflush(stdout);
      results.push_back(r);
    }
  }
  bool all = true, any = false;
  for (const Result& r : results) {
    if (r.batch < 64) continue;
    any = true;
    all = all && r.verdict == "pass";
  }
  if (any && rounds < kMinRounds) {
    std::printf("no verdict: %d rounds per point, fewer than the %d its quartiles need\n", rounds,
                kMinRounds);
  } else if (any) {
    std::printf("verdict: cache overhead under %.0f%% at B >= 64 %s\n", 100 * kTarget,
                all ? "DEMONSTRATED (upper quartile under the target in every case)"
                    : "NOT demonstrated in every case (see the lines above)");
  }
  if (!json.empty() && !WriteJson(json.c_str(), *m, backend_name, steps, rounds, warmup, results)) {
    std::fprintf(stderr, "replayssm-bench-cache: cannot write %s\n", json.c_str());
    return 1;
  }
  return 0;
}

}  // namespace
}  // namespace replayssm::cache

int main(int argc, char** argv) { return replayssm::cache::Run(argc, argv); }
