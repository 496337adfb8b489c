#include "replayssm/cache/quiet_release.h"

#include <utility>

#include "absl/time/time.h"

namespace replayssm::cache {
namespace {

// How often a held release asks again whether the device is quiet.
constexpr absl::Duration kPoll = absl::Milliseconds(10);

}  // namespace

QuietRelease::QuietRelease(std::function<bool()> quiet, size_t bound)
    : quiet_(std::move(quiet)), bound_(bound), thread_([this] { Run(); }) {}

void QuietRelease::Add(absl::AnyInvocable<void()> release) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      held_.push_back(std::move(release));
      return;
    }
  }
  release();  // stopped: nothing asks quiet_ any more
}

void QuietRelease::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  absl::MutexLock join(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

int QuietRelease::held() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(held_.size());
}

int64_t QuietRelease::forced() const {
  absl::MutexLock lock(&mu_);
  return forced_;
}

void QuietRelease::Run() ABSL_NO_THREAD_SAFETY_ANALYSIS {  // unlocks around the calls out
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](QuietRelease* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
          return r->stop_ || !r->held_.empty();
        },
        this));
    if (held_.empty()) return;  // stopping, nothing held
    bool now = stop_ || !quiet_;
    bool forced = false;
    if (!now) {
      mu_.Unlock();  // quiet_ takes its owner's locks
      now = quiet_();
      mu_.Lock();
      if (!now && held_.size() > bound_) now = forced = true;
    }
    if (!now) {
      mu_.AwaitWithTimeout(absl::Condition(
                               +[](QuietRelease* r) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                 return r->stop_ || r->held_.size() > r->bound_;
                               },
                               this),
                           kPoll);
      continue;
    }
    absl::AnyInvocable<void()> oldest = std::move(held_.front());
    held_.pop_front();
    if (forced) ++forced_;
    mu_.Unlock();
    oldest();  // on CUDA: may wait for the running kernels
    oldest = nullptr;
    mu_.Lock();
  }
}

}  // namespace replayssm::cache
