#include "service/region_leases.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace replayssm::service {

RegionLeases::RegionLeases(cache::RegionTable* shared, TenantRegions* tenants,
                           absl::Duration ttl)
    : shared_(shared), tenants_(tenants), ttl_(ttl) {
  const absl::Duration period = std::clamp(ttl_ / 4, absl::Milliseconds(10), absl::Seconds(1));
  thread_ = std::thread([this, period] {
    while (!stop_.WaitForNotificationWithTimeout(period)) ExpireIdle(absl::Now());
  });
}

RegionLeases::~RegionLeases() {
  stop_.Notify();
  if (thread_.joinable()) thread_.join();
}

int32_t RegionLeases::ExpireIdle(absl::Time now) {
  const absl::Time cutoff = now - ttl_;
  int32_t n = shared_->ExpireIdle(cutoff);
  if (tenants_ != nullptr) n += tenants_->ExpireIdle(cutoff);
  return n;
}

}  // namespace replayssm::service
