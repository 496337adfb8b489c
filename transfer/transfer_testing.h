// Test support for the transfer layer: caches of a preset shape, slots of random bytes, and
// a Peer that calls a Receiver directly and can be told to fail, lie or go quiet.
#ifndef REPLAYSSM_TRANSFER_TRANSFER_TESTING_H_
#define REPLAYSSM_TRANSFER_TRANSFER_TESTING_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "replayssm/cache/state_cache.h"
#include "replayssm/transfer/peer.h"
#include "replayssm/transfer/receiver.h"
#include "replayssm/transfer/ucx_transport.h"
#include "test_model.h"

namespace replayssm::transfer::testing {

// A CPU cache of `preset` (f32 state, ring 4) cut to `layers` layers, room for 4 slots.
std::unique_ptr<cache::StateCache> MakeCache(const char* preset, int32_t layers);

// A slot of `c` holding random bytes in every layer's checkpoint (tokens 1, 2, 3).
cache::SlotId RandomSlot(cache::StateCache& c, uint32_t seed);

// Fills every slot of `c` with a non-zero state and frees them again: whatever is allocated
// next holds stale bytes unless something overwrites them.
void DirtyEverySlot(cache::StateCache& c);

// An exported state as one payload (every layer's checkpoint, layer-major), and its checksum.
std::vector<uint8_t> Payload(const cache::ExportedState& e);
uint64_t Checksum(const std::vector<uint8_t>& payload);

// Two instances in one process: A (the sender) and B, each a tiny-gdn cache of 2 layers and
// a UCX transport, and the reference that makes their activations.
class TwoInstancesTest : public ::testing::Test {
 protected:
  void SetUp() override;
  // A slot on A with a prefill of 3 tokens and `steps` decode steps (a ring holding records
  // when steps % 3 != 0).
  cache::SlotId Prepare(int steps);
  // One decode step of slot s on cache c; its outputs.
  std::vector<std::vector<uint8_t>> Step(cache::StateCache& c, cache::SlotId s, int32_t tok,
                                         int64_t pos);

  std::unique_ptr<cache::StateCache> a_, b_;
  std::unique_ptr<UcxTransport> ucx_a_, ucx_b_;
  std::unique_ptr<cache::testing::Oracle> oracle_;
};

// Calls the receiver directly. The switches make it behave like a peer that broke.
class DirectPeer : public Peer {
 public:
  explicit DirectPeer(Receiver* r) : r_(r) {}
  absl::StatusOr<Reservation> Reserve(const std::string& id, const StateFormat& f, int64_t seq_len,
                                      uint32_t version, absl::Duration budget,
                                      absl::Time deadline) override;
  absl::StatusOr<uint64_t> Commit(const std::string& id, const std::vector<int32_t>& tokens,
                                  uint64_t checksum, absl::Time deadline) override;
  absl::StatusOr<Decision> Abort(const std::string& id, absl::Time deadline) override;
  void Acknowledge(const std::string& id) override;

  std::atomic<bool> drop_commit{false};        // never reaches the receiver: UNAVAILABLE
  std::atomic<bool> drop_abort{false};         // likewise
  std::atomic<bool> corrupt_checksum{false};   // the commit's checksum is off by one bit
  std::atomic<bool> lose_commit_reply{false};  // applied, but the answer is lost
  std::function<void()> before_commit;         // runs first in Commit
  std::function<void()> before_abort;          // runs first in Abort
  std::atomic<int> reserves{0};
  std::atomic<int> acknowledged{0};

 private:
  Receiver* r_;
};

// A peer that accepts every call and answers none before the caller's deadline.
class HungPeer : public Peer {
 public:
  absl::StatusOr<Reservation> Reserve(const std::string&, const StateFormat&, int64_t, uint32_t,
                                      absl::Duration, absl::Time deadline) override;
  absl::StatusOr<uint64_t> Commit(const std::string&, const std::vector<int32_t>&, uint64_t,
                                  absl::Time deadline) override;
  absl::StatusOr<Decision> Abort(const std::string&, absl::Time deadline) override;
  void Acknowledge(const std::string&) override {}
};

}  // namespace replayssm::transfer::testing

#endif  // REPLAYSSM_TRANSFER_TRANSFER_TESTING_H_
