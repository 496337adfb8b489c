// Slot I/O of a tensor-parallel group (tp_group.h): a move out or in carries the unsharded
// payload (every layer's [HV, V, K] checkpoint and [W-1, C] conv window whole), streamed to and
// from the ranks' own readers and writers as it goes — no whole-payload copy first.
//
// Out: a thread per rank copies its chunks into the unsharded layers (the checkpoint part is
// one run per rank; the window is interleaved), ahead of the mover, and hash threads digest the
// payload's 1 MiB segments as the layers under them complete.
// In: each range is split at the ranks' runs; a checkpoint part goes to its rank's writer at
// once, which hashes it as the unsharded payload's bytes in the pass that copies it
// (ShardSlotWriter::WriteAndHash; checked against the sender's checksum at Commit); window
// parts are hashed, gathered per (layer, rank) and written whole when complete (a few KB each).
// The ranks' readers and writers are opened without checksums of their own
// (SlotIoOptions::checksum): the group checks the payload the wire carries.
#ifndef REPLAYSSM_CACHE_TP_SLOT_IO_H_
#define REPLAYSSM_CACHE_TP_SLOT_IO_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "replayssm/cache/slot_io.h"
#include "replayssm/cache/tp.h"
#include "slot_io_internal.h"

namespace replayssm::cache {

// Where each rank's bytes lie in one unsharded layer state (the same for every layer).
struct TpLayerMap {
  struct Run {
    int64_t full = 0;   // offset in the unsharded layer state
    int64_t shard = 0;  // offset in rank `rank`'s layer state
    int64_t count = 0;  // bytes
    int32_t rank = 0;
  };
  std::vector<Run> runs;             // sorted by full, tiling the layer exactly
  int64_t layer_bytes = 0;           // unsharded
  std::vector<int64_t> shard_bytes;  // [ranks]: each rank's layer state
  std::vector<int64_t> ckpt_bytes;   // [ranks]: the checkpoint part of it (the window follows)
  int32_t num_layers = 0;

  static TpLayerMap Of(const ModelSpec& full, const std::vector<ModelSpec>& shards,
                       const std::vector<std::vector<SliceRun>>& runs);
};

// What the readers and writers need of their group.
class TpSlotIoHost {
 public:
  virtual ~TpSlotIoHost() = default;
  virtual void Use(size_t rank) const = 0;  // rank's device current on this thread
  // The per-rank opens and commits run at once (OnEachRank): by default when the ranks are on
  // distinct devices (CacheOptions::tp_ranks_at_once). Ranks that share a device (or the CPU
  // backend's threads) take turns.
  virtual bool ranks_at_once() const = 0;
  virtual absl::Mutex& ops_mu() = 0;        // orders the shards' slot decisions
  virtual int32_t backend() const = 0;
  virtual SlotId Bind(std::vector<SlotId> ids) = 0;  // a group id for the ranks' slots
  virtual void Unbind(SlotId group) = 0;
  // Frees ids (one per rank, in order) and returns `why`.
  virtual absl::Status FreeAll(const std::vector<SlotId>& ids, absl::Status why) = 0;
  // A host buffer of a whole unsharded payload, reused from move to move: a fresh one would
  // be faulted in, and registered by the transport, on every move.
  virtual std::unique_ptr<uint8_t[]> TakePayloadBuffer() = 0;
  virtual void ReturnPayloadBuffer(std::unique_ptr<uint8_t[]> buffer) = 0;
};

// Runs f(r) for every rank r < n, each with its device current (host.Use); the statuses, by
// rank. With host.ranks_at_once() the ranks run together, rank 0 on the calling thread and
// each other on a thread of its own: a group's per-rank opens and commits (a fold, a
// reservation, the staged copies' drain) then overlap their device waits. Otherwise they run
// in turn, as ranks on one device should: at once they only contend for it (a 2 -> 2 move's
// fold and reservation measured slower on one H200: bench/results/tp.md, "Tried and not kept").
std::vector<absl::Status> OnEachRank(const TpSlotIoHost& host, size_t n,
                                     absl::FunctionRef<absl::Status(size_t)> f);

std::unique_ptr<SlotReader> NewTpReader(TpSlotIoHost* host, SlotId group,
                                        std::vector<std::unique_ptr<SlotReader>> ranks,
                                        const TpLayerMap* map, size_t chunk_bytes);
std::unique_ptr<SlotWriter> NewTpWriter(TpSlotIoHost* host,
                                        std::vector<std::unique_ptr<ShardSlotWriter>> ranks,
                                        const TpLayerMap* map);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_TP_SLOT_IO_H_
