// The pieces of the chunked transfer pipeline shared by Sender and Receiver: how a payload
// (all layers' checkpoints, layer-major) splits into chunks, a ring of pinned host staging
// buffers with one backend stream each, a pool of threads for short tasks (a receiver's
// copies, a sender's hashing), the sender's parallel checksum over it, and the checksum of
// backend (device) memory hashed by the backend.
//
// Thread safety: StagingRing is used by one transfer at a time (its owner's lock);
// TaskPool is thread-safe; one of its Batches (and a PieceHasher, a SlotHasher, a
// BackendStream) is used by one thread at a time.
#ifndef REPLAYSSM_SERVICE_TRANSFER_PIPELINE_H_
#define REPLAYSSM_SERVICE_TRANSFER_PIPELINE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "checksum.h"
#include "replayssm/cache/state_cache.h"

namespace replayssm::transfer {

// How the bytes of a slot reach UCX on one side of a transfer.
enum class DataPath {
  kHostDirect,    // CPU backend: slot memory is host memory; put from / import into it as is
  kDeviceDirect,  // CUDA backend and a UCX with CUDA memory: device memory goes to UCX as is
  kHostStaged,    // CUDA backend, UCX without CUDA memory: chunks through pinned host buffers
};
DataPath SelectDataPath(int32_t backend, bool ucx_cuda_memory);
// Whether a sender on this path hashes its slot on the backend (rssm_segment_digests_parts, one
// call over the slot's layers in place: SlotHasher) rather than its pieces on the host: every
// path of a CUDA slot (device-direct and host-staged).
inline bool HashedOnDevice(DataPath p) {
  return p == DataPath::kDeviceDirect || p == DataPath::kHostStaged;
}
const char* DataPathName(DataPath p);

// One chunk of the payload: bytes [offset, offset + size) of the layer-major payload, which
// are bytes [layer_offset, layer_offset + size) of layer `layer`'s checkpoint.
struct Piece {
  int32_t layer = 0;
  size_t layer_offset = 0, offset = 0, size = 0;
};
// Chunks of at most `chunk` bytes that never cross a layer boundary.
std::vector<Piece> SplitPayload(int32_t num_layers, size_t bytes_per_layer, size_t chunk);
// Pieces of [begin, end) of the payload (for a receiver consuming what has landed).
std::vector<Piece> SplitRange(size_t begin, size_t end, size_t bytes_per_layer, size_t chunk);

// `count` pinned host buffers of `bytes` each (rssm_alloc_host) and one stream per buffer
// (rssm_stream_create): copy into buffer i on stream i, synchronize stream i before use.
class StagingRing {
 public:
  StagingRing() = default;
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  // (Re)allocates when the backend, count or size differ from what is held.
  absl::Status Ensure(int32_t backend, int32_t count, size_t bytes);
  int32_t count() const { return static_cast<int32_t>(buffers_.size()); }
  uint8_t* buffer(int32_t i) const { return static_cast<uint8_t*>(buffers_[i]); }
  // Enqueues a copy (rssm_copy_kind) on stream i; Sync waits for everything on it.
  absl::Status Copy(int32_t i, void* dst, const void* src, size_t bytes, int32_t kind);
  absl::Status Sync(int32_t i);

 private:
  void Release();
  int32_t backend_ = RSSM_BACKEND_CPU;
  size_t bytes_ = 0;
  std::vector<void*> buffers_, streams_;
};

// Threads that run short tasks (a receiver's copies of landed chunks) in submission order,
// several at once. Work is submitted through a Batch, one per user (an import): its tasks are
// numbered 0, 1, ... and its destructor waits for every one of them, so nothing a task
// touches (a slot, a staging buffer) is written after its import has ended.
class TaskPool {
 public:
  explicit TaskPool(int32_t threads);  // at least one thread
  ~TaskPool();                         // runs what is queued, then joins
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;
  int32_t threads() const { return static_cast<int32_t>(threads_.size()); }

  class Batch {
   public:
    explicit Batch(TaskPool* pool) : pool_(pool) {}
    ~Batch();  // waits for every task submitted
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
    // Queues fn (it may run at once on another thread); returns its number.
    size_t Submit(std::function<absl::Status()> fn);
    // Waits up to `timeout` for task i: true and *status = its result once it ran.
    bool WaitFor(size_t i, absl::Duration timeout, absl::Status* status);

   private:
    // Shared with the queued tasks, so that the last one to finish (not the destructor that
    // it wakes) releases the mutex for good.
    struct State {
      absl::Mutex mu;
      std::deque<absl::Status> results ABSL_GUARDED_BY(mu);  // [submitted]
      std::deque<bool> done ABSL_GUARDED_BY(mu);             // [submitted]
      size_t running ABSL_GUARDED_BY(mu) = 0;                // submitted, not done
    };
    TaskPool* const pool_;
    const std::shared_ptr<State> state_ = std::make_shared<State>();
  };

 private:
  void Loop();
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

// The sender's checksum (version 3): each submitted piece (a payload offset and host bytes)
// is hashed as a task of a TaskPool (the Sender's, one thread per lane), several at once and
// in any order; Finish combines the segments. Its destructor waits for every task (nothing
// reads a slot or a staging buffer once it has gone).
class PieceHasher {
 public:
  PieceHasher(TaskPool* pool, size_t total) : sum_(total), batch_(pool) {}
  // Queues data[0, size) as payload bytes [offset, offset + size) (valid until
  // WaitFor(ticket) returns); returns its ticket (from 1; WaitFor(0) returns at once).
  uint64_t Submit(size_t offset, const void* data, size_t size);
  void WaitFor(uint64_t ticket);
  uint64_t Finish();  // waits for everything; the digest

 private:
  SegmentedChecksum sum_;
  uint64_t submitted_ = 0;
  TaskPool::Batch batch_;  // declared last: ends (waits) before sum_ goes
};

// One backend stream (rssm_stream_create: a non-blocking stream on CUDA, NULL on CPU), created
// on first use and kept; destroyed (after a synchronize) with its owner.
class BackendStream {
 public:
  BackendStream() = default;
  ~BackendStream() { Release(); }
  BackendStream(const BackendStream&) = delete;
  BackendStream& operator=(const BackendStream&) = delete;
  // The stream of `backend` (created on the first call, again when the backend differs).
  absl::StatusOr<void*> Get(int32_t backend);

 private:
  void Release();
  int32_t backend_ = RSSM_BACKEND_CPU;
  bool created_ = false;
  void* stream_ = nullptr;
};

// Checksum `version` of `bytes` of contiguous backend memory (device memory on CUDA), hashed by
// the backend: the digests of every segment in one call (on l's stream, which it
// synchronizes, so whatever was queued on it before is done too), combined as
// SegmentedChecksum combines them. Version 2 (kChecksumV2, an older sender's) is the digest of
// one segment as long as the payload: on CUDA a single chain of rounds per lane (slow).
absl::StatusOr<uint64_t> BackendChecksum(const rssm_launch& l, const void* data, size_t bytes,
                                         uint32_t version = kChecksumVersion);
// The same of the payload parts[0] | ... | parts[count - 1] (part_bytes each), hashed in place
// (rssm_segment_digests_parts: each part 16-byte aligned, part_bytes a multiple of 16 when
// count > 1).
absl::StatusOr<uint64_t> BackendPartsChecksum(const rssm_launch& l, const void* const* parts,
                                              size_t count, size_t part_bytes,
                                              uint32_t version = kChecksumVersion);

// A CUDA sender's checksum (version 3; HashedOnDevice): the slot's layers are hashed where they
// lie by one BackendPartsChecksum over them (the payload, layer-major), on `stream` (a
// stream of m.backend that nothing else uses meanwhile: the Sender's, which the call
// synchronizes), as a task of a TaskPool beside the puts. One call per layer would cost a whole
// segment's lane chain per layer: the segments of one call are hashed at once, and segments
// span layers. m must outlive the hasher; its destructor waits for the task (nothing reads the
// slot once it has gone).
class SlotHasher {
 public:
  SlotHasher(TaskPool* pool, void* stream, const cache::StateCache::CheckpointMemory& m);
  absl::StatusOr<uint64_t> Finish();  // waits; the digest

 private:
  absl::StatusOr<uint64_t> digest_;
  TaskPool::Batch batch_;  // declared last: ends (waits) before digest_ goes
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_SERVICE_TRANSFER_PIPELINE_H_
