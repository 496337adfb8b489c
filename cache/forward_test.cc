// Layer-by-layer prefill and verify forwards (StateCache::BeginPrefill, BeginVerify): the same
// outputs and states as the one-call forms, bit for bit, in every state dtype and both gates;
// abandoned after any number of layers they change nothing; their spare slots; bad calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "replayssm/cache/state_cache.h"
#include "test_model.h"

namespace replayssm::cache {
namespace {

using testing::BackendBatch;
using testing::BackendWords;
using testing::Batch;
using testing::Oracle;
using testing::Tok;

struct KindParams {
  const char* preset;
  int32_t state_dtype;
};

void PrintTo(const KindParams& p, std::ostream* os) {
  *os << p.preset << " state " << rssm_dtype_name(p.state_dtype);
}

std::string KindName(const ::testing::TestParamInfo<KindParams>& info) {
  return absl::StrCat(info.param.preset[5] == 'g' ? "gdn_" : "kda_",
                      rssm_dtype_name(info.param.state_dtype));
}

// Toks for `tokens` continuing a history of `start` tokens.
std::vector<Tok> Toks(const std::vector<int32_t>& tokens, int64_t start) {
  std::vector<Tok> toks;
  for (int32_t t : tokens) toks.push_back({t, start + static_cast<int64_t>(toks.size())});
  return toks;
}

// Runs the given layers of a forward (all when `layers` < 0), in reverse order: any order is
// allowed.
absl::Status RunLayers(Forward& f, const std::vector<LayerIo>& io, int layers = -1) {
  const int n = layers < 0 ? static_cast<int>(io.size()) : layers;
  for (int l = n - 1; l >= 0; --l) {
    absl::Status st = f.RunLayer(l, io[l]);
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

class ForwardKindsTest : public ::testing::TestWithParam<KindParams> {
 protected:
  void SetUp() override {
    absl::StatusOr<ModelSpec> m = ModelPreset(GetParam().preset, GetParam().state_dtype, 4);
    ASSERT_TRUE(m.ok()) << m.status();
    m->shape.head_k = m->shape.head_v = 16;
    m->num_layers = 3;
    m->layers = SeededParams(m->shape, 3, 11, m->conv_width);
    CacheOptions o;
    o.backend = testing::TestBackend();
    o.memory_budget_bytes = 16 * m->SlotBytes();
    o.track_interval = 0;
    absl::StatusOr<std::unique_ptr<StateCache>> c = StateCache::Create(*m, o);
    ASSERT_TRUE(c.ok()) << c.status();
    cache_ = std::move(*c);
    oracle_ = std::make_unique<Oracle>(cache_->model());
  }

  const ModelSpec& model() const { return cache_->model(); }
  size_t OutBytes(int64_t n) const {
    return n * model().OutWidth() * rssm_dtype_size(model().shape.act_dtype);
  }

  // A slot whose history is `history`: its first `prefilled` tokens prefilled, the rest
  // decoded one by one (so records sit in its ring).
  SlotId Build(const std::vector<int32_t>& history, size_t prefilled) {
    const SlotId s = *cache_->Allocate();
    const std::vector<int32_t> head(history.begin(), history.begin() + prefilled);
    Batch p = oracle_->MakeBatch(Toks(head, 0));
    EXPECT_TRUE(cache_->Prefill(s, head, p.io).ok());
    for (size_t i = prefilled; i < history.size(); ++i) Decode(s, history[i], i);
    return s;
  }

  void Decode(SlotId s, int32_t token, int64_t pos, Batch* outputs = nullptr) {
    Batch b = oracle_->MakeBatch({{token, pos}});
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{s, token}});
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(RunLayers(**f, b.io).ok());
    ASSERT_TRUE((*f)->Commit().ok());
    if (outputs != nullptr) *outputs = std::move(b);
  }

  // Everything observable about a slot, bit for bit: cursors, then its exported (folded)
  // state. Export folds the slot: compare twins observed at the same point.
  std::string Observe(SlotId s) {
    absl::StatusOr<SlotInfo> info = cache_->Info(s);
    absl::StatusOr<ExportedState> e = cache_->Export(s);
    EXPECT_TRUE(info.ok() && e.ok());
    if (!info.ok() || !e.ok()) return "";
    std::string out = absl::StrCat(info->seq_len, "/", info->write_pos, "/", info->pending_drafts,
                                   "/", e->tokens.size(), ":");
    for (const std::vector<uint8_t>& c : e->checkpoints) out.append(c.begin(), c.end());
    return out;
  }

  // Outputs of token i..i+n of a batch's layer l.
  std::string Outputs(const Batch& b, int l, int64_t i, int64_t n) const {
    return std::string(reinterpret_cast<const char*>(b.out[l].data()) + OutBytes(i), OutBytes(n));
  }

  std::unique_ptr<StateCache> cache_;
  std::unique_ptr<Oracle> oracle_;
};

// A prefill on backend memory longer than max_batch tokens: the convolution's outputs still go
// to the lane's scratch, which Start sized for max_batch tokens (it overflowed before).
TEST_P(ForwardKindsTest, ALongPrefillOnBackendMemoryEqualsHostMemoryBitForBit) {
  std::vector<int32_t> tokens;
  for (int i = 0; i < 300; ++i) tokens.push_back(i % 7);
  ASSERT_GT(static_cast<int64_t>(tokens.size()), cache_->options().max_batch);
  Batch host = oracle_->MakeBatch(Toks(tokens, 0)), dev_out = oracle_->MakeBatch(Toks(tokens, 0));
  const SlotId a = *cache_->Allocate(), b = *cache_->Allocate();
  ASSERT_TRUE(cache_->Prefill(a, tokens, host.io).ok());
  BackendBatch dev(cache_->options().backend, host);
  ASSERT_TRUE(cache_->Prefill(b, tokens, dev.io).ok());
  dev.CopyOutputsTo(dev_out);
  for (int l = 0; l < model().num_layers; ++l) {
    EXPECT_EQ(Outputs(dev_out, l, 0, 300), Outputs(host, l, 0, 300)) << "layer " << l;
  }
  EXPECT_EQ(Observe(b), Observe(a));
}

TEST_P(ForwardKindsTest, LayerByLayerPrefillEqualsUnaryPrefillBitForBit) {
  const std::vector<int32_t> ha = {1, 2, 3, 4, 5}, hb = {7, 8};
  const std::vector<int32_t> x = {11, 12, 13, 14, 15, 16}, y = {21};  // x is longer than L
  for (IoMemory memory : {IoMemory::kHost, IoMemory::kBackend}) {
    SCOPED_TRACE(memory == IoMemory::kHost ? "host memory" : "backend memory");
    const SlotId a1 = Build(ha, 3), a2 = Build(ha, 3), b1 = Build(hb, 1), b2 = Build(hb, 1);
    Batch ux = oracle_->MakeBatch(Toks(x, 5)), uy = oracle_->MakeBatch(Toks(y, 2));
    ASSERT_TRUE(cache_->Prefill(a1, x, ux.io).ok());
    ASSERT_TRUE(cache_->Prefill(b1, y, uy.io).ok());

    std::vector<Tok> packed = Toks(x, 5);
    for (const Tok& t : Toks(y, 2)) packed.push_back(t);
    Batch s = oracle_->MakeBatch(packed);
    std::unique_ptr<BackendBatch> dev;
    if (memory == IoMemory::kBackend)
      dev = std::make_unique<BackendBatch>(cache_->options().backend, s);
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefill({{a2, x}, {b2, y}});
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->batch(), 2);
    EXPECT_EQ((*f)->tokens(), 7);
    ASSERT_TRUE(RunLayers(**f, dev ? dev->io : s.io).ok());
    ASSERT_TRUE((*f)->Commit().ok());
    if (dev) dev->CopyOutputsTo(s);
    for (int l = 0; l < model().num_layers; ++l) {
      EXPECT_EQ(Outputs(s, l, 0, 6), Outputs(ux, l, 0, 6)) << "layer " << l;
      EXPECT_EQ(Outputs(s, l, 6, 1), Outputs(uy, l, 0, 1)) << "layer " << l;
    }
    EXPECT_EQ(cache_->Info(a2)->seq_len, 11);
    EXPECT_EQ(cache_->Info(a2)->write_pos, 0);
    EXPECT_EQ(Observe(a2), Observe(a1));
    EXPECT_EQ(Observe(b2), Observe(b1));
    // ... and the outputs are the recurrence's.
    // Measured: < 1e-5 with an fp32 state, 2.6e-4 at worst with a 16-bit one. The bound was
    // 3e-2 for every dtype, loose enough to pass an fp32 regression of 1e-2 (an outside review).
    const double tol = GetParam().state_dtype == RSSM_DTYPE_F32 ? 1e-4 : 2e-3;
    Oracle::State ref = oracle_->Run(ha, 5);
    for (size_t i = 0; i < x.size(); ++i) {
      const Oracle::Outputs want = oracle_->Step(ref, {x[i], 5 + static_cast<int64_t>(i)});
      for (int l = 0; l < model().num_layers; ++l) {
        EXPECT_LE(testing::RelErr(s.Output(model(), l, i), want[l]), tol) << "layer " << l;
      }
    }
    for (SlotId id : {a1, a2, b1, b2}) ASSERT_TRUE(cache_->Free(id).ok());
  }
  EXPECT_EQ(cache_->stats().slots_free, cache_->capacity()) << "every spare slot returned";
}

TEST_P(ForwardKindsTest, LayerByLayerVerifyEqualsUnaryVerifyBitForBit) {
  const std::vector<int32_t> ha = {1, 2, 3, 4, 5}, hb = {7, 8, 9};
  for (int32_t T : {1, 3}) {  // T = 3 folds a (w = 2) and b (w = 2) at begin
    SCOPED_TRACE(absl::StrCat("T = ", T));
    const SlotId a1 = Build(ha, 3), a2 = Build(ha, 3), b1 = Build(hb, 1), b2 = Build(hb, 1);
    std::vector<int32_t> drafts;
    std::vector<Tok> toks;
    for (int r = 0; r < 2; ++r) {
      for (int t = 0; t < T; ++t) {
        drafts.push_back(30 + 10 * r + t);
        toks.push_back({drafts.back(), (r == 0 ? 5 : 3) + t});
      }
    }
    Batch u = oracle_->MakeBatch(toks), s = oracle_->MakeBatch(toks);
    ASSERT_TRUE(cache_->Verify({a1, b1}, T, drafts, u.io).ok());
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginVerify({a2, b2}, T, drafts);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->tokens(), 2 * T);
    ASSERT_TRUE(RunLayers(**f, s.io).ok());
    ASSERT_TRUE((*f)->Commit().ok());
    for (int l = 0; l < model().num_layers; ++l) {
      EXPECT_EQ(Outputs(s, l, 0, 2 * T), Outputs(u, l, 0, 2 * T)) << "layer " << l;
    }
    EXPECT_EQ(cache_->Info(a2)->pending_drafts, T);
    EXPECT_EQ(cache_->Info(a2)->seq_len, 5) << "nothing advances before Accept";
    ASSERT_TRUE(cache_->Accept(a1, T - 1).ok());
    ASSERT_TRUE(cache_->Accept(a2, T - 1).ok());
    ASSERT_TRUE(cache_->Accept(b1, T).ok());
    ASSERT_TRUE(cache_->Accept(b2, T).ok());
    EXPECT_EQ(Observe(a2), Observe(a1));
    EXPECT_EQ(Observe(b2), Observe(b1));
    for (SlotId id : {a1, a2, b1, b2}) ASSERT_TRUE(cache_->Free(id).ok());
  }
}

// ContinueForward: decode forwards chained on one stream, each committed when the next one
// begins, give the outputs and states of forwards committed one by one, across ring folds.
TEST_P(ForwardKindsTest, ContinuedDecodeForwardsEqualCommittedOnesBitForBit) {
  const SlotId a1 = Build({1, 2, 3}, 2), c1 = Build({4, 5}, 1);
  const SlotId a2 = Build({1, 2, 3}, 2), c2 = Build({4, 5}, 1);
  std::unique_ptr<Forward> chain;
  for (int step = 0; step < 7; ++step) {  // L = 4: every row folds on the way
    const int32_t t = 20 + step;
    const std::vector<Tok> toks = {{t, 3 + step}, {t, 2 + step}};
    Batch want = oracle_->MakeBatch(toks), got = oracle_->MakeBatch(toks);
    BackendBatch want_dev(cache_->options().backend, want), got_dev(cache_->options().backend, got);
    // One by one.
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a2, t}, {c2, t}});
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(RunLayers(**f, want_dev.io).ok());
    ASSERT_TRUE((*f)->Commit().ok());
    want_dev.CopyOutputsTo(want);
    // Chained: the previous forward is committed by the next one's begin, not waited for.
    const std::vector<DecodeRow> rows = {{a1, t}, {c1, t}};
    absl::StatusOr<std::unique_ptr<Forward>> next =
        chain ? cache_->ContinueForward(chain, rows) : cache_->BeginForward(rows);
    ASSERT_TRUE(next.ok()) << next.status();
    ASSERT_NE(*next, nullptr) << "step " << step;
    EXPECT_EQ(chain, nullptr);  // taken over
    chain = *std::move(next);
    ASSERT_TRUE(RunLayers(*chain, got_dev.io).ok());
    ASSERT_TRUE(chain->Synchronize().ok());
    got_dev.CopyOutputsTo(got);
    for (int l = 0; l < model().num_layers; ++l) EXPECT_EQ(got.out[l], want.out[l]) << step;
    // The rows stay held while the chain is open.
    EXPECT_EQ(cache_->BeginForward({{a1, t}}).status().code(),
              absl::StatusCode::kFailedPrecondition);
  }
  ASSERT_TRUE(chain->Commit().ok());
  chain.reset();
  EXPECT_EQ(Observe(a1), Observe(a2));
  EXPECT_EQ(Observe(c1), Observe(c2));
  EXPECT_EQ(cache_->Info(a1)->seq_len, 10);
}

TEST_P(ForwardKindsTest, ContinueForwardLeavesOtherRowsToTheCaller) {
  const SlotId a = Build({1, 2}, 2), b = Build({3, 4}, 2);
  const std::string before_b = Observe(b);
  Batch in = oracle_->MakeBatch({{7, 2}});
  absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a, 7}});
  ASSERT_TRUE(f.ok()) << f.status();
  std::unique_ptr<Forward> prev = *std::move(f);
  // Not every layer queued yet: not continuable.
  absl::StatusOr<std::unique_ptr<Forward>> next = cache_->ContinueForward(prev, {{a, 8}});
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(*next, nullptr);
  ASSERT_TRUE(RunLayers(*prev, in.io).ok());
  // Other slots, more rows, padding in another place: null, previous untouched.
  for (const std::vector<DecodeRow>& rows :
       {std::vector<DecodeRow>{{b, 8}}, std::vector<DecodeRow>{{a, 8}, {b, 8}},
        std::vector<DecodeRow>{{kPaddingSlot, 0}}}) {
    next = cache_->ContinueForward(prev, rows);
    ASSERT_TRUE(next.ok()) << next.status();
    EXPECT_EQ(*next, nullptr);
    ASSERT_NE(prev, nullptr);
  }
  ASSERT_TRUE(prev->Commit().ok());
  EXPECT_EQ(cache_->Info(a)->seq_len, 3);
  EXPECT_EQ(Observe(b), before_b);
}

TEST_P(ForwardKindsTest, AForwardAbandonedAfterAnyLayerChangesNothing) {
  const std::vector<int32_t> h = {1, 2, 3, 4, 5};  // prefilled 3, decoded 2: w = 2
  const int layers = model().num_layers;
  for (bool prefill : {true, false}) {
    for (int k = 0; k <= layers; ++k) {  // k = layers: every layer ran, no commit
      SCOPED_TRACE(absl::StrCat(prefill ? "prefill" : "verify", " abandoned after ", k, " layers"));
      const SlotId a = Build(h, 3), twin = Build(h, 3);
      const int64_t free_before = cache_->stats().slots_free;
      const std::vector<int32_t> x = {40, 41, 42, 43, 44}, drafts = {50, 51};  // w + T = L: no fold
      {
        Batch b = oracle_->MakeBatch(Toks(prefill ? x : drafts, 5));
        std::unique_ptr<BackendBatch> dev;
        if (k % 2 == 1) dev = std::make_unique<BackendBatch>(cache_->options().backend, b);
        absl::StatusOr<std::unique_ptr<Forward>> f =
            prefill ? cache_->BeginPrefill({{a, x}}) : cache_->BeginVerify({a}, 2, drafts);
        ASSERT_TRUE(f.ok()) << f.status();
        if (prefill) {
          EXPECT_EQ(cache_->stats().slots_free, free_before - 1) << "its spare slot";
        }
        for (int l = 0; l < k; ++l) ASSERT_TRUE((*f)->RunLayer(l, dev ? dev->io[l] : b.io[l]).ok());
      }
      EXPECT_EQ(cache_->stats().slots_free, free_before);
      EXPECT_EQ(cache_->Info(a)->write_pos, 2);
      EXPECT_EQ(cache_->Info(a)->seq_len, 5);
      EXPECT_EQ(cache_->Info(a)->pending_drafts, 0);
      // The slot is usable and goes on exactly like its twin (the ring is read, then folded).
      Batch oa, ot;
      Decode(a, 9, 5, &oa);
      Decode(twin, 9, 5, &ot);
      for (int l = 0; l < layers; ++l) EXPECT_EQ(Outputs(oa, l, 0, 1), Outputs(ot, l, 0, 1));
      EXPECT_EQ(Observe(a), Observe(twin));
      ASSERT_TRUE(cache_->Free(a).ok());
      ASSERT_TRUE(cache_->Free(twin).ok());
    }
  }
  EXPECT_EQ(cache_->stats().forwards_abandoned, 0) << "the counters are decode forwards'";
}

// RunLayers: every layer queued at once, with and without doorbells, gives the outputs and
// states of layer-by-layer forwards, bit for bit, across ring folds. On CUDA a key's first
// forward runs call by call and its repeats as one recording, whose doorbells take each
// forward's own value (a fresh one every forward here); the CPU never records.
TEST_P(ForwardKindsTest, DecodeForwardsQueuedAtOnceEqualLayerByLayerOnesBitForBit) {
  const int32_t backend = cache_->options().backend;
  const int layers = model().num_layers;
  const SlotId a1 = Build({1, 2, 3}, 2), c1 = Build({4, 5}, 1);
  const SlotId a2 = Build({1, 2, 3}, 2), c2 = Build({4, 5}, 1);
  // One set of buffers and doorbells for every forward: a recording's key is its addresses.
  BackendBatch dev(backend, oracle_->MakeBatch({{0, 0}, {0, 0}}));
  BackendWords words(backend, 2 * layers);  // ready[l] = l, done[l] = layers + l
  std::vector<LayerDoorbells> bells(layers);
  for (int l = 0; l < layers; ++l) bells[l] = {words.at(l), words.at(layers + l)};
  const CacheStats before = cache_->stats();
  for (int step = 0; step < 9; ++step) {  // L = 4: every row folds on the way
    SCOPED_TRACE(step);
    const int32_t t = 20 + step;
    const std::vector<Tok> toks = {{t, 3 + step}, {t, 2 + step}};
    Batch want = oracle_->MakeBatch(toks), got = oracle_->MakeBatch(toks);
    {
      BackendBatch want_dev(backend, want);
      absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a2, t}, {c2, t}});
      ASSERT_TRUE(f.ok()) << f.status();
      ASSERT_TRUE(RunLayers(**f, want_dev.io).ok());
      ASSERT_TRUE((*f)->Commit().ok());
      want_dev.CopyOutputsTo(want);
    }
    dev.CopyInputsFrom(got);
    // Doorbells on the even steps, none on the odd ones: two keys, recorded side by side.
    const bool ringing = step % 2 == 0;
    const uint32_t value = 1000 + 17 * step;
    words.Fill(value, 0, layers);  // every ready word rung
    words.Fill(0, layers);
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a1, t}, {c1, t}});
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE(
        (*f)->RunLayers(dev.io, ringing ? bells : std::vector<LayerDoorbells>{}, value).ok());
    ASSERT_TRUE((*f)->Commit().ok());
    dev.CopyOutputsTo(got);
    for (int l = 0; l < layers; ++l) EXPECT_EQ(got.out[l], want.out[l]) << "layer " << l;
    const std::vector<uint32_t> w = words.Read();
    for (int l = 0; l < layers; ++l) EXPECT_EQ(w[layers + l], ringing ? value : 0u) << l;
  }
  EXPECT_TRUE(Observe(a1) == Observe(a2));
  EXPECT_TRUE(Observe(c1) == Observe(c2));
  const CacheStats after = cache_->stats();
  const bool records = backend == RSSM_BACKEND_CUDA;
  // Steps 0 and 1 call by call (each key's first), 2 and 3 record, 2..8 launch recordings.
  EXPECT_EQ(after.forward_recordings - before.forward_recordings, records ? 2 : 0);
  EXPECT_EQ(after.forwards_graphed - before.forwards_graphed, records ? 7 : 0);
  EXPECT_EQ(after.forward_recording_failures, 0);
}

// A release can land before some waits were issued (between two layers' doorbells): those
// waits are skipped but counted, unrung unless their word was rung by then, so ReleaseWaits
// asked again once every layer was queued names the first layer whose inputs never came.
// (Before, a release between waits saw only the ones issued: a forward whose later layers ran
// on inputs nobody rang was committed.)
TEST_P(ForwardKindsTest, WaitsIssuedAfterAReleaseCountAsUnrungUnlessRung) {
  const int32_t backend = cache_->options().backend;
  const int layers = model().num_layers;
  ASSERT_GE(layers, 2);
  const SlotId a = Build({1, 2, 3}, 2);
  BackendBatch dev(backend, oracle_->MakeBatch({{7, 3}}));
  BackendWords words(backend, 2 * layers);
  std::vector<LayerDoorbells> bells(layers);
  for (int l = 0; l < layers; ++l) bells[l] = {words.at(l), words.at(layers + l)};
  Observe(a);  // folded by its export: observed again at write_pos 0
  const std::string before = Observe(a);
  for (const int rung : {0, 1, layers}) {  // layers whose ready word was rung before the release
    SCOPED_TRACE(rung);
    words.Fill(0);
    words.Fill(3, 0, rung);
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a, 7}});
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ((*f)->ReleaseWaits(), -1) << "no wait issued yet";
    ASSERT_TRUE((*f)->RunLayers(dev.io, bells, 3).ok()) << "released: nothing blocks";
    ASSERT_TRUE((*f)->Synchronize().ok()) << "released: the stream drains";
    EXPECT_EQ((*f)->ReleaseWaits(), rung < layers ? rung : -1);
    EXPECT_EQ(words.Read()[rung < layers ? rung : 0], rung < layers ? 0u : 3u)
        << "a skipped word is not written";
  }  // abandoned
  EXPECT_TRUE(Observe(a) == before);
}

// A forward queued at once whose doorbells are never rung (recorded on CUDA: its key ran
// twice before) drains once ReleaseWaits rings them, names the first unrung wait, and,
// abandoned, changes nothing.
TEST_P(ForwardKindsTest, AnUnrungForwardQueuedAtOnceIsReleasedAndChangesNothing) {
  const int32_t backend = cache_->options().backend;
  const int layers = model().num_layers;
  const SlotId a = Build({1, 2, 3}, 2), twin = Build({1, 2, 3}, 2);
  BackendBatch dev(backend, oracle_->MakeBatch({{7, 3}}));
  BackendWords words(backend, 2 * layers);
  std::vector<LayerDoorbells> bells(layers);
  for (int l = 0; l < layers; ++l) bells[l] = {words.at(l), words.at(layers + l)};
  for (int step = 0; step < 2; ++step) {  // rung: the key's first run, then its recording
    words.Fill(5 + step, 0, layers);
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a, 7}});
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE((*f)->RunLayers(dev.io, bells, 5 + step).ok());
    ASSERT_TRUE((*f)->Commit().ok());
    Decode(twin, 7, 3);  // the inputs dev holds
  }
  Observe(a);  // both folded by their export: observed again at write_pos 0
  Observe(twin);
  const std::string before = Observe(a);
  ASSERT_TRUE(before == Observe(twin));
  const int64_t graphed = cache_->stats().forwards_graphed;
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a, 7}});
    ASSERT_TRUE(f.ok()) << f.status();
    absl::Status queued;
    // CPU: RunLayers blocks on layer 0's doorbell until released.
    std::thread driver([&] { queued = (*f)->RunLayers(dev.io, bells, 9); });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    (*f)->ReleaseWaits();  // its answer so far: the waits decide as they end
    driver.join();
    EXPECT_TRUE(queued.ok()) << queued;
    EXPECT_TRUE((*f)->Synchronize().ok()) << "the stream drained";
    EXPECT_EQ((*f)->ReleaseWaits(), 0) << "layer 0's doorbell was never rung";
  }  // abandoned
  EXPECT_EQ(cache_->stats().forwards_graphed - graphed, backend == RSSM_BACKEND_CUDA ? 1 : 0);
  EXPECT_TRUE(Observe(a) == before);
  Batch oa, ot;
  Decode(a, 8, 5, &oa);
  Decode(twin, 8, 5, &ot);
  for (int l = 0; l < layers; ++l) EXPECT_EQ(Outputs(oa, l, 0, 1), Outputs(ot, l, 0, 1));
}

// A chain never synchronizes its lane, so the lane's pinned staging buffer fills up; a forward
// whose uploads would have to wait for the buffer (so for the forward before it, so for the
// engine's doorbells, on the thread handing the forward over) is not continued: the caller
// commits previous the usual way, and the chain goes on from there.
TEST_P(ForwardKindsTest, AChainWhoseStagingIsFullIsCommittedTheUsualWay) {
  const int32_t backend = cache_->options().backend;
  const SlotId a = Build({1, 2, 3}, 2);
  BackendBatch dev(backend, oracle_->MakeBatch({{7, 3}}));
  absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a, 7}});
  ASSERT_TRUE(f.ok()) << f.status();
  std::unique_ptr<Forward> chain = *std::move(f);
  int64_t tokens = 3, refused_at = -1;
  for (int step = 0; step < 100000 && refused_at < 0; ++step) {
    ASSERT_TRUE(RunLayers(*chain, dev.io).ok());
    absl::StatusOr<std::unique_ptr<Forward>> next = cache_->ContinueForward(chain, {{a, 7}});
    ASSERT_TRUE(next.ok()) << next.status();
    if (*next == nullptr) {
      refused_at = step;
      break;
    }
    chain = *std::move(next);
    ++tokens;
  }
  ASSERT_GT(refused_at, 0) << "the staging buffer never filled";
  ASSERT_TRUE(chain->Commit().ok());
  ++tokens;
  chain.reset();
  EXPECT_EQ(cache_->Info(a)->seq_len, tokens);
  f = cache_->BeginForward({{a, 7}});  // the lane synchronized: a chain continues again
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(RunLayers(**f, dev.io).ok());
  absl::StatusOr<std::unique_ptr<Forward>> next = cache_->ContinueForward(*f, {{a, 7}});
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_NE(*next, nullptr);
  ASSERT_TRUE(RunLayers(**next, dev.io).ok());
  EXPECT_TRUE((*next)->Commit().ok());
  EXPECT_EQ(cache_->Info(a)->seq_len, tokens + 2);
}

// A continuation refused by a check after the predecessor's (here: other rows) leaves the
// forward as it was: its ReleaseWaits still counts the predecessor's waits first, so its own
// layer 0 is wait L. The predecessor used to be let go by the check that confirmed it, before
// the row checks: the index then dropped to 0 and the service, reading it as the
// predecessor's layer, answered DATA_LOSS "rows are broken" for a forward it had abandoned.
TEST_P(ForwardKindsTest, ARefusedContinuationLeavesThePredecessorCounted) {
  const int32_t backend = cache_->options().backend;
  const int layers = model().num_layers;
  const SlotId a = Build({1, 2, 3}, 2), b = Build({4, 5}, 1);
  BackendBatch dev(backend, oracle_->MakeBatch({{7, 3}}));
  BackendWords words(backend, 2 * layers);
  std::vector<LayerDoorbells> bells(layers);
  for (int l = 0; l < layers; ++l) bells[l] = {words.at(l), words.at(layers + l)};
  words.Fill(1, 0, layers);  // the first forward's ready doorbells: rung
  absl::StatusOr<std::unique_ptr<Forward>> first = cache_->BeginForward({{a, 7}});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->RunLayers(dev.io, bells, 1).ok());
  absl::StatusOr<std::unique_ptr<Forward>> second = cache_->ContinueForward(*first, {{a, 8}});
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_NE(*second, nullptr);
  absl::Status queued;
  // The second forward's doorbells (value 2) never ring; CPU: RunLayers blocks on layer 0.
  std::thread driver([&] { queued = (*second)->RunLayers(dev.io, bells, 2); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  (*second)->ReleaseWaits();  // what it names depends on how far the driver got; asked below
  driver.join();
  ASSERT_TRUE(queued.ok()) << queued;
  ASSERT_TRUE((*second)->Synchronize().ok());  // the first's work is done: confirmable
  EXPECT_EQ((*second)->ReleaseWaits(), layers) << "its own layer 0, after the first's waits";
  EXPECT_FALSE(cache_->CanContinueForward(**second, {{b, 8}}));
  absl::StatusOr<std::unique_ptr<Forward>> third = cache_->ContinueForward(*second, {{b, 8}});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(*third, nullptr) << "other rows";
  EXPECT_EQ((*second)->ReleaseWaits(), layers) << "the first's waits still come first";
  second->reset();  // abandoned: the first stays committed, the second changes nothing
  EXPECT_EQ(cache_->Info(a)->seq_len, 4);
  EXPECT_EQ(cache_->Info(b)->seq_len, 2);
}

// A chain confirms the forward two back done by the event the cache recorded at its end, not
// by its last done word: that word is in the engine's memory, and an engine that writes it
// itself while the forward's work still waits on its doorbells must not have that work
// confirmed (the server would let the forward's regions go under it). CUDA only: on the CPU a
// forward's layers have run when RunLayers returns, so no work can be left waiting.
TEST_P(ForwardKindsTest, AChainConfirmsItsPredecessorByItsOwnEventNotByTheDoneWord) {
  const int32_t backend = cache_->options().backend;
  if (backend != RSSM_BACKEND_CUDA) GTEST_SKIP() << "CPU layers run when they are queued";
  const int layers = model().num_layers;
  const SlotId a = Build({1, 2, 3}, 2);
  BackendBatch dev(backend, oracle_->MakeBatch({{7, 3}}));
  BackendWords words(backend, 2 * layers);
  std::vector<LayerDoorbells> bells(layers);
  for (int l = 0; l < layers; ++l) bells[l] = {words.at(l), words.at(layers + l)};
  absl::StatusOr<std::unique_ptr<Forward>> first = cache_->BeginForward({{a, 7}});
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE((*first)->RunLayers(dev.io, bells, 1).ok());  // queued behind layer 0's wait
  words.Fill(1, 2 * layers - 1, 2 * layers);  // the engine writes the last done word itself
  absl::StatusOr<std::unique_ptr<Forward>> second = cache_->ContinueForward(*first, {{a, 8}});
  ASSERT_TRUE(second.ok()) << second.status();
  ASSERT_NE(*second, nullptr) << "the first forward has no predecessor to confirm";
  ASSERT_TRUE((*second)->RunLayers(dev.io, bells, 2).ok());
  absl::StatusOr<std::unique_ptr<Forward>> third = cache_->ContinueForward(*second, {{a, 9}});
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_EQ(*third, nullptr);  // continued past a forward whose work has not run
  words.Fill(2, 0, layers);    // every ready doorbell rung: the chain drains
  std::unique_ptr<Forward>& open = *third != nullptr ? *third : *second;
  if (*third != nullptr) {
    ASSERT_TRUE(open->RunLayers(dev.io, bells, 2).ok());
  }
  EXPECT_TRUE(open->Commit().ok());
  EXPECT_EQ(cache_->Info(a)->seq_len, *third != nullptr ? 6 : 5) << "3 tokens, then the chain";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ForwardKindsTest,
                         ::testing::Values(KindParams{"tiny-gdn", RSSM_DTYPE_F32},
                                           KindParams{"tiny-gdn", RSSM_DTYPE_BF16},
                                           KindParams{"tiny-gdn", RSSM_DTYPE_F16},
                                           KindParams{"tiny-kda", RSSM_DTYPE_F32},
                                           KindParams{"tiny-kda", RSSM_DTYPE_BF16},
                                           KindParams{"tiny-kda", RSSM_DTYPE_F16}),
                         KindName);

class ForwardRulesTest : public ::testing::Test {
 protected:
  void Make(int64_t slots, int32_t track = 0, int64_t host_snapshots = 0) {
    const ModelSpec m = testing::TwoLayerTinyGdn();
    CacheOptions o = testing::TestOptions(m, slots);
    o.track_interval = track;
    o.host_snapshot_bytes = host_snapshots * m.SlotBytes();
    o.max_prefill_tokens = 8;
    cache_ = std::move(*StateCache::Create(m, o));
    oracle_ = std::make_unique<Oracle>(cache_->model());
  }

  std::unique_ptr<StateCache> cache_;
  std::unique_ptr<Oracle> oracle_;
};

TEST_F(ForwardRulesTest, APrefillWithoutASpareSlotIsRefusedAndTakesNothing) {
  Make(3);
  const SlotId a = *cache_->Allocate(), b = *cache_->Allocate();
  const std::vector<int32_t> x = {1, 2}, y = {3};
  const absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefill({{a, x}, {b, y}});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kResourceExhausted) << f.status();
  EXPECT_NE(f.status().message().find("spare slot"), std::string::npos) << f.status();
  EXPECT_EQ(cache_->stats().slots_free, 1);
  // Neither row is held: both can start another forward; one row fits the spare left.
  EXPECT_TRUE(cache_->BeginForward({{a, 1}, {b, 2}}).ok());
  absl::StatusOr<std::unique_ptr<Forward>> g = cache_->BeginPrefill({{b, y}});
  ASSERT_TRUE(g.ok()) << g.status();
  Batch batch = oracle_->MakeBatch({{3, 0}});
  ASSERT_TRUE(RunLayers(**g, batch.io).ok());
  ASSERT_TRUE((*g)->Commit().ok());
  EXPECT_EQ(cache_->Info(b)->seq_len, 1);
  EXPECT_EQ(cache_->stats().slots_free, 1);
}

TEST_F(ForwardRulesTest, ASnapshotIsEvictedForASpareSlotAndAPrefillEndingOnABoundarySnapshots) {
  Make(3, /*track=*/3);
  const SlotId a = *cache_->Allocate();
  const std::vector<int32_t> p = {1, 2};
  Batch pb = oracle_->MakeBatch(Toks(p, 0));
  ASSERT_TRUE(cache_->Prefill(a, p, pb.io).ok());
  ASSERT_TRUE(cache_->Donate(a).ok());
  const SlotId b = *cache_->Allocate(), c = *cache_->Allocate();  // b evicted nothing
  EXPECT_EQ(cache_->stats().slots_snapshot, 1);
  EXPECT_EQ(cache_->stats().slots_free, 0);
  const std::vector<int32_t> x = {5, 6, 7};
  absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefill({{b, x}});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(cache_->stats().snapshot_evictions, 1);
  Batch xb = oracle_->MakeBatch(Toks(x, 0));
  ASSERT_TRUE(RunLayers(**f, xb.io).ok());
  ASSERT_TRUE((*f)->Commit().ok());
  EXPECT_EQ(cache_->Info(b)->seq_len, 3);
  EXPECT_EQ(cache_->stats().snapshots_taken, 1) << "seq_len 3 ends on the track boundary";
  EXPECT_EQ(cache_->MatchPrefix(x), 3);
  EXPECT_TRUE(cache_->Info(c).ok());
}

TEST_F(ForwardRulesTest, BadBeginsAndLayerCallsAreRefusedAndChangeNothing) {
  Make(4);
  const SlotId a = *cache_->Allocate(), b = *cache_->Allocate();
  const std::vector<int32_t> none, one = {1}, nine(9, 1);
  EXPECT_EQ(cache_->BeginPrefill({}).status().code(), absl::StatusCode::kInvalidArgument);
  const absl::Status empty = cache_->BeginPrefill({{a, one}, {b, none}}).status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(empty.message().find("rows[1].tokens"), std::string::npos) << empty;
  EXPECT_EQ(cache_->BeginPrefill({{a, nine}}).status().code(), absl::StatusCode::kInvalidArgument)
      << "more than max_prefill_tokens";
  EXPECT_EQ(cache_->BeginPrefill({{a, one}, {a, one}}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->BeginVerify({a}, 5, {1, 2, 3, 4, 5}).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->BeginVerify({a}, 2, {1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->stats().slots_free, 2);
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefill({{a, one}});
    ASSERT_TRUE(f.ok());
    EXPECT_EQ(cache_->BeginVerify({a}, 1, {1}).status().code(),
              absl::StatusCode::kFailedPrecondition)
        << "a slot in an open prefill";
    EXPECT_EQ(cache_->Prefill(a, one, oracle_->MakeBatch({{1, 0}}).io).code(),
              absl::StatusCode::kFailedPrecondition);
    Batch batch = oracle_->MakeBatch({{1, 0}});
    EXPECT_EQ((*f)->RunLayer(2, batch.io[0]).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE((*f)->RunLayer(0, batch.io[0]).ok());
    EXPECT_EQ((*f)->RunLayer(0, batch.io[0]).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ((*f)->Commit().code(), absl::StatusCode::kFailedPrecondition) << "layer 1 missing";
  }
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginVerify({a}, 1, {1});
    ASSERT_TRUE(f.ok());
    Batch batch = oracle_->MakeBatch({{1, 0}});
    LayerIo no_out = batch.io[0];
    no_out.out = nullptr;
    EXPECT_EQ((*f)->RunLayer(0, no_out).code(), absl::StatusCode::kInvalidArgument)
        << "a verify's outputs are its point";
  }
  EXPECT_EQ(cache_->Info(a)->seq_len, 0);
  EXPECT_EQ(cache_->Info(a)->pending_drafts, 0);
  EXPECT_EQ(cache_->stats().slots_free, 2);
}

// RunLayers checks every argument before it queues anything: a refused call leaves the
// forward as it was, and the same forward then runs and commits as its twin does.
TEST_F(ForwardRulesTest, RunLayersChecksEverythingFirstAndARefusalChangesNothing) {
  Make(4);
  const int32_t backend = cache_->options().backend;
  const SlotId a = *cache_->Allocate(), twin = *cache_->Allocate();
  Batch batch = oracle_->MakeBatch({{3, 0}}), want = oracle_->MakeBatch({{3, 0}});
  BackendBatch dev(backend, batch);
  BackendWords words(backend, 5);
  words.Fill(1);
  const std::vector<LayerDoorbells> bells = {{words.at(0), words.at(1)},
                                             {words.at(2), words.at(3)}};
  absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a, 3}});
  ASSERT_TRUE(f.ok()) << f.status();
  auto refused = [&](std::vector<LayerIo> io, std::vector<LayerDoorbells> b, absl::StatusCode code,
                     const std::string& says) {
    const absl::Status st = (*f)->RunLayers(io, b, 1);
    EXPECT_EQ(st.code(), code) << st;
    EXPECT_NE(st.message().find(says), std::string::npos) << st;
  };
  const absl::StatusCode invalid = absl::StatusCode::kInvalidArgument;
  refused({dev.io[0]}, {}, invalid, "layers: expected 2 layers of inputs, got 1");
  std::vector<LayerIo> missing = dev.io;
  missing[1].b = nullptr;
  refused(missing, {}, invalid, "layers[1]: expected mixed_qkv, a, b and out buffers");
  refused(dev.io, {bells[0]}, invalid, "bells: expected none or 2 layers' doorbells, got 1");
  std::vector<LayerDoorbells> bad = bells;
  bad[1].done = nullptr;
  refused(dev.io, bad, invalid, "bells[1].done: expected a doorbell word, got NULL");
  bad = bells;
  bad[0].ready = reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(words.at(4)) + 2);
  refused(dev.io, bad, invalid, "bells[0].ready: expected a 4-byte aligned word, got one 2 bytes");
  EXPECT_EQ(words.Read(), std::vector<uint32_t>(5, 1)) << "no doorbell written";
  // Nothing was queued: the forward runs now and matches its twin.
  ASSERT_TRUE((*f)->RunLayers(dev.io, bells, 1).ok());
  ASSERT_TRUE((*f)->Commit().ok());
  dev.CopyOutputsTo(batch);
  absl::StatusOr<std::unique_ptr<Forward>> g = cache_->BeginForward({{twin, 3}});
  ASSERT_TRUE(g.ok()) << g.status();
  ASSERT_TRUE(RunLayers(**g, want.io).ok());
  ASSERT_TRUE((*g)->Commit().ok());
  EXPECT_EQ(batch.out, want.out);
  EXPECT_EQ(cache_->Info(a)->seq_len, 1);
  // A layer that ran already: refused, and the forward goes on layer by layer.
  absl::StatusOr<std::unique_ptr<Forward>> h = cache_->BeginForward({{a, 4}});
  ASSERT_TRUE(h.ok()) << h.status();
  Batch next = oracle_->MakeBatch({{4, 1}});
  ASSERT_TRUE((*h)->RunLayer(0, next.io[0]).ok());
  const absl::Status again = (*h)->RunLayers(next.io, {}, 0);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_NE(again.message().find("layer 0 already ran"), std::string::npos) << again;
  ASSERT_TRUE((*h)->RunLayer(1, next.io[1]).ok());
  ASSERT_TRUE((*h)->Commit().ok());
  EXPECT_EQ(cache_->Info(a)->seq_len, 2);
}

// A verify refused or abandoned before its first layer keeps the drafts waiting from the last
// one (nothing overwrote their records); once a layer ran they are gone.
TEST_F(ForwardRulesTest, AVerifyAbandonedBeforeItsFirstLayerKeepsTheWaitingDrafts) {
  Make(3);
  const SlotId a = *cache_->Allocate();
  const std::vector<int32_t> p = {1, 2, 3};
  ASSERT_TRUE(cache_->Prefill(a, p, oracle_->MakeBatch(Toks(p, 0)).io).ok());
  const std::vector<int32_t> drafts = {4, 5};
  Batch d = oracle_->MakeBatch(Toks(drafts, 3));
  ASSERT_TRUE(cache_->Verify({a}, 2, drafts, d.io).ok());
  ASSERT_EQ(cache_->Info(a)->pending_drafts, 2);
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginVerify({a}, 2, {6, 7});
    ASSERT_TRUE(f.ok()) << f.status();
    LayerIo no_out = d.io[0];
    no_out.out = nullptr;
    EXPECT_EQ((*f)->RunLayer(0, no_out).code(), absl::StatusCode::kInvalidArgument);
  }  // abandoned
  EXPECT_EQ(cache_->Info(a)->pending_drafts, 2) << "no layer ran";
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginVerify({a}, 2, {6, 7});
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE((*f)->RunLayer(0, d.io[0]).ok());
    EXPECT_EQ(cache_->Info(a)->pending_drafts, 0) << "layer 0's records overwrote theirs";
  }
  EXPECT_EQ(cache_->Info(a)->pending_drafts, 0);
  EXPECT_EQ(cache_->Accept(a, 1).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(cache_->Verify({a}, 2, drafts, d.io).ok());
  ASSERT_TRUE(cache_->Accept(a, 2).ok());
  EXPECT_EQ(cache_->Info(a)->seq_len, 5);
}

// Accepted drafts that land exactly on a track boundary snapshot it; ones that jump over one do
// not (that state never existed folded): docs/cache.md's rule, untested until an outside review.
TEST_F(ForwardRulesTest, AnAcceptOnATrackBoundarySnapshotsItAndOneOverItDoesNot) {
  Make(4, /*track=*/4);
  const SlotId a = *cache_->Allocate(), b = *cache_->Allocate();
  const std::vector<int32_t> p = {1, 2};
  for (SlotId s : {a, b}) {
    ASSERT_TRUE(cache_->Prefill(s, p, oracle_->MakeBatch(Toks(p, 0)).io).ok());
  }
  const std::vector<int32_t> drafts = {3, 4, 5};
  Batch d = oracle_->MakeBatch(Toks(drafts, 2));
  ASSERT_TRUE(cache_->Verify({a}, 3, drafts, d.io).ok());
  ASSERT_TRUE(cache_->Accept(a, 2).ok());  // seq_len 4: on the boundary
  EXPECT_EQ(cache_->Info(a)->seq_len, 4);
  EXPECT_EQ(cache_->stats().slots_snapshot, 1);
  EXPECT_EQ(cache_->MatchPrefix({1, 2, 3, 4, 9}), 4);
  ASSERT_TRUE(cache_->Verify({b}, 3, {6, 7, 8}, d.io).ok());
  ASSERT_TRUE(cache_->Accept(b, 3).ok());  // seq_len 5: over the boundary at 4
  EXPECT_EQ(cache_->Info(b)->seq_len, 5);
  EXPECT_EQ(cache_->stats().slots_snapshot, 1) << "no snapshot of a state never folded";
  EXPECT_EQ(cache_->MatchPrefix({1, 2, 6, 7, 8, 9}), 0);
}

// A prefill whose rows cannot all have a spare slot is refused before it takes any: no
// snapshot is evicted for the rows it then gives up.
TEST_F(ForwardRulesTest, ARefusedPrefillEvictsNoSnapshot) {
  Make(3);
  const SlotId a = *cache_->Allocate();
  const std::vector<int32_t> p = {1, 2};
  ASSERT_TRUE(cache_->Prefill(a, p, oracle_->MakeBatch(Toks(p, 0)).io).ok());
  ASSERT_TRUE(cache_->Donate(a).ok());
  const SlotId b = *cache_->Allocate();  // the last free slot; one snapshot could be evicted
  const std::vector<int32_t> x = {5}, y = {6};
  const SlotId c = *cache_->Allocate();  // evicted nothing: a slot was free
  EXPECT_EQ(cache_->stats().slots_free, 0);
  EXPECT_EQ(cache_->stats().slots_snapshot, 1);
  const absl::Status st = cache_->BeginPrefill({{b, x}, {c, y}}).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  EXPECT_NE(st.message().find("rows[1]"), std::string::npos) << st;
  EXPECT_EQ(cache_->stats().snapshot_evictions, 0);
  EXPECT_EQ(cache_->MatchPrefix(p), 2) << "the donated state is still there";
  EXPECT_EQ(cache_->stats().slots_free, 0);
  // One row fits: its spare evicts the snapshot then, as it must.
  absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefill({{b, x}});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(cache_->stats().snapshot_evictions, 1);
}

// With the host tier a begin makes room for its spares by spilling snapshots to the host; a
// begin refused for its rows (no spare for each, a row not found) did so all the same before
// its refusal (an outside review): the snapshot left backend memory, a host eviction could
// have dropped another for good.
TEST_F(ForwardRulesTest, ARefusedPrefillSpillsNothingToTheHost) {
  Make(4, /*track=*/0, /*host_snapshots=*/1);
  const SlotId a = *cache_->Allocate();
  const std::vector<int32_t> p = {1, 2};
  ASSERT_TRUE(cache_->Prefill(a, p, oracle_->MakeBatch(Toks(p, 0)).io).ok());
  ASSERT_TRUE(cache_->Donate(a).ok());
  const SlotId b = *cache_->Allocate(), c = *cache_->Allocate(), d = *cache_->Allocate();
  const CacheStats before = cache_->stats();
  ASSERT_EQ(before.slots_snapshot, 1);
  ASSERT_EQ(before.slots_free, 0);
  const std::vector<int32_t> x = {5}, y = {6};
  const absl::Status none = cache_->BeginPrefill({{b, x}, {c, y}}).status();  // room for one
  EXPECT_EQ(none.code(), absl::StatusCode::kResourceExhausted) << none;
  ASSERT_TRUE(cache_->Free(d).ok());
  const absl::Status missing = cache_->BeginPrefill({{b, x}, {d, y}}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound) << missing;
  const CacheStats after = cache_->stats();
  EXPECT_EQ(after.snapshot_spills, before.snapshot_spills);
  EXPECT_EQ(after.snapshot_evictions, before.snapshot_evictions);
  EXPECT_EQ(after.slots_snapshot, 1) << "the snapshot stays in backend memory";
  absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefill({{b, x}, {c, y}});
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(cache_->stats().snapshot_spills, before.snapshot_spills + 1) << "room made then";
}

// A forward's commit moves its rows' cursors, then snapshots the rows on a track boundary. A
// snapshot that failed (its scan, its copy) failed the commit after the cursors had moved: the
// service released the request id and a retry applied the step twice. The commit stands now;
// the snapshot is dropped.
TEST_F(ForwardRulesTest, ACommitWhoseSnapshotFailsStands) {
  if (testing::TestBackend() != RSSM_BACKEND_CPU) {
    GTEST_SKIP() << "the CPU backend's fault seam (REPLAYSSM_CPU_FAIL_CALLS)";
  }
  Make(3, /*track=*/2);
  const SlotId a = *cache_->Allocate();
  const std::vector<int32_t> p = {1, 2};
  ASSERT_EQ(setenv("REPLAYSSM_CPU_FAIL_CALLS", "rssm_none,rssm_count_nonfinite", 1), 0);
  const absl::Status st = cache_->Prefill(a, p, oracle_->MakeBatch(Toks(p, 0)).io);
  unsetenv("REPLAYSSM_CPU_FAIL_CALLS");
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_EQ(cache_->Info(a)->seq_len, 2);
  EXPECT_EQ(cache_->stats().slots_snapshot, 0) << "the boundary's snapshot dropped";
  EXPECT_EQ(cache_->stats().slots_free, 2) << "its slot given back";
  const std::vector<int32_t> q = {3, 4};
  ASSERT_TRUE(cache_->Prefill(a, q, oracle_->MakeBatch(Toks(q, 2)).io).ok());
  EXPECT_EQ(cache_->stats().slots_snapshot, 1) << "the next boundary's, taken";
  EXPECT_EQ(cache_->MatchPrefix({1, 2, 3, 4, 5}), 4);
}

// A forward whose wait for its device work failed stays failed: the lane forgot the error once
// it had waited (it is idle again), and a second Commit took that for success and moved the
// cursors over work that had failed (an outside review).
TEST_F(ForwardRulesTest, ACommitWhoseDeviceWaitFailedStaysFailed) {
  if (testing::TestBackend() != RSSM_BACKEND_CPU) {
    GTEST_SKIP() << "the CPU backend's fault seam (REPLAYSSM_CPU_FAIL_CALLS)";
  }
  Make(3);
  const SlotId a = *cache_->Allocate();
  const std::vector<int32_t> p = {1, 2};
  ASSERT_TRUE(cache_->Prefill(a, p, oracle_->MakeBatch(Toks(p, 0)).io).ok());
  Batch b = oracle_->MakeBatch(Toks({3}, 2));
  absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginForward({{a, 3}});
  ASSERT_TRUE(f.ok()) << f.status();
  for (int32_t l = 0; l < cache_->model().num_layers; ++l) {
    LayerIo io = b.io[l];
    io.memory = IoMemory::kBackend;  // (the CPU's is host memory) nothing waited for till Commit
    ASSERT_TRUE((*f)->RunLayer(l, io).ok());
  }
  ASSERT_EQ(setenv("REPLAYSSM_CPU_FAIL_CALLS", "rssm_synchronize", 1), 0);
  const absl::Status first = (*f)->Commit();
  unsetenv("REPLAYSSM_CPU_FAIL_CALLS");
  EXPECT_FALSE(first.ok());
  EXPECT_NE(first.message().find("rssm_synchronize: cpu: a failure injected"), std::string::npos)
      << first;
  EXPECT_EQ((*f)->Commit().code(), first.code()) << "the same failure, not a commit";
  EXPECT_EQ(cache_->Info(a)->seq_len, 2);
  f->reset();  // abandoned
  EXPECT_EQ(cache_->Info(a)->seq_len, 2);
  EXPECT_EQ(cache_->Info(a)->write_pos, 0);
  ASSERT_TRUE(cache_->Prefill(a, {3}, oracle_->MakeBatch(Toks({3}, 2)).io).ok()) << "usable";
}

// BeginPrefillInPlace, the forward Prefill runs: refused with bad tokens, holds its slot
// until it ends, changes nothing abandoned before a layer ran, and leaves the slot broken
// abandoned after one (it kept no copy).
TEST_F(ForwardRulesTest, APrefillInPlaceHoldsItsSlotAndKeepsNoCopy) {
  Make(3);
  const SlotId a = *cache_->Allocate(), b = *cache_->Allocate();
  const std::vector<int32_t> none, nine(9, 1), x = {1, 2};
  EXPECT_EQ(cache_->BeginPrefillInPlace(a, none).status().code(),
            absl::StatusCode::kInvalidArgument);
  const absl::Status many = cache_->BeginPrefillInPlace(a, nine).status();
  EXPECT_NE(many.message().find("tokens: expected 1 to 8 tokens, got 9"), std::string::npos)
      << many;
  Batch batch = oracle_->MakeBatch(Toks(x, 0));
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefillInPlace(a, x);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(cache_->stats().slots_free, 1) << "no spare slot";
    EXPECT_EQ(cache_->Free(a).code(), absl::StatusCode::kFailedPrecondition);
  }
  EXPECT_EQ(cache_->Info(a)->seq_len, 0);
  ASSERT_TRUE(cache_->Prefill(a, x, batch.io).ok()) << "not broken: no layer ran";
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = cache_->BeginPrefillInPlace(b, x);
    ASSERT_TRUE(f.ok()) << f.status();
    ASSERT_TRUE((*f)->RunLayer(0, batch.io[0]).ok());
  }
  EXPECT_EQ(cache_->Prefill(b, x, batch.io).code(), absl::StatusCode::kDataLoss)
      << "layer 0's checkpoint was overwritten in place";
  EXPECT_TRUE(cache_->Free(b).ok());
}

}  // namespace
}  // namespace replayssm::cache
