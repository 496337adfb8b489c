#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <memory>

namespace replayssm::kernels::cpu {

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) {
    num_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) - 1);
  }
  workers_.reserve(num_threads);
  for (int i = 0; i < num_threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;  // stop_ and drained
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t helpers = std::min<int64_t>(static_cast<int64_t>(workers_.size()), n - 1);
  if (helpers == 0) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Shared by the caller and the helper tasks; lives until the last helper has finished.
  struct Job {
    std::atomic<int64_t> next{0};
    std::mutex mu;
    std::condition_variable done_cv;
    int64_t running = 0;  // guarded by mu
  };
  auto job = std::make_shared<Job>();
  auto drain = [job, n, &fn] {
    for (int64_t i = job->next.fetch_add(1); i < n; i = job->next.fetch_add(1)) fn(i);
  };
  job->running = helpers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (int64_t h = 0; h < helpers; ++h) {
      tasks_.emplace_back([job, drain] {
        drain();
        std::lock_guard<std::mutex> l(job->mu);
        if (--job->running == 0) job->done_cv.notify_all();
      });
    }
  }
  cv_.notify_all();
  drain();
  std::unique_lock<std::mutex> lock(job->mu);
  job->done_cv.wait(lock, [&] { return job->running == 0; });
}

int ThreadsFromEnvironment(const char* value) {
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  errno = 0;
  const long n = std::strtol(value, &end, 10);
  const bool digits = *value >= '0' && *value <= '9';  // strtol would skip spaces and signs
  if (digits && errno == 0 && *end == '\0' && n <= kMaxThreads) return static_cast<int>(n);
  // A library cannot refuse its environment: it says so once and takes the default.
  std::fprintf(stderr,
               "replayssm: REPLAYSSM_CPU_THREADS: expected a whole number of threads from 0 to "
               "%d (0: the hardware threads less one), got \"%s\"; using the default\n",
               kMaxThreads, value);
  return 0;
}

ThreadPool& ThreadPool::Default() {
  static ThreadPool* pool =
      new ThreadPool(ThreadsFromEnvironment(std::getenv("REPLAYSSM_CPU_THREADS")));
  return *pool;
}

}  // namespace replayssm::kernels::cpu
