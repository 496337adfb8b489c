// Doorbells::Release on the CPU backend: a wait given up on is rung by the server, but a word
// its client rings further meanwhile (the next forward's value) is never set back, even when
// the client's ring lands between Release's read and its write; and a wait ends at the
// release even when its client sets the word back.
#include "doorbells.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace replayssm::cache {
namespace {

TEST(Doorbells, ReleaseRingsAWordShortOfItsValueAndCountsItUnrung) {
  alignas(4) uint32_t ready[2] = {7, 4};  // the first rung, the second not
  Doorbells d;
  const uint32_t* waits[] = {&ready[0], &ready[1]};
  ASSERT_TRUE(d.Expect(waits, 7));
  EXPECT_EQ(d.Release(RSSM_BACKEND_CPU), 1);
  EXPECT_EQ(ready[0], 7u);
  EXPECT_EQ(ready[1], 7u);
}

TEST(Doorbells, ReleaseNeverSetsBackARingThatRacesIt) {
  // The client rings value + 1 (its next forward) while Release rings value: whichever lands
  // first, the word must end at value + 1. A plain read-then-write Release sets it back to
  // value whenever the client's store falls between the two.
  constexpr int kRounds = 20000;
  alignas(4) uint32_t word = 0;
  std::atomic<int> round{-1};
  std::atomic<int> rung{-1};
  std::thread client([&] {
    for (int r = 0; r < kRounds; ++r) {
      while (round.load(std::memory_order_acquire) != r) {
      }
      const uint32_t value = static_cast<uint32_t>(r) * 4 + 1;
      std::atomic_ref<uint32_t>(word).store(value + 1, std::memory_order_release);
      rung.store(r, std::memory_order_release);
    }
  });
  int set_back = 0;
  for (int r = 0; r < kRounds; ++r) {
    const uint32_t value = static_cast<uint32_t>(r) * 4 + 1;
    std::atomic_ref<uint32_t>(word).store(value - 1, std::memory_order_release);  // not rung
    Doorbells d;
    const uint32_t* waits[] = {&word};
    ASSERT_TRUE(d.Expect(waits, value));
    round.store(r, std::memory_order_release);
    d.Release(RSSM_BACKEND_CPU);
    while (rung.load(std::memory_order_acquire) != r) {
    }
    if (std::atomic_ref<uint32_t>(word).load(std::memory_order_acquire) != value + 1) ++set_back;
  }
  client.join();
  EXPECT_EQ(set_back, 0) << "rounds whose later ring Release set back, of " << kRounds;
}

TEST(Doorbells, ACpuWaitEndsAtReleaseEvenIfItsWordIsSetBack) {
  // A client that writes its word back to 0 again and again: Release's ring is overwritten
  // before the wait's poll sees it. The wait must end anyway (it used to spin for good).
  alignas(4) uint32_t word = 0;
  std::atomic<bool> stop{false}, woke{false};
  std::thread client([&] {
    while (!stop.load(std::memory_order_acquire)) {
      std::atomic_ref<uint32_t>(word).store(0, std::memory_order_release);
    }
  });
  Doorbells d;
  std::thread waiter([&] {
    EXPECT_TRUE(d.Wait(rssm_launch{RSSM_BACKEND_CPU, nullptr}, &word, 5).ok());
    woke.store(true, std::memory_order_release);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke.load());
  EXPECT_EQ(d.Release(RSSM_BACKEND_CPU), 0) << "the wait's word had not reached its value";
  for (int i = 0; i < 300 && !woke.load(std::memory_order_acquire); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(woke.load()) << "the wait outlived its release by 3 s";
  stop.store(true, std::memory_order_release);
  client.join();
  std::atomic_ref<uint32_t>(word).store(5, std::memory_order_release);  // else it never ends
  waiter.join();
}

}  // namespace
}  // namespace replayssm::cache
