#include "doorbells.h"

#include <atomic>
#include <string>

#include "absl/strings/str_cat.h"
#include "device_buffer.h"

namespace replayssm::cache {

void Doorbells::Bind(uint32_t* word, uint32_t ticket, uint32_t* outcomes, int32_t max_waits) {
  word_ = word;
  ticket_ = ticket;
  outcomes_ = outcomes;
  max_waits_ = max_waits;
}

rssm_release Doorbells::ReleaseOf(int32_t index) const {
  return rssm_release{word_, ticket_, outcomes_ + 2 * static_cast<size_t>(index)};
}

absl::Status Doorbells::Wait(const rssm_launch& launch, const uint32_t* addr, uint32_t value) {
  const int32_t index = waits_.load(std::memory_order_relaxed);
  if (word_ == nullptr || index >= max_waits_) {
    return absl::FailedPreconditionError(absl::StrCat("doorbell wait: a forward waits on at most ",
                                                      max_waits_, " doorbells (one a layer)"));
  }
  const rssm_release release = ReleaseOf(index);
  // Counted before it is queued, so that a Release from now on looks at its outcome.
  waits_.store(index + 1, std::memory_order_release);
  return KernelStatus(rssm_stream_wait_value32_or(&launch, addr, value, &release), "doorbell wait");
}

absl::Status Doorbells::Signal(const rssm_launch& launch, uint32_t* addr, uint32_t value) {
  return KernelStatus(rssm_stream_write_value32(&launch, addr, value), "doorbell signal");
}

bool Doorbells::Expect(int32_t count) {
  if (word_ == nullptr || count > max_waits_ || waits_.load(std::memory_order_relaxed) != 0) {
    return false;
  }
  waits_.store(count, std::memory_order_release);
  return true;
}

int32_t Doorbells::Release() {
  if (word_ == nullptr) return -1;  // never bound: nothing was queued
  // Raised, not written: a later forward's release (its ticket is further) is never set back.
  // The word is host memory on every backend, so the CPU backend's raise (at once, no stream).
  const rssm_launch host{RSSM_BACKEND_CPU, nullptr};
  rssm_stream_raise_value32(&host, word_, ticket_);  // a bound word is aligned: cannot fail
  return FirstUnrung();
}

int32_t Doorbells::FirstUnrung() const {
  if (outcomes_ == nullptr) return -1;
  const int32_t n = waits_.load(std::memory_order_acquire);
  for (int32_t i = 0; i < n; ++i) {
    std::atomic_ref<uint32_t> outcome(outcomes_[2 * static_cast<size_t>(i) + (ticket_ & 1u)]);
    if (outcome.load(std::memory_order_acquire) == ticket_) return i;
  }
  return -1;
}

Doorbells::~Doorbells() {
  if (end_backend_ >= 0) rssm_event_destroy(end_backend_, end_);
}

absl::Status Doorbells::MarkEnd(const rssm_launch& launch) {
  if (end_backend_ >= 0) rssm_event_destroy(end_backend_, end_);
  end_backend_ = -1;
  end_ = nullptr;
  absl::Status st = KernelStatus(rssm_event_record(&launch, &end_), "forward end event");
  if (st.ok()) end_backend_ = launch.backend;
  return st;
}

bool Doorbells::WorkDone() const {
  int done = 0;
  return end_backend_ >= 0 && rssm_event_query(end_backend_, end_, &done) == RSSM_OK && done == 1;
}

}  // namespace replayssm::cache
