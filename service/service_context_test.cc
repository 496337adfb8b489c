#include "service/service_context.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "service/server.h"

namespace replayssm::service {
namespace {

// The drain's age, from which the server tells a stuck drain (replayssm_drain_overdue).
TEST(ForwardGate, CountsHowLongItHasBeenDraining) {
  ForwardGate gate;
  const absl::Time start = absl::Now();
  EXPECT_EQ(gate.draining_for(start + absl::Hours(1)), absl::ZeroDuration()) << "not draining";
  gate.Drain(start);
  EXPECT_TRUE(gate.draining());
  EXPECT_EQ(gate.draining_for(start + absl::Seconds(70)), absl::Seconds(70));
  gate.Drain(start + absl::Seconds(5));  // a second signal does not restart the count
  EXPECT_EQ(gate.draining_for(start + absl::Seconds(70)), absl::Seconds(70));
}

// A drain waits --drain-timeout, then lets the outgoing transfers finish (each within
// --transfer-timeout) and gRPC's shutdown take its half second: past that, and a second more,
// it is stuck. deploy/k8s's grace period leaves a scrape after it (validate.js).
TEST(DrainBound, IsTheDrainTimeoutAndTheTransferTimeoutAndASecond) {
  ServerOptions o;
  EXPECT_EQ(DrainBound(o), absl::Seconds(61));  // 30 + 30 + 1
  o.drain_timeout = absl::Seconds(5);
  o.transfer_timeout = absl::Seconds(2);
  EXPECT_EQ(DrainBound(o), absl::Seconds(8));
}

}  // namespace
}  // namespace replayssm::service
