// Doorbells of one forward: waits on 32-bit words in a co-located client's memory, queued on
// the forward's stream (CUDA: polling kernels; CPU: the queueing thread polls), and writes
// after its layers — plus the way out when a client never rings: Release raises the lane's
// release word to the forward's ticket, a store on the host, which ends every wait of the
// forward, queued or to come, whatever its word does (the forward is then abandoned by its
// owner). The client's words are never written by a release.
//
// Thread safety: Wait and Signal are called by the forward's driver; Release may be called
// from any thread at any time, also while the driver is blocked in Wait (CPU backend).
#ifndef REPLAYSSM_CACHE_DOORBELLS_H_
#define REPLAYSSM_CACHE_DOORBELLS_H_

#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {

class Doorbells {
 public:
  // The forward's release (Lane): the lane's release `word`, the forward's `ticket`, and its
  // outcome words (`max_waits` pairs). Called once, before any wait.
  void Bind(uint32_t* word, uint32_t ticket, uint32_t* outcomes, int32_t max_waits);
  // Queues a wait for *addr to reach `value` on `launch` (CPU: blocks until then, or until
  // Release). After Release it passes at once, counted unrung unless its word has reached
  // `value` by then.
  absl::Status Wait(const rssm_launch& launch, const uint32_t* addr, uint32_t value);
  absl::Status Signal(const rssm_launch& launch, uint32_t* addr, uint32_t value);
  // The release the wait of index `index` is queued with (a recorded sequence's waits are
  // recorded with these and launched with ticket()).
  rssm_release ReleaseOf(int32_t index) const;
  uint32_t ticket() const { return ticket_; }
  // For `count` waits queued inside a recorded sequence (rssm_graph_launch, recorded with
  // ReleaseOf(0..count-1)) rather than through Wait: counts them as Wait would. False, counting
  // nothing, unless they are the forward's first waits and fit.
  bool Expect(int32_t count);
  // Raises the release word to this forward's ticket (so that no wait of it blocks any more,
  // now or later) and returns the index, in queue order, of the first wait that ended on the
  // release with its word short of its value, or -1. Waits still queued decide when they run:
  // called again once the forward's stream has run past every wait, it gives the whole answer.
  // Never waits for the device.
  int32_t Release();
  // The index of the first wait that ended unrung so far, or -1 (Release's answer, without
  // releasing).
  int32_t FirstUnrung() const;
  // Marks the end of the work queued on `launch` so far (a forward's last layer, its last
  // signal): WorkDone then tells, without waiting, whether that work has run. The server's own
  // proof: the last signal's word is in the client's memory, and the client can write it.
  absl::Status MarkEnd(const rssm_launch& launch);
  // Whether the work before MarkEnd has finished; false when MarkEnd was not called or
  // failed. Not thread-safe against MarkEnd (the forward's driver calls both).
  bool WorkDone() const;

  ~Doorbells();

 private:
  uint32_t* word_ = nullptr;  // the lane's release word (host memory)
  uint32_t ticket_ = 0;
  uint32_t* outcomes_ = nullptr;  // [max_waits_][2] (host memory)
  int32_t max_waits_ = 0;
  std::atomic<int32_t> waits_{0};  // queued so far (their indices are 0 .. waits_ - 1)
  int32_t end_backend_ = -1;       // MarkEnd's launch's backend; -1: not marked
  void* end_ = nullptr;            // its event (NULL on the CPU: done at once)
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_DOORBELLS_H_
