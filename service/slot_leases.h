// Slot leases (--slot-ttl): a live slot whose handle no call named for the TTL is freed, as
// if its client had called Free, so that the slots of a crashed scheduler do not live
// forever. Any call that names the handle renews the lease (SlotHandles::FromWire); ListSlots
// does not. A slot in an open forward or being transferred is in use: the cache refuses to
// free it and the next round tries again.
//
// Thread safety: a thread of its own scans the handles every TTL/4 (at most 1 s); the
// destructor stops it.
#ifndef REPLAYSSM_SERVICE_SLOT_LEASES_H_
#define REPLAYSSM_SERVICE_SLOT_LEASES_H_

#include <cstdint>
#include <functional>

#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
#include "service/periodic_sweep.h"
#include "service/slot_handles.h"

namespace replayssm::service {

class SlotLeases {
 public:
  // `cache` and `handles` outlive this; `on_expiry` runs once per slot freed. `free` frees an
  // idle slot (the transfer receiver's FreeSlot, which also settles a commit its sender has
  // not acknowledged); null: the cache's Free.
  SlotLeases(cache::StateCache* cache, SlotHandles* handles, absl::Duration ttl,
             std::function<void()> on_expiry,
             std::function<absl::Status(cache::SlotId)> free = nullptr);
  ~SlotLeases();
  SlotLeases(const SlotLeases&) = delete;
  SlotLeases& operator=(const SlotLeases&) = delete;

  // Frees every slot idle since before `now - ttl`; returns how many were freed.
  int32_t ExpireIdle(absl::Time now);

 private:
  cache::StateCache* cache_;
  SlotHandles* handles_;
  const absl::Duration ttl_;
  std::function<void()> on_expiry_;
  std::function<absl::Status(cache::SlotId)> free_;
  PeriodicSweep sweep_;  // last: stops before the members above go
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SLOT_LEASES_H_
