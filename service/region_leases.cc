#include "service/region_leases.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace replayssm::service {

RegionLeases::RegionLeases(cache::RegionTable* shared, TenantRegions* tenants, absl::Duration ttl)
    : shared_(shared),
      tenants_(tenants),
      ttl_(ttl),
      sweep_(PeriodicSweep::LeasePeriod(ttl), [this](absl::Time now) { ExpireIdle(now); }) {}

RegionLeases::~RegionLeases() = default;

int32_t RegionLeases::ExpireIdle(absl::Time now) {
  const absl::Time cutoff = now - ttl_;
  int32_t n = shared_->ExpireIdle(cutoff);
  if (tenants_ != nullptr) n += tenants_->ExpireIdle(cutoff);
  return n;
}

}  // namespace replayssm::service
