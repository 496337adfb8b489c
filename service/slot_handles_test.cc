#include "service/slot_handles.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace replayssm::service {
namespace {

constexpr cache::SlotId kSlot = (uint64_t{1} << 32) | 7;  // generation 1, index 7

TEST(SlotHandles, AHandleIsRandomNonZeroAndStableForItsSlot) {
  SlotHandles h;
  const uint64_t a = h.ToWire(kSlot);
  EXPECT_NE(a, 0u);
  EXPECT_NE(a, kSlot);
  EXPECT_EQ(h.ToWire(kSlot), a);
  EXPECT_EQ(h.FromWire(a), kSlot);
  EXPECT_EQ(h.ToWire(cache::kPaddingSlot), 0u);
  EXPECT_EQ(h.FromWire(0), cache::kPaddingSlot);
  SlotHandles other;  // another server: another handle for the same id
  EXPECT_NE(other.ToWire(kSlot), a);
}

TEST(SlotHandles, AnotherTenantsHandleIsAnUnknownHandle) {
  SlotHandles h;
  const uint64_t a = h.ToWire(kSlot, /*tenant=*/1);
  const absl::Time issued = h.List().front().last_use;
  const cache::SlotId seen = h.FromWire(a, /*tenant=*/2);
  EXPECT_NE(seen, kSlot);
  EXPECT_EQ(seen & 0xffffffffu, 0xffffffffu) << "the id of a miss, as for a handle never issued";
  EXPECT_EQ(h.Describe(seen), absl::StrCat(a)) << "the same message as an unknown handle";
  EXPECT_EQ(h.List().front().last_use, issued) << "another tenant's call renews no lease";
  EXPECT_EQ(h.List().front().tenant, 1u);
  EXPECT_EQ(h.FromWire(a, /*tenant=*/1), kSlot);
  EXPECT_EQ(h.ToWire(kSlot, /*tenant=*/2), a) << "a slot keeps its first tenant";
  h.Forget(kSlot);  // retired: still another tenant's miss
  EXPECT_EQ(h.FromWire(a, /*tenant=*/1), kSlot);
  EXPECT_EQ(h.FromWire(a, /*tenant=*/2) & 0xffffffffu, 0xffffffffu);
}

TEST(SlotHandles, UnknownNeighbourAndForgottenHandlesReachNoSlot) {
  SlotHandles h;
  const uint64_t a = h.ToWire(kSlot);
  for (uint64_t guess : {a + 1, a - 1, a ^ (uint64_t{1} << 32), uint64_t{kSlot}}) {
    const cache::SlotId id = h.FromWire(guess);
    EXPECT_NE(id, kSlot) << guess;
    EXPECT_EQ(id & 0xffffffffu, 0xffffffffu) << "an index no pool has";
    EXPECT_EQ(h.Describe(id), absl::StrCat(guess)) << "errors name the caller's handle";
  }
  h.Forget(kSlot);  // freed: the handle names the dead slot (the cache has a newer generation)
  EXPECT_EQ(h.FromWire(a), kSlot);
  EXPECT_EQ(h.Describe(kSlot), absl::StrCat(a));
  EXPECT_TRUE(h.List().empty());
  EXPECT_NE(h.ToWire(kSlot + (uint64_t{1} << 32)), a) << "the index's next slot: a new handle";
}

TEST(SlotHandles, TheNextGenerationOfAnIndexReplacesTheOldHandle) {
  SlotHandles h;
  const uint64_t old_handle = h.ToWire(kSlot);
  const cache::SlotId next = kSlot + (uint64_t{1} << 32);  // freed without Forget, reused
  const uint64_t new_handle = h.ToWire(next);
  EXPECT_NE(new_handle, old_handle);
  EXPECT_EQ(h.FromWire(new_handle), next);
  EXPECT_EQ(h.FromWire(old_handle), kSlot) << "its own, dead, slot";
  EXPECT_EQ(h.List().size(), 1u);
  EXPECT_EQ(h.Describe(next), absl::StrCat(new_handle));
  EXPECT_EQ(h.Describe(kSlot), absl::StrCat(old_handle));
  EXPECT_EQ(h.Describe(kSlot + 5), "(a slot without a handle)");  // never the id
  EXPECT_EQ(h.Describe(h.FromWire(0)), "0, the padding handle");
}

TEST(SlotHandles, NamingAHandleRenewsItsLeaseAndListingDoesNot) {
  SlotHandles h;
  const uint64_t a = h.ToWire(kSlot);
  const absl::Time issued = h.List()[0].last_use;
  EXPECT_TRUE(h.IdleSince(kSlot, issued));
  EXPECT_EQ(h.List()[0].last_use, issued);
  absl::SleepFor(absl::Milliseconds(2));
  EXPECT_EQ(h.FromWire(a), kSlot);
  EXPECT_FALSE(h.IdleSince(kSlot, issued));
  EXPECT_FALSE(h.IdleSince(kSlot + (uint64_t{1} << 32), absl::Now()));  // no such handle
}

// A dead slot named again (an abort's answer about a commit whose slot a lease freed since):
// its old handle, and the index's newer slot keeps its own.
TEST(SlotHandles, ADeadSlotNamedAgainGetsItsOldHandleAndDisturbsNoNewerSlot) {
  SlotHandles h;
  const uint64_t old = h.ToWire(kSlot);
  h.Forget(kSlot);
  EXPECT_EQ(h.ToWire(kSlot), old) << "its retired handle";
  EXPECT_TRUE(h.List().empty()) << "not issued again";
  const cache::SlotId newer = (uint64_t{2} << 32) | 7;
  const uint64_t live = h.ToWire(newer);
  const cache::SlotId older = (uint64_t{0} << 32) | 7;  // never had a handle here
  const uint64_t dead = h.ToWire(older);
  EXPECT_NE(dead, live);
  EXPECT_EQ(h.FromWire(live), newer) << "the newer slot's handle was not retired";
  EXPECT_EQ(h.FromWire(dead), older) << "names the dead slot (NOT_FOUND in the cache)";
  ASSERT_EQ(h.List().size(), 1u);
  EXPECT_EQ(h.List().front().slot, newer);
}

// Incoming transfers count against a tenant's bound from their reservation; the commit's
// handle is issued as the reservation settles, so the count never dips between the two.
TEST(SlotHandles, ReservationsCountUntilTheySettle) {
  SlotHandles h;
  h.ToWire(kSlot, /*tenant=*/1);
  EXPECT_TRUE(h.Reserve(1, /*max=*/2));
  EXPECT_EQ(h.Held(1), 2);
  EXPECT_EQ(h.Count(1), 1) << "live slots only";
  EXPECT_FALSE(h.Reserve(1, 2)) << "at the bound: nothing counted";
  EXPECT_EQ(h.Held(1), 2);
  EXPECT_TRUE(h.Reserve(2, 2)) << "another tenant's own bound";
  h.Settle(2, cache::kPaddingSlot);  // aborted
  EXPECT_EQ(h.Held(2), 0);
  const cache::SlotId arrived = (uint64_t{1} << 32) | 9;
  h.Settle(1, arrived);  // committed: its handle issued in the same step
  EXPECT_EQ(h.Held(1), 2);
  EXPECT_EQ(h.Count(1), 2);
  const uint64_t handle = h.ToWire(arrived, 1);
  EXPECT_EQ(h.FromWire(handle, 1), arrived);
  EXPECT_TRUE(h.Reserve(1, 0)) << "no bound";
  h.Settle(1, cache::kPaddingSlot);
  EXPECT_EQ(h.Held(1), 2);
}

}  // namespace
}  // namespace replayssm::service
