// TaskPool: tasks run at once on its threads; a batch ends only after its tasks.
#include "task_pool.h"

#include <gtest/gtest.h>

#include <atomic>

#include "absl/time/clock.h"

namespace replayssm::transfer {
namespace {

TEST(TaskPool, RunsTasksAtOnceAndABatchWaitsForAllOfThem) {
  TaskPool pool(2);
  std::atomic<int> started{0}, finished{0};
  {
    TaskPool::Batch batch(&pool);
    for (int i = 0; i < 2; ++i) {
      batch.Submit([&] {
        ++started;
        // Both tasks run at once, or this one gives up.
        for (int t = 0; t < 5000 && started.load() < 2; ++t) absl::SleepFor(absl::Milliseconds(1));
        absl::SleepFor(absl::Milliseconds(20));
        ++finished;
        return started.load() == 2 ? absl::OkStatus() : absl::InternalError("ran alone");
      });
    }
    const size_t last = batch.Submit([] { return absl::DataLossError("third"); });
    absl::Status st;
    ASSERT_TRUE(batch.WaitFor(0, absl::Seconds(10), &st));
    EXPECT_TRUE(st.ok()) << st;
    ASSERT_TRUE(batch.WaitFor(last, absl::Seconds(10), &st));
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  }
  EXPECT_EQ(finished.load(), 2);
  std::atomic<bool> done{false};
  {
    TaskPool::Batch batch(&pool);
    batch.Submit([&] {
      absl::SleepFor(absl::Milliseconds(50));
      done = true;
      return absl::OkStatus();
    });
  }  // the batch ends only after its task
  EXPECT_TRUE(done.load());
}

}  // namespace
}  // namespace replayssm::transfer
