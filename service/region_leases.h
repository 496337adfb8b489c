// Region leases (--region-ttl): a registered region that no forward or call used for the TTL
// is unregistered, as if its client had called UnregisterRegion, so that the regions of a
// co-located engine that died (it cannot unregister) are not mapped forever. Registering a
// region and every range a forward or a unary call takes of it renew its lease; GetRegionStatus
// does not. A region some forward still holds is never taken away.
//
// Thread safety: a thread of its own scans the tables every TTL/4 (at most 1 s); the
// destructor stops it.
#ifndef REPLAYSSM_SERVICE_REGION_LEASES_H_
#define REPLAYSSM_SERVICE_REGION_LEASES_H_

#include <cstdint>

#include "absl/time/time.h"
#include "replayssm/cache/regions.h"
#include "service/caller.h"
#include "service/periodic_sweep.h"

namespace replayssm::service {

class RegionLeases {
 public:
  // `shared` (the one tenant's table) and `tenants` (each tenant's, null without tokens)
  // outlive this.
  RegionLeases(cache::RegionTable* shared, TenantRegions* tenants, absl::Duration ttl);
  ~RegionLeases();
  RegionLeases(const RegionLeases&) = delete;
  RegionLeases& operator=(const RegionLeases&) = delete;

  // Unregisters every region idle since before `now - ttl`; returns how many went.
  int32_t ExpireIdle(absl::Time now);

 private:
  cache::RegionTable* shared_;
  TenantRegions* tenants_;
  const absl::Duration ttl_;
  PeriodicSweep sweep_;  // last: stops before the members above go
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_REGION_LEASES_H_
