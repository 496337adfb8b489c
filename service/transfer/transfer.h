// Slot transfer between instances (prefill/decode disaggregation), minus the wire: the
// receiver's reservations with leases, the sender's export → put → commit sequence, and the
// checks between them, pipelined chunk by chunk (pipeline.h). gRPC carries the control
// messages (service/), UCX the bytes (ucx_transport.h); both sides talk to their peer through
// the Peer interface, so tests can swap in an in-process peer and inject faults.
//
// The invariant (DESIGN §2): a state leaves a slot only fully flushed. The sender reads a
// slot's memory only inside the cache's guard (StateCache::WithCheckpoints, which folds
// first: write_pos -> 0); the receiver's slot starts with write_pos 0 and the sender's seq_len, checked.
//
// Thread safety: both classes are thread-safe.
#ifndef REPLAYSSM_SERVICE_TRANSFER_TRANSFER_H_
#define REPLAYSSM_SERVICE_TRANSFER_TRANSFER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
#include "checksum.h"
#include "pipeline.h"
#include "ucx_transport.h"

namespace replayssm::transfer {

// What must agree between two instances for a state to move: everything that shapes or
// interprets the checkpoint bytes. (Ring length and activation dtype may differ: the ring is
// empty after a transfer.)
struct StateFormat {
  int32_t num_layers = 0;
  int32_t gate = 0, num_qk_heads = 0, num_v_heads = 0, head_k = 0, head_v = 0;
  int32_t state_dtype = 0;
  uint64_t params_hash = 0;  // the layer parameters: same model, same weights

  static StateFormat Of(const cache::ModelSpec& m);
  int64_t Bytes() const;  // all layers' checkpoints
  // OK, or FAILED_PRECONDITION naming the first field that differs (expected vs got).
  absl::Status CheckCompatible(const StateFormat& sender) const;
};

// The receiver's answer to Reserve: where to put the bytes.
struct Reservation {
  std::string worker_address;  // UCX worker of the receiver
  uint64_t remote_addr = 0;    // the payload, layer-major
  std::string rkey;
  int64_t bytes = 0;
  // Where the sender writes, after each chunk (fenced), how many payload bytes have landed,
  // so the receiver imports chunk by chunk while the rest is in flight; 0 = no doorbell
  // (a device-direct receiver imports at the commit).
  uint64_t doorbell_addr = 0;
};

struct ReceiverOptions {
  absl::Duration lease = absl::Seconds(30);  // a reservation not committed by then is dropped
  int32_t max_open = 16;                     // concurrent reservations
  size_t chunk_bytes = 4 << 20;              // import granularity (and staging buffer size)
  // Threads that copy landed chunks into the slot (CPU) or pinned staging (CUDA), several at
  // once, and hash what they copied (checksum v3; a v2 sender's chunks are hashed in order by
  // the import thread): one thread doing both fell behind the puts. Shared by all
  // reservations. 8: on the H200 host 4 copiers were the whole move's limit once the CUDA
  // sender stopped hashing on the host (f32 7.0 -> 5.2 ms; transfer-h200-2026-11-30-v6.md).
  int32_t import_threads = 8;
  // Tests only: forces a path (e.g. the host-staged one on the CPU backend).
  std::optional<DataPath> force_path;
};

// The receiving side: holds reservations (a slot, a registered receive buffer, an importer
// thread that has each landed chunk copied into the slot and hashes it) until Commit, Abort
// or lease expiry; commits are idempotent by transfer id. The reserved slot is allocated
// without zeroing (StateCache::AllocateForImport: the import writes every byte) and written
// before the commit, but it is nobody's until then (the cache refuses it to anything but the
// import): a failed or abandoned transfer frees it.
class Receiver {
 public:
  Receiver(cache::StateCache* cache, UcxTransport* ucx, ReceiverOptions options);
  ~Receiver();

  // checksum_version: what the sender computes: kChecksumVersion (3; every path of this
  // build), kChecksumV2 (an older sender; hashed in order by the import thread, or as one
  // segment on the device on the device-direct path) or kChecksumNone (an older device-direct
  // sender, which did not hash: not verified). Anything else (0: a sender from before
  // the chunked protocol) is FAILED_PRECONDITION, before any byte moves.
  absl::StatusOr<Reservation> Reserve(const std::string& transfer_id, const StateFormat& format,
                                      int64_t seq_len, uint32_t checksum_version);
  // Waits for the import of every byte, verifies the checksum and seq_len and makes the slot
  // live. A retry of a committed id returns the same slot.
  absl::StatusOr<cache::SlotId> Commit(const std::string& transfer_id,
                                       const std::vector<int32_t>& tokens, uint64_t checksum);
  absl::Status Abort(const std::string& transfer_id);
  // Drops reservations past their lease (also done on every Reserve); returns how many.
  int ExpireLeases();
  int open() const;
  DataPath path() const { return path_; }

  // For tests: flips a byte of the next payload as it lands, before it is hashed.
  void CorruptNextPayloadForTest() { corrupt_next_ = true; }
  // For tests: the slot reserved for an open transfer (kPaddingSlot when none).
  cache::SlotId ReservedSlotForTest(const std::string& transfer_id) const;

 private:
  struct Buffer;    // a registered receive buffer (host, UCX-allocated; or device)
  struct Importer;  // one reservation's import thread and its hand-over with Commit
  struct Pending {
    cache::SlotId slot = cache::kPaddingSlot;
    int64_t seq_len = 0;
    uint32_t checksum_version = 0;
    std::unique_ptr<Buffer> buffer;
    std::unique_ptr<Importer> importer;
    absl::Time expires;
  };
  void DropLocked(std::map<std::string, Pending>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::unique_ptr<Buffer>> TakeBufferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReturnBufferLocked(std::unique_ptr<Buffer> b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartImporter(Pending& p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The import thread's work inside the cache's guard: consume chunks as the doorbell says
  // they landed, then wait for the commit and verify.
  absl::Status ImportChunks(Buffer& buf, Importer& in, const cache::StateCache::CheckpointMemory& m,
                            uint32_t checksum_version);
  absl::Status ImportDirect(Buffer& buf, Importer& in, const cache::StateCache::CheckpointMemory& m,
                            uint32_t checksum_version);
  // Ends a pending's importer (abort) and frees its slot; the buffer goes back to the pool.
  void Finish(Pending& p, bool abort);

  cache::StateCache* const cache_;
  UcxTransport* const ucx_;
  const ReceiverOptions options_;
  const StateFormat format_;
  const DataPath path_;
  mutable absl::Mutex mu_;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, cache::SlotId> committed_ ABSL_GUARDED_BY(mu_);  // recent, for retries
  std::vector<std::unique_ptr<Buffer>> spare_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> corrupt_next_{false};
  const int32_t depth_;  // landed chunks between copy and hash at most (import_threads + 2, >= 6)
  TaskPool copiers_;  // options_.import_threads; idle between imports
};

// How a sender reaches its peer's Receiver (gRPC in the service, direct calls in tests).
class Peer {
 public:
  virtual ~Peer() = default;
  virtual absl::StatusOr<Reservation> Reserve(const std::string& transfer_id,
                                              const StateFormat& format, int64_t seq_len,
                                              uint32_t checksum_version) = 0;
  virtual absl::StatusOr<cache::SlotId> Commit(const std::string& transfer_id,
                                               const std::vector<int32_t>& tokens,
                                               uint64_t checksum) = 0;
  virtual absl::Status Abort(const std::string& transfer_id) = 0;
};

struct SendOptions {
  bool keep_source = false;       // false: the sender's slot is freed after the commit
  size_t chunk_bytes = 4 << 20;   // UCX put granularity (and staging buffer size)
  absl::Duration timeout = absl::Seconds(30);
  std::optional<DataPath> force_path;  // tests only
  // Tests only (multi-lane sends): the lane given this piece fails it instead of putting it,
  // while the other lanes' puts are in flight.
  std::optional<size_t> fail_piece_for_test;
  // Tests only (multi-lane sends): called on a lane thread after piece i landed.
  std::function<void(size_t)> on_piece_landed_for_test;
};

struct SendResult {
  cache::SlotId remote_slot = cache::kPaddingSlot;
  int64_t bytes = 0;
  int64_t seq_len = 0;
  DataPath path = DataPath::kHostDirect;
  double seconds = 0;  // all of it; the phases below add up to about this
  // export: the fold (materialize); reserve: the peer's reservation; put: the pipelined
  // stage + hash + put + flush; commit: the peer's wait for its last chunks, verify, commit.
  double export_seconds = 0, reserve_seconds = 0, put_seconds = 0, commit_seconds = 0;
};

// The sending side: moves a slot to a peer. The slot is held (busy) from the fold to the end
// of the put: chunks go straight from its memory (CPU; CUDA with a CUDA-capable UCX) or
// through a ring of pinned staging buffers (device -> host of chunk i+1 while chunk i is put)
// and are hashed beside the puts. On any failure the peer's reservation is aborted (or left
// to its lease) and the local slot is as it was (export only folds, which keeps its logical
// state). Sends through one Sender run one at a time (it reuses its staging ring); use
// several Senders for parallel transfers.
//
// Lanes: with one transport the calling thread puts every chunk (fence, doorbell, next). With
// N > 1 transports (`lanes`; each its own UCX context, worker and endpoint, since a put on
// shared memory is a memcpy by the putting thread), chunk i goes to lane i % N, each lane a
// thread of its own; a lane flushes each chunk (it is then in the peer's memory) before it
// counts as landed, and the doorbell advances only over a prefix of landed chunks, rung by
// one lane at a time and flushed before the next ring: a doorbell value never overtakes the
// bytes it announces, and the values arrive in increasing order. The calling thread feeds
// the lanes (and the staging ring) and submits the hashing (below) to the hashing pool.
//
// Checksum: version 3 (checksum.h). Host-direct: each chunk hashed as a task of a pool of as
// many threads as lanes, beside the puts; the segments are combined after the last chunk. The
// CUDA paths (device-direct, host-staged: HashedOnDevice): the slot is hashed on the device
// instead (SlotHasher: its layers in place, one rssm_segment_digests_parts call on a stream the
// Sender creates on first use and keeps), as one task of the same pool, beside the puts.
class Sender {
 public:
  Sender(cache::StateCache* cache, UcxTransport* ucx) : Sender(cache, std::vector{ucx}) {}
  // lanes[0] may be the transport the Receiver uses; the others: UcxTransport::Create(false).
  Sender(cache::StateCache* cache, std::vector<UcxTransport*> lanes)
      : cache_(cache),
        ucx_(lanes.at(0)),
        lanes_(std::move(lanes)),
        hashers_(static_cast<int32_t>(lanes_.size())) {}
  absl::StatusOr<SendResult> Send(Peer& peer, cache::SlotId slot, const std::string& transfer_id,
                                  const SendOptions& options);
  int32_t lanes() const { return static_cast<int32_t>(lanes_.size()); }

 private:
  struct Lanes;  // one multi-lane send's shared state
  // PutAll's put loop over several lanes (lanes_.size() > 1).
  absl::Status PutLanes(const Reservation& r, const cache::StateCache::CheckpointMemory& m,
                        const std::vector<Piece>& pieces, DataPath path, size_t chunk,
                        const SendOptions& options, PieceHasher& hasher)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inside the cache's guard: reserves on the peer (*reserved = true once it did) and puts
  // every chunk; fills out's reserve/put times and *checksum.
  absl::Status PutAll(Peer& peer, const cache::StateCache::CheckpointMemory& m,
                      const std::string& transfer_id, int64_t seq_len, DataPath path,
                      const SendOptions& options, SendResult& out, bool* reserved,
                      uint64_t* checksum)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  cache::StateCache* const cache_;
  UcxTransport* const ucx_;  // lanes_[0]
  const std::vector<UcxTransport*> lanes_;
  TaskPool hashers_;  // checksum v3 of the chunks, one thread per lane; idle between sends
  absl::Mutex mu_;
  StagingRing ring_ ABSL_GUARDED_BY(mu_);
  BackendStream hash_stream_ ABSL_GUARDED_BY(mu_);  // a CUDA send's slot hash (SlotHasher)
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_SERVICE_TRANSFER_TRANSFER_H_
