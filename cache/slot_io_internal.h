// The cache's side of slot I/O (slot_io.h): the readers and writers the cache hands out, and
// what they need from the cache that made them (SlotIoOwner: StateCacheImpl). The cache
// decides which slot and marks it (MOVING, importing) under its lock; the readers and
// writers move the bytes on the cache's streams and report back when they end.
#ifndef REPLAYSSM_CACHE_SLOT_IO_INTERNAL_H_
#define REPLAYSSM_CACHE_SLOT_IO_INTERNAL_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "lane.h"
#include "replayssm/cache/slot_io.h"
#include "slot_pool.h"

namespace replayssm::cache {

class SegmentedChecksum;

class SlotIoOwner {
 public:
  virtual ~SlotIoOwner() = default;
  virtual SlotPool& pool() = 0;
  virtual LanePool& lanes() = 0;
  virtual StagingPool& staging() = 0;
  // An export ended: the slot stops MOVING and is released as it is, or freed (moved).
  virtual void EndExport(int32_t index, bool moved) = 0;
  // An import's slot becomes live (write_pos 0) with `tokens`; its id.
  virtual SlotId CommitImport(int32_t index, absl::Span<const int32_t> tokens) = 0;
  // An import's slot goes back to the free list.
  virtual void DropImport(int32_t index) = 0;
};

// What one reader or writer works on.
struct SlotIoSpec {
  int32_t index = -1;  // the slot in the pool
  SlotIoPath path = SlotIoPath::kHostDirect;
  size_t chunk_bytes = 0;  // > 0
  int32_t staging_buffers = 4;
  bool checksum = true;  // a reader hashes the slot (SlotIoOptions::checksum)
};

// The writers NewSlotWriter makes. A rank of a tensor-parallel group (tp_slot_io.h) writes
// its part of an unsharded payload with WriteAndHash: the bytes it copies into its slot are
// also the group's payload bytes, hashed into the group's checksum in the same pass (the
// rank's writer is opened without a checksum of its own).
class ShardSlotWriter : public SlotWriter {
 public:
  // Write(offset, src, size, /*backend_memory=*/false), adding the bytes to `sum` as its
  // payload bytes [sum_offset, sum_offset + size).
  virtual absl::Status WriteAndHash(size_t offset, const void* src, size_t size,
                                    SegmentedChecksum& sum, size_t sum_offset) = 0;
};

// OK, or INVALID_ARGUMENT naming the option: the path `options` ask for (or the cache's
// choice) on `backend`, and sane sizes.
absl::StatusOr<SlotIoSpec> ResolveSlotIo(int32_t backend, const SlotIoOptions& options);

// The owner must outlive them. The reader starts hashing the slot at once.
absl::StatusOr<std::unique_ptr<SlotReader>> NewSlotReader(SlotIoOwner* owner,
                                                          const SlotIoSpec& spec, int64_t seq_len,
                                                          std::vector<int32_t> tokens);
absl::StatusOr<std::unique_ptr<ShardSlotWriter>> NewSlotWriter(SlotIoOwner* owner,
                                                               const SlotIoSpec& spec,
                                                               int64_t seq_len);
// Backend memory of `bytes` (rssm_alloc).
absl::StatusOr<std::unique_ptr<BackendBuffer>> NewBackendBuffer(int32_t backend, size_t bytes);

// The payload checksum of slot `index` hashed where it lies (its layers in place, one
// rssm_segment_digests_parts call) on `lane`; waits for it.
absl::StatusOr<uint64_t> SlotDigest(const SlotPool& pool, int32_t index, Lane& lane);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_SLOT_IO_INTERNAL_H_
