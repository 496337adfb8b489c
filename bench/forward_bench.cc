// replayssm-bench-forwards: what a layer-by-layer prefill costs over the one-call Prefill, and
// what the ring-append alternative would cost (docs/cache.md, "Prefill and verify forwards").
//
//   replayssm-bench-forwards [--model qwen3-next-80b-a3b] [--backend cuda|cpu]
//                            [--tokens 1,4,16,64,256,1024] [--rounds R]
//
// One row, activations in backend memory (no staging copies: what is left is the cache and
// its kernels). Per prompt length T, three forms run alternately for R rounds (after one
// warm-up round each) on slots of their own:
//  - unary:   StateCache::Prefill — one rssm_prefill per layer, no spare slot;
//  - forward: BeginPrefill, RunLayer per layer, Commit — each layer first copies the row's
//             checkpoint into its spare slot (what makes abandonment safe);
//  - append:  (T <= L only) BeginVerify + RunLayer per layer + Commit + Accept(T): the same T
//             tokens as ring appends past the cursor, the design not chosen.
// Reported: each form's median µs per forward and the forward's overhead over the unary form.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
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

using bench::DeviceInputs;
using bench::Median;

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}


absl::Status RunForward(Forward& f, const std::vector<LayerIo>& layers) {
  for (size_t l = 0; l < layers.size(); ++l) {
    absl::Status s = f.RunLayer(static_cast<int32_t>(l), layers[l]);
    if (!s.ok()) return s;
  }
  return f.Commit();
}

int Main(int argc, char** argv) {
  std::string model_name = "qwen3-next-80b-a3b";
  std::string backend_name = rssm_backend_available(RSSM_BACKEND_CUDA) ? "cuda" : "cpu";
  std::vector<int64_t> lengths = {1, 4, 16, 64, 256, 1024};
  int32_t rounds = 20;
  bench::Flags flags("replayssm-bench-forwards",
                     "[--model M] [--backend cuda|cpu] [--tokens 1,4,16,64,256,1024] [--rounds R]");
  flags.Choice("model", ModelPresetNames(), &model_name);
  flags.Choice("backend", {"cuda", "cpu"}, &backend_name);
  flags.IntList("tokens", 1, 1 << 20, &lengths);
  flags.Int("rounds", 1, 1 << 20, &rounds);
  if (const int code = flags.ParseOrExitCode(argc, argv); code >= 0) return code;
  const int32_t backend = backend_name == "cuda" ? RSSM_BACKEND_CUDA : RSSM_BACKEND_CPU;
  absl::StatusOr<ModelSpec> m = ModelPreset(model_name);
  CHECK_OK(m.status());
  const int32_t L = m->shape.ring_len;
  CacheOptions o;
  o.backend = backend;
  o.memory_budget_bytes = 6 * m->SlotBytes();  // three forms' slots + the forward's spare
  o.track_interval = 0;
  o.max_prefill_tokens = 1 << 20;
  absl::StatusOr<std::unique_ptr<StateCache>> created = StateCache::Create(*m, o);
  CHECK_OK(created.status());  // e.g. --backend cuda where it is not built
  std::unique_ptr<StateCache> cache = std::move(*created);
  std::printf("model %s (%d layers, state %s, act %s, L = %d), backend %s, 1 row, %d rounds\n",
              model_name.c_str(), m->num_layers, rssm_dtype_name(m->shape.state_dtype),
              rssm_dtype_name(m->shape.act_dtype), L, backend == RSSM_BACKEND_CUDA ? "cuda" : "cpu",
              rounds);
  std::printf("%6s %12s %12s %9s %12s\n", "T", "unary us", "forward us", "overhead", "append us");
  for (int64_t t : lengths) {
    DeviceInputs in(backend, *m, t);
    const std::vector<int32_t> tokens(t, 7);
    const SlotId unary = *cache->Allocate(), forward = *cache->Allocate(),
                 append = *cache->Allocate();
    std::vector<double> tu, tf, ta;
    for (int r = -1; r < rounds; ++r) {  // round -1 warms up
      double t0 = Now();
      CHECK_OK(cache->Prefill(unary, tokens, in.layers));
      const double u = Now() - t0;
      t0 = Now();
      const PrefillRow row{forward, tokens};
      absl::StatusOr<std::unique_ptr<Forward>> f = cache->BeginPrefill({&row, 1});
      CHECK_OK(f.status());
      CHECK_OK(RunForward(**f, in.layers));
      const double fw = Now() - t0;
      if (t <= L) {
        t0 = Now();
        absl::StatusOr<std::unique_ptr<Forward>> v =
            cache->BeginVerify({append}, static_cast<int32_t>(t), tokens);
        CHECK_OK(v.status());
        CHECK_OK(RunForward(**v, in.layers));
        CHECK_OK(cache->Accept(append, static_cast<int32_t>(t)));
        if (r >= 0) ta.push_back(Now() - t0);
      }
      if (r >= 0) {
        tu.push_back(u);
        tf.push_back(fw);
      }
    }
    const double mu = Median(tu) * 1e6, mf = Median(tf) * 1e6;
    std::printf("%6lld %12.1f %12.1f %8.1f%% %12s\n", static_cast<long long>(t), mu, mf,
                100.0 * (mf / mu - 1.0),
                ta.empty() ? "-" : std::to_string(static_cast<int64_t>(Median(ta) * 1e6)).c_str());
    for (SlotId s : {unary, forward, append}) CHECK_OK(cache->Free(s));
  }
  return 0;
}

}  // namespace
}  // namespace replayssm::cache

int main(int argc, char** argv) { return replayssm::cache::Main(argc, argv); }
