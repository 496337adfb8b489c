// The receiving side of a move: reservations (a slot opened for import, a registered receive
// buffer, an import thread that has each landed chunk written into the slot) until the
// transfer is decided, and the decisions themselves.
//
// Decided once, under the lock: a transfer id is committed (Commit: every byte arrived, the
// seq_len and the checksum match, before its commit-by time) or aborted (Abort, any failed
// Commit, a commit that comes too late, lease expiry), never both, and the decision is kept so
// that retried calls and the sender's question "what did you decide?" (Abort) get the same
// answer. The two are kept apart:
//  - a commit is kept until its sender acknowledges it (Acknowledge: it learned the outcome)
//    or for decision_horizon, far beyond any retry; nothing else evicts it, but a slot freed
//    for idleness before the acknowledgement turns it into an abort (FreeSlot). A peer holds at
//    most max_unacknowledged_per_peer of them: past that its Reserve is refused, never an
//    older commit forgotten. A sender asking about a forgotten commit would hear "aborted"
//    and release its source while the slot lives here: the state twice.
//  - an abort is kept among the last `remembered` aborts. Forgetting one is harmless: an id
//    this receiver does not know is answered "aborted" too, and only an open reservation can
//    commit. Abort of an id never seen decides it aborted (into this FIFO only): a reservation
//    that arrives late is then refused.
//
// Commit-by: a reservation must be committed by its receipt time (a monotonic clock, which
// keeps running while the process is stopped) + the sender's budget - AbortReserve(budget);
// a commit read after that (a receiver frozen and resumed) is refused and the reservation
// dropped. A gRPC deadline cannot do this: its header is relative, so a resumed process
// computes a fresh one.
//
// The reserved slot is nobody's until the commit (cache::SlotWriter): a failed or abandoned
// transfer frees it.
//
// Thread safety: thread-safe.
#ifndef REPLAYSSM_TRANSFER_RECEIVER_H_
#define REPLAYSSM_TRANSFER_RECEIVER_H_

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "replayssm/cache/quiet_release.h"
#include "replayssm/cache/slot_io.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/transfer/peer.h"
#include "replayssm/transfer/ucx_transport.h"

namespace replayssm::transfer {

class TaskPool;

struct ReceiverOptions {
  absl::Duration lease = absl::Seconds(30);  // a reservation lives at most this long
  int32_t max_open = 16;                     // concurrent reservations
  int32_t max_open_per_peer = 0;             // of them held by one peer; 0: no bound
  size_t chunk_bytes = 4 << 20;              // import granularity (and staging buffer size)
  // Threads that write landed chunks into reserved slots, several at once (each hashes what
  // it writes); shared by all reservations. 8: on the H200 host 4 were the whole move's limit.
  int32_t import_threads = 8;
  int32_t remembered = 4096;  // aborts kept for retries and late reservations (FIFO)
  // Commits are kept until acknowledged or this old: far beyond any sender's retries (a
  // sender in doubt asks every second; its --transfer-timeout is 30 s by default).
  absl::Duration decision_horizon = absl::Hours(24);
  // Unacknowledged commits one peer may hold; past that its reservations are refused.
  int32_t max_unacknowledged_per_peer = 1024;
  // The slot I/O path (a benchmark, or a test of another path on CPU); default: the cache's
  // choice for this transport.
  std::optional<cache::SlotIoPath> path;
  // The owners' slot bounds (the service's tenants). `admit(owner)` is asked under the
  // receiver's lock before a new reservation is made (an error refuses it, as returned), and
  // every admitted reservation ends in one `settle(owner, slot)`, also under the lock: slot is
  // the committed slot, or kPaddingSlot (aborted, expired, failed). Neither may call the
  // receiver. Both or neither.
  std::function<absl::Status(uint64_t owner)> admit;
  std::function<void(uint64_t owner, cache::SlotId slot)> settle;
  // Whether a commit may still be decided "committed" (the service: false once it drains),
  // asked under the receiver's lock as the decision is made; false: the slot the commit made
  // is given back and the transfer aborted, so the sender keeps its source. Null: always.
  std::function<bool()> accepting;
  // Where device-direct receive buffers come from (a test's, to watch when they are freed);
  // null: the cache's backend memory.
  using AllocateDevice =
      std::function<absl::StatusOr<std::unique_ptr<cache::BackendBuffer>>(size_t bytes)>;
  AllocateDevice allocate_device;
  // Whether freeing device memory now would wait for nothing long (the service on CUDA: no
  // planned forward open, so no doorbell wait running). A dropped device-direct buffer is held
  // until then, off the lock, and freed on a thread of the receiver's own; past max_open held
  // the oldest is freed at once all the same. Null: each is freed at once on that thread.
  std::function<bool()> device_quiet;
};

class Receiver {
 public:
  Receiver(cache::StateCache* cache, UcxTransport* ucx, ReceiverOptions options);
  ~Receiver();  // aborts what is open

  // checksum_version must be cache::kChecksumVersion, budget > 0, the format this server's:
  // else FAILED_PRECONDITION / INVALID_ARGUMENT before any byte moves. A retried Reserve of an
  // open id returns the same reservation (INVALID_ARGUMENT naming seq_len if it names another
  // length; ALREADY_EXISTS if another peer made it); of a decided id: ALREADY_EXISTS
  // (committed) or ABORTED.
  // `peer` names the sender (its certificate's identity or its host) for max_open_per_peer
  // and max_unacknowledged_per_peer. RESOURCE_EXHAUSTED past either. `owner` is the caller's
  // (the slot's tenant): kept with the reservation and its decision, never looked up elsewhere.
  absl::StatusOr<Reservation> Reserve(const std::string& transfer_id, const StateFormat& format,
                                      int64_t seq_len, uint32_t checksum_version,
                                      absl::Duration budget, const std::string& peer = "",
                                      uint64_t owner = 0);
  // Waits for the last bytes, checks and makes the slot live; the decision (slot: its cache
  // id, owner: the reservation's). A retry of a committed id returns the same decision. Any
  // failure aborts the transfer (ABORTED for a commit past its commit-by time or of an
  // aborted id; NOT_FOUND for an id never reserved, which is not remembered, or reserved by
  // another peer than `peer`, which stays open; empty: any, for a caller in this process).
  absl::StatusOr<Decision> Commit(const std::string& transfer_id,
                                  const std::vector<int32_t>& tokens, uint64_t checksum,
                                  const std::string& peer = "");
  // Aborts an open transfer (waits for a commit in progress); the decision (slot: cache id).
  // A reservation is aborted only by the peer that made it (`peer` as Reserve's; empty: any,
  // for a caller in this process): another peer's Abort leaves it open and is answered
  // NOT_FOUND, not "aborted" -- a decision the sender would act on while the reservation
  // can still commit (a sender whose address changed between its commit and its abort freed
  // its source and the late commit landed: the state twice; an outside review).
  absl::StatusOr<Decision> Abort(const std::string& transfer_id, const std::string& peer = "");
  // The sender `peer` learned that transfer_id committed: the decision may go. A commit of
  // another peer, an abort or an unknown id is left alone.
  void Acknowledge(const std::string& transfer_id, const std::string& peer);
  // Frees `slot` for a caller that found it idle (slot leases): the cache's Free, and when the
  // slot is a commit its sender has not acknowledged, that decision becomes an abort in the
  // same step. The sender, in doubt, then hears "aborted" and keeps its source (the state
  // lives there) instead of releasing it for a slot that is gone here.
  absl::Status FreeSlot(cache::SlotId slot);
  // Drops reservations past their commit-by time or lease, and commits past the decision
  // horizon (also done on every Reserve).
  int ExpireLeases();
  int open() const;
  // Dropped device-direct buffers waiting for a quiet device (ReceiverOptions::device_quiet),
  // and those freed all the same, past max_open held, while it was busy.
  int held_device_buffers() const;
  int64_t forced_device_frees() const;
  cache::SlotIoPath path() const { return path_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Buffer;    // a registered receive buffer (host, UCX-allocated; or backend memory)
  struct Importer;  // one reservation's import thread and its hand-over with Commit
  // An admitted reservation's hold on its owner's bound (ReceiverOptions::admit): settled once,
  // by Settle (Commit: the slot, or as aborted) or, never settled, as aborted when it goes.
  class Claim {
   public:
    Claim() = default;
    Claim(const ReceiverOptions* options, uint64_t owner) : options_(options), owner_(owner) {}
    Claim(Claim&& other) noexcept { *this = std::move(other); }
    Claim& operator=(Claim&& other) noexcept {
      Settle(cache::kPaddingSlot);
      options_ = std::exchange(other.options_, nullptr);
      owner_ = other.owner_;
      return *this;
    }
    ~Claim() { Settle(cache::kPaddingSlot); }
    void Settle(cache::SlotId slot) {
      if (options_ != nullptr && options_->settle) options_->settle(owner_, slot);
      options_ = nullptr;
    }

   private:
    const ReceiverOptions* options_ = nullptr;
    uint64_t owner_ = 0;
  };
  struct Pending {
    std::unique_ptr<cache::SlotWriter> writer;
    std::unique_ptr<Buffer> buffer;
    std::unique_ptr<Importer> importer;
    Clock::time_point commit_by;  // see the top; never later than the lease
    bool committing = false;  // Commit took it: Abort waits for the decision
    std::string peer;         // who reserved it (max_open_per_peer)
    uint64_t owner = 0;       // Reserve's owner, into the decision
    int64_t seq_len = 0;      // a retried Reserve must name the same
    Claim claim;              // settled when it commits, else when it goes
  };
  struct Committed {
    Decision decision;
    std::string peer;             // the sender that may acknowledge it
    Clock::time_point decided;    // forgotten decision_horizon after this
  };
  absl::StatusOr<std::unique_ptr<Buffer>> TakeBufferLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartImporter(Pending& p);
  // The import thread's work: writes chunks as the doorbell says they landed, until the
  // commit (or the abort) comes.
  absl::Status Import(Buffer& buf, Importer& in, cache::SlotWriter& writer);
  // Ends a reservation's import (abort) and frees its slot. Its buffer is released, never
  // pooled: the sender may still be putting into it (it learns of the abort at its commit).
  // Its registration goes at once; device memory goes to reaper_.
  void DropLocked(std::map<std::string, Pending>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records the decision once (a commit: `peer`'s until acknowledged; an abort: in the FIFO).
  void DecideLocked(const std::string& transfer_id, Decision d, const std::string& peer)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetCommitLocked(std::map<std::string, Committed>::iterator it)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits while a Commit of transfer_id is checking its bytes (mu_ is released meanwhile).
  void AwaitNoCommitLocked(const std::string& transfer_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Decision* DecisionLocked(const std::string& transfer_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  cache::StateCache* const cache_;
  UcxTransport* const ucx_;
  const ReceiverOptions options_;
  const StateFormat format_;
  const cache::SlotIoPath path_;
  const int32_t depth_;  // landed chunks between the start and the end of their write, at most
  std::unique_ptr<TaskPool> writers_;  // options_.import_threads; idle between imports
  // Frees dropped device-direct buffers off mu_, when the device is quiet: on CUDA a free waits
  // for every kernel running on the device, a planned forward's doorbell wait included (it
  // runs until its engine rings), and every other thread's CUDA calls wait with it (H100,
  // 2026-12-07). Freed under mu_, it held every transfer of the server that long.
  std::unique_ptr<cache::QuietRelease> reaper_;
  mutable absl::Mutex mu_;
  std::map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, Committed> committed_ ABSL_GUARDED_BY(mu_);  // until acknowledged
  std::map<std::string, int32_t> unacknowledged_ ABSL_GUARDED_BY(mu_);  // commits per peer
  std::map<std::string, Decision> aborted_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> aborted_order_ ABSL_GUARDED_BY(mu_);  // oldest first
  std::vector<std::unique_ptr<Buffer>> spare_ ABSL_GUARDED_BY(mu_);
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_TRANSFER_RECEIVER_H_
