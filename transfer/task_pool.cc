#include "task_pool.h"

#include <algorithm>

namespace replayssm::transfer {

TaskPool::TaskPool(int32_t threads) {
  for (int32_t i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Loop(); });
}

TaskPool::~TaskPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void TaskPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TaskPool* p)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return p->stop_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

TaskPool::Batch::~Batch() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  s.mu.Await(absl::Condition(
      +[](State* st) ABSL_NO_THREAD_SAFETY_ANALYSIS { return st->running == 0; }, &s));
}

size_t TaskPool::Batch::Submit(std::function<absl::Status()> fn) {
  size_t i;
  {
    absl::MutexLock lock(&state_->mu);
    i = state_->results.size();
    state_->results.emplace_back();
    state_->done.push_back(false);
    ++state_->running;
  }
  absl::MutexLock lock(&pool_->mu_);
  pool_->queue_.push_back([state = state_, i, fn = std::move(fn)]() mutable {
    absl::Status st = fn();
    fn = nullptr;  // what it captured goes before the batch may end
    absl::MutexLock lock(&state->mu);
    state->results[i] = std::move(st);
    state->done[i] = true;
    --state->running;
  });
  return i;
}

bool TaskPool::Batch::WaitFor(size_t i, absl::Duration timeout, absl::Status* status) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  struct Arg {
    State* s;
    size_t i;
  } arg{&s, i};
  if (!s.mu.AwaitWithTimeout(
          absl::Condition(
              +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->s->done[a->i]; }, &arg),
          timeout)) {
    return false;
  }
  *status = s.results[i];
  return true;
}

}  // namespace replayssm::transfer
