// The move protocol between two instances, minus the wire: what a sender and a receiver say
// to each other (reserve, commit, abort) and what must agree between them. gRPC carries it in
// the service (replayssm.v1.SlotTransfer); tests call a Receiver directly. UCX carries the
// bytes (put_lane.h).
//
// Decided once: a receiver decides each transfer id once, commit or abort, under its lock,
// and remembers the decision; Abort is also the question "what did you decide?". A sender
// that cannot get that answer does not know the outcome and keeps its source locked. Once a
// sender knows a transfer committed it acknowledges it, and the receiver may forget it.
#ifndef REPLAYSSM_TRANSFER_PEER_H_
#define REPLAYSSM_TRANSFER_PEER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "replayssm/cache/model.h"

namespace replayssm::transfer {

// What must agree between two instances for a state to move: everything that shapes or
// interprets the checkpoint bytes and the conv window after them. (Ring length may differ:
// the ring is empty after a move; so may the activation dtype of a model without a
// convolution.)
struct StateFormat {
  int32_t num_layers = 0;
  int32_t gate = 0, num_qk_heads = 0, num_v_heads = 0, head_k = 0, head_v = 0;
  int32_t state_dtype = 0;
  int32_t conv_width = 0;    // 0: no convolution (no window in the payload)
  int32_t conv_dtype = 0;    // the window's dtype (the act dtype); 0 without a convolution
  // How the state was computed (not its bytes): a state moves only between servers that go
  // on with the same numerics.
  int32_t ring_dtype = 0;    // rssm_dtype of ring d, k (rssm_ring_storage_dtype)
  bool round_beta = false;   // rssm_layer_params.round_beta
  uint64_t params_hash = 0;  // the layer parameters: same model, same weights
  // How the payload's heads are laid out. kUnshardedHeads: every layer's checkpoint
  // [HV, V, K] and conv window [W-1, C] whole, whatever TP degree holds the slot (a TP group
  // assembles and splits them), so servers of any TP degrees exchange states. Anything else
  // is refused naming format.head_layout.
  static constexpr int32_t kUnshardedHeads = 1;
  int32_t head_layout = kUnshardedHeads;
  int32_t tp_size = 1;  // the sender's TP degree (informational: the payload is unsharded)

  static StateFormat Of(const cache::ModelSpec& m);
  // OK, or FAILED_PRECONDITION naming the first field that differs (expected vs got).
  absl::Status CheckCompatible(const StateFormat& sender) const;
};

// The receiver's answer to Reserve: where to put the bytes.
struct Reservation {
  std::string worker_address;  // UCX worker of the receiver
  uint64_t remote_addr = 0;    // the payload, layer-major
  std::string rkey;
  int64_t bytes = 0;
  // Where the sender writes, after each chunk landed, how many payload bytes have landed, so
  // the receiver imports while the rest is in flight; 0 = none (a receive buffer in device
  // memory: imported at the commit).
  uint64_t doorbell_addr = 0;
};

// What a receiver decided for a transfer id.
struct Decision {
  bool committed = false;
  uint64_t slot = 0;  // committed: the slot's handle on the receiver
  int64_t seq_len = 0;
  // Receiver side: the owner its Reserve was given (the service: the slot's tenant), kept
  // with the reservation and the decision. Not sent on the wire.
  uint64_t owner = 0;
};

// How long, of a transfer's remaining `budget`, is kept for the abort that asks the receiver
// for its decision: a quarter, at most 2 s. The sender sends its commit only before
// (now + budget - AbortReserve(budget)); the receiver refuses a commit that reaches it after
// (its receipt of the reservation + budget - AbortReserve(budget)), which is never earlier.
absl::Duration AbortReserve(absl::Duration budget);

// How a sender reaches its peer's receiver. Every call ends by its deadline.
class Peer {
 public:
  virtual ~Peer() = default;
  // budget: the time left for the whole transfer (the receiver's commit-by is derived from it).
  virtual absl::StatusOr<Reservation> Reserve(const std::string& transfer_id,
                                              const StateFormat& format, int64_t seq_len,
                                              uint32_t checksum_version, absl::Duration budget,
                                              absl::Time deadline) = 0;
  // The slot's handle on the peer.
  virtual absl::StatusOr<uint64_t> Commit(const std::string& transfer_id,
                                          const std::vector<int32_t>& tokens, uint64_t checksum,
                                          absl::Time deadline) = 0;
  // Aborts the transfer unless the peer committed it already; either way the decision.
  virtual absl::StatusOr<Decision> Abort(const std::string& transfer_id, absl::Time deadline) = 0;
  // Tells the peer that this sender learned the commit of transfer_id (it will never ask
  // again), so the peer may forget the decision. Best effort: it may return before the peer
  // has it, and a lost one only keeps the decision until the peer's horizon.
  virtual void Acknowledge(const std::string& transfer_id) = 0;
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_TRANSFER_PEER_H_
