// Slot transfer between instances (prefill/decode disaggregation), minus the wire: the
// receiver's reservations with leases, the sender's export → put → commit sequence, and the
// checks between them. gRPC carries the control messages (service/), UCX the bytes
// (ucx_transport.h); both sides talk to their peer through the Peer interface, so tests can
// swap in an in-process peer and inject faults.
//
// The invariant (DESIGN §2): a state leaves a slot only fully flushed. The sender exports
// through the cache's guard (it folds, write_pos -> 0) and never reads a slot's memory
// itself; the receiver's slot starts with write_pos 0 and the sender's seq_len, checked.
//
// Thread safety: both classes are thread-safe.
#ifndef REPLAYSSM_SERVICE_TRANSFER_TRANSFER_H_
#define REPLAYSSM_SERVICE_TRANSFER_TRANSFER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
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

// 64-bit checksum of the payload (four interleaved multiply-xorshift lanes; not crypto).
uint64_t Checksum(const void* data, size_t size);

// The receiver's answer to Reserve: where to put the bytes.
struct Reservation {
  std::string worker_address;  // UCX worker of the receiver
  uint64_t remote_addr = 0;
  std::string rkey;
  int64_t bytes = 0;
};

struct ReceiverOptions {
  absl::Duration lease = absl::Seconds(30);  // a reservation not committed by then is dropped
  int32_t max_open = 16;                     // concurrent reservations
};

// The receiving side: holds reservations (a slot, a registered host buffer) until Commit,
// Abort or lease expiry; commits are idempotent by transfer id.
class Receiver {
 public:
  Receiver(cache::StateCache* cache, UcxTransport* ucx, ReceiverOptions options);
  ~Receiver();

  absl::StatusOr<Reservation> Reserve(const std::string& transfer_id, const StateFormat& format,
                                      int64_t seq_len);
  // Verifies the payload's checksum and seq_len, imports it into the reserved slot and makes
  // it live. A retry of a committed id returns the same slot.
  absl::StatusOr<cache::SlotId> Commit(const std::string& transfer_id,
                                       const std::vector<int32_t>& tokens, uint64_t checksum);
  absl::Status Abort(const std::string& transfer_id);
  // Drops reservations past their lease (also done on every Reserve); returns how many.
  int ExpireLeases();
  int open() const;

  // For tests: flips a byte of the next committed payload before it is verified.
  void CorruptNextPayloadForTest() { corrupt_next_ = true; }

 private:
  // A registered receive buffer; kept for reuse, since fresh pages and registration cost
  // more than the copy itself.
  using Buffer = UcxTransport::Region;  // allocated by UCX (see UcxTransport::Allocate)
  struct Pending {
    cache::SlotId slot = cache::kPaddingSlot;
    int64_t seq_len = 0;
    std::unique_ptr<Buffer> buffer;
    absl::Time expires;
  };
  void DropLocked(std::map<std::string, Pending>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<std::unique_ptr<Buffer>> TakeBufferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReturnBufferLocked(std::unique_ptr<Buffer> b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  cache::StateCache* const cache_;
  UcxTransport* const ucx_;
  const ReceiverOptions options_;
  const StateFormat format_;
  mutable absl::Mutex mu_;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, cache::SlotId> committed_ ABSL_GUARDED_BY(mu_);  // recent, for retries
  std::vector<std::unique_ptr<Buffer>> spare_ ABSL_GUARDED_BY(mu_);
  bool corrupt_next_ = false;
};

// How a sender reaches its peer's Receiver (gRPC in the service, direct calls in tests).
class Peer {
 public:
  virtual ~Peer() = default;
  virtual absl::StatusOr<Reservation> Reserve(const std::string& transfer_id,
                                              const StateFormat& format, int64_t seq_len) = 0;
  virtual absl::StatusOr<cache::SlotId> Commit(const std::string& transfer_id,
                                               const std::vector<int32_t>& tokens,
                                               uint64_t checksum) = 0;
  virtual absl::Status Abort(const std::string& transfer_id) = 0;
};

struct SendOptions {
  bool keep_source = false;       // false: the sender's slot is freed after the commit
  size_t chunk_bytes = 4 << 20;   // UCX put granularity
  absl::Duration timeout = absl::Seconds(30);
};

struct SendResult {
  cache::SlotId remote_slot = cache::kPaddingSlot;
  int64_t bytes = 0;
  int64_t seq_len = 0;
  double seconds = 0;  // all of it; the phases below add up to about this
  double export_seconds = 0, reserve_seconds = 0, put_seconds = 0, commit_seconds = 0;
};

// The sending side: moves a slot to a peer. On any failure the peer's reservation is
// aborted (or left to its lease) and the local slot is as it was (export only folds, which
// keeps its logical state). Sends through one Sender run one at a time (it reuses its
// payload buffer); use several Senders for parallel transfers.
class Sender {
 public:
  Sender(cache::StateCache* cache, UcxTransport* ucx) : cache_(cache), ucx_(ucx) {}
  absl::StatusOr<SendResult> Send(Peer& peer, cache::SlotId slot, const std::string& transfer_id,
                                  const SendOptions& options);

 private:
  cache::StateCache* const cache_;
  UcxTransport* const ucx_;
  absl::Mutex mu_;
  std::vector<uint8_t> payload_ ABSL_GUARDED_BY(mu_);
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_SERVICE_TRANSFER_TRANSFER_H_
