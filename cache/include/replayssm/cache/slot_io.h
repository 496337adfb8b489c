// Slot I/O: the only way a slot's bytes leave or enter the cache in bulk (a move to or from
// another instance). The cache owns slot memory, its streams and its guard; a mover (the
// transfer layer) gets typed readers and writers from StateCache::OpenExport/OpenImport and
// never touches slot memory, streams or the kernel ABI itself.
//
// The payload of a slot is every layer's checkpoint ([HV, V, K] in the state dtype),
// layer-major: payload offset o is byte o % bytes_per_layer of layer o / bytes_per_layer.
// Chunks are pieces of the payload of at most SlotIoOptions::chunk_bytes that never cross a
// layer.
//
// Paths (one interface; the cache picks the implementation from its backend and what the
// transport can take, SelectSlotIoPath):
//  - host-direct (CPU backend): chunks are views of slot memory itself; no copy.
//  - staged (CUDA, a transport that takes host memory only): chunks go through pinned host
//    buffers, copied on the cache's streams (device -> host ahead of the mover's need).
//  - device-direct (CUDA, a transport that reads and writes device memory): chunks are views
//    of device memory.
// Any path runs on either backend (on CPU, backend memory is host memory), so every path is
// tested without a GPU.
//
// The checksum of a payload (kChecksumVersion) is computed inside the cache: a reader hashes
// its slot where it lies (on the device on CUDA), beside the mover's reads; a writer hashes
// what the slot gets as it copies it in, and compares at Commit.
#ifndef REPLAYSSM_CACHE_SLOT_IO_H_
#define REPLAYSSM_CACHE_SLOT_IO_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "replayssm/cache/model.h"

namespace replayssm::cache {

using SlotId = uint64_t;

// The payload checksum both sides of a move compute: 1 MiB segments, each hashed on its own
// (replayssm/segment_hash.h), the segment digests mixed in order with the payload's length.
inline constexpr uint32_t kChecksumVersion = 3;
inline constexpr size_t kChecksumSegmentBytes = size_t{1} << 20;  // part of the format

// The checksum of a payload in host memory, on this thread: the reference for what a reader's
// Checksum gives for the same bytes (and what a writer's Commit expects).
uint64_t PayloadChecksum(const void* data, size_t size);

// Bytes of a slot's payload: num_layers x (checkpoint [HV, V, K] in the state dtype, then
// the short convolution's window [W-1, C] in the act dtype when the model has one).
size_t SlotPayloadBytes(const ModelSpec& model);

enum class SlotIoPath { kHostDirect, kStaged, kDeviceDirect };
const char* SlotIoPathName(SlotIoPath path);
// host-direct on the CPU backend; on CUDA device-direct when the transport reads and writes
// device memory, else staged.
SlotIoPath SelectSlotIoPath(int32_t backend, bool transport_takes_backend_memory);
// The path a cache of `tp_size` ranks moves slots on (what a receiver sizes its buffers for):
// SelectSlotIoPath's, but never device-direct for a tensor-parallel group, which re-lays its
// ranks' bytes out on the host (staged on CUDA).
SlotIoPath SelectCacheSlotIoPath(int32_t backend, int32_t tp_size,
                                 bool transport_takes_backend_memory);

struct SlotIoOptions {
  size_t chunk_bytes = size_t{4} << 20;  // at most; a chunk never crosses a layer
  // Whether the transport can read and write backend (device) memory directly.
  bool transport_takes_backend_memory = false;
  // Overrides the cache's choice (a benchmark, or a test of the staged path on CPU).
  std::optional<SlotIoPath> path;
  // Staged path: pinned buffers, i.e. the chunks a reader may hold at once (at least 2).
  int32_t staging_buffers = 4;
  // false: a reader computes no checksum (its Checksum() is FAILED_PRECONDITION) and a writer
  // neither hashes nor checks one at Commit, for a mover that hashes the bytes itself (a TP
  // group re-lays its ranks' bytes out and checks the payload it sends or receives whole).
  bool checksum = true;
};

// A chunk of the payload handed to or by a mover.
struct SlotChunk {
  size_t index = 0;   // in the reader's order, 0..num_chunks - 1
  size_t offset = 0;  // payload offset
  size_t size = 0;
  const void* data = nullptr;
  bool backend_memory = false;  // data is device memory (device-direct on CUDA)
};

// One export of one slot, from OpenExport until it is destroyed. OpenExport folded the slot
// (write_pos 0: the guarded path) and marked it MOVING: every mutation of it (forward,
// prefill, verify, accept, import, donate, export, free) is refused with FAILED_PRECONDITION
// naming the move until the reader is finished, so what is read is exactly the state the
// receiver gets, and no token is applied to a state that is leaving.
//
// Thread safety: Next from one thread at a time; Done, Checksum and the accessors from any.
// Finish (and the destructor) only once every thread that calls Next or Done has stopped: it
// releases the staging buffers that Done hands back (the callers join their movers first).
class SlotReader {
 public:
  virtual ~SlotReader() = default;  // not finished: as Finish(/*moved=*/false)

  virtual int64_t seq_len() const = 0;
  virtual const std::vector<int32_t>& tokens() const = 0;  // [seq_len]
  virtual size_t bytes() const = 0;                        // the whole payload
  virtual SlotIoPath path() const = 0;
  virtual size_t num_chunks() const = 0;
  // Chunks that may be held (returned by Next, not yet Done) at once: the staging buffers on
  // the staged path, every chunk on the others. Next refuses to exceed it.
  virtual size_t depth() const = 0;
  // The next chunk in order (staged: its copy to host memory is complete; later ones are
  // already being copied). Its data stays valid until Done(its index).
  virtual absl::StatusOr<SlotChunk> Next() = 0;
  // The mover no longer needs chunk `index` (it was put and flushed): its buffer may be reused.
  virtual void Done(size_t index) = 0;
  // The payload's checksum, computed beside the reads since OpenExport (waits for it).
  virtual absl::StatusOr<uint64_t> Checksum() = 0;
  // Ends the move: moved = false releases the slot unchanged (its logical state; it was
  // folded); moved = true frees it (its state lives on elsewhere now). Waits for the reader's
  // own work first. Later calls do nothing.
  virtual void Finish(bool moved) = 0;
};

// One import into a fresh slot, from OpenImport until Commit. The slot is nobody's: it has no
// id anyone can use, and its bytes are the previous holder's until written. Destroying the
// writer without a successful Commit frees the slot.
//
// Thread safety: Write from any number of threads at once (disjoint payload ranges); Commit
// once, after every Write returned.
class SlotWriter {
 public:
  virtual ~SlotWriter() = default;

  virtual size_t bytes() const = 0;  // the whole payload
  virtual SlotIoPath path() const = 0;
  // Copies src[0, size) into payload bytes [offset, offset + size) and hashes what the slot
  // gets. `backend_memory`: src is backend (device) memory, else host memory. Each payload
  // byte must be written exactly once, in any order.
  virtual absl::Status Write(size_t offset, const void* src, size_t size,
                             bool backend_memory = false) = 0;
  // Every byte written, tokens.size() the reserved seq_len and `checksum` (version
  // kChecksumVersion) the digest of what the slot got: the slot becomes live (write_pos 0,
  // seq_len tokens.size()) and its id is returned. Otherwise nothing becomes live:
  // FAILED_PRECONDITION (seq_len), DATA_LOSS (bytes missing or checksum) and the slot is freed.
  virtual absl::StatusOr<SlotId> Commit(absl::Span<const int32_t> tokens, uint64_t checksum) = 0;
};

// Backend memory (device memory on CUDA) that a transport reads or writes directly: a
// device-direct receive buffer. Freed with the object.
class BackendBuffer {
 public:
  virtual ~BackendBuffer() = default;
  virtual void* data() const = 0;
  virtual size_t size() const = 0;
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_SLOT_IO_H_
