// Doorbells of one forward: GPU-side (CUDA) or polled (CPU) waits on 32-bit words in a
// co-located client's memory, queued on the forward's stream, and writes after its layers —
// plus the way out when a client never rings: Release writes every awaited value itself so
// that the stream drains (the forward is then abandoned by its owner).
//
// Thread safety: Wait and Signal are called by the forward's driver; Release may be called
// from any thread at any time, also while the driver is blocked in Wait (CPU backend).
#ifndef REPLAYSSM_CACHE_DOORBELLS_H_
#define REPLAYSSM_CACHE_DOORBELLS_H_

#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {

class Doorbells {
 public:
  // Queues a wait for *addr to reach `value` on `launch` (CPU: blocks until then, or until
  // Release, whatever the word does after it). After Release the wait is not queued; it
  // counts as unrung unless its word has reached `value`.
  absl::Status Wait(const rssm_launch& launch, const uint32_t* addr, uint32_t value)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Signal(const rssm_launch& launch, uint32_t* addr, uint32_t value);
  // For waits queued inside a recorded sequence (rssm_graph_launch) rather than through Wait:
  // records `waits` (in queue order) as those would, with `value`. False, recording nothing,
  // once released (the caller then queues them one by one through Wait, which skips them).
  bool Expect(absl::Span<const uint32_t* const> waits, uint32_t value) ABSL_LOCKS_EXCLUDED(mu_);
  // Writes every awaited word that has not reached its value so that no wait blocks any more,
  // and skips the waits to come. Returns the index (in queue order) of the first wait whose
  // word had not reached its value, among those queued or skipped so far, or -1: called again
  // once every wait was issued, it gives the whole answer (a release can land between two
  // waits, before the later ones were issued).
  int32_t Release(int32_t backend) ABSL_LOCKS_EXCLUDED(mu_);
  // Marks the end of the work queued on `launch` so far (a forward's last layer, its last
  // signal): WorkDone then tells, without waiting, whether that work has run. The server's own
  // proof: the last signal's word is in the client's memory, and the client can write it.
  absl::Status MarkEnd(const rssm_launch& launch);
  // Whether the work before MarkEnd has finished; false when MarkEnd was not called or
  // failed. Not thread-safe against MarkEnd (the forward's driver calls both).
  bool WorkDone() const;
  ~Doorbells();

 private:
  struct Awaited {
    uint32_t* addr;
    uint32_t value;
    bool unrung = false;  // found short of its value by Release, or skipped after it
  };
  // The CPU backend's wait: polls the word and releasing_ (a word the client sets back after
  // the release must not hold it).
  absl::Status WaitOnHost(const uint32_t* addr, uint32_t value);

  std::atomic<bool> releasing_{false};  // set by Release before it takes mu_
  absl::Mutex mu_;
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  int32_t end_backend_ = -1;  // MarkEnd's launch's backend; -1: not marked
  void* end_ = nullptr;       // its event (NULL on the CPU: done at once)
  std::vector<Awaited> awaited_ ABSL_GUARDED_BY(mu_);
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_DOORBELLS_H_
