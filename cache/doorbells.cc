#include "doorbells.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "device_buffer.h"

namespace replayssm::cache {
namespace {

bool Reached(uint32_t word, uint32_t value) { return static_cast<int32_t>(word - value) >= 0; }

// Whether the word at `addr` has reached `value`, read on `launch` and waited for.
bool ReadReached(const rssm_launch& launch, const uint32_t* addr, uint32_t value) {
  uint32_t word = 0;
  return rssm_memcpy(&launch, &word, addr, 4, RSSM_COPY_DEVICE_TO_HOST) == RSSM_OK &&
         rssm_synchronize(&launch) == RSSM_OK && Reached(word, value);
}

}  // namespace

absl::Status Doorbells::Wait(const rssm_launch& launch, const uint32_t* addr, uint32_t value) {
  bool skip = false;
  {
    absl::MutexLock lock(&mu_);
    skip = released_;
    if (!skip) {
      // Recorded before the wait starts, so a Release from now on ends it.
      awaited_.push_back({const_cast<uint32_t*>(addr), value});
      if (launch.backend != RSSM_BACKEND_CPU) {  // queued, returns at once
        return KernelStatus(rssm_stream_wait_value32(&launch, addr, value), "doorbell wait");
      }
    }
  }
  if (!skip) return WaitOnHost(addr, value);
  // Released before this wait: not queued, but counted, as unrung unless its word has reached
  // the value (read on the forward's stream, behind the layers queued so far).
  const bool reached = ReadReached(launch, addr, value);
  absl::MutexLock lock(&mu_);
  awaited_.push_back({const_cast<uint32_t*>(addr), value, !reached});
  return absl::OkStatus();
}

absl::Status Doorbells::Signal(const rssm_launch& launch, uint32_t* addr, uint32_t value) {
  return KernelStatus(rssm_stream_write_value32(&launch, addr, value), "doorbell signal");
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

absl::Status Doorbells::WaitOnHost(const uint32_t* addr, uint32_t value) {
  if (addr == nullptr || reinterpret_cast<uintptr_t>(addr) % 4 != 0) {
    return absl::InvalidArgumentError(
        "doorbell wait: addr: expected a 4-byte aligned pointer to the word");
  }
  // The word or the release, whichever comes first: a client that sets its word back after
  // Release rang it would otherwise hold this thread (and the forward's owner waiting for
  // it) for good. Polled as rssm_stream_wait_value32 polls: a short spin, yields, then sleeps.
  std::atomic_ref<const uint32_t> word(*addr);
  for (int64_t i = 0; !Reached(word.load(std::memory_order_acquire), value); ++i) {
    if (releasing_.load(std::memory_order_acquire)) break;
    if (i < 1000) continue;
    if (i < 2000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return absl::OkStatus();
}

bool Doorbells::Expect(absl::Span<const uint32_t* const> waits, uint32_t value) {
  absl::MutexLock lock(&mu_);
  if (released_) return false;
  for (const uint32_t* addr : waits) awaited_.push_back({const_cast<uint32_t*>(addr), value});
  return true;
}

int32_t Doorbells::Release(int32_t backend) {
  releasing_.store(true, std::memory_order_release);  // ends a CPU wait whatever its word does
  absl::MutexLock lock(&mu_);
  if (!released_ && !awaited_.empty()) {
    // A stream of its own: the forward's is blocked on these very words. Only the words that
    // have not reached their value are rung, and raised, not written: a ring further by the
    // client (its next forward), even between the read and the ring, is never set back.
    void* stream = nullptr;
    if (rssm_stream_create(backend, &stream) != RSSM_OK) stream = nullptr;
    const rssm_launch side{backend, stream};
    for (Awaited& a : awaited_) {
      if (ReadReached(side, a.addr, a.value)) continue;
      a.unrung = true;
      rssm_stream_raise_value32(&side, a.addr, a.value);
    }
    rssm_synchronize(&side);
    rssm_stream_destroy(backend, stream);
  }
  released_ = true;
  for (size_t i = 0; i < awaited_.size(); ++i) {
    if (awaited_[i].unrung) return static_cast<int32_t>(i);
  }
  return -1;
}

}  // namespace replayssm::cache
