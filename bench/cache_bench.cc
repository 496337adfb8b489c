// replayssm-bench-cache: decode-forward throughput through the StateCache against the bare
// kernel calls for the same work (issue 4).
//
//   replayssm-bench-cache [--model qwen3-next-80b-a3b] [--backend cuda|cpu] [--batch 1,64,256]
//                         [--steps N] [--rounds R] [--json PATH]
//
// Both paths do, per step and per layer: copy the layer's inputs host -> device, one replay
// decode launch, copy the outputs device -> host, synchronize; every ring-full row is folded
// before the step. The cache path adds what the cache layer itself costs: id lookups and the
// busy/cursor bookkeeping under its mutex, staging buffers, validation, commit and
// fold/snapshot policy. Rows start with cursors spread over 0..L-2 and advance every step.
// Throughput is rows·layers per second; overhead = cache time / bare time - 1, each the
// median over R alternating rounds of N steps.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {
namespace {

#define CHECK_OK(x)                                                              \
  do {                                                                           \
    const absl::Status s_ = (x);                                                 \
    if (!s_.ok()) {                                                              \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                              \
    }                                                                            \
  } while (0)
#define CHECK_RSSM(x)                                                                 \
  do {                                                                                \
    if ((x) != RSSM_OK) {                                                             \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, rssm_last_error());      \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct HostIo {  // one step's activations for every layer, random, never zeros
  std::vector<std::vector<uint8_t>> qkv, a, b, out;
  std::vector<LayerIo> io;
  HostIo(const ModelSpec& m, int64_t n, uint64_t seed) {
    const size_t es = rssm_dtype_size(m.shape.act_dtype);
    std::mt19937_64 rng(seed);
    auto fill = [&](std::vector<uint8_t>& v, int64_t elems) {
      v.resize(elems * es);
      for (size_t i = 0; i < v.size(); i += es) {
        const float x = std::uniform_real_distribution<float>(-1.f, 1.f)(rng);
        if (es == 4) {
          std::memcpy(&v[i], &x, 4);
        } else {  // bf16 or fp16 bit patterns of small values; exact values do not matter here
          uint32_t u;
          std::memcpy(&u, &x, 4);
          const uint16_t h = m.shape.act_dtype == RSSM_DTYPE_BF16 ? u >> 16 : 0x3000 | (u >> 22);
          std::memcpy(&v[i], &h, 2);
        }
      }
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
      io.push_back({qkv[l].data(), a[l].data(), b[l].data(), out[l].data()});
    }
  }
};

struct Result {
  int batch;
  double cache_us, bare_us, overhead;
};

// The cache path: BeginForward, RunLayer x layers, Commit.
double TimeCache(StateCache& cache, const std::vector<SlotId>& slots, const HostIo& io, int steps) {
  std::vector<DecodeRow> rows;
  for (SlotId s : slots) rows.push_back({s, 1});
  auto step = [&] {
    auto f = cache.BeginForward(rows);
    CHECK_OK(f.status());
    for (int l = 0; l < cache.model().num_layers; ++l) CHECK_OK((*f)->RunLayer(l, io.io[l]));
    CHECK_OK((*f)->Commit());
  };
  for (int i = 0; i < 3; ++i) step();
  const double t0 = Now();
  for (int i = 0; i < steps; ++i) step();
  return (Now() - t0) / steps;
}

// The bare path over its own pool: the same copies, launches, folds and syncs, no cache.
double TimeBare(const ModelSpec& m, int32_t backend, int batch, const HostIo& io, int steps) {
  const rssm_layer_shape& s = m.shape;
  const size_t es = rssm_dtype_size(s.state_dtype), ae = rssm_dtype_size(s.act_dtype);
  const rssm_launch launch{backend, nullptr};
  struct Layer {
    void *cp, *d, *k, *g, *a_log, *dt;
  };
  std::vector<Layer> layers(m.num_layers);
  auto alloc = [&](size_t bytes) {
    void* p = nullptr;
    CHECK_RSSM(rssm_alloc(backend, bytes, &p));
    CHECK_RSSM(rssm_memset(&launch, p, 0, bytes));
    return p;
  };
  for (int l = 0; l < m.num_layers; ++l) {
    layers[l] = {alloc(batch * rssm_checkpoint_elems(&s) * es), alloc(batch * rssm_ring_d_elems(&s) * es),
                 alloc(batch * rssm_ring_k_elems(&s) * es), alloc(batch * rssm_ring_g_elems(&s) * 4),
                 alloc(m.layers[l].a_log.size() * 4), alloc(m.layers[l].dt_bias.size() * 4)};
    CHECK_RSSM(rssm_memcpy(&launch, layers[l].a_log, m.layers[l].a_log.data(), m.layers[l].a_log.size() * 4, RSSM_COPY_HOST_TO_DEVICE));
    CHECK_RSSM(rssm_memcpy(&launch, layers[l].dt, m.layers[l].dt_bias.data(), m.layers[l].dt_bias.size() * 4, RSSM_COPY_HOST_TO_DEVICE));
  }
  void* qkv = alloc(batch * m.QkvWidth() * ae);
  void* a = alloc(batch * m.AWidth() * ae);
  void* b = alloc(batch * m.BWidth() * ae);
  void* out = alloc(batch * m.OutWidth() * ae);
  void* idx = alloc(batch * 4);
  void* pos = alloc(batch * 4);
  std::vector<int32_t> h_idx(batch), h_pos(batch);
  for (int r = 0; r < batch; ++r) {
    h_idx[r] = r;
    h_pos[r] = r % (s.ring_len - 1);
  }
  CHECK_RSSM(rssm_memcpy(&launch, idx, h_idx.data(), batch * 4, RSSM_COPY_HOST_TO_DEVICE));
  auto step = [&] {
    std::vector<int32_t> fold_idx, fold_pos;
    for (int r = 0; r < batch; ++r) {
      if (h_pos[r] + 1 >= s.ring_len) {
        fold_idx.push_back(r);
        fold_pos.push_back(h_pos[r]);
        h_pos[r] = 0;
      }
    }
    if (!fold_idx.empty()) {  // fold ring-full rows first, as the cache does
      const int n = static_cast<int>(fold_idx.size());
      CHECK_RSSM(rssm_memcpy(&launch, idx, fold_idx.data(), n * 4, RSSM_COPY_HOST_TO_DEVICE));
      CHECK_RSSM(rssm_memcpy(&launch, pos, fold_pos.data(), n * 4, RSSM_COPY_HOST_TO_DEVICE));
      for (int l = 0; l < m.num_layers; ++l) {
        rssm_state_pool pool{layers[l].cp, layers[l].d, layers[l].k, static_cast<float*>(layers[l].g), batch, 0, 0, 0, 0};
        const rssm_fold_args f{launch, s, pool, n, static_cast<int32_t*>(idx), static_cast<int32_t*>(pos)};
        CHECK_RSSM(rssm_fold(&f));
      }
      CHECK_RSSM(rssm_synchronize(&launch));
      CHECK_RSSM(rssm_memcpy(&launch, idx, h_idx.data(), batch * 4, RSSM_COPY_HOST_TO_DEVICE));
    }
    CHECK_RSSM(rssm_memcpy(&launch, pos, h_pos.data(), batch * 4, RSSM_COPY_HOST_TO_DEVICE));
    for (int l = 0; l < m.num_layers; ++l) {
      CHECK_RSSM(rssm_memcpy(&launch, qkv, io.io[l].mixed_qkv, batch * m.QkvWidth() * ae, RSSM_COPY_HOST_TO_DEVICE));
      CHECK_RSSM(rssm_memcpy(&launch, a, io.io[l].a, batch * m.AWidth() * ae, RSSM_COPY_HOST_TO_DEVICE));
      CHECK_RSSM(rssm_memcpy(&launch, b, io.io[l].b, batch * m.BWidth() * ae, RSSM_COPY_HOST_TO_DEVICE));
      rssm_decode_args d{};
      d.launch = launch;
      d.shape = s;
      d.params = {static_cast<float*>(layers[l].a_log), static_cast<float*>(layers[l].dt),
                  m.layers[l].scale, m.layers[l].use_qk_l2norm ? 1 : 0};
      d.pool = {layers[l].cp, layers[l].d, layers[l].k, static_cast<float*>(layers[l].g), batch, 0, 0, 0, 0};
      d.batch = batch;
      d.slot_idx = static_cast<int32_t*>(idx);
      d.write_pos = static_cast<int32_t*>(pos);
      d.in = {qkv, a, b, 0, 0, 0};
      d.out = {out, 0};
      CHECK_RSSM(rssm_replay_decode(&d));
      CHECK_RSSM(rssm_memcpy(&launch, io.io[l].out, out, batch * m.OutWidth() * ae, RSSM_COPY_DEVICE_TO_HOST));
      CHECK_RSSM(rssm_synchronize(&launch));
    }
    for (int32_t& w : h_pos) ++w;
  };
  for (int i = 0; i < 3; ++i) step();
  const double t0 = Now();
  for (int i = 0; i < steps; ++i) step();
  const double t = (Now() - t0) / steps;
  for (auto& l : layers) {
    for (void* p : {l.cp, l.d, l.k, l.g, l.a_log, l.dt}) rssm_free(backend, p);
  }
  for (void* p : {qkv, a, b, out, idx, pos}) rssm_free(backend, p);
  return t;
}

int Run(int argc, char** argv) {
  std::string model_name = "qwen3-next-80b-a3b", backend_name = "cuda", batches = "1,64,256";
  const char* json = nullptr;
  int steps = 20, rounds = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (arg == "--model") model_name = next();
    else if (arg == "--backend") backend_name = next();
    else if (arg == "--batch") batches = next();
    else if (arg == "--steps") steps = std::atoi(next().c_str());
    else if (arg == "--rounds") rounds = std::max(1, std::atoi(next().c_str()));
    else if (arg == "--json") json = argv[++i];
    else {
      std::fprintf(stderr, "usage: replayssm-bench-cache [--model M] [--backend cuda|cpu] [--batch 1,64] [--steps N] [--rounds R] [--json PATH]\n");
      return 2;
    }
  }
  const int32_t backend = backend_name == "cpu" ? RSSM_BACKEND_CPU : RSSM_BACKEND_CUDA;
  absl::StatusOr<ModelSpec> m = ModelPreset(model_name);
  CHECK_OK(m.status());
  std::printf("cache bench: %s (%d layers, HV=%d H=%d K=%d V=%d L=%d, state %s), backend %s\n",
              m->name.c_str(), m->num_layers, m->shape.num_v_heads, m->shape.num_qk_heads,
              m->shape.head_k, m->shape.head_v, m->shape.ring_len,
              rssm_dtype_name(m->shape.state_dtype), backend_name.c_str());
  std::vector<Result> results;
  for (absl::string_view part : absl::StrSplit(batches, ',')) {
    int batch = 0;
    if (!absl::SimpleAtoi(part, &batch) || batch < 1) return 2;
    const HostIo io(*m, batch, 7);
    double cache_t, bare_t;
    {
      CacheOptions o;
      o.backend = backend;
      o.memory_budget_bytes = (batch + 2) * m->SlotBytes();
      o.track_interval = 0;
      o.max_batch = batch;
      auto cache = StateCache::Create(*m, o);
      CHECK_OK(cache.status());
      std::vector<SlotId> slots;
      for (int r = 0; r < batch; ++r) slots.push_back(*(*cache)->Allocate());
      // Spread the cursors over 0..L-2: row r first decodes r % (L-1) steps on its own.
      for (int r = 0; r < batch; ++r) {
        for (int t = 0; t < r % (m->shape.ring_len - 1); ++t) {
          const HostIo one(*m, 1, r);
          auto f = (*cache)->BeginForward({{slots[r], 1}});
          CHECK_OK(f.status());
          for (int l = 0; l < m->num_layers; ++l) CHECK_OK((*f)->RunLayer(l, one.io[l]));
          CHECK_OK((*f)->Commit());
        }
      }
      // Alternate the two paths in rounds and keep each one's median: the machine's noise
      // then hits both alike.
      std::vector<double> ct, bt;
      for (int round = 0; round < rounds; ++round) {
        ct.push_back(TimeCache(**cache, slots, io, steps));
        bt.push_back(TimeBare(*m, backend, batch, io, steps));
      }
      std::sort(ct.begin(), ct.end());
      std::sort(bt.begin(), bt.end());
      cache_t = ct[rounds / 2];
      bare_t = bt[rounds / 2];
    }
    results.push_back({batch, cache_t * 1e6, bare_t * 1e6, cache_t / bare_t - 1.0});
    const Result& r = results.back();
    std::printf("B=%-4d cache %9.1f us/step  bare %9.1f us/step  overhead %+6.2f%%  (%.3g rows*layers/s)\n",
                batch, r.cache_us, r.bare_us, 100 * r.overhead,
                batch * m->num_layers / (cache_t));
  }
  if (json != nullptr) {
    FILE* f = std::fopen(json, "w");
    if (f == nullptr) return 1;
    std::fprintf(f, "{\"model\": \"%s\", \"backend\": \"%s\", \"steps\": %d, \"rounds\": %d, \"results\": [",
                 m->name.c_str(), backend_name.c_str(), steps, rounds);
    for (size_t i = 0; i < results.size(); ++i) {
      std::fprintf(f, "%s{\"batch\": %d, \"cache_us\": %.2f, \"bare_us\": %.2f, \"overhead\": %.4f}",
                   i ? ", " : "", results[i].batch, results[i].cache_us, results[i].bare_us, results[i].overhead);
    }
    std::fprintf(f, "]}\n");
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace replayssm::cache

int main(int argc, char** argv) { return replayssm::cache::Run(argc, argv); }
