// Threads that run short tasks in submission order, several at once: a receiver's writes of
// landed chunks into reserved slots.
//
// Thread safety: TaskPool is thread-safe; a Batch is used by one thread at a time.
#ifndef REPLAYSSM_TRANSFER_TASK_POOL_H_
#define REPLAYSSM_TRANSFER_TASK_POOL_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace replayssm::transfer {

class TaskPool {
 public:
  explicit TaskPool(int32_t threads);  // at least one thread
  ~TaskPool();                         // runs what is queued, then joins
  TaskPool(const TaskPool&) = delete;
  TaskPool& operator=(const TaskPool&) = delete;
  int32_t threads() const { return static_cast<int32_t>(threads_.size()); }

  // One user's tasks (an import), numbered 0, 1, ...; its destructor waits for every one of
  // them, so nothing a task touches is used after its user has ended.
  class Batch {
   public:
    explicit Batch(TaskPool* pool) : pool_(pool) {}
    ~Batch();
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;
    // Queues fn (it may run at once on another thread); returns its number.
    size_t Submit(std::function<absl::Status()> fn);
    // Waits up to `timeout` for task i: true and *status = its result once it ran.
    bool WaitFor(size_t i, absl::Duration timeout, absl::Status* status);

   private:
    // Shared with the queued tasks, so that the last one to finish (not the destructor that
    // it wakes) releases the mutex for good.
    struct State {
      absl::Mutex mu;
      std::deque<absl::Status> results ABSL_GUARDED_BY(mu);  // [submitted]
      std::deque<bool> done ABSL_GUARDED_BY(mu);             // [submitted]
      size_t running ABSL_GUARDED_BY(mu) = 0;                // submitted, not done
    };
    TaskPool* const pool_;
    const std::shared_ptr<State> state_ = std::make_shared<State>();
  };

 private:
  void Loop();
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_TRANSFER_TASK_POOL_H_
