// The sending side of a move: export (the cache's guarded path: the slot is folded and then
// MOVING) -> reserve on the peer -> put every chunk -> commit -> the decision. The slot is
// MOVING from the export until the move's outcome is known: every mutation of it is refused
// meanwhile, so the receiver's copy is never missing a token the source applied.
//
// The puts (one pipeline for any number of lanes): chunk i goes to lane i % N, each lane a
// thread with its own stream; a lane flushes each chunk (it is then in the peer's memory)
// before it counts as landed, and the doorbell (bytes landed so far) advances only over the
// prefix of landed chunks, rung by one lane at a time and flushed before the next ring: a
// doorbell value never overtakes the bytes it announces. The calling thread feeds the lanes
// from the cache's reader, holding no more chunks than the reader's depth; the cache hashes
// the slot meanwhile.
//
// Time: everything (reserve, put, commit, the abort) ends by SendOptions::deadline. The commit
// is sent only before the deadline less AbortReserve; if its answer does not come, Abort asks
// the receiver what it decided. Committed: the move succeeded. Aborted: the source is released
// as it was. No answer: the outcome is unknown and the source stays MOVING (SendOutcome's
// in_doubt) until Resolve learns it.
//
// Thread safety: Send and Resolve may run on many threads at once; puts to one peer worker
// take turns (they share UCX endpoints), puts to different peers run at once.
#ifndef REPLAYSSM_TRANSFER_SENDER_H_
#define REPLAYSSM_TRANSFER_SENDER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "replayssm/cache/slot_io.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/transfer/peer.h"
#include "replayssm/transfer/put_lane.h"

namespace replayssm::transfer {

struct SendOptions {
  bool keep_source = false;                      // false: the source slot is freed once committed
  size_t chunk_bytes = size_t{4} << 20;          // put granularity (and staging buffer size)
  absl::Time deadline = absl::InfiniteFuture();  // the whole move ends by then
  std::optional<cache::SlotIoPath> path;         // default: the cache's choice for the lanes
};

struct SendResult {
  uint64_t remote_slot = 0;  // the slot's handle on the peer
  int64_t bytes = 0;
  int64_t seq_len = 0;
  cache::SlotIoPath path = cache::SlotIoPath::kHostDirect;
  double seconds = 0;  // all of it; the phases below add up to about this
  // export: the fold; reserve: the peer's reservation; put: stage + put + flush and the
  // cache's hash; commit: the peer's wait for its last chunks, verify, commit.
  double export_seconds = 0, reserve_seconds = 0, put_seconds = 0, commit_seconds = 0;
};

struct SendOutcome {
  absl::StatusOr<SendResult> result;
  // Set when the outcome is unknown (result is then UNAVAILABLE): the export, its slot still
  // MOVING, for Resolve.
  std::unique_ptr<cache::SlotReader> in_doubt;
};

class Sender {
 public:
  // lanes: at least one; each its own UCX context, worker and endpoint (a put on shared
  // memory is a memcpy by the putting thread). They must outlive the Sender.
  Sender(cache::StateCache* cache, std::vector<PutLane*> lanes);

  // Moves `slot` as `transfer_id` (the receiver's key); `move_id` names the move in the
  // refusals of the slot's mutations meanwhile.
  SendOutcome Send(Peer& peer, cache::SlotId slot, const std::string& move_id,
                   const std::string& transfer_id, const SendOptions& options);
  // Asks the peer what it decided for an in-doubt transfer (Abort): committed, the move
  // succeeded (the source is freed unless kept); aborted, the source is released and the
  // result is ABORTED; no answer by `deadline`, still in doubt.
  SendOutcome Resolve(Peer& peer, std::unique_ptr<cache::SlotReader> in_doubt,
                      const std::string& move_id, const std::string& transfer_id, bool keep_source,
                      absl::Time deadline);
  int32_t lanes() const { return static_cast<int32_t>(lanes_.size()); }

 private:
  // Puts every chunk of `reader` into the reservation over the lanes.
  absl::Status PutChunks(const Reservation& r, cache::SlotReader& reader, absl::Time deadline);
  // One peer worker's puts at a time: false when `deadline` passed first.
  bool LockPeer(const std::string& worker, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  void UnlockPeer(const std::string& worker) ABSL_LOCKS_EXCLUDED(mu_);
  // What the decision means for the source and the reply.
  SendOutcome Decided(const Decision& d, std::unique_ptr<cache::SlotReader> reader,
                      bool keep_source, const absl::Status& why) const;

  cache::StateCache* const cache_;
  const std::vector<PutLane*> lanes_;
  absl::Mutex mu_;
  std::set<std::string> putting_ ABSL_GUARDED_BY(mu_);  // peer workers being put into
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_TRANSFER_SENDER_H_
