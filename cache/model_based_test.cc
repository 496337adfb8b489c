// A randomized model-based test: thousands of random operations over many requests (allocate,
// allocate from a prefix, prefill, decode steps with folds, layer-by-layer prefills of several
// requests, abandoned forwards of every kind, verify (one call or layer by layer) and
// accept/reject, donate, import/export, a move through slot I/O, free), against a plain fp64 model
// of each request's token history. Every output and every exported state must match the model. The
// seed is printed on failure; REPLAYSSM_TEST_SEED reruns one.
#include <gtest/gtest.h>

#include <cstdlib>
#include <map>
#include <ostream>
#include <random>
#include <string>

#include "replayssm/cache/slot_io.h"
#include "replayssm/cache/state_cache.h"
#include "test_model.h"

namespace replayssm::cache {
namespace {

using testing::Batch;
using testing::Oracle;
using testing::Tok;

struct Request {
  SlotId slot;
  std::vector<int32_t> tokens;
  Oracle::State ref;
};

struct Params {
  int32_t state_dtype;
  int32_t gate_preset;  // 0 tiny-gdn, 1 tiny-kda
  uint64_t seed;
  int ops;
  // The model options: bf16 activations (the tiny presets' are fp32) with beta rounded to them
  // or not (-1: the gate's default), a ring dtype of its own (-1: the state dtype).
  bool bf16_act = false;
  int32_t round_beta = -1;
  int32_t ring_dtype = -1;
  int64_t host_snapshots = 0;  // the host tier's size in snapshots (0: off)
  std::string Name() const {
    return std::string(gate_preset ? "kda" : "gdn") + "_s" + rssm_dtype_name(state_dtype) +
           (ring_dtype >= 0 ? std::string("_r") + rssm_dtype_name(ring_dtype) : "") +
           (bf16_act ? "_abf16" : "") + (round_beta == 1 ? "_rbeta" : "") +
           (round_beta == 0 ? "_f32beta" : "") + (host_snapshots > 0 ? "_host" : "") + "_seed" +
           std::to_string(seed);
  }
};
void PrintTo(const Params& p, std::ostream* os) { *os << p.Name() << ", " << p.ops << " ops"; }

class ModelBased : public ::testing::TestWithParam<Params> {};

std::string ParamName(const ::testing::TestParamInfo<Params>& info) { return info.param.Name(); }

TEST_P(ModelBased, EveryOutputAndExportMatchesTheModel) {
  const Params p = GetParam();
  const char* env = std::getenv("REPLAYSSM_TEST_SEED");
  const uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : p.seed;
  SCOPED_TRACE("seed " + std::to_string(seed) + " (rerun with REPLAYSSM_TEST_SEED=" +
               std::to_string(seed) + ")");
  absl::StatusOr<ModelSpec> m = ModelPreset(p.gate_preset ? "tiny-kda" : "tiny-gdn", p.state_dtype, 4);
  ASSERT_TRUE(m.ok());
  m->shape.head_k = m->shape.head_v = 16;
  m->num_layers = 2;
  m->layers = SeededParams(m->shape, 2, seed, m->conv_width);
  if (p.bf16_act) m->shape.act_dtype = RSSM_DTYPE_BF16;
  ASSERT_TRUE(
      ApplyModelOptions(*m, p.ring_dtype < 0 ? 0 : RSSM_RING_DTYPE_F32 + p.ring_dtype, p.round_beta)
          .ok());
  CacheOptions o;
  o.backend = testing::TestBackend();
  o.memory_budget_bytes = 10 * m->SlotBytes();
  o.track_interval = 5;
  o.host_snapshot_bytes = p.host_snapshots * m->LayerStateBytes() * m->num_layers;
  auto cache = std::move(*StateCache::Create(*m, o));
  const Oracle oracle(cache->model());
  const bool f32 = p.state_dtype == RSSM_DTYPE_F32;
  // bf16 outputs carry their own rounding; the fp32 state (exports) stays at fp32's bound: the
  // oracle rounds beta and the ring's d, k as the model says, so a step that did not would show.
  const double out_tol = !f32 ? 3e-2 : p.bf16_act ? 8e-3 : 1e-4, state_tol = f32 ? 1e-4 : 2e-2;

  std::mt19937_64 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % n); };
  // Decode activations in host or backend memory: a stream of its own, so that the operation
  // sequence of a seed does not depend on it.
  std::mt19937_64 memory_rng(seed ^ 0x6d656d);
  std::vector<Request> live;
  std::vector<std::vector<int32_t>> finished;  // histories donated: later prompts extend them
  auto check_outputs = [&](const Batch& b, int64_t i, const Oracle::Outputs& want, const char* what) {
    for (int l = 0; l < cache->model().num_layers; ++l) {
      const double err = testing::RelErr(b.Output(cache->model(), l, i), want[l]);
      ASSERT_LE(err, out_tol) << what << " output, layer " << l;
    }
  };
  int64_t checked = 0;
  for (int op = 0; op < p.ops; ++op) {
    SCOPED_TRACE("op " + std::to_string(op));
    const int kind = pick(100);
    if (kind < 12 || live.empty()) {  // a new request, maybe continuing a finished one
      std::vector<int32_t> prompt;
      if (!finished.empty() && pick(2) == 0) {
        prompt = finished[pick(static_cast<int>(finished.size()))];  // the next turn
        if (pick(2) == 0) prompt.resize(1 + pick(static_cast<int>(prompt.size())));  // a fork
      }
      for (int n = 1 + pick(4); n > 0; --n) prompt.push_back(pick(6));
      absl::StatusOr<StateCache::PrefixAllocation> a = cache->AllocateFromPrefix(prompt);
      if (!a.ok()) {
        ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
        ASSERT_EQ(cache->stats().slots_snapshot, 0) << "refused while snapshots could be evicted";
        continue;
      }
      Request r{a->slot, {}, oracle.Run(prompt, a->matched)};
      r.tokens.assign(prompt.begin(), prompt.begin() + a->matched);
      std::vector<int32_t> rest(prompt.begin() + a->matched, prompt.end());
      std::vector<Tok> toks;
      for (size_t i = 0; i < rest.size(); ++i) toks.push_back({rest[i], a->matched + static_cast<int64_t>(i)});
      Batch b = oracle.MakeBatch(toks);
      const absl::Status st = cache->Prefill(r.slot, rest, b.io);
      ASSERT_TRUE(st.ok()) << st;
      for (size_t i = 0; i < toks.size(); ++i) {
        check_outputs(b, i, oracle.Step(r.ref, toks[i]), "prefill");
        r.tokens.push_back(rest[i]);
      }
      live.push_back(std::move(r));
    } else if (kind < 52) {  // a decode step over a random subset, sometimes abandoned
      std::vector<int> rows;
      for (size_t i = 0; i < live.size(); ++i) {
        if (pick(3) != 0) rows.push_back(static_cast<int>(i));
      }
      if (rows.empty()) continue;
      std::vector<DecodeRow> drows;
      std::vector<Tok> toks;
      for (int i : rows) {
        const int32_t t = pick(6);
        drows.push_back({live[i].slot, t});
        toks.push_back({t, static_cast<int64_t>(live[i].tokens.size())});
        if (pick(4) == 0) {  // a padding row
          drows.push_back({kPaddingSlot, 0});
          toks.push_back({0, 0});
        }
      }
      Batch b = oracle.MakeBatch(toks);
      std::unique_ptr<testing::BackendBatch> dev;
      if (memory_rng() % 2 == 0) dev = std::make_unique<testing::BackendBatch>(o.backend, b);
      auto f = cache->BeginForward(drows);
      ASSERT_TRUE(f.ok()) << f.status();
      const bool abandon = pick(8) == 0;
      const int layers = abandon ? pick(cache->model().num_layers) : cache->model().num_layers;
      for (int l = 0; l < layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, dev ? dev->io[l] : b.io[l]).ok());
      if (abandon) continue;  // the forward is destroyed: nothing may change
      const absl::Status cs = (*f)->Commit();
      ASSERT_TRUE(cs.ok()) << cs;
      if (dev) dev->CopyOutputsTo(b);
      size_t row = 0;
      for (int i : rows) {
        while (drows[row].slot == kPaddingSlot) ++row;
        check_outputs(b, row, oracle.Step(live[i].ref, toks[row]), "decode");
        live[i].tokens.push_back(toks[row].id);
        ++row;
        ++checked;
      }
    } else if (kind < 60) {  // a layer-by-layer prefill of a few requests, sometimes abandoned
      std::vector<int> rows;
      for (size_t i = 0; i < live.size(); ++i) {
        if (pick(3) == 0) rows.push_back(static_cast<int>(i));
      }
      if (rows.empty()) continue;
      std::vector<std::vector<int32_t>> add(rows.size());
      std::vector<Tok> toks;
      for (size_t j = 0; j < rows.size(); ++j) {
        const int64_t start = static_cast<int64_t>(live[rows[j]].tokens.size());
        for (int t = 1 + pick(6); t > 0; --t) {
          add[j].push_back(pick(6));
          toks.push_back({add[j].back(), start + static_cast<int64_t>(add[j].size()) - 1});
        }
      }
      std::vector<PrefillRow> prows;
      for (size_t j = 0; j < rows.size(); ++j) prows.push_back({live[rows[j]].slot, add[j]});
      Batch b = oracle.MakeBatch(toks);
      std::unique_ptr<testing::BackendBatch> dev;
      if (memory_rng() % 2 == 0) dev = std::make_unique<testing::BackendBatch>(o.backend, b);
      auto f = cache->BeginPrefill(prows);
      if (!f.ok()) {  // every slot is live: no spare one for each row
        ASSERT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
        continue;
      }
      const bool abandon = pick(6) == 0;
      const int layers = abandon ? pick(cache->model().num_layers + 1) : cache->model().num_layers;
      for (int l = layers - 1; l >= 0; --l) {
        ASSERT_TRUE((*f)->RunLayer(l, dev ? dev->io[l] : b.io[l]).ok());
      }
      if (abandon) {  // the forward is destroyed: nothing may change
        f->reset();
        for (int i : rows) {
          ASSERT_EQ(cache->Info(live[i].slot)->seq_len,
                    static_cast<int64_t>(live[i].tokens.size()));
        }
        continue;
      }
      const absl::Status cs = (*f)->Commit();
      ASSERT_TRUE(cs.ok()) << cs;
      if (dev) dev->CopyOutputsTo(b);
      int64_t token = 0;
      for (size_t j = 0; j < rows.size(); ++j) {
        Request& r = live[rows[j]];
        for (int32_t t : add[j]) {
          check_outputs(b, token, oracle.Step(r.ref, toks[token]), "prefill forward");
          r.tokens.push_back(t);
          ++token;
        }
      }
    } else if (kind < 72) {  // verify T drafts on one request (maybe layer by layer), accept some
      Request& r = live[pick(static_cast<int>(live.size()))];
      const int T = 1 + pick(4);
      std::vector<int32_t> drafts;
      std::vector<Tok> toks;
      for (int t = 0; t < T; ++t) {
        drafts.push_back(pick(6));
        toks.push_back({drafts.back(), static_cast<int64_t>(r.tokens.size()) + t});
      }
      Batch b = oracle.MakeBatch(toks);
      if (pick(2) == 0) {
        const absl::Status vs = cache->Verify({r.slot}, T, drafts, b.io);
        ASSERT_TRUE(vs.ok()) << vs;
      } else {
        auto f = cache->BeginVerify({r.slot}, T, drafts);
        ASSERT_TRUE(f.ok()) << f.status();
        const bool abandon = pick(6) == 0;
        const int layers =
            abandon ? pick(cache->model().num_layers + 1) : cache->model().num_layers;
        for (int l = 0; l < layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, b.io[l]).ok());
        if (abandon) continue;  // no drafts wait: nothing to accept
        const absl::Status cs = (*f)->Commit();
        ASSERT_TRUE(cs.ok()) << cs;
      }
      const int n = pick(T + 1);
      Oracle::State s = r.ref;
      for (int t = 0; t < T; ++t) {
        check_outputs(b, t, oracle.Step(s, toks[t]), "verify");
        if (t + 1 == n) r.ref = s;
      }
      const absl::Status as = cache->Accept(r.slot, n);
      ASSERT_TRUE(as.ok()) << as;
      r.tokens.insert(r.tokens.end(), drafts.begin(), drafts.begin() + n);
    } else if (kind < 80) {  // export and compare
      Request& r = live[pick(static_cast<int>(live.size()))];
      absl::StatusOr<ExportedState> e = cache->Export(r.slot);
      ASSERT_TRUE(e.ok()) << e.status();
      ASSERT_EQ(e->tokens, r.tokens);
      ASSERT_LE(testing::RelErr(oracle.FromExport(*e), r.ref), state_tol) << "export";
      const int then = pick(3);
      if (then == 0) {  // ... and import it into a new slot as a new request
        absl::StatusOr<SlotId> s = cache->Allocate();
        if (!s.ok()) continue;
        std::vector<absl::Span<const uint8_t>> cps(e->checkpoints.begin(), e->checkpoints.end());
        ASSERT_TRUE(cache->Import(*s, e->tokens, cps).ok());
        live.push_back(Request{*s, r.tokens, oracle.FromExport(*e)});
      } else if (then == 1) {  // ... or move it through slot I/O (the transfer's path)
        absl::StatusOr<std::unique_ptr<SlotReader>> reader =
            cache->OpenExport(r.slot, "move", {.chunk_bytes = 4096});
        ASSERT_TRUE(reader.ok()) << reader.status();
        absl::StatusOr<std::unique_ptr<SlotWriter>> writer =
            cache->OpenImport((*reader)->seq_len(), {});
        if (!writer.ok()) {  // no free slot: the request stays where it is
          (*reader)->Finish(/*moved=*/false);
          continue;
        }
        for (size_t i = 0; i < (*reader)->num_chunks(); ++i) {
          absl::StatusOr<SlotChunk> c = (*reader)->Next();
          ASSERT_TRUE(c.ok()) << c.status();
          ASSERT_TRUE((*writer)->Write(c->offset, c->data, c->size, c->backend_memory).ok());
          (*reader)->Done(i);
        }
        absl::StatusOr<uint64_t> sum = (*reader)->Checksum();
        ASSERT_TRUE(sum.ok()) << sum.status();
        absl::StatusOr<SlotId> moved = (*writer)->Commit((*reader)->tokens(), *sum);
        ASSERT_TRUE(moved.ok()) << moved.status();
        (*reader)->Finish(/*moved=*/true);
        r.slot = *moved;  // the request goes on from the moved state
      }
    } else if (kind < 92) {  // a request finishes: donated (or freed)
      const int i = pick(static_cast<int>(live.size()));
      if (pick(4) == 0) {
        ASSERT_TRUE(cache->Free(live[i].slot).ok());
      } else {
        ASSERT_TRUE(cache->Donate(live[i].slot).ok());
        finished.push_back(live[i].tokens);
      }
      ASSERT_EQ(cache->Info(live[i].slot).status().code(), absl::StatusCode::kNotFound);
      live.erase(live.begin() + i);
    } else {  // match: whatever is matched must be a real prefix of some history
      std::vector<int32_t> probe = finished.empty() ? std::vector<int32_t>{1, 2}
                                                    : finished[pick(static_cast<int>(finished.size()))];
      probe.push_back(pick(6));
      const int64_t n = cache->MatchPrefix(probe);
      ASSERT_LE(n, static_cast<int64_t>(probe.size()));
    }
  }
  EXPECT_GT(checked, p.ops / 4) << "the run decoded too little to mean anything";
  const CacheStats s = cache->stats();
  EXPECT_GT(s.snapshot_hits, 0);
  EXPECT_GT(s.folds_ring_full + s.folds_track, 0);
  if (p.host_snapshots > 0) {
    EXPECT_GT(s.snapshot_spills, 0);
    EXPECT_GT(s.host_hits, 0);
    EXPECT_LE(s.host_bytes, s.host_capacity_bytes);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, ModelBased,
    ::testing::Values(Params{RSSM_DTYPE_F32, 0, 1, 3000}, Params{RSSM_DTYPE_F32, 1, 2, 3000},
                      Params{RSSM_DTYPE_BF16, 0, 3, 800}, Params{RSSM_DTYPE_F16, 1, 4, 800},
                      // GDN: beta rounded by default; a bf16 ring
                      Params{RSSM_DTYPE_F32, 0, 5, 1000, true, -1, RSSM_DTYPE_BF16},
                      // KDA with beta rounded by option; an fp16 ring
                      Params{RSSM_DTYPE_F32, 1, 6, 1000, true, 1, RSSM_DTYPE_F16},
                      // a host tier: snapshots spill and come back
                      Params{RSSM_DTYPE_F32, 0, 7, 2000, false, -1, -1, 6},
                      Params{RSSM_DTYPE_BF16, 1, 8, 800, true, -1, -1, 3}),
    ParamName);

}  // namespace
}  // namespace replayssm::cache
