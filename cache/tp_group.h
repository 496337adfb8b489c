// The state cache of a tensor-parallel group (CacheOptions::tp_size > 1): one StateCache whose
// slots span tp_size shards, each an ordinary StateCache of one rank's heads (tp.h). It is
// what StateCache::Create returns for tp_size > 1; everything above sees one cache: one slot
// id per request, one cursor, one prefix cache, the unsharded model().
//
// Layouts:
//  - Activations (LayerIo) are the ranks' own tensors one after another, rank-major: e.g.
//    mixed_qkv holds rank 0's [N, QkvWidth/T], then rank 1's, ... (with T dividing H and HV
//    these are exactly the bytes of [T, N, width/T]). Bells of RunLayers: empty, or
//    num_layers per rank, rank-major.
//  - A state that leaves or enters a slot (Export/Import, slot I/O, snapshots moved between
//    servers) is unsharded: each layer's [HV, V, K] checkpoint and [W-1, C] conv window, as
//    a TP = 1 server holds it. So any TP degree reads what any other wrote.
//
// Consistency: every operation that decides which slots hold what (allocate, free, donate,
// begin and commit of a forward, import, export, accept) runs on all shards in the same order
// under one mutex, so the shards' slot pools, LRU orders and prefix trees make the same
// decisions. A shard may still hold a snapshot another lacks (one rank's state was not finite
// when it was taken); prefix matches take the longest prefix every shard holds.
#ifndef REPLAYSSM_CACHE_TP_GROUP_H_
#define REPLAYSSM_CACHE_TP_GROUP_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "replayssm/cache/state_cache.h"

namespace replayssm::cache {

// The group's cache events from its shards' (CacheOptions::event_sink): a snapshot is held by
// the group in backend memory when every shard holds it there, and on the host when every
// shard holds it there or every shard holds it in one tier or the other and not all in backend
// memory (a hit then promotes the host shards' copies: a host hit's cost). Each shard's
// spill-ahead thread picks its own victims, so shards can hold one key in different tiers;
// counting each medium alone, the group reported such a key removed and never stored while
// its prefix match still found it (an outside review). Events go out on each change of what
// the group holds, stores before removals. Thread-safe.
class TpEventMerger {
 public:
  TpEventMerger(int32_t ranks, CacheEventSink sink) : ranks_(ranks), sink_(std::move(sink)) {}
  void OnShardEvent(int32_t rank, const CacheEvent& e) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Held {
    uint32_t backend = 0, host = 0;  // the shards (bit r: rank r) holding it in each medium
    bool told_backend = false, told_host = false;  // what the group reported
  };
  const int32_t ranks_;
  const CacheEventSink sink_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::pair<PrefixNamespace, std::vector<int32_t>>, Held> held_
      ABSL_GUARDED_BY(mu_);
};

// `full` is the unsharded model; options.tp_size > 1 ranks (tp.h's CheckTpSize), each shard
// with options.memory_budget_bytes of its own.
absl::StatusOr<std::unique_ptr<StateCache>> CreateTpGroup(ModelSpec full, CacheOptions options);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_TP_GROUP_H_
