// HostTier: the snapshots kept in pinned host memory once they left backend memory (a spill),
// indexed by namespace and token key like the backend's, with their own bound and eviction
// policy (CacheOptions::host_snapshot_bytes, host_policy). It holds bytes and bookkeeping only:
// StateCache decides what spills and what is promoted, copies the bytes (SlotPool::SaveState,
// LoadState) and reports the events.
//
// Every entry is the same size (one folded state: SlotPool::StateBytes()), so the tier is a
// fixed table of capacity() entries; an entry's pinned buffer is allocated the first time the
// entry is used and kept for reuse until the tier is destroyed (pinning is slow).
//
// Thread safety: none; StateCache guards it with its mutex. A reserved or pinned entry's
// buffer may be read or written without the lock by the one operation that holds it.
#ifndef REPLAYSSM_CACHE_HOST_TIER_H_
#define REPLAYSSM_CACHE_HOST_TIER_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "radix_tree.h"
#include "replayssm/cache/state_cache.h"

namespace replayssm::cache {

class HostTier {
 public:
  // capacity: entries of entry_bytes each (host_snapshot_bytes / entry_bytes); ns_bound:
  // CacheOptions::max_snapshots_per_namespace (0 = none), applied to this tier on its own.
  HostTier(int32_t backend, size_t entry_bytes, int64_t capacity, HostPolicy policy,
           int64_t ns_bound);
  ~HostTier();  // frees the pinned buffers: no copy may be in flight
  HostTier(const HostTier&) = delete;
  HostTier& operator=(const HostTier&) = delete;

  struct Entry {
    enum class State { kFree, kReserved, kStored };
    State state = State::kFree;
    PrefixNamespace ns = 0;
    std::vector<int32_t> tokens;  // the key: the whole prefix the state folds
    int32_t refs = 0;             // promotions reading the buffer
    int32_t backend_slot = -1;    // the backend snapshot holding the same state, or -1
    bool reported = false;        // a kStored event in Medium::kHost was sent
    int64_t hits = 0;
    double priority = 0;  // the policy's: the lowest goes first
    void* data = nullptr;  // pinned, entry_bytes; null until first used
  };

  int64_t capacity() const { return static_cast<int64_t>(entries_.size()); }
  size_t entry_bytes() const { return entry_bytes_; }
  int64_t stored() const { return stored_; }
  Entry& entry(int32_t e) { return entries_[e]; }

  // An entry for a new snapshot in `ns`, kReserved: a free one, else (the tier or ns's share of
  // it full) the policy's victim among the unpinned stored ones of the tier (of ns), whose
  // entry is appended to *evicted (as it was) before it is reused. -1 when none can be had.
  int32_t Reserve(PrefixNamespace ns, std::vector<Entry>* evicted);
  // The reserved entry's buffer, pinned on first use (called without the lock by its holder).
  absl::StatusOr<void*> Buffer(int32_t e);
  // A reserved entry now holds `tokens`' state: findable from here on.
  void Store(int32_t e, PrefixNamespace ns, std::vector<int32_t> tokens);
  // A reservation that did not become an entry (its copy failed).
  void Unreserve(int32_t e);
  // Drops a stored, unpinned entry (the caller reports it).
  void Drop(int32_t e);

  RadixTree::Match LongestPrefix(PrefixNamespace ns, absl::Span<const int32_t> tokens) const {
    return radix_.LongestPrefix(ns, tokens);
  }
  int32_t Find(PrefixNamespace ns, absl::Span<const int32_t> key) const {
    return radix_.Find(ns, key);
  }
  // A lookup found entry e (the policy's bookkeeping).
  void Hit(int32_t e);

 private:
  // The policy's priority of entry e now (LRU: a tick; value: GDSF, clock + its worth).
  double Priority(const Entry& e);
  // The unpinned stored entry of the lowest priority (of `ns` when only_ns), or -1.
  int32_t Victim(bool only_ns, PrefixNamespace ns) const;

  const int32_t backend_;
  const size_t entry_bytes_;
  const HostPolicy policy_;
  const int64_t ns_bound_;
  std::vector<Entry> entries_;
  std::vector<int32_t> free_;
  absl::flat_hash_map<PrefixNamespace, int64_t> ns_count_;  // stored + reserved
  PrefixForest radix_;
  int64_t stored_ = 0;
  double tick_ = 0;   // LRU: one per insert or hit
  double clock_ = 0;  // value: the priority of the last victim (GDSF's inflation)
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_HOST_TIER_H_
