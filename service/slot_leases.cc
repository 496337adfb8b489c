#include "service/slot_leases.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/time/clock.h"

namespace replayssm::service {

SlotLeases::SlotLeases(cache::StateCache* cache, SlotHandles* handles, absl::Duration ttl,
                       std::function<void()> on_expiry,
                       std::function<absl::Status(cache::SlotId)> free)
    : cache_(cache),
      handles_(handles),
      ttl_(ttl),
      on_expiry_(std::move(on_expiry)),
      free_(free != nullptr ? std::move(free)
                            : [cache](cache::SlotId slot) { return cache->Free(slot); }),
      sweep_(PeriodicSweep::LeasePeriod(ttl), [this](absl::Time now) { ExpireIdle(now); }) {}

SlotLeases::~SlotLeases() = default;

int32_t SlotLeases::ExpireIdle(absl::Time now) {
  const absl::Time cutoff = now - ttl_;
  int32_t freed = 0;
  for (const SlotHandles::Issued& e : handles_->List()) {
    if (e.last_use > cutoff) continue;
    // Looked at again right before the free: a call may have named it meanwhile.
    if (!handles_->IdleSince(e.slot, cutoff)) continue;
    const absl::Status freed_now = free_(e.slot);
    if (absl::IsNotFound(freed_now)) handles_->Forget(e.slot);  // freed by another path
    if (!freed_now.ok()) continue;  // in use (busy, being moved): the next round tries again
    handles_->Forget(e.slot);
    on_expiry_();
    ++freed;
  }
  return freed;
}

}  // namespace replayssm::service
