// PlannedForward: a forward whose every layer was named at its begin (ForwardPlan: regions +
// doorbells), so that it costs no message per layer. All layers are queued at once on the
// cache forward's stream, layer l behind a wait for its ready doorbell and followed by a
// write of its done doorbell, so a co-located client's GPU work and ours interleave with no
// host hop (CPU backend: the same protocol, the waits poll shared memory).
//
// One thread per planned forward queues the layers (on the CPU backend it runs them, as
// their doorbells ring) and then watches the deadline: if the forward is not finished by
// then, it rings every doorbell itself so that the stream drains, and the forward is
// abandoned (no cursor moves). The region leases are held until this object is gone.
//
// Not thread-safe: one owner (a forward session) calls Commit or destroys it.
#ifndef REPLAYSSM_SERVICE_PLANNED_FORWARD_H_
#define REPLAYSSM_SERVICE_PLANNED_FORWARD_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "replayssm/cache/model.h"
#include "replayssm/cache/regions.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/v1/regions.pb.h"
#include "replayssm/v1/replayssm.pb.h"

namespace replayssm::service {

// A plan resolved against the registered regions: every pointer checked and held.
struct ResolvedPlan {
  struct Layer {
    cache::LayerIo io;
    const uint32_t* ready = nullptr;
    uint32_t* done = nullptr;
  };
  std::vector<Layer> layers;  // [num_layers]
  uint32_t value = 0;
  std::map<std::string, cache::RegionLease> leases;  // one hold per region (GetRegionStatus
                                                     // counts forwards, not ranges)
};

// Checks `plan` (field names under `field`, e.g. "begin.plan") for a forward of N tokens:
// every layer named once, every range inside its region, 16-byte aligned (doorbells 4),
// and memory this backend uses in place. Nothing is touched on error.
absl::StatusOr<ResolvedPlan> ResolvePlan(const v1::ForwardPlan& plan, const std::string& field,
                                         const cache::RegionTable& regions,
                                         const cache::ModelSpec& model, int64_t n);

// The regions of one DecodeStream layer message whose tensors name regions (CheckLayerInput
// has checked dtypes and shapes): the LayerIo over them, the leases held in `leases`.
absl::StatusOr<cache::LayerIo> ResolveLayerRegions(const v1::LayerInput& input,
                                                   const std::string& field,
                                                   const cache::RegionTable& regions,
                                                   const cache::ModelSpec& model, int64_t n,
                                                   std::map<std::string, cache::RegionLease>* leases);

// For a planned begin that was refused: writes plan.value into each of the plan's done
// doorbells (num_layers words at plan.done), so that an engine that queued its GPU work
// without waiting for the begin's reply (docs/data-plane.md, "Pipelined begins") drains
// instead of waiting forever; the reply tells it the outputs are not valid. Best effort:
// nothing is written when plan.done does not name a range of a registered region in memory
// the backend writes in place.
void RingRefused(const v1::ForwardPlan& plan, const cache::RegionTable& regions,
                 int32_t num_layers);

class PlannedForward {
 public:
  // Starts queueing `plan` on `forward` (which it owns from now on).
  PlannedForward(std::unique_ptr<cache::Forward> forward, ResolvedPlan plan,
                 absl::Duration timeout);
  ~PlannedForward();  // abandons the forward unless Commit succeeded
  PlannedForward(const PlannedForward&) = delete;
  PlannedForward& operator=(const PlannedForward&) = delete;

  // Waits for every layer (until the deadline at most) and commits the cache forward.
  // DEADLINE_EXCEEDED names the first layer whose doorbell was never rung; any failure
  // abandons the forward (no cursor moves).
  absl::Status Commit();

 private:
  void Queue();  // the thread: queue every layer, then watch the deadline
  void Release() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish();  // stops the thread (ringing the doorbells if the forward is not done)

  std::unique_ptr<cache::Forward> forward_;
  const ResolvedPlan plan_;
  const absl::Time deadline_;
  absl::Mutex mu_;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;  // the owner has taken over (commit/abandon)
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int32_t first_unrung_ ABSL_GUARDED_BY(mu_) = -1;  // a layer (one wait per layer, in order)
  absl::Status queue_status_ ABSL_GUARDED_BY(mu_);
  absl::Notification queued_;
  std::thread thread_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_PLANNED_FORWARD_H_
