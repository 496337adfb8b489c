// The host tier (host_tier.h; docs/cache.md, "Host tier"): snapshots evicted from backend
// memory spill to pinned host memory and come back on a prefix hit bit for bit; the bound, the
// policies, namespaces, the finiteness rule and the events across tiers; promotions beside
// unrelated forwards.
#include "host_tier.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
#include "test_model.h"

namespace replayssm::cache {
namespace {

using testing::Batch;
using testing::Oracle;
using testing::Tok;

constexpr double kStateTol = 1e-4;  // fp32 state against fp64

class HostTierTest : public ::testing::Test {
 protected:
  // A cache of `slots` backend slots and `host` host snapshots.
  std::unique_ptr<StateCache> Make(int64_t slots, int64_t host,
                                   HostPolicy policy = HostPolicy::kLru, int64_t ns_bound = 0,
                                   int32_t track = 0, int32_t spill_ahead = 0, bool pin = false) {
    const ModelSpec m = testing::TwoLayerTinyGdn();
    CacheOptions o = testing::TestOptions(m, slots);
    o.track_interval = track;
    o.host_spill_ahead = spill_ahead;
    o.host_pin_at_start = pin;
    o.max_snapshots_per_namespace = ns_bound;
    o.host_snapshot_bytes = host * m.LayerStateBytes() * m.num_layers;
    o.host_policy = policy;
    o.event_sink = [this](const CacheEvent& e) { events_.push_back(e); };
    absl::StatusOr<std::unique_ptr<StateCache>> c = StateCache::Create(m, o);
    EXPECT_TRUE(c.ok()) << c.status();
    if (!c.ok()) return nullptr;
    oracle_ = std::make_unique<Oracle>((*c)->model());
    return *std::move(c);
  }

  // A request in namespace ns that prefills `tokens`, then decodes `decode` more; returns it.
  SlotId Run(StateCache& c, const std::vector<int32_t>& tokens, PrefixNamespace ns = 0,
             const std::vector<int32_t>& decode = {}) {
    absl::StatusOr<StateCache::PrefixAllocation> a = c.AllocateFromPrefixIn(ns, {});
    EXPECT_TRUE(a.ok()) << a.status();
    if (!a.ok()) return kPaddingSlot;
    std::vector<Tok> toks;
    for (size_t i = 0; i < tokens.size(); ++i) toks.push_back({tokens[i], static_cast<int64_t>(i)});
    Batch batch = oracle_->MakeBatch(toks);
    EXPECT_TRUE(c.Prefill(a->slot, tokens, batch.io).ok());
    for (size_t i = 0; i < decode.size(); ++i) {
      Batch one = oracle_->MakeBatch({{decode[i], static_cast<int64_t>(tokens.size() + i)}});
      absl::StatusOr<std::unique_ptr<Forward>> f = c.BeginForward({{a->slot, decode[i]}});
      EXPECT_TRUE(f.ok()) << f.status();
      for (int l = 0; l < c.model().num_layers; ++l) EXPECT_TRUE((*f)->RunLayer(l, one.io[l]).ok());
      EXPECT_TRUE((*f)->Commit().ok());
    }
    return a->slot;
  }
  // One decode step of `slot`: token t at position pos.
  void Step(StateCache& c, SlotId slot, int32_t t, int64_t pos) {
    Batch one = oracle_->MakeBatch({{t, pos}});
    absl::StatusOr<std::unique_ptr<Forward>> f = c.BeginForward({{slot, t}});
    ASSERT_TRUE(f.ok()) << f.status();
    for (int l = 0; l < c.model().num_layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, one.io[l]).ok());
    ASSERT_TRUE((*f)->Commit().ok());
  }
  void Donate(StateCache& c, const std::vector<int32_t>& tokens, PrefixNamespace ns = 0) {
    ASSERT_TRUE(c.Donate(Run(c, tokens, ns)).ok());
  }
  // Takes every backend slot (spilling every snapshot it can), then frees them again.
  void Flush(StateCache& c) {
    std::vector<SlotId> held;
    for (absl::StatusOr<SlotId> s = c.Allocate(); s.ok(); s = c.Allocate()) held.push_back(*s);
    for (SlotId s : held) ASSERT_TRUE(c.Free(s).ok());
    ASSERT_EQ(c.stats().slots_snapshot, 0);
  }
  std::vector<uint8_t> State(StateCache& c, SlotId slot) {
    absl::StatusOr<ExportedState> e = c.Export(slot);
    EXPECT_TRUE(e.ok()) << e.status();
    std::vector<uint8_t> bytes;
    if (!e.ok()) return bytes;
    for (const auto& l : e->checkpoints) bytes.insert(bytes.end(), l.begin(), l.end());
    return bytes;
  }

  std::vector<CacheEvent> events_;
  std::unique_ptr<Oracle> oracle_;
};

// Turn 1 is donated, pushed out of backend memory by other requests, and turn 2 starts from the
// host copy: the same bits as a twin cache that never evicted it, the reference state, and a
// backend snapshot again (promoted) for the turn after.
TEST_F(HostTierTest, ASpilledSnapshotComesBackBitForBit) {
  std::unique_ptr<StateCache> c = Make(3, 4), twin = Make(8, 0);
  const std::vector<int32_t> turn1 = {11, 12, 13, 14, 15}, decode = {20, 21, 22, 23, 24, 25};
  std::vector<int32_t> history = turn1;
  history.insert(history.end(), decode.begin(), decode.end());
  ASSERT_TRUE(c->Donate(Run(*c, turn1, 0, decode)).ok());
  ASSERT_TRUE(twin->Donate(Run(*twin, turn1, 0, decode)).ok());
  Flush(*c);
  CacheStats s = c->stats();
  EXPECT_EQ(s.snapshot_spills, 1);
  EXPECT_EQ(s.snapshot_evictions, 1);
  EXPECT_EQ(s.host_snapshots, 1);
  EXPECT_EQ(s.host_bytes, c->model().LayerStateBytes() * c->model().num_layers);
  std::vector<int32_t> turn2 = history;
  turn2.insert(turn2.end(), {30, 31});
  EXPECT_EQ(c->MatchPrefix(turn2), 11) << "MatchPrefix sees the host tier";
  absl::StatusOr<StateCache::PrefixAllocation> p = c->AllocateFromPrefix(turn2);
  absl::StatusOr<StateCache::PrefixAllocation> q = twin->AllocateFromPrefix(turn2);
  ASSERT_TRUE(p.ok() && q.ok()) << p.status() << q.status();
  EXPECT_EQ(p->matched, 11);
  EXPECT_EQ(c->Info(p->slot)->seq_len, 11);
  EXPECT_EQ(State(*c, p->slot), State(*twin, q->slot)) << "bit for bit";
  absl::StatusOr<ExportedState> e = c->Export(p->slot);
  ASSERT_TRUE(e.ok());
  EXPECT_LE(testing::RelErr(oracle_->FromExport(*e), oracle_->Run(history, 11)), kStateTol);
  s = c->stats();
  EXPECT_EQ(s.host_hits, 1);
  EXPECT_EQ(s.snapshot_hits, 0);
  EXPECT_EQ(s.snapshot_misses, 2) << "the backend's: turn 1's empty prefix and this one";
  EXPECT_EQ(s.host_promotions, 1);
  EXPECT_EQ(s.slots_snapshot, 1) << "promoted: a backend snapshot again";
  int64_t counted = 0;
  for (int64_t n : s.promotion_latency_counts) counted += n;
  EXPECT_EQ(counted, 1);
  EXPECT_GE(s.promotion_seconds, 0);
  // The next hit is the backend's.
  absl::StatusOr<StateCache::PrefixAllocation> r = c->AllocateFromPrefix(turn2);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(State(*c, r->slot), State(*twin, q->slot));
  EXPECT_EQ(c->stats().snapshot_hits, 1);
  EXPECT_EQ(c->stats().host_hits, 1);
}

// A spill is reported removed from kBackend then stored in kHost; a promotion stored in
// kBackend while the host copy stays; evicting the promoted copy again costs no copy and only
// removes it from kBackend; a host eviction removes it from kHost.
TEST_F(HostTierTest, EventsFollowTheSnapshotAcrossTiers) {
  std::unique_ptr<StateCache> c = Make(2, 1);
  const std::vector<int32_t> a = {1, 2, 3}, b = {4, 5, 6};
  Donate(*c, a);
  Flush(*c);
  const std::vector<int32_t> probe = {1, 2, 3, 9};
  ASSERT_TRUE(c->AllocateFromPrefix(probe).ok());  // a promoted: a backend snapshot again
  Flush(*c);  // its backend copy is dropped: the host holds it already
  EXPECT_EQ(c->stats().snapshot_spills, 2);
  Donate(*c, b);
  Flush(*c);  // b spills: the one host entry is a's, which goes
  using T = CacheEvent::Type;
  const std::vector<std::tuple<T, Medium, std::vector<int32_t>>> want = {
      {T::kStored, Medium::kBackend, a},  {T::kStored, Medium::kHost, a},
      {T::kRemoved, Medium::kBackend, a}, {T::kStored, Medium::kBackend, a},
      {T::kRemoved, Medium::kBackend, a}, {T::kStored, Medium::kBackend, b},
      {T::kRemoved, Medium::kHost, a},    {T::kStored, Medium::kHost, b},
      {T::kRemoved, Medium::kBackend, b}};
  ASSERT_EQ(events_.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(events_[i].type, std::get<0>(want[i])) << i;
    EXPECT_EQ(events_[i].medium, std::get<1>(want[i])) << i;
    EXPECT_EQ(events_[i].tokens, std::get<2>(want[i])) << i;
  }
  EXPECT_EQ(c->stats().host_evictions, 1);
  EXPECT_EQ(c->stats().host_evictions_kept, 0) << "a was in no other tier: lost";
}

// A host eviction of a snapshot that backend memory holds too loses nothing: it is counted
// apart (host_evictions_kept), so that an alert on lost snapshots can leave it out.
TEST_F(HostTierTest, AHostEvictionOfASnapshotTheBackendHoldsIsCountedKept) {
  std::unique_ptr<StateCache> c = Make(2, 1);
  const std::vector<int32_t> a = {1, 2, 3}, b = {4, 5, 6}, probe = {1, 2, 3, 9};
  Donate(*c, a);
  Flush(*c);  // a spills: the host holds it, the backend not
  absl::StatusOr<StateCache::PrefixAllocation> r = c->AllocateFromPrefix(probe);
  ASSERT_TRUE(r.ok()) << r.status();  // a promoted: in both tiers
  ASSERT_TRUE(c->Free(r->slot).ok());
  Donate(*c, b);
  r = c->AllocateFromPrefix(probe);  // a backend hit: b, older, spills; the host drops a's copy
  ASSERT_TRUE(r.ok()) << r.status();
  const CacheStats s = c->stats();
  EXPECT_EQ(s.host_evictions, 1);
  EXPECT_EQ(s.host_evictions_kept, 1);
  EXPECT_EQ(c->MatchPrefix(probe), 3) << "a is still in backend memory";
}

// A decode forward's track snapshot never waits for a spill: with the pool full it evicts a
// snapshot whose state the host holds (no loss) before an older one it does not.
TEST_F(HostTierTest, ATrackSnapshotEvictsAHostBackedSnapshotFirst) {
  std::unique_ptr<StateCache> c = Make(3, 4, HostPolicy::kLru, 0, /*track=*/8);
  Donate(*c, {1, 2, 3});
  Flush(*c);  // {1, 2, 3} on the host
  Donate(*c, {4, 5, 6});  // in GPU memory only: now the least recently used
  absl::StatusOr<StateCache::PrefixAllocation> p = c->AllocateFromPrefix({1, 2, 3, 9});
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(c->stats().host_promotions, 1);  // {1, 2, 3} in GPU memory too: the pool is full
  for (int i = 0; i < 5; ++i) {  // seq_len 3 -> 8: a track snapshot
    const int32_t t = 30 + i;
    Batch one = oracle_->MakeBatch({{t, 3 + i}});
    absl::StatusOr<std::unique_ptr<Forward>> f = c->BeginForward({{p->slot, t}});
    ASSERT_TRUE(f.ok()) << f.status();
    for (int l = 0; l < c->model().num_layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, one.io[l]).ok());
    ASSERT_TRUE((*f)->Commit().ok());
  }
  EXPECT_EQ(c->stats().snapshots_taken, 1);
  EXPECT_EQ(c->MatchPrefix({4, 5, 6, 7}), 3) << "the older GPU-only snapshot stays";
  EXPECT_EQ(c->MatchPrefix({1, 2, 3, 7}), 3) << "still on the host";
  EXPECT_EQ(c->MatchPrefix({1, 2, 3, 30, 31, 32, 33, 34, 0}), 8);
  EXPECT_EQ(c->stats().host_hits, 1);
}

// Host entries pinned at Create hold spilled states as entries pinned at first use do.
TEST_F(HostTierTest, PinnedAtStartTheTierWorksAsPinnedOnFirstUse) {
  std::unique_ptr<StateCache> c = Make(3, 4, HostPolicy::kLru, 0, 0, 0, /*pin=*/true),
                              twin = Make(8, 0);
  ASSERT_NE(c, nullptr);
  const std::vector<int32_t> turn1 = {11, 12, 13, 14, 15};
  ASSERT_TRUE(c->Donate(Run(*c, turn1)).ok());
  ASSERT_TRUE(twin->Donate(Run(*twin, turn1)).ok());
  Flush(*c);
  EXPECT_EQ(c->stats().snapshot_spills, 1);
  absl::StatusOr<StateCache::PrefixAllocation> p = c->AllocateFromPrefix({11, 12, 13, 14, 15, 0});
  absl::StatusOr<StateCache::PrefixAllocation> q =
      twin->AllocateFromPrefix({11, 12, 13, 14, 15, 0});
  ASSERT_TRUE(p.ok() && q.ok()) << p.status() << q.status();
  EXPECT_EQ(c->stats().host_hits, 1);
  EXPECT_EQ(State(*c, p->slot), State(*twin, q->slot));
}

// Until the spiller has made `ahead` slots obtainable without loss (or 10 s: it never should).
void AwaitSpills(const StateCache& c, int64_t ahead) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  for (;;) {
    const CacheStats s = c.stats();
    if (s.slots_free + s.host_backed_snapshots >= ahead) return;
    ASSERT_LT(absl::Now(), deadline) << "free " << s.slots_free << ", host-backed "
                                     << s.host_backed_snapshots;
    absl::SleepFor(absl::Milliseconds(1));
  }
}

// With host_spill_ahead, the least recently used snapshots are copied to the host before any
// call needs their slots, and stay hits in backend memory meanwhile.
TEST_F(HostTierTest, SpillingAheadCopiesTheOldestSnapshotsAndKeepsThem) {
  std::unique_ptr<StateCache> c = Make(4, 8, HostPolicy::kLru, 0, 0, /*spill_ahead=*/2);
  Donate(*c, {1, 2, 3});
  Donate(*c, {4, 5, 6});
  EXPECT_EQ(c->stats().spills_ahead, 0) << "2 of 4 slots free: nothing to do";
  Donate(*c, {7, 8, 9});  // 1 free: the oldest snapshot is copied
  AwaitSpills(*c, 2);
  CacheStats s = c->stats();
  EXPECT_EQ(s.spills_ahead, 1);
  EXPECT_EQ(s.host_backed_snapshots, 1);
  EXPECT_EQ(s.host_snapshots, 1);
  EXPECT_EQ(s.snapshot_evictions, 0);
  absl::StatusOr<StateCache::PrefixAllocation> p = c->AllocateFromPrefix({1, 2, 3, 0});
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->matched, 3);
  EXPECT_EQ(c->stats().snapshot_hits, 1) << "still a hit in backend memory";
}

// A host tier smaller than host_spill_ahead asks for: each copy ahead evicts the copy made
// before it, so the pass stops there instead of swapping copies for ever (it spun at ~500k
// copies a second, the cache mutex taken each time, before).
TEST_F(HostTierTest, SpillingAheadIntoATooSmallTierStops) {
  std::unique_ptr<StateCache> c = Make(8, 2, HostPolicy::kLru, 0, 0, /*spill_ahead=*/6);
  for (int32_t i = 0; i < 6; ++i) Donate(*c, {10 * i + 1, 10 * i + 2});
  absl::SleepFor(absl::Milliseconds(200));
  const int64_t spilled = c->stats().spills_ahead;
  EXPECT_LE(spilled, 12) << "bounded by the slots taken, not by time";
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(c->stats().spills_ahead, spilled) << "idle: no copy more";
  EXPECT_LE(c->stats().host_snapshots, 2);
}

// The hole spilling ahead closes: a decode forward's track snapshot at a full pool evicts
// without waiting for a spill. With the spiller every evicted snapshot is on the host and
// found again; without it the same decode drops them.
TEST_F(HostTierTest, DecodeTimeEvictionsMoveSnapshotsToTheHost) {
  for (const int32_t ahead : {2, 0}) {
    SCOPED_TRACE(absl::StrCat("host_spill_ahead ", ahead));
    std::unique_ptr<StateCache> c = Make(4, 16, HostPolicy::kLru, 0, /*track=*/4, ahead);
    absl::StatusOr<StateCache::PrefixAllocation> a = c->AllocateFromPrefix({});
    ASSERT_TRUE(a.ok()) << a.status();
    std::vector<int32_t> history;
    for (int32_t i = 0; i < 40; ++i) {  // a track snapshot every 4 tokens: 10, 3 slots for them
      const int32_t t = 100 + i;
      Step(*c, a->slot, t, i);
      ASSERT_FALSE(HasFatalFailure());
      history.push_back(t);
      if (ahead > 0) AwaitSpills(*c, ahead);
    }
    const CacheStats s = c->stats();
    EXPECT_EQ(s.snapshots_taken, 10);
    EXPECT_GE(s.snapshot_evictions, 7);
    if (ahead == 0) {
      EXPECT_EQ(s.snapshot_spills, 0) << "no call waited for a spill: every eviction dropped";
      continue;
    }
    EXPECT_EQ(s.snapshot_spills, s.snapshot_evictions) << "every eviction went to the host";
    for (size_t k = 4; k <= history.size(); k += 4) {
      std::vector<int32_t> probe(history.begin(), history.begin() + k);
      probe.push_back(0);
      EXPECT_EQ(c->MatchPrefix(probe), static_cast<int64_t>(k)) << "the snapshot at " << k;
    }
  }
}

// The host tier never holds more than host_snapshot_bytes; LRU keeps the most recent.
TEST_F(HostTierTest, HostBytesAreNeverExceeded) {
  std::unique_ptr<StateCache> c = Make(2, 2);
  const int64_t entry = c->model().LayerStateBytes() * c->model().num_layers;
  EXPECT_EQ(c->stats().host_capacity_bytes, 2 * entry);
  for (int i = 0; i < 6; ++i) {
    Donate(*c, {i, i + 1, i + 2});
    Flush(*c);
    const CacheStats s = c->stats();
    EXPECT_LE(s.host_bytes, s.host_capacity_bytes);
    EXPECT_LE(s.host_snapshots, 2);
  }
  EXPECT_EQ(c->stats().host_evictions, 4);
  EXPECT_EQ(c->MatchPrefix({5, 6, 7, 8}), 3);
  EXPECT_EQ(c->MatchPrefix({4, 5, 6, 8}), 3);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(c->MatchPrefix({i, i + 1, i + 2, 9}), 0) << i;
}

// The value policy keeps the snapshot that saves the most tokens per byte (a long one) over
// more recent short ones; LRU drops it as the oldest.
TEST_F(HostTierTest, TheValuePolicyKeepsTheHighValueSnapshot) {
  const std::vector<int32_t> long_one = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  for (HostPolicy policy : {HostPolicy::kValue, HostPolicy::kLru}) {
    SCOPED_TRACE(policy == HostPolicy::kValue ? "value" : "lru");
    std::unique_ptr<StateCache> c = Make(2, 2, policy);
    Donate(*c, long_one);
    Flush(*c);
    for (int i = 0; i < 3; ++i) {
      Donate(*c, {50 + i, 60});
      Flush(*c);
    }
    EXPECT_EQ(c->MatchPrefix({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}),
              policy == HostPolicy::kValue ? 12 : 0);
    EXPECT_EQ(c->MatchPrefix({52, 60, 1}), 2) << "the newest short one is kept by both";
  }
}

// Namespaces never share across tiers, and max_snapshots_per_namespace bounds each tier: a
// namespace at its bound on the host replaces its own entry, never another's.
TEST_F(HostTierTest, NamespacesAndTheirBoundHoldOnTheHost) {
  std::unique_ptr<StateCache> c = Make(2, 4, HostPolicy::kLru, /*ns_bound=*/1);
  Donate(*c, {50, 51}, 2);
  Flush(*c);
  Donate(*c, {1, 2, 3}, 1);
  Flush(*c);
  Donate(*c, {4, 5, 6}, 1);
  Flush(*c);
  EXPECT_EQ(c->stats().host_snapshots, 2);
  EXPECT_EQ(c->MatchPrefixIn(2, {50, 51, 52}), 2) << "namespace 1 never evicts namespace 2's";
  EXPECT_EQ(c->MatchPrefixIn(1, {4, 5, 6, 7}), 3);
  EXPECT_EQ(c->MatchPrefixIn(1, {1, 2, 3, 7}), 0) << "its own older one went";
  EXPECT_EQ(c->MatchPrefixIn(1, {50, 51, 52}), 0) << "never found from another namespace";
  EXPECT_EQ(c->MatchPrefix({4, 5, 6, 7}), 0);
  const int64_t misses = c->stats().host_misses;
  absl::StatusOr<StateCache::PrefixAllocation> p = c->AllocateFromPrefixIn(3, {4, 5, 6, 7});
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->matched, 0);
  EXPECT_EQ(c->stats().host_hits, 0);
  EXPECT_EQ(c->stats().host_misses, misses + 1);
  absl::StatusOr<StateCache::PrefixAllocation> q = c->AllocateFromPrefixIn(1, {4, 5, 6, 7});
  ASSERT_TRUE(q.ok());
  EXPECT_EQ(q->matched, 3);
}

// A namespace at its bound with a pool that has room: the bound's eviction dropped its oldest
// snapshot, host tier or not (an outside review: a capped tenant's host tier stayed empty and
// its prompts were gone). A donation now moves the oldest to the host first; a forward's track
// snapshot does not wait, and the spiller copies a full namespace's oldest ahead of it.
TEST_F(HostTierTest, ANamespaceAtItsBoundMovesItsOldestToTheHost) {
  {
    SCOPED_TRACE("donations, no spiller");
    std::unique_ptr<StateCache> c = Make(16, 8, HostPolicy::kLru, /*ns_bound=*/2);
    for (int32_t i = 0; i < 4; ++i) Donate(*c, {10 * i + 1, 10 * i + 2, 10 * i + 3}, 1);
    const CacheStats s = c->stats();
    EXPECT_EQ(s.snapshot_evictions, 2);
    EXPECT_EQ(s.snapshot_spills, 2) << "every eviction went to the host";
    EXPECT_EQ(s.host_snapshots, 2);
    for (int32_t i = 0; i < 4; ++i) {
      EXPECT_EQ(c->MatchPrefixIn(1, {10 * i + 1, 10 * i + 2, 10 * i + 3, 0}), 3) << i;
    }
    // A hit on the host at the bound is promoted into a slot, and no snapshot of the
    // namespace is evicted for it (a promotion never evicts).
    const int64_t evictions = c->stats().snapshot_evictions;
    absl::StatusOr<StateCache::PrefixAllocation> p = c->AllocateFromPrefixIn(1, {1, 2, 3, 0});
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->matched, 3);
    EXPECT_EQ(c->stats().snapshot_evictions, evictions);
    EXPECT_EQ(c->MatchPrefixIn(1, {31, 32, 33, 0}), 3);
  }
  {
    SCOPED_TRACE("track snapshots, the spiller on");
    std::unique_ptr<StateCache> c =
        Make(16, 16, HostPolicy::kLru, /*ns_bound=*/2, /*track=*/4, /*spill_ahead=*/1);
    absl::StatusOr<StateCache::PrefixAllocation> a = c->AllocateFromPrefixIn(1, {});
    ASSERT_TRUE(a.ok()) << a.status();
    std::vector<int32_t> history;
    for (int32_t i = 0; i < 24; ++i) {  // 6 track snapshots into a share of 2
      const int32_t t = 200 + i;
      Step(*c, a->slot, t, i);
      ASSERT_FALSE(HasFatalFailure());
      history.push_back(t);
      // The share full: the spiller copies its oldest (the next to go) to the host.
      const absl::Time deadline = absl::Now() + absl::Seconds(10);
      for (CacheStats s = c->stats(); s.slots_snapshot >= 2 && s.host_backed_snapshots < 1;
           s = c->stats()) {
        ASSERT_LT(absl::Now(), deadline) << "at token " << i;
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
    const CacheStats s = c->stats();
    EXPECT_EQ(s.snapshots_taken, 6);
    EXPECT_EQ(s.snapshot_evictions, 4);
    EXPECT_EQ(s.snapshot_spills, s.snapshot_evictions) << "every eviction went to the host";
    // The share bounds each tier: the newest 2 in backend memory, and on the host the 2 spilled
    // last (it replaced its own older entries): the one before them, and the older of the two in
    // backend memory, copied ahead of its eviction (the price of copying ahead: one entry of the
    // share holds a state backend memory holds too).
    for (size_t k = 4; k <= history.size(); k += 4) {
      std::vector<int32_t> probe(history.begin(), history.begin() + k);
      probe.push_back(0);
      const int64_t found = c->MatchPrefixIn(1, probe);
      EXPECT_EQ(found, k >= 16 ? static_cast<int64_t>(k) : 0) << "the snapshot at " << k;
    }
    EXPECT_EQ(c->stats().host_snapshots, 2);
  }
}

// A state with a NaN never becomes a snapshot, so no pressure can move it to the host.
TEST_F(HostTierTest, ANonFiniteStateNeverReachesTheHost) {
  std::unique_ptr<StateCache> c = Make(3, 4);
  const SlotId good = Run(*c, {1, 2, 3});
  absl::StatusOr<ExportedState> e = c->Export(good);
  ASSERT_TRUE(e.ok());
  std::vector<std::vector<uint8_t>> bad = e->checkpoints;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bad[1].data() + 12, &nan, 4);
  std::vector<absl::Span<const uint8_t>> cps(bad.begin(), bad.end());
  const SlotId s = *c->Allocate();
  ASSERT_TRUE(c->Import(s, {7, 8, 9}, cps).ok());
  EXPECT_EQ(c->Donate(s).code(), absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(c->Free(s).ok());
  ASSERT_TRUE(c->Donate(good).ok());
  Flush(*c);
  EXPECT_EQ(c->stats().host_snapshots, 1) << "only the finite one";
  EXPECT_EQ(c->MatchPrefix({7, 8, 9, 1}), 0);
  EXPECT_EQ(c->MatchPrefix({1, 2, 3, 1}), 3);
}

// A promotion copies without the cache's lock, on a lane of its own: it goes through while a
// forward on another slot is open, and promotions in a loop on one thread and forwards on
// another both go on (each until the other has done its share), with the right states.
TEST_F(HostTierTest, PromotionsDoNotBlockAnUnrelatedForward) {
  std::unique_ptr<StateCache> c = Make(6, 4);
  Donate(*c, {1, 2, 3, 4});
  Flush(*c);
  const SlotId busy = Run(*c, {40, 41});
  std::vector<int32_t> history = {40, 41};
  auto promote = [&]() -> bool {
    absl::StatusOr<StateCache::PrefixAllocation> p = c->AllocateFromPrefix({1, 2, 3, 4, 5});
    if (!p.ok() || p->matched != 4 || !c->Free(p->slot).ok()) return false;
    Flush(*c);  // back to the host, so that every round is a promotion
    return true;
  };
  auto forward = [&](int32_t t, bool promote_between_layers) {
    Batch one = oracle_->MakeBatch({{t, static_cast<int64_t>(history.size())}});
    absl::StatusOr<std::unique_ptr<Forward>> f = c->BeginForward({{busy, t}});
    ASSERT_TRUE(f.ok()) << f.status();
    for (int l = 0; l < c->model().num_layers; ++l) {
      ASSERT_TRUE((*f)->RunLayer(l, one.io[l]).ok());
      if (l == 0 && promote_between_layers) {
        ASSERT_TRUE(promote()) << "beside an open forward";
      }
    }
    ASSERT_TRUE((*f)->Commit().ok());
    history.push_back(t);
  };
  forward(99, /*promote_between_layers=*/true);
  constexpr int kShare = 20;
  std::atomic<int> promotions{0}, forwards{0};
  std::thread promoter([&] {
    for (int i = 0; i < 1000 && (i < kShare || forwards < kShare); ++i) {
      if (!promote()) {
        ADD_FAILURE() << "promotion " << i;
        return;
      }
      ++promotions;
    }
  });
  for (int i = 0; i < 1000 && (i < kShare || promotions < kShare); ++i) {
    forward(100 + i % 50, false);
    ++forwards;
  }
  promoter.join();
  EXPECT_GE(promotions.load(), kShare);
  EXPECT_GE(forwards.load(), kShare);
  EXPECT_EQ(c->stats().host_hits, 1 + promotions.load());
  absl::StatusOr<ExportedState> e = c->Export(busy);
  ASSERT_TRUE(e.ok());
  EXPECT_LE(testing::RelErr(oracle_->FromExport(*e), oracle_->Run(history, history.size())),
            kStateTol);
}

// Every prefix lookup counts once on the backend tier and, when that misses, once on the host
// tier: snapshot_hits + snapshot_misses = lookups and host_hits + host_misses =
// snapshot_misses, also when the pool has no slot for a hit (a backend hit without a slot
// counted no host miss; a host hit without one counted nowhere: an outside review).
TEST_F(HostTierTest, EveryLookupCountsOnceOnEachTierItAsks) {
  std::unique_ptr<StateCache> c = Make(2, 4);
  ASSERT_NE(c, nullptr);
  const std::vector<int32_t> a = {11, 12, 13, 14, 15}, b = {31, 32, 33, 34};
  auto lookups = [&] { return c->stats().snapshot_hits + c->stats().snapshot_misses; };
  auto expect_identities = [&](int64_t want_lookups, const char* where) {
    const CacheStats s = c->stats();
    EXPECT_EQ(s.snapshot_hits + s.snapshot_misses, want_lookups) << where;
    EXPECT_EQ(s.host_hits + s.host_misses, s.snapshot_misses) << where;
  };
  Donate(*c, a);  // Run's own lookups (empty prompts) count too
  const int64_t base = lookups();
  expect_identities(base, "after a donation");
  // A backend hit, but the pool's other slot is live and the hit's snapshot is pinned: a miss
  // (the request starts from nothing, the snapshot spilled to make its slot).
  const SlotId live = *c->Allocate();
  std::vector<int32_t> more = a;
  more.push_back(16);
  absl::StatusOr<StateCache::PrefixAllocation> hit = c->AllocateFromPrefixIn(0, more);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->matched, 0);
  expect_identities(base + 1, "a backend hit without a slot");
  ASSERT_TRUE(c->Free(hit->slot).ok());
  // A host hit (only the host holds b now) while every slot is live: refused, and a lookup.
  Donate(*c, b);
  ASSERT_TRUE(c->Free(live).ok());
  Flush(*c);
  const SlotId x = *c->Allocate(), y = *c->Allocate();
  std::vector<int32_t> more_b = b;
  more_b.push_back(35);
  const int64_t before = lookups();
  EXPECT_EQ(c->AllocateFromPrefixIn(0, more_b).status().code(),
            absl::StatusCode::kResourceExhausted);
  expect_identities(before + 1, "a host hit without a slot");
  ASSERT_TRUE(c->Free(x).ok());
  ASSERT_TRUE(c->Free(y).ok());
}

TEST_F(HostTierTest, BadOptionsAreRefused) {
  absl::StatusOr<ModelSpec> m = ModelPreset("tiny-gdn", RSSM_DTYPE_F32, 4);
  ASSERT_TRUE(m.ok());
  CacheOptions o;
  o.backend = testing::TestBackend();
  o.memory_budget_bytes = 4 * m->SlotBytes();
  for (int64_t bytes : {int64_t{-1}, int64_t{100}}) {
    o.host_snapshot_bytes = bytes;
    const absl::Status st = StateCache::Create(*m, o).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bytes;
    EXPECT_NE(st.message().find("host_snapshot_bytes: expected 0 (no host tier) or at least one"),
              std::string::npos)
        << st;
  }
  o.host_snapshot_bytes = 0;
  o.host_policy = static_cast<HostPolicy>(7);
  const absl::Status st = StateCache::Create(*m, o).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("host_policy: expected kLru or kValue, got 7"), std::string::npos)
      << st;
}

}  // namespace
}  // namespace replayssm::cache
