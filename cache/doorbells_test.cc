// Doorbells on the CPU backend: a release ends every wait of its forward, queued or to come,
// whatever the client's words do, without writing them; it says which waits were never rung;
// and it never ends a later forward's waits on the same release word.
#include "doorbells.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace replayssm::cache {
namespace {

const rssm_launch kCpu{RSSM_BACKEND_CPU, nullptr};

// A lane's release memory: the word, then `waits` pairs of outcome words.
struct ReleaseMemory {
  explicit ReleaseMemory(int32_t waits) : words(1 + 2 * waits, 0), waits(waits) {}
  void Bind(Doorbells& d, uint32_t ticket) { d.Bind(&words[0], ticket, &words[1], waits); }
  std::vector<uint32_t> words;
  int32_t waits;
};

bool WaitsFor(std::atomic<bool>& flag) {
  for (int i = 0; i < 300 && !flag.load(std::memory_order_acquire); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return flag.load();
}

TEST(Doorbells, ReleaseCountsTheFirstWaitShortOfItsValueAndWritesNoWord) {
  alignas(4) uint32_t ready[3] = {7, 4, 3};  // the first rung, the others not
  ReleaseMemory mem(4);
  Doorbells d;
  mem.Bind(d, 1);
  std::atomic<bool> done{false};
  std::thread driver([&] {  // the CPU backend's waits block their caller
    for (uint32_t& word : ready) EXPECT_TRUE(d.Wait(kCpu, &word, 7).ok());
    done.store(true, std::memory_order_release);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(done.load()) << "the second wait's word is short";
  d.Release();
  ASSERT_TRUE(WaitsFor(done)) << "the waits outlived their release by 3 s";
  driver.join();
  EXPECT_EQ(d.Release(), 1) << "asked again once every wait ran: the second never rang";
  EXPECT_EQ(ready[0], 7u);
  EXPECT_EQ(ready[1], 4u) << "a release never writes the client's word";
  EXPECT_EQ(ready[2], 3u);
  EXPECT_EQ(mem.words[0], 1u) << "the release word carries the ticket";
}

TEST(Doorbells, ACpuWaitEndsAtReleaseEvenIfItsWordIsSetBack) {
  // A client that writes its word back to 0 again and again: the wait must end at the release
  // all the same (it used to spin for good).
  alignas(4) uint32_t word = 0;
  std::atomic<bool> stop{false}, woke{false};
  std::thread client([&] {
    while (!stop.load(std::memory_order_acquire)) {
      std::atomic_ref<uint32_t>(word).store(0, std::memory_order_release);
    }
  });
  ReleaseMemory mem(1);
  Doorbells d;
  mem.Bind(d, 3);
  std::thread waiter([&] {
    EXPECT_TRUE(d.Wait(kCpu, &word, 5).ok());
    woke.store(true, std::memory_order_release);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke.load());
  d.Release();
  EXPECT_TRUE(WaitsFor(woke)) << "the wait outlived its release by 3 s";
  stop.store(true, std::memory_order_release);
  client.join();
  if (!woke.load()) std::atomic_ref<uint32_t>(word).store(5, std::memory_order_release);
  waiter.join();
  EXPECT_EQ(d.FirstUnrung(), 0) << "the wait's word had not reached its value";
}

TEST(Doorbells, AWaitAfterTheReleasePassesAndCountsUnrungUnlessItsWordArrived) {
  alignas(4) uint32_t ready[2] = {9, 2};
  ReleaseMemory mem(2);
  Doorbells d;
  mem.Bind(d, 2);
  EXPECT_EQ(d.Release(), -1) << "nothing waited yet";
  EXPECT_TRUE(d.Wait(kCpu, &ready[0], 9).ok());  // rung: not counted
  EXPECT_TRUE(d.Wait(kCpu, &ready[1], 9).ok());  // short: passes, counted
  EXPECT_EQ(d.Release(), 1);
}

TEST(Doorbells, AReleaseEndsItsForwardAndThoseBeforeItOnTheLaneNeverALaterOne) {
  // Two forwards on one lane's release word (a forward and the one continued behind it):
  // releasing the later ends both; releasing the earlier leaves the later waiting.
  alignas(4) uint32_t word = 0;
  ReleaseMemory mem(1);
  Doorbells earlier, later;
  mem.Bind(earlier, 5);
  mem.Bind(later, 6);
  std::atomic<bool> later_done{false};
  earlier.Release();
  EXPECT_TRUE(earlier.Wait(kCpu, &word, 1).ok()) << "released: passes at once";
  std::thread waiter([&] {
    EXPECT_TRUE(later.Wait(kCpu, &word, 1).ok());
    later_done.store(true, std::memory_order_release);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(later_done.load()) << "the earlier forward's release ended a later one's wait";
  later.Release();
  EXPECT_TRUE(WaitsFor(later_done));
  if (!later_done.load()) std::atomic_ref<uint32_t>(word).store(1, std::memory_order_release);
  waiter.join();
  // Each counts its own wait, in the outcome word of its ticket's parity.
  EXPECT_EQ(earlier.FirstUnrung(), 0);
  EXPECT_EQ(later.FirstUnrung(), 0);
  EXPECT_EQ(mem.words[1], 6u);
  EXPECT_EQ(mem.words[2], 5u);
  // A release never sets the word back: the earlier one's again leaves the later ticket.
  earlier.Release();
  EXPECT_EQ(mem.words[0], 6u);
}

TEST(Doorbells, RecordedWaitsAreCountedOnlyAsAForwardsFirstAndWaitsAreBounded) {
  alignas(4) uint32_t word = 1;
  ReleaseMemory mem(2);
  Doorbells d;
  mem.Bind(d, 1);
  EXPECT_FALSE(d.Expect(3)) << "more waits than the lane holds";
  EXPECT_TRUE(d.Expect(2));
  EXPECT_FALSE(d.Expect(1)) << "not the forward's first waits";
  const absl::Status past = d.Wait(kCpu, &word, 1);
  EXPECT_EQ(past.code(), absl::StatusCode::kFailedPrecondition) << past;
  EXPECT_NE(past.message().find("at most 2 doorbells"), std::string::npos) << past;
  // The recorded waits' outcomes are read as Wait's would be.
  mem.words[1 + 2 * 1 + 1] = 1;  // wait 1 of ticket 1 (odd) ended unrung
  EXPECT_EQ(d.FirstUnrung(), 1);
  EXPECT_EQ(d.ReleaseOf(1).outcome, &mem.words[3]);
  EXPECT_EQ(d.ReleaseOf(1).ticket, 1u);
}

}  // namespace
}  // namespace replayssm::cache
