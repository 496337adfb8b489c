// A fixed pool of worker threads for the CPU backend's data-parallel loops.
//
// Thread safety: ParallelFor may be called concurrently from any number of threads; each call
// blocks until all of its iterations are done, and the calling thread works on them too, so a
// call never waits on a pool that is busy with other calls' work alone.
#ifndef REPLAYSSM_KERNELS_CPU_THREAD_POOL_H_
#define REPLAYSSM_KERNELS_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace replayssm::kernels::cpu {

// The workers REPLAYSSM_CPU_THREADS asks for: 0 (the default) when unset, or when it is not
// a whole number from 0 to kMaxThreads (said on stderr, once).
inline constexpr int kMaxThreads = 1024;
int ThreadsFromEnvironment(const char* value);

class ThreadPool {
 public:
  // `num_threads` workers besides the callers (0 = hardware concurrency - 1).
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Runs fn(i) for every i in [0, n), spread over the workers and the calling thread.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

  // The process-wide pool (sized from REPLAYSSM_CPU_THREADS when set: ThreadsFromEnvironment).
  static ThreadPool& Default();

 private:
  void WorkerLoop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stop_ = false;                        // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace replayssm::kernels::cpu

#endif  // REPLAYSSM_KERNELS_CPU_THREAD_POOL_H_
