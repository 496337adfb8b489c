// PeriodicSweep: a thread that calls a function every `period` (a quarter of a lease's TTL,
// within [10 ms, 1 s]) until it is destroyed. The lease sweepers (slot_leases.h,
// region_leases.h) own one each, declared last so that it stops before their members go.
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
  // Calls sweep(now) every ttl / 4, at least 10 ms and at most 1 s apart.
  PeriodicSweep(absl::Duration ttl, std::function<void(absl::Time)> sweep)
      : thread_([this, period = std::clamp(ttl / 4, absl::Milliseconds(10), absl::Seconds(1)),
                 sweep = std::move(sweep)] {
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
