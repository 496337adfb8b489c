// PeriodicSweep: a thread that calls a function every `period` until it is destroyed. The lease
// sweepers (slot_leases.h, region_leases.h) own one each at LeasePeriod(ttl), and the server's
// device check one at --device-check-interval; each declared last in its owner, so that it
// stops before the owner's members go.
#ifndef REPLAYSSM_SERVICE_PERIODIC_SWEEP_H_
#define REPLAYSSM_SERVICE_PERIODIC_SWEEP_H_

#include <algorithm>
#include <functional>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace replayssm::service {

class PeriodicSweep {
 public:
  // A lease sweeper's period: a quarter of the lease's TTL, at least 10 ms and at most 1 s.
  static absl::Duration LeasePeriod(absl::Duration ttl) {
    return std::clamp(ttl / 4, absl::Milliseconds(10), absl::Seconds(1));
  }
  // Calls sweep(now) every `period` (> 0).
  PeriodicSweep(absl::Duration period, std::function<void(absl::Time)> sweep)
      : thread_([this, period, sweep = std::move(sweep)] {
          while (!stop_.WaitForNotificationWithTimeout(period)) sweep(absl::Now());
        }) {}
  ~PeriodicSweep() {
    stop_.Notify();
    thread_.join();
  }
  PeriodicSweep(const PeriodicSweep&) = delete;
  PeriodicSweep& operator=(const PeriodicSweep&) = delete;

 private:
  absl::Notification stop_;
  std::thread thread_;  // last: starts once stop_ exists
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_PERIODIC_SWEEP_H_
