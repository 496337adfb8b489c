// Lane: what one cache operation needs to drive the backend: a stream of its own, a pinned
// host staging buffer for copies to and from ordinary host memory, backend scratch for the
// operation's activations and index arrays, and the decode forwards recorded on its stream
// (ForwardGraphs: their addresses are the stream's and the scratch's). StateCache keeps a free list of lanes (as
// many as operations ever ran at once), so steady-state operations allocate nothing and
// operations on disjoint slots overlap on the device. StagingRing: pinned buffers with a
// stream each for bulk slot I/O (a move's chunks), kept between moves by a StagingPool.
//
// Ordering: everything queued on a lane runs in order on its stream. Host memory passed to
// Upload may be reused as soon as Upload returns (it was copied into pinned memory); host
// memory passed to Download is filled when Synchronize returns OK. Nothing synchronizes
// except Synchronize (and Upload/Download when the pinned buffer is full: then they wait for
// what is queued before reusing it, so any size works).
//
// Thread safety: none; a lane is used by one operation (one thread at a time). It is
// returned to the cache only when idle (synchronized).
#ifndef REPLAYSSM_CACHE_LANE_H_
#define REPLAYSSM_CACHE_LANE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "device_buffer.h"
#include "forward_graphs.h"
#include "replayssm/cache/model.h"

namespace replayssm::cache {

// Backend-side scratch of one operation: inputs, outputs and index arrays, grown on demand
// (to at least twice the old size). A buffer outgrown is kept in `retired` until the lane is
// destroyed, not freed: on CUDA freeing device memory waits for every kernel running on the
// device, and a doorbell wait on another lane runs until its engine rings. So a lane holds at
// most 4x the scratch its largest operation needed (live <= 2x, retired < live).
struct Scratch {
  DeviceBuffer qkv, a, b, out;          // act dtype, [tokens, width]
  DeviceBuffer conv;                    // act dtype, [tokens, qkv width]: conv outputs
  DeviceBuffer slot_idx, write_pos, cu;  // int32: the operation's rows
  DeviceBuffer fold_idx, fold_pos;       // int32: the rows a fold before it acts on
  DeviceBuffer flags;                    // uint8
  DeviceBuffer digests, digest_parts;    // a slot checksum: its segment digests, part table
  std::vector<DeviceBuffer> retired;     // outgrown buffers (their total < the live ones')
  absl::Status Reserve(int32_t backend, const ModelSpec& m, int64_t tokens, int64_t rows);
  // Room for the convolution's outputs of `tokens` tokens (conv only: a forward on backend
  // memory stages nothing else).
  absl::Status ReserveConv(int32_t backend, const ModelSpec& m, int64_t tokens);
  // Room for the digests of `segments` segments and a table of `parts` part pointers.
  absl::Status ReserveDigests(int32_t backend, size_t segments, size_t parts);

 private:
  // At least `bytes` in buf, at least twice its old size when it grows; the outgrown buffer
  // goes to `retired`.
  absl::Status Grow(DeviceBuffer& buf, int32_t backend, size_t bytes);
};

class Lane {
 public:
  // A lane whose pinned staging holds `host_bytes` (copies larger than that are chunked),
  // pinned at the lane's first staged copy (every forward stages its index arrays, so a lane
  // pins at its first operation; lanes made at start and never used pin nothing). Waits of up
  // to `max_waits` a forward can be released.
  static absl::StatusOr<std::unique_ptr<Lane>> Create(int32_t backend, size_t host_bytes,
                                                      int32_t max_waits);
  ~Lane();  // waits for queued work, then releases the stream and the pinned memory
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  int32_t backend() const { return backend_; }
  void* stream() const { return stream_; }  // NULL on CPU
  // The launch for work about to be queued on this lane (the lane then counts as busy).
  rssm_launch Launch() {
    queued_ = true;
    return rssm_launch{backend_, stream_};
  }

  // Queues a copy of `bytes` of host memory at src into backend memory at dst.
  absl::Status Upload(void* dst, const void* src, size_t bytes);
  // Queues a copy of `bytes` of backend memory at src into host memory at dst; dst holds them
  // once Synchronize returns OK.
  absl::Status Download(void* dst, const void* src, size_t bytes);
  // Waits for everything queued (free when nothing was queued since the last call), then
  // completes the downloads. On an error the downloads' destinations are undefined.
  absl::Status Synchronize();
  bool idle() const { return !queued_ && downloads_.empty(); }
  // Whether `count` uploads of `bytes` each fit the pinned buffer now, so that queueing them
  // waits for nothing queued before (Take waits once the buffer is full).
  bool FitsWithoutWait(int count, size_t bytes) const;
  // Pinned staging bytes the lane holds: 0 until its first staged copy, then host_bytes.
  size_t pinned_staging_bytes() const { return host_ == nullptr ? 0 : host_bytes_; }

  // Doorbell releases (Doorbells, rssm_stream_wait_value32_or): each forward on the lane takes
  // the next ticket; the lane's release word, raised to a ticket, ends the waits of that forward
  // and of those before it on the lane, never a later one's; each wait index has two outcome
  // words (by the ticket's parity: a forward and the one continued behind it never share one).
  // All host memory the backend reads (pinned on CUDA).
  uint32_t NextTicket() { return ++ticket_; }
  uint32_t* release_word() const { return bells_; }
  uint32_t* outcomes() const { return bells_ + 1; }  // [max_waits][2]
  int32_t max_waits() const { return max_waits_; }
  // Called when the lane is idle (nothing queued can still wait): every ticket so far counts as
  // released, so that the word stays within a chain's length of the next ticket (the
  // comparison is cyclic).
  void SettleRelease();

  Scratch scratch;
  ForwardGraphs graphs;  // the decode forwards recorded on this lane's stream

 private:
  Lane(int32_t backend, void* stream, size_t host_bytes, uint32_t* bells, int32_t max_waits)
      : backend_(backend),
        stream_(stream),
        host_bytes_(host_bytes),
        bells_(bells),
        max_waits_(max_waits) {}

  // A free region of the pinned buffer of up to `want` bytes (at least 1), pinning the buffer
  // first if needed, waiting for the queued copies when it is full. *got is its size.
  absl::StatusOr<char*> Take(size_t want, size_t* got);

  struct PendingDownload {
    void* dst;
    const char* staged;
    size_t bytes;
  };
  const int32_t backend_;
  void* const stream_;
  void* host_ = nullptr;  // pinned (rssm_alloc_host) at the first Take
  const size_t host_bytes_;
  uint32_t* const bells_;  // pinned: the release word, then max_waits_ pairs of outcome words
  const int32_t max_waits_;
  uint32_t ticket_ = 0;   // the last ticket taken
  size_t host_used_ = 0;  // bytes of host_ taken since the last Synchronize
  bool queued_ = false;   // work queued since the last Synchronize
  std::vector<PendingDownload> downloads_;
};

// A free list of lanes. Take gives an idle lane, a new one when none is free (lanes are never
// dropped before the pool, so their number is the most operations that ever ran at once);
// the lease gives it back when destroyed, waiting for its queued work first.
// Thread safety: Take and the leases' destruction are thread-safe.
class LanePool {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept { *this = std::move(o); }
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        reset();
        pool_ = std::exchange(o.pool_, nullptr);
        lane_ = std::move(o.lane_);
      }
      return *this;
    }
    ~Lease() { reset(); }
    Lane& operator*() const { return *lane_; }
    Lane* operator->() const { return lane_.get(); }
    explicit operator bool() const { return lane_ != nullptr; }
    void reset();  // gives the lane back now

   private:
    friend class LanePool;
    LanePool* pool_ = nullptr;
    std::unique_ptr<Lane> lane_;
  };

  LanePool(int32_t backend, size_t host_bytes, int32_t max_waits)
      : backend_(backend), host_bytes_(host_bytes), max_waits_(max_waits) {}
  absl::StatusOr<Lease> Take();
  int64_t size() const;  // lanes made so far

 private:
  const int32_t backend_;
  const size_t host_bytes_;
  const int32_t max_waits_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Lane>> free_ ABSL_GUARDED_BY(mu_);
  int64_t made_ ABSL_GUARDED_BY(mu_) = 0;
};

// `count` pinned host buffers of `bytes` each, with a stream each: a copy into or out of
// buffer i is queued on stream i, and Sync(i) waits for it before the buffer is used again.
// Thread safety: calls on different buffers may run on different threads at once.
class StagingRing {
 public:
  static absl::StatusOr<std::unique_ptr<StagingRing>> Create(int32_t backend, int32_t count,
                                                             size_t bytes);
  ~StagingRing();  // waits for every stream
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;

  int32_t count() const { return static_cast<int32_t>(buffers_.size()); }
  size_t bytes() const { return bytes_; }
  uint8_t* buffer(int32_t i) const { return static_cast<uint8_t*>(buffers_[i]); }
  // Queues a copy (rssm_copy_kind) of `n` bytes on stream i.
  absl::Status Copy(int32_t i, void* dst, const void* src, size_t n, int32_t kind);
  absl::Status Sync(int32_t i);

 private:
  StagingRing(int32_t backend, size_t bytes) : backend_(backend), bytes_(bytes) {}
  const int32_t backend_;
  const size_t bytes_;
  std::vector<void*> buffers_, streams_;
};

// Idle staging rings, so that a move does not allocate pinned memory (which costs more than
// the move's copies). Take gives an idle ring of that shape, or a new one; a returned ring is
// kept until the pool is destroyed (so their number is the most moves that ever ran at once):
// on CUDA freeing pinned memory waits for every kernel running on the device, and a doorbell
// wait runs until its engine rings.
// Thread safety: Take and the leases' destruction are thread-safe.
class StagingPool {
 public:
  class Lease {
   public:
    Lease() = default;
    Lease(StagingPool* pool, std::unique_ptr<StagingRing> ring)
        : pool_(pool), ring_(std::move(ring)) {}
    Lease(Lease&& o) noexcept = default;
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        reset();
        pool_ = o.pool_;
        ring_ = std::move(o.ring_);
      }
      return *this;
    }
    ~Lease() { reset(); }
    StagingRing* operator->() const { return ring_.get(); }
    explicit operator bool() const { return ring_ != nullptr; }
    void reset();  // gives the ring back now (after its streams are idle)

   private:
    StagingPool* pool_ = nullptr;
    std::unique_ptr<StagingRing> ring_;
  };

  explicit StagingPool(int32_t backend) : backend_(backend) {}
  absl::StatusOr<Lease> Take(int32_t count, size_t bytes);
  int64_t made() const;  // rings made so far

 private:
  const int32_t backend_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<StagingRing>> idle_ ABSL_GUARDED_BY(mu_);
  int64_t made_ ABSL_GUARDED_BY(mu_) = 0;
};

// Pinned staging a lane of `model` needs so that one decode layer of `max_batch` rows and its
// index arrays never wait for a full buffer.
size_t LaneHostBytes(const ModelSpec& model, int64_t max_batch);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_LANE_H_
