// QuietRelease: releases (freeing device memory, unmapping a client's CUDA IPC region) that on
// CUDA wait for every running kernel — the planned forwards' doorbell waits among them, which
// end only when their engines ring or their deadlines release them — and hold every other CUDA
// call of the process while they wait (bench/results/gpu_tests.md). Each is held until
// `quiet()` says no wait runs (the service: no planned forward open) and then run on a thread
// of the releaser's own, oldest first; past `bound` held, the oldest runs at once all the same
// (counted as forced). Without `quiet` each runs at once, on that thread.
//
// Stop (and the destructor) runs what is held without asking `quiet` again and makes every
// later Add run its release at once on the caller's thread: an owner whose `quiet` reads
// state it is about to destroy stops its releaser first.
//
// A release is move-only and owns what it releases (a buffer moved into it, not a copy of a
// shared pointer: a copy left with the caller could be the last owner and release it there).
//
// Thread safety: every method is thread-safe; Stop must not be called from a release.
#ifndef REPLAYSSM_CACHE_QUIET_RELEASE_H_
#define REPLAYSSM_CACHE_QUIET_RELEASE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace replayssm::cache {

class QuietRelease {
 public:
  QuietRelease(std::function<bool()> quiet, size_t bound);
  ~QuietRelease() { Stop(); }
  QuietRelease(const QuietRelease&) = delete;
  QuietRelease& operator=(const QuietRelease&) = delete;

  void Add(absl::AnyInvocable<void()> release) ABSL_LOCKS_EXCLUDED(mu_);
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  int held() const ABSL_LOCKS_EXCLUDED(mu_);
  int64_t forced() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();

  const std::function<bool()> quiet_;
  const size_t bound_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<absl::AnyInvocable<void()>> held_ ABSL_GUARDED_BY(mu_);  // oldest first
  int64_t forced_ ABSL_GUARDED_BY(mu_) = 0;  // run past bound_, the device busy
  absl::Mutex join_mu_;  // one Stop joins the thread
  std::thread thread_;
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_QUIET_RELEASE_H_
