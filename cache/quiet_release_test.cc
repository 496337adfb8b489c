// QuietRelease: a release waits for a quiet device, runs oldest first on the releaser's thread,
// runs anyway past the bound (counted), and runs at once without a quiet check or once stopped.
#include "replayssm/cache/quiet_release.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"

namespace replayssm::cache {
namespace {

// What ran, in order, and on which thread.
struct Ran {
  absl::Mutex mu;
  std::vector<int> order ABSL_GUARDED_BY(mu);
  std::vector<std::thread::id> threads ABSL_GUARDED_BY(mu);
  std::function<void()> Release(int i) {
    return [this, i] {
      absl::MutexLock lock(&mu);
      order.push_back(i);
      threads.push_back(std::this_thread::get_id());
    };
  }
  std::vector<int> Order() {
    absl::MutexLock lock(&mu);
    return order;
  }
  // Waits up to 5 s for n releases to have run.
  bool AwaitCount(size_t n) {
    std::pair<Ran*, size_t> want{this, n};
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(
        absl::Condition(
            +[](std::pair<Ran*, size_t>* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
              return a->first->order.size() >= a->second;
            },
            &want),
        absl::Seconds(5));
  }
};

TEST(QuietRelease, HoldsUntilQuietThenRunsOldestFirstOnItsOwnThread) {
  std::atomic<bool> quiet{false};
  Ran ran;
  QuietRelease r([&] { return quiet.load(); }, /*bound=*/8);
  for (int i = 0; i < 3; ++i) r.Add(ran.Release(i));
  std::this_thread::sleep_for(std::chrono::milliseconds(60));  // several polls
  EXPECT_TRUE(ran.Order().empty()) << "ran while a forward was open";
  EXPECT_EQ(r.held(), 3);
  quiet = true;
  ASSERT_TRUE(ran.AwaitCount(3));
  EXPECT_EQ(ran.Order(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(r.held(), 0);
  EXPECT_EQ(r.forced(), 0);
  absl::MutexLock lock(&ran.mu);
  for (std::thread::id t : ran.threads) EXPECT_NE(t, std::this_thread::get_id());
}

TEST(QuietRelease, PastItsBoundTheOldestRunsAllTheSameAndIsCounted) {
  Ran ran;
  QuietRelease r([] { return false; }, /*bound=*/2);
  for (int i = 0; i < 4; ++i) r.Add(ran.Release(i));
  ASSERT_TRUE(ran.AwaitCount(2));
  std::this_thread::sleep_for(std::chrono::milliseconds(40));
  EXPECT_EQ(ran.Order(), (std::vector<int>{0, 1})) << "only down to the bound";
  EXPECT_EQ(r.held(), 2);
  EXPECT_EQ(r.forced(), 2);
}

TEST(QuietRelease, WithoutAQuietCheckEachRunsAtOnce) {
  Ran ran;
  QuietRelease r(nullptr, /*bound=*/8);
  r.Add(ran.Release(7));
  ASSERT_TRUE(ran.AwaitCount(1));
  EXPECT_EQ(r.forced(), 0);
}

TEST(QuietRelease, StopRunsWhatIsHeldAndLaterAddsRunOnTheCallersThread) {
  std::atomic<int> asked{0};
  Ran ran;
  QuietRelease r(
      [&] {
        ++asked;
        return false;
      },
      /*bound=*/8);
  r.Add(ran.Release(0));
  r.Add(ran.Release(1));
  r.Stop();
  EXPECT_EQ(ran.Order(), (std::vector<int>{0, 1})) << "what was held ran by the time Stop returned";
  const int asked_at_stop = asked.load();
  r.Add(ran.Release(2));
  EXPECT_EQ(ran.Order(), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(asked.load(), asked_at_stop) << "nothing asks quiet once stopped";
  absl::MutexLock lock(&ran.mu);
  EXPECT_EQ(ran.threads.back(), std::this_thread::get_id());
}

}  // namespace
}  // namespace replayssm::cache
