// The prefix cache: snapshots (taken, donated, found by prefix, evicted), their namespaces,
// and the host tier's spills and promotions.
#include <algorithm>
#include <functional>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "state_cache_impl.h"

namespace replayssm::cache {
namespace internal {

absl::StatusOr<StateCache::PrefixAllocation> StateCacheImpl::AllocateFromPrefixIn(
    PrefixNamespace ns, absl::Span<const int32_t> tokens) {
  int32_t src = -1, index = -1, entry = -1;
  RadixTree::Match m;
  {
    absl::MutexLock lock(&mu_);
    m = radix_.LongestPrefix(ns, tokens);
    const RadixTree::Match h =
        host_ != nullptr ? host_->LongestPrefix(ns, tokens) : RadixTree::Match{};
    if (h.length > m.length) {
      m = h;
      entry = h.value;
      ++host_->entry(entry).refs;  // pins it: no host eviction takes it
    } else if (m.length == 0) {
      CountLookup(PrefixAllocation::Source::kNone, host_ != nullptr, stats_);
    } else {
      src = m.value;
      ++slots_[src].refs;  // pins the snapshot while it is copied
      TouchLocked(src);
    }
  }
  if (entry >= 0) return PromoteFromHost(ns, tokens.subspan(0, m.length), entry);
  // A miss: a plain allocation in the namespace, from nothing.
  auto fresh = [&]() -> absl::StatusOr<PrefixAllocation> {
    absl::StatusOr<SlotId> id = Allocate();
    if (!id.ok()) return id.status();
    if (absl::Status s = SetPrefixNamespace(*id, ns); !s.ok()) return s;
    return PrefixAllocation{*id, 0};
  };
  if (m.length == 0) return fresh();
  MakeRoom(1);  // the pinned snapshot is no victim
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = TakeFreeLocked();
    if (i.ok()) {
      index = *i;
      StartLiveLocked(index, std::vector<int32_t>(tokens.begin(), tokens.begin() + m.length));
      slots_[index].ns = ns;
    } else {
      // No slot but what the snapshot itself could give: unpinned, a plain allocation takes
      // it (or another victim) and the request starts from nothing. It used to be refused
      // where Allocate() without the prompt succeeded (an outside review). A miss.
      --slots_[src].refs;
      CountLookup(PrefixAllocation::Source::kNone, host_ != nullptr, stats_);
    }
  }
  if (index < 0) return fresh();
  absl::Status s = OnLane([&](Lane& lane) {
    absl::Status st = Materialize(src, "copy-on-write from a snapshot", lane);
    return st.ok() ? pool_->CopyCheckpoints(index, src, lane) : st;
  });
  absl::MutexLock lock(&mu_);
  --slots_[src].refs;
  if (!s.ok()) {
    ReleaseLocked(index);
    return s;
  }
  CountLookup(PrefixAllocation::Source::kBackend, host_ != nullptr, stats_);
  slots_[index].busy = false;
  return PrefixAllocation{MakeId(index, slots_[index].generation), m.length,
                          PrefixAllocation::Source::kBackend};
}

int64_t StateCacheImpl::MatchPrefixIn(PrefixNamespace ns,
                                      absl::Span<const int32_t> tokens) const {
  absl::MutexLock lock(&mu_);
  const int64_t backend = radix_.LongestPrefix(ns, tokens).length;
  return host_ == nullptr ? backend : std::max(backend, host_->LongestPrefix(ns, tokens).length);
}

absl::Status StateCacheImpl::SetPrefixNamespace(SlotId id, PrefixNamespace ns) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<int32_t> i = LookupLocked(id, "slot", /*allow_broken=*/true);
  if (!i.ok()) return i.status();
  slots_[*i].ns = ns;
  return absl::OkStatus();
}

void StateCacheImpl::DropBackendLocked(int32_t victim) {
  Slot& s = slots_[victim];
  radix_.Erase(s.ns, s.tokens);
  // Stored on the host before removed from backend memory: a router following the events never
  // sees a moment where the snapshot is nowhere (nor does a TP group merging its shards').
  const int32_t e = s.host >= 0 ? s.host : host_ != nullptr ? host_->Find(s.ns, s.tokens) : -1;
  if (e >= 0) {
    HostTier::Entry& h = host_->entry(e);
    h.backend_slot = -1;
    if (!h.reported) EmitLocked(CacheEvent::Type::kStored, h.ns, h.tokens, Medium::kHost);
    h.reported = true;
    ++stats_.snapshot_spills;
  }
  EmitLocked(CacheEvent::Type::kRemoved, s.ns, s.tokens, Medium::kBackend);
  lru_.erase(s.lru);
  --ns_snapshots_[s.ns];
  ++stats_.snapshot_evictions;
  s = Slot{Kind::kFree, s.generation + 1};
  free_.push_back(victim);
}

int32_t StateCacheImpl::LruVictimLocked(const std::function<bool(const Slot&)>& which) const {
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    const Slot& s = slots_[*it];
    if (s.refs == 0 && !s.busy && which(s)) return *it;
  }
  return -1;
}

void StateCacheImpl::HostEvictedLocked(const std::vector<HostTier::Entry>& evicted) {
  for (const HostTier::Entry& h : evicted) {
    if (h.reported) EmitLocked(CacheEvent::Type::kRemoved, h.ns, h.tokens, Medium::kHost);
    if (h.backend_slot >= 0) {  // backend memory holds it still: nothing lost
      slots_[h.backend_slot].host = -1;
      ++stats_.host_evictions_kept;
    }
    ++stats_.host_evictions;
  }
}

void StateCacheImpl::LinkHostLocked(int32_t index) {
  if (host_ == nullptr) return;
  Slot& s = slots_[index];
  s.host = host_->Find(s.ns, s.tokens);
  if (s.host >= 0) host_->entry(s.host).backend_slot = index;
}

bool StateCacheImpl::NamespaceFullLocked(PrefixNamespace ns) const {
  const int64_t bound = options_.max_snapshots_per_namespace;
  if (bound <= 0) return false;
  const auto it = ns_snapshots_.find(ns);
  return it != ns_snapshots_.end() && it->second >= bound;
}

bool StateCacheImpl::ReserveSnapshotLocked(PrefixNamespace ns) {
  // At the bound its own oldest goes: one the host holds first (nothing is lost), else any.
  if (NamespaceFullLocked(ns) && !(host_ != nullptr && EvictLruLocked([&](const Slot& s) {
                                     return s.ns == ns && HostBackedLocked(s);
                                   })) &&
      !EvictLruLocked([ns](const Slot& s) { return s.ns == ns; })) {
    return false;
  }
  ++ns_snapshots_[ns];
  return true;
}

void StateCacheImpl::EmitLocked(CacheEvent::Type type, PrefixNamespace ns,
                                const std::vector<int32_t>& tokens, Medium medium) {
  if (!options_.event_sink) return;
  CacheEvent e;
  e.type = type;
  e.ns = ns;
  e.medium = medium;
  e.tokens = tokens;
  options_.event_sink(e);
}

void StateCacheImpl::MakeRoom(size_t n) {
  SpillUntil([this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return free_.size() >= n; },
             [](const Slot&) { return true; });
}

void StateCacheImpl::MakeNamespaceRoom(PrefixNamespace ns) {
  if (options_.max_snapshots_per_namespace <= 0) return;
  SpillUntil([this, ns]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !NamespaceFullLocked(ns); },
             [ns](const Slot& s) { return s.ns == ns; });
}

void StateCacheImpl::SpillUntil(const std::function<bool()>& done,
                                const std::function<bool(const Slot&)>& which) {
  if (host_ == nullptr) return;
  for (;;) {
    int32_t victim = -1, e = -1;
    {
      absl::MutexLock lock(&mu_);
      if (done()) return;
      victim = LruVictimLocked(which);
      if (victim < 0 && spills_in_flight_ > 0) {
        // The evictable snapshots are being copied to the host (the spiller's, or another
        // call's MakeRoom): wait for the copies, a moment, then evict them without loss. It
        // used to give up, and the allocation failed RESOURCE_EXHAUSTED beside a snapshot
        // about to be host-backed (seen under ASan, where copies are slow).
        // Until one of the copies ends (then look again) — not until every copy is done:
        // under steady allocation some spill is always in flight, and the wait went on after
        // the room it needed was there (an outside review). The condition is re-checked at
        // every release of mu_: it scans nothing.
        const int64_t ended = spills_ended_;
        const auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return spills_ended_ != ended || spills_in_flight_ == 0;
        };
        mu_.Await(absl::Condition(&ready));
        continue;
      }
      if (victim < 0) return;
      if (HostBackedLocked(slots_[victim])) {  // on the host already: no copy
        DropBackendLocked(victim);
        continue;
      }
      e = StartSpillLocked(victim);
      if (e < 0) return;  // every host entry in use: an eviction now drops
    }
    const absl::Status st = Spill(victim, e);
    absl::MutexLock lock(&mu_);
    if (!EndSpillLocked(victim, e, st)) return;
    // Else a copy from it goes on: it stays, backed by the host.
    if (slots_[victim].refs == 0) DropBackendLocked(victim);
  }
}

int32_t StateCacheImpl::StartSpillLocked(int32_t victim, bool* displaced) {
  Slot& s = slots_[victim];
  std::vector<HostTier::Entry> evicted;
  const int32_t e = host_->Reserve(s.ns, &evicted);
  if (displaced != nullptr) {
    *displaced = std::any_of(evicted.begin(), evicted.end(),
                             [](const HostTier::Entry& h) { return h.backend_slot >= 0; });
  }
  HostEvictedLocked(evicted);
  if (e >= 0) {
    s.busy = true;  // no other eviction takes it; prefix hits still copy from it
    ++spills_in_flight_;
  }
  return e;
}

bool StateCacheImpl::EndSpillLocked(int32_t victim, int32_t e, const absl::Status& st) {
  Slot& s = slots_[victim];
  s.busy = false;
  --spills_in_flight_;
  ++spills_ended_;
  if (!st.ok()) {  // the snapshot stays in backend memory
    host_->Unreserve(e);
    return false;
  }
  host_->Store(e, s.ns, s.tokens);
  s.host = e;
  host_->entry(e).backend_slot = victim;
  return true;
}

int32_t StateCacheImpl::SpillAheadVictimLocked() const {
  int64_t obtainable = static_cast<int64_t>(free_.size());
  for (auto it = lru_.rbegin(); it != lru_.rend() && obtainable < options_.host_spill_ahead;
       ++it) {
    const Slot& s = slots_[*it];
    if (s.refs > 0 || s.busy) continue;  // no eviction takes it now either
    if (HostBackedLocked(s)) {
      ++obtainable;
      continue;
    }
    return *it;
  }
  // A namespace at its bound (max_snapshots_per_namespace) evicts its own oldest at its next
  // snapshot, in the forward that takes it: that one goes to the host first, so that the
  // eviction loses nothing (an outside review: a capped tenant's evictions were all drops).
  if (options_.max_snapshots_per_namespace <= 0) return -1;
  absl::flat_hash_set<PrefixNamespace> looked;
  for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
    const Slot& s = slots_[*it];
    if (s.refs > 0 || s.busy || !NamespaceFullLocked(s.ns) || !looked.insert(s.ns).second) {
      continue;
    }
    if (!HostBackedLocked(s)) return *it;  // its oldest: the next to go
  }
  return -1;
}

void StateCacheImpl::SpillAhead() {
  uint64_t seen = 0;
  bool look = false;  // a spill just ended: look again before sleeping
  for (;;) {
    int32_t victim = -1, e = -1;
    bool displaced = false;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || look || slots_taken_ != seen;
      };
      mu_.Await(absl::Condition(&wake));
      if (stopping_) return;
      seen = slots_taken_;
      look = false;
      victim = SpillAheadVictimLocked();
      if (victim < 0) continue;
      e = StartSpillLocked(victim, &displaced);
      if (e < 0) continue;  // every host entry in use: retried when the next slot is taken
    }
    const absl::Status st = Spill(victim, e);
    absl::MutexLock lock(&mu_);
    if (EndSpillLocked(victim, e, st)) {
      ++stats_.spills_ahead;
      // A copy whose host entry cost another snapshot's host copy gained nothing: the host
      // tier holds fewer entries than host_spill_ahead asks for. Looking again at once would
      // swap copies for ever; the next slot taken wakes the pass.
      look = !displaced;
    }
  }
}

absl::Status StateCacheImpl::Spill(int32_t victim, int32_t e) {
  absl::StatusOr<void*> buffer = host_->Buffer(e);
  if (!buffer.ok()) return buffer.status();
  return OnLane([&](Lane& lane) { return pool_->SaveState(victim, *buffer, lane); });
}

absl::StatusOr<StateCache::PrefixAllocation> StateCacheImpl::PromoteFromHost(
    PrefixNamespace ns, absl::Span<const int32_t> prefix, int32_t e) {
  MakeRoom(2);
  Promotion p;
  {
    absl::MutexLock lock(&mu_);
    absl::Status st = StartPromotionLocked(ns, prefix, e, &p);
    if (!st.ok()) {
      --host_->entry(e).refs;
      return st;
    }
  }
  return FinishPromotion(p);
}

absl::Status StateCacheImpl::StartPromotionLocked(PrefixNamespace ns,
                                                  absl::Span<const int32_t> prefix, int32_t e,
                                                  Promotion* p) {
  absl::StatusOr<int32_t> i = TakeFreeLocked();
  if (!i.ok()) {  // a lookup all the same: a miss on both tiers (it used to count nowhere)
    CountLookup(PrefixAllocation::Source::kNone, /*host_tier=*/true, stats_);
    return i.status();
  }
  CountLookup(PrefixAllocation::Source::kHost, /*host_tier=*/true, stats_);
  p->entry = e;
  p->slot = *i;
  p->matched = static_cast<int64_t>(prefix.size());
  StartLiveLocked(p->slot, std::vector<int32_t>(prefix.begin(), prefix.end()));
  slots_[p->slot].ns = ns;
  host_->Hit(e);
  // A promotion never evicts: it takes a free slot, within the namespace's bound (at the bound
  // the entry stays on the host alone).
  if (free_.empty() || NamespaceFullLocked(ns) || !ReserveSnapshotLocked(ns)) {
    return absl::OkStatus();
  }
  p->snapshot = free_.back();
  free_.pop_back();
  Slot& d = slots_[p->snapshot];
  d.kind = Kind::kSnapshot;
  d.busy = true;
  d.seq_len = p->matched;
  d.tokens = slots_[p->slot].tokens;
  d.ns = ns;
  return absl::OkStatus();
}

absl::StatusOr<StateCache::PrefixAllocation> StateCacheImpl::FinishPromotion(const Promotion& p) {
  const void* data = nullptr;
  {
    absl::MutexLock lock(&mu_);
    data = host_->entry(p.entry).data;
  }
  const absl::Time start = absl::Now();
  const absl::Status st = OnLane([&](Lane& lane) {
    if (p.snapshot < 0) return pool_->LoadState(p.slot, data, lane);
    absl::Status s = pool_->LoadState(p.snapshot, data, lane);
    return s.ok() ? pool_->CopyCheckpoints(p.slot, p.snapshot, lane) : s;
  });
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  --host_->entry(p.entry).refs;
  if (p.snapshot >= 0) {
    Slot& d = slots_[p.snapshot];
    // Another promotion or snapshot of the same key may have got there first: keep that one.
    if (!st.ok() || !radix_.Insert(d.ns, d.tokens, p.snapshot)) {
      SnapshotDroppedLocked(d.ns);
      ReleaseLocked(p.snapshot);
    } else {
      d.busy = false;
      lru_.push_front(p.snapshot);
      d.lru = lru_.begin();
      d.host = p.entry;
      host_->entry(p.entry).backend_slot = p.snapshot;
      ++stats_.host_promotions;
      EmitLocked(CacheEvent::Type::kStored, d.ns, d.tokens, Medium::kBackend);
    }
  }
  if (!st.ok()) {
    ReleaseLocked(p.slot);
    return st;
  }
  const auto bucket = std::lower_bound(kPromotionLatencyBounds.begin(),
                                       kPromotionLatencyBounds.end(), seconds);
  ++stats_.promotion_latency_counts[bucket - kPromotionLatencyBounds.begin()];
  stats_.promotion_seconds += seconds;
  slots_[p.slot].busy = false;
  return PrefixAllocation{MakeId(p.slot, slots_[p.slot].generation), p.matched,
                          PrefixAllocation::Source::kHost};
}

absl::Status StateCacheImpl::TakeSnapshot(int32_t index, Lane& lane) {
  absl::Status st = Materialize(index, "snapshot", lane);
  if (!st.ok()) return st;
  int32_t snap = -1;
  {
    absl::MutexLock lock(&mu_);
    const Slot& s = slots_[index];
    if (radix_.Find(s.ns, s.tokens) >= 0) {
      TouchLocked(radix_.Find(s.ns, s.tokens));
      return absl::OkStatus();
    }
    // No room (in the pool, or in the namespace's share): a snapshot is an optimization.
    if (!ReserveSnapshotLocked(s.ns)) return absl::OkStatus();
    absl::StatusOr<int32_t> i = TakeFreeLocked();
    if (!i.ok()) {
      SnapshotDroppedLocked(s.ns);
      return absl::OkStatus();
    }
    snap = *i;
    Slot& d = slots_[snap];
    d.kind = Kind::kSnapshot;
    d.busy = true;
    d.seq_len = s.seq_len;
    d.tokens = s.tokens;
    d.ns = s.ns;
  }
  // The finiteness scan and the copy are queued together and waited for once: a state with a
  // NaN or Inf never becomes a snapshot (counted); the request goes on.
  uint32_t counts[2] = {0, 0};
  st = pool_->CountNonfinite(index, counts, lane);
  if (st.ok()) st = pool_->CopyCheckpoints(snap, index, lane);
  absl::Status done = lane.Synchronize();
  if (st.ok()) st = done;
  const bool shareable = st.ok() && ShareRefusal("snapshot", counts).ok();
  absl::MutexLock lock(&mu_);
  Slot& d = slots_[snap];
  if (!shareable || !radix_.Insert(d.ns, d.tokens, snap)) {
    SnapshotDroppedLocked(d.ns);
    slots_[snap] = Slot{Kind::kFree, d.generation + 1};
    free_.push_back(snap);
    return st;
  }
  d.busy = false;
  lru_.push_front(snap);
  d.lru = lru_.begin();
  ++stats_.snapshots_taken;
  LinkHostLocked(snap);
  EmitLocked(CacheEvent::Type::kStored, d.ns, d.tokens, Medium::kBackend);
  return absl::OkStatus();
}

absl::StatusOr<int32_t> StateCacheImpl::AcquireShareable(SlotId id, const char* purpose) {
  int32_t index = -1;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", /*allow_pending=*/true);
    if (!i.ok()) return i.status();
    index = *i;
  }
  absl::Status st = OnLane([&](Lane& lane) {
    absl::Status r = Materialize(index, purpose, lane);
    return r.ok() ? CheckShareable(index, purpose, lane) : r;
  });
  if (st.ok()) return index;
  absl::MutexLock lock(&mu_);
  slots_[index].busy = false;
  return st;
}

absl::Status StateCacheImpl::CheckFinite(SlotId id, const char* purpose) {
  absl::StatusOr<int32_t> index = AcquireShareable(id, purpose);
  if (!index.ok()) return index.status();
  absl::MutexLock lock(&mu_);
  slots_[*index].busy = false;
  return absl::OkStatus();
}

absl::Status StateCacheImpl::Donate(SlotId id) {
  absl::StatusOr<int32_t> acquired = AcquireShareable(id, "donate");
  if (!acquired.ok()) return acquired.status();
  const int32_t index = *acquired;
  if (host_ != nullptr) {
    // At the namespace's bound its oldest snapshot makes way: copied to the host first (a unary
    // call may wait for that; a forward's snapshot does not, and relies on the spiller).
    PrefixNamespace ns;
    bool adds = false;
    {
      absl::MutexLock lock(&mu_);
      ns = slots_[index].ns;
      adds = slots_[index].seq_len > 0 && radix_.Find(ns, slots_[index].tokens) < 0;
    }
    if (adds) MakeNamespaceRoom(ns);
  }
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[index];
  ++stats_.donations;
  if (s.seq_len == 0 || radix_.Find(s.ns, s.tokens) >= 0) {  // nothing new to keep
    if (s.seq_len > 0) TouchLocked(radix_.Find(s.ns, s.tokens));
    ReleaseLocked(index);
    return absl::OkStatus();
  }
  if (!ReserveSnapshotLocked(s.ns)) {  // the namespace's share is full and all in use
    ReleaseLocked(index);
    return absl::OkStatus();
  }
  s.kind = Kind::kSnapshot;
  s.generation += 1;  // the request's id stops working
  s.busy = false;
  radix_.Insert(s.ns, s.tokens, index);
  lru_.push_front(index);
  s.lru = lru_.begin();
  LinkHostLocked(index);
  EmitLocked(CacheEvent::Type::kStored, s.ns, s.tokens, Medium::kBackend);
  return absl::OkStatus();
}

}  // namespace internal

void CountLookup(StateCache::PrefixAllocation::Source source, bool host_tier, CacheStats& s) {
  using Source = StateCache::PrefixAllocation::Source;
  if (source == Source::kBackend) {
    ++s.snapshot_hits;
    return;
  }
  ++s.snapshot_misses;  // the backend's
  if (source == Source::kHost) {
    ++s.host_hits;
  } else if (host_tier) {
    ++s.host_misses;
  }
}

}  // namespace replayssm::cache
