// TransferManager: the moves a server makes for its callers (TransferSlot), by request id,
// on threads of its own.
//
//  - Never on the caller's thread: Transfer returns at once and `done` runs later on a
//    transfer thread (or at once when the answer is already known), so a hung peer holds no
//    RPC thread.
//  - Bounded: at most max_concurrent moves run at once (to any peers; one peer's puts take
//    turns in the Sender); the others wait in arrival order. A move's deadline (timeout) is
//    set when it arrives and bounds everything, waiting included.
//  - By request id: a retry while the move is in flight joins it; after success it gets the
//    original result (the last `remembered` successes are kept); after a failure it runs
//    anew (a failed move changed nothing); in doubt, it first asks the peer what it decided. A
//    retry that joins the resolver's asking (begun before the caller asked, perhaps of a peer
//    since restarted) is not answered with that attempt's failure: it gets an attempt of its
//    own (asking again, or moving afresh once the peer said aborted).
//  - In doubt (the peer answered neither the commit nor the abort): the source stays MOVING,
//    the caller is told to retry with the same request id, and the peer is asked again every
//    resolve_interval until it answers.
//
// Thread safety: thread-safe. The Sender and the peers must outlive the manager.
#ifndef REPLAYSSM_TRANSFER_MANAGER_H_
#define REPLAYSSM_TRANSFER_MANAGER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/transfer/peer.h"
#include "replayssm/transfer/sender.h"

namespace replayssm::transfer {

struct TransferRequest {
  std::string request_id;  // names the move; its retries carry the same
  cache::SlotId slot = cache::kPaddingSlot;
  std::string peer_address;  // the receiving server (what PeerFactory dials)
  bool keep_source = false;
};

struct ManagerOptions {
  absl::Duration timeout = absl::Seconds(30);  // one move at most, waiting included
  size_t chunk_bytes = size_t{4} << 20;
  int32_t max_concurrent = 8;                          // moves running at once
  absl::Duration resolve_interval = absl::Seconds(1);  // asking again about moves in doubt
  int32_t remembered = 4096;                           // successes kept for retries
  // Called once per completed move (not for the replies to its retries), on a transfer
  // thread, before the move counts as succeeded (so before any caller, a retry included,
  // hears of it): metrics, and the source's handle retired when it was freed — also for a
  // move the resolver settled with nobody waiting.
  std::function<void(const TransferRequest&, const SendResult&)> on_moved;
};

// The peer at `address` (gRPC in the service, an in-process one in tests).
using PeerFactory = std::function<std::unique_ptr<Peer>(const std::string& address)>;

class TransferManager {
 public:
  using Done = std::function<void(const absl::StatusOr<SendResult>&)>;

  TransferManager(Sender* sender, PeerFactory peers, ManagerOptions options);
  ~TransferManager();  // Stop()

  // Starts, joins or answers the move request.request_id; `done` runs exactly once.
  void Transfer(const TransferRequest& request, Done done) ABSL_LOCKS_EXCLUDED(mu_);
  // Moves whose outcome is unknown (their sources locked).
  int in_doubt() const ABSL_LOCKS_EXCLUDED(mu_);
  // Refuses new moves, answers the waiting ones UNAVAILABLE, waits for the running ones.
  // Sources still in doubt are released when the manager is destroyed.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry;
  void Work();
  void ResolveLoop();
  // Runs one queued entry: a fresh attempt, or the resolution of an in-doubt one.
  SendOutcome Run(const std::string& request_id) ABSL_LOCKS_EXCLUDED(mu_);
  void Finish(const std::string& request_id, SendOutcome outcome) ABSL_LOCKS_EXCLUDED(mu_);

  Sender* const sender_;
  const PeerFactory peers_;
  const ManagerOptions options_;
  const uint64_t nonce_;  // this process's: transfer ids never repeat across restarts
  mutable absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  std::deque<std::string> queue_ ABSL_GUARDED_BY(mu_);      // entries to run, in order
  std::deque<std::string> succeeded_ ABSL_GUARDED_BY(mu_);  // oldest first
  uint64_t attempts_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
  std::thread resolver_;
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_TRANSFER_MANAGER_H_
