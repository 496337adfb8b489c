// replayssm-bench-host-tier: the host tier (docs/cache.md, "Host tier") on the model's shape.
//
//   replayssm-bench-host-tier [--model qwen3-next-80b-a3b] [--backend cuda|cpu] [--rounds R]
//                             [--gpu-slots N] [--sessions S] [--turns T] [--user-tokens U]
//                             [--reply-tokens D] [--host-snapshots H] [--track-interval I]
//                             [--spill-ahead N] [--pin-host-at-start] [--json PATH]
//
// 1. Promotion against the copy it is made of, alternating in one run: a plain host -> device
//    copy of one folded state (pinned memory, one copy on a stream of its own) and a host hit
//    (AllocateFromPrefix of a snapshot that was spilled), whose promotion copies the same bytes
//    back layer by layer and copy-on-writes them into the new slot. Reported: each one's median
//    time and bandwidth, and the promotion's bandwidth over the plain copy's (target >= 80%).
// 2. A prefix-reuse trace: S multi-turn chat sessions, visited in a random order for T turns
//    each; a turn is AllocateFromPrefix(history + U new tokens), a prefill of what was not
//    matched, D decode steps and a Donate of the whole history. More sessions than the GPU pool
//    holds snapshots, run with the host tier off and on (same seed, same order). Reported: hits
//    per tier, the share of history tokens that did not need a prefill, and the time of a
//    turn's forwards (the prefill and the decode steps). With --track-interval I the decode
//    steps take track snapshots, which at a full pool evict at once (no spill: a forward never
//    waits for a copy), and --spill-ahead N adds a third run with the host tier spilling the
//    oldest snapshots ahead of need: dropped snapshots and the decode step's time compared.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/check.h"
#include "bench/device_inputs.h"
#include "bench/flags.h"
#include "bench/stats.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {
namespace {

using bench::CheckRssm;
using bench::DeviceInputs;
using bench::Median;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::unique_ptr<StateCache> MakeCache(const ModelSpec& m, int32_t backend, int64_t slots,
                                      int64_t host_snapshots, int32_t track_interval = 0,
                                      int32_t spill_ahead = 0, bool pin = false) {
  CacheOptions o;
  o.backend = backend;
  o.memory_budget_bytes = slots * m.SlotBytes();
  o.track_interval = track_interval;
  o.host_spill_ahead = spill_ahead;
  o.host_pin_at_start = pin;  // no host tier: nothing to pin
  o.max_prefill_tokens = 1 << 20;
  o.host_snapshot_bytes = host_snapshots * m.LayerStateBytes() * m.num_layers;
  absl::StatusOr<std::unique_ptr<StateCache>> c = StateCache::Create(m, o);
  CHECK_OK(c.status());
  return *std::move(c);
}

absl::Status Prefill(StateCache& c, SlotId slot, const std::vector<int32_t>& tokens,
                     const DeviceInputs& in) {
  return c.Prefill(slot, tokens, in.layers);
}

absl::Status DecodeStep(StateCache& c, SlotId slot, int32_t token, const DeviceInputs& in) {
  absl::StatusOr<std::unique_ptr<Forward>> f = c.BeginForward({{slot, token}});
  if (!f.ok()) return f.status();
  for (int32_t l = 0; l < c.model().num_layers; ++l) {
    absl::Status s = (*f)->RunLayer(l, in.layers[l]);
    if (!s.ok()) return s;
  }
  return (*f)->Commit();
}

// Takes every free backend slot (which spills every snapshot the host tier takes), then frees
// them.
void PushToHost(StateCache& c) {
  std::vector<SlotId> held;
  for (absl::StatusOr<SlotId> s = c.Allocate(); s.ok(); s = c.Allocate()) held.push_back(*s);
  for (SlotId s : held) CHECK_OK(c.Free(s));
}

struct PromotionResult {
  double bytes = 0;
  std::vector<double> copy_s, promote_s, allocate_s;
};

PromotionResult MeasurePromotion(const ModelSpec& m, int32_t backend, int rounds) {
  std::unique_ptr<StateCache> c = MakeCache(m, backend, 4, 2);
  PromotionResult r;
  const size_t bytes = static_cast<size_t>(m.LayerStateBytes()) * m.num_layers;
  r.bytes = static_cast<double>(bytes);
  // The plain copy: pinned host memory -> device memory, on a stream of its own.
  void *host = nullptr, *dev = nullptr, *stream = nullptr;
  CheckRssm(rssm_alloc_host(backend, bytes, &host), "alloc host");
  CheckRssm(rssm_alloc(backend, bytes, &dev), "alloc");
  CheckRssm(rssm_stream_create(backend, &stream), "stream");
  std::memset(host, 1, bytes);
  const rssm_launch launch{backend, stream};
  // A snapshot on the host.
  const std::vector<int32_t> prompt(32, 7);
  std::vector<int32_t> probe = prompt;
  probe.push_back(8);
  {
    DeviceInputs in(backend, m, static_cast<int64_t>(prompt.size()));
    const SlotId s = *c->Allocate();
    CHECK_OK(Prefill(*c, s, prompt, in));
    CHECK_OK(c->Donate(s));
  }
  PushToHost(*c);
  for (int round = -2; round < rounds; ++round) {  // two warm-up rounds
    double t0 = Now();
    CheckRssm(rssm_memcpy(&launch, dev, host, bytes, RSSM_COPY_HOST_TO_DEVICE), "copy");
    CheckRssm(rssm_synchronize(&launch), "copy");
    const double copy = Now() - t0;
    const double before = c->stats().promotion_seconds;
    t0 = Now();
    absl::StatusOr<StateCache::PrefixAllocation> a = c->AllocateFromPrefix(probe);
    const double allocate = Now() - t0;
    CHECK_OK(a.status());
    if (a->matched != static_cast<int64_t>(prompt.size())) {
      std::fprintf(stderr, "expected a host hit of %zu tokens, got %lld\n", prompt.size(),
                   static_cast<long long>(a->matched));
      std::exit(1);
    }
    const double promote = c->stats().promotion_seconds - before;
    CHECK_OK(c->Free(a->slot));
    PushToHost(*c);  // the promoted copy goes again (no copy: the host keeps its own)
    if (round < 0) continue;
    r.copy_s.push_back(copy);
    r.promote_s.push_back(promote);
    r.allocate_s.push_back(allocate);
  }
  const CacheStats s = c->stats();
  if (s.host_hits != rounds + 2) {
    std::fprintf(stderr, "expected %d host hits, got %lld\n", rounds + 2,
                 static_cast<long long>(s.host_hits));
    std::exit(1);
  }
  rssm_stream_destroy(backend, stream);
  rssm_free(backend, dev);
  rssm_free_host(backend, host);
  return r;
}

struct TraceOptions {
  int64_t gpu_slots = 16, sessions = 48, turns = 4, user_tokens = 128, reply_tokens = 16;
  int64_t host_snapshots = 64;
  int32_t track_interval = 0;  // > 0: decode takes track snapshots (evicting at a full pool)
  int32_t spill_ahead = 0;     // > 0: a third run, the host tier spilling ahead
  bool pin = false;            // host entries pinned when the cache is made
  uint64_t seed = 1;
};

struct TraceResult {
  int64_t turns = 0, history_tokens = 0, reused_tokens = 0, prefill_tokens = 0;
  double create_s = 0;  // StateCache::Create (pinning the host tier with --pin-host-at-start)
  CacheStats stats;
  std::vector<double> turn_s, prefill_s, step_s;
};

TraceResult RunTrace(const ModelSpec& m, int32_t backend, const TraceOptions& t, bool host,
                     int32_t spill_ahead) {
  const double created = Now();
  std::unique_ptr<StateCache> c = MakeCache(m, backend, t.gpu_slots, host ? t.host_snapshots : 0,
                                            t.track_interval, spill_ahead, t.pin);
  const double create_s = Now() - created;
  const int64_t longest = t.turns * (t.user_tokens + t.reply_tokens);
  DeviceInputs prefill_in(backend, m, longest), decode_in(backend, m, 1);
  std::vector<std::vector<int32_t>> history(t.sessions);
  std::vector<int64_t> order;
  for (int64_t turn = 0; turn < t.turns; ++turn) {
    for (int64_t s = 0; s < t.sessions; ++s) order.push_back(s);
  }
  std::mt19937_64 rng(t.seed);
  // Each session's turns stay in order; sessions interleave at random.
  std::shuffle(order.begin(), order.end(), rng);
  TraceResult r;
  r.create_s = create_s;
  for (int64_t s : order) {
    std::vector<int32_t>& h = history[s];
    const int64_t before = static_cast<int64_t>(h.size());
    for (int64_t i = 0; i < t.user_tokens; ++i) {
      h.push_back(static_cast<int32_t>(1000 * s + h.size() % 997 + 1));  // unique per session
    }
    const double t0 = Now();
    absl::StatusOr<StateCache::PrefixAllocation> a = c->AllocateFromPrefix(h);
    CHECK_OK(a.status());
    const std::vector<int32_t> rest(h.begin() + a->matched, h.end());
    const double t1 = Now();
    CHECK_OK(Prefill(*c, a->slot, rest, prefill_in));
    const double t2 = Now();
    for (int64_t d = 0; d < t.reply_tokens; ++d) {
      const int32_t token = static_cast<int32_t>(500000 + 1000 * s + h.size() % 997);
      const double s0 = Now();
      CHECK_OK(DecodeStep(*c, a->slot, token, decode_in));
      r.step_s.push_back(Now() - s0);
      h.push_back(token);
    }
    const double t3 = Now();
    CHECK_OK(c->Donate(a->slot));
    r.turns += 1;
    r.history_tokens += before;
    r.reused_tokens += std::min<int64_t>(a->matched, before);
    r.prefill_tokens += static_cast<int64_t>(rest.size());
    r.prefill_s.push_back(t2 - t1);
    r.turn_s.push_back(t3 - t0);
  }
  r.stats = c->stats();
  return r;
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

void PrintTrace(FILE* f, const char* name, const TraceResult& r, bool last) {
  const CacheStats& s = r.stats;
  std::fprintf(f,
               "    \"%s\": {\"turns\": %lld, \"gpu_hits\": %lld, \"host_hits\": %lld, "
               "\"misses\": %lld, \"spills\": %lld, \"promotions\": %lld, "
               "\"host_evictions\": %lld, \"history_tokens\": %lld, \"reused_tokens\": %lld, "
               "\"prefill_tokens\": %lld, \"mean_turn_ms\": %.3f, \"median_turn_ms\": %.3f, "
               "\"mean_prefill_ms\": %.3f, \"total_s\": %.3f, \"gpu_evictions\": %lld, "
               "\"dropped\": %lld, \"spills_ahead\": %lld, \"mean_step_ms\": %.4f, "
               "\"median_step_ms\": %.4f, \"create_s\": %.3f}%s\n",
               name, static_cast<long long>(r.turns), static_cast<long long>(s.snapshot_hits),
               static_cast<long long>(s.host_hits),
               static_cast<long long>(s.snapshot_misses - s.host_hits),
               static_cast<long long>(s.snapshot_spills), static_cast<long long>(s.host_promotions),
               static_cast<long long>(s.host_evictions), static_cast<long long>(r.history_tokens),
               static_cast<long long>(r.reused_tokens), static_cast<long long>(r.prefill_tokens),
               Mean(r.turn_s) * 1e3, Median(r.turn_s) * 1e3, Mean(r.prefill_s) * 1e3,
               Mean(r.turn_s) * static_cast<double>(r.turns),
               static_cast<long long>(s.snapshot_evictions),
               static_cast<long long>(s.snapshot_evictions - s.snapshot_spills),
               static_cast<long long>(s.spills_ahead), Mean(r.step_s) * 1e3,
               Median(r.step_s) * 1e3, r.create_s, last ? "" : ",");
}

void Report(const char* name, const TraceResult& r) {
  const CacheStats& s = r.stats;
  std::printf(
      "  host tier %-8s: %lld turns, hits gpu %lld host %lld, misses %lld; history reused "
      "%.1f%% (%lld of %lld tokens), prefilled %lld tokens; turn %.2f ms mean (%.2f median), "
      "prefill %.2f ms mean; GPU evictions %lld (dropped %lld), spilled ahead %lld; decode "
      "step %.3f ms mean (%.3f median); cache made in %.2f s\n",
      name, static_cast<long long>(r.turns), static_cast<long long>(s.snapshot_hits),
      static_cast<long long>(s.host_hits), static_cast<long long>(s.snapshot_misses - s.host_hits),
      r.history_tokens ? 100.0 * r.reused_tokens / r.history_tokens : 0.0,
      static_cast<long long>(r.reused_tokens), static_cast<long long>(r.history_tokens),
      static_cast<long long>(r.prefill_tokens), Mean(r.turn_s) * 1e3, Median(r.turn_s) * 1e3,
      Mean(r.prefill_s) * 1e3, static_cast<long long>(s.snapshot_evictions),
      static_cast<long long>(s.snapshot_evictions - s.snapshot_spills),
      static_cast<long long>(s.spills_ahead), Mean(r.step_s) * 1e3, Median(r.step_s) * 1e3,
      r.create_s);
}

int Main(int argc, char** argv) {
  std::string model_name = "qwen3-next-80b-a3b", json;
  std::string backend_name = rssm_backend_available(RSSM_BACKEND_CUDA) ? "cuda" : "cpu";
  int32_t rounds = 30;
  TraceOptions t;
  bench::Flags flags("replayssm-bench-host-tier",
                     "[--model M] [--backend cuda|cpu] [--rounds R] [--gpu-slots N] "
                     "[--sessions S] [--turns T] [--user-tokens U] [--reply-tokens D] "
                     "[--host-snapshots H] [--track-interval I] [--spill-ahead N] "
                     "[--pin-host-at-start] [--json PATH]");
  flags.Choice("model", ModelPresetNames(), &model_name);
  flags.Choice("backend", {"cuda", "cpu"}, &backend_name);
  flags.Int("rounds", 1, 1 << 20, &rounds);
  flags.Int("gpu-slots", int64_t{4}, int64_t{1} << 20, &t.gpu_slots);
  flags.Int("sessions", int64_t{1}, int64_t{1} << 20, &t.sessions);
  flags.Int("turns", int64_t{1}, int64_t{1} << 10, &t.turns);
  flags.Int("user-tokens", int64_t{1}, int64_t{1} << 16, &t.user_tokens);
  flags.Int("reply-tokens", int64_t{0}, int64_t{1} << 16, &t.reply_tokens);
  flags.Int("host-snapshots", int64_t{1}, int64_t{1} << 20, &t.host_snapshots);
  flags.Int("track-interval", 0, 1 << 20, &t.track_interval);
  flags.Int("spill-ahead", 0, 1 << 16, &t.spill_ahead);
  flags.Switch("pin-host-at-start", &t.pin);
  flags.String("json", &json);
  if (const int code = flags.ParseOrExitCode(argc, argv); code >= 0) return code;
  const int32_t backend = backend_name == "cuda" ? RSSM_BACKEND_CUDA : RSSM_BACKEND_CPU;
  absl::StatusOr<ModelSpec> m = ModelPreset(model_name);
  CHECK_OK(m.status());
  const double state_mb = static_cast<double>(m->LayerStateBytes()) * m->num_layers / 1e6;
  std::printf("model %s: %d layers, state %s, one folded state %.1f MB (slot %.1f MB), backend %s\n",
              model_name.c_str(), m->num_layers, rssm_dtype_name(m->shape.state_dtype), state_mb,
              static_cast<double>(m->SlotBytes()) / 1e6, backend_name.c_str());

  const PromotionResult p = MeasurePromotion(*m, backend, rounds);
  const double copy = Median(p.copy_s), promote = Median(p.promote_s),
               allocate = Median(p.allocate_s);
  const double copy_gbs = p.bytes / copy / 1e9, promote_gbs = p.bytes / promote / 1e9,
               allocate_gbs = p.bytes / allocate / 1e9;
  std::printf("promotion, %d rounds (medians): plain H2D copy %.1f us (%.2f GB/s); promotion "
              "%.1f us (%.2f GB/s, %.1f%% of the copy: %s); AllocateFromPrefix on a host hit "
              "%.1f us (%.1f%%)\n",
              rounds, copy * 1e6, copy_gbs, promote * 1e6, promote_gbs,
              100.0 * promote_gbs / copy_gbs, promote_gbs >= 0.8 * copy_gbs ? "met" : "missed",
              allocate * 1e6, 100.0 * allocate_gbs / copy_gbs);

  std::printf("trace: %lld sessions x %lld turns (%lld user + %lld reply tokens a turn), "
              "%lld GPU slots, host tier %lld snapshots\n",
              static_cast<long long>(t.sessions), static_cast<long long>(t.turns),
              static_cast<long long>(t.user_tokens), static_cast<long long>(t.reply_tokens),
              static_cast<long long>(t.gpu_slots), static_cast<long long>(t.host_snapshots));
  const TraceResult off = RunTrace(*m, backend, t, false, 0);
  Report("off", off);
  const TraceResult on = RunTrace(*m, backend, t, true, 0);
  Report("on", on);
  TraceResult ahead;
  if (t.spill_ahead > 0) {
    ahead = RunTrace(*m, backend, t, true, t.spill_ahead);
    Report("on+ahead", ahead);
  }

  if (json.empty()) return 0;
  FILE* f = std::fopen(json.c_str(), "w");
  if (f == nullptr) {
    std::fprintf(stderr, "replayssm-bench-host-tier: cannot write %s\n", json.c_str());
    return 1;
  }
  std::fprintf(f, "{\n  \"model\": \"%s\", \"backend\": \"%s\", \"state_bytes\": %.0f,\n",
               model_name.c_str(), backend_name.c_str(), p.bytes);
  std::fprintf(f,
               "  \"promotion\": {\"rounds\": %d, \"copy_us\": %.2f, \"copy_gbs\": %.3f, "
               "\"promote_us\": %.2f, \"promote_gbs\": %.3f, \"ratio\": %.4f, "
               "\"allocate_from_prefix_us\": %.2f},\n",
               rounds, copy * 1e6, copy_gbs, promote * 1e6, promote_gbs, promote_gbs / copy_gbs,
               allocate * 1e6);
  std::fprintf(f,
               "  \"trace\": {\"sessions\": %lld, \"turns\": %lld, \"user_tokens\": %lld, "
               "\"reply_tokens\": %lld, \"gpu_slots\": %lld, \"host_snapshots\": %lld, "
               "\"track_interval\": %d, \"spill_ahead\": %d, \"pin_host_at_start\": %s,\n",
               static_cast<long long>(t.sessions), static_cast<long long>(t.turns),
               static_cast<long long>(t.user_tokens), static_cast<long long>(t.reply_tokens),
               static_cast<long long>(t.gpu_slots), static_cast<long long>(t.host_snapshots),
               t.track_interval, t.spill_ahead, t.pin ? "true" : "false");
  PrintTrace(f, "host_off", off, false);
  PrintTrace(f, "host_on", on, t.spill_ahead == 0);
  if (t.spill_ahead > 0) PrintTrace(f, "host_on_spill_ahead", ahead, true);
  std::fprintf(f, "  }\n}\n");
  std::fclose(f);
  return 0;
}

}  // namespace
}  // namespace replayssm::cache

int main(int argc, char** argv) { return replayssm::cache::Main(argc, argv); }
