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

#include <memory>

#include "absl/status/statusor.h"
#include "replayssm/cache/state_cache.h"

namespace replayssm::cache {

// `full` is the unsharded model; options.tp_size > 1 ranks (tp.h's CheckTpSize), each shard
// with options.memory_budget_bytes of its own.
absl::StatusOr<std::unique_ptr<StateCache>> CreateTpGroup(ModelSpec full, CacheOptions options);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_TP_GROUP_H_
