// PlannedForward: a forward whose every layer was named at its begin (ForwardPlan: regions +
// doorbells), so that it costs no message per layer. All layers are queued at once on the
// cache forward's stream, layer l behind a wait for its ready doorbell and followed by a
// write of its done doorbell, so a co-located client's GPU work and ours interleave with no
// host hop (CPU backend: the same protocol, the waits poll shared memory).
//
// A stream's worker thread (QueueWorker) queues the layers (on the CPU backend it runs them, as
// their doorbells ring); one watch thread for the process (PlanWatch) handles the deadlines: if a
// forward is not finished by then, it rings every doorbell itself so that the stream drains, and
// the forward is abandoned (no cursor moves). The region leases are held until this object is gone.
//
// Not thread-safe: one owner (a forward session) calls Commit or destroys it.
#ifndef REPLAYSSM_SERVICE_PLANNED_FORWARD_H_
#define REPLAYSSM_SERVICE_PLANNED_FORWARD_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "replayssm/cache/model.h"
#include "replayssm/cache/regions.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/v1/regions.pb.h"
#include "replayssm/v1/replayssm.pb.h"

namespace replayssm::service {

// A plan resolved against the registered regions: every pointer checked and held.
struct ResolvedPlan {
  struct Layer {
    cache::LayerIo io;
    const uint32_t* ready = nullptr;
    uint32_t* done = nullptr;
  };
  // [num_layers], or [tp_size * num_layers] rank-major for a plan of per-rank parts (each
  // io then the rank's own tensors, each doorbell pair the rank's)
  std::vector<Layer> layers;
  int32_t num_layers = 0;
  uint32_t value = 0;
  std::map<std::string, cache::RegionLease> leases;  // one hold per region (GetRegionStatus
                                                     // counts forwards, not ranges)
};

// Checks `plan` (field names under `field`, e.g. "begin.plan") for a forward of N tokens:
// every layer named once, every range inside its region, 16-byte aligned (doorbells 4),
// and memory this backend uses in place. Nothing is touched on error.
absl::StatusOr<ResolvedPlan> ResolvePlan(const v1::ForwardPlan& plan, const std::string& field,
                                         const cache::RegionTable& regions,
                                         const cache::ModelSpec& model, int64_t n);

// The regions of one DecodeStream layer message whose tensors name regions (CheckLayerInput
// has checked dtypes and shapes): the LayerIo over them, the leases held in `leases`.
absl::StatusOr<cache::LayerIo> ResolveLayerRegions(const v1::LayerInput& input,
                                                   const std::string& field,
                                                   const cache::RegionTable& regions,
                                                   const cache::ModelSpec& model, int64_t n,
                                                   std::map<std::string, cache::RegionLease>* leases);

// For a planned begin that was refused: writes plan.value into each of the plan's done
// doorbells (num_layers words at plan.done), so that an engine that queued its GPU work
// without waiting for the begin's reply (docs/data-plane.md, "Pipelined begins") drains
// instead of waiting forever; the reply tells it the outputs are not valid. Best effort:
// nothing is written when plan.done does not name a range of a registered region in memory
// the backend writes in place.
void RingRefused(const v1::ForwardPlan& plan, const cache::RegionTable& regions,
                 int32_t num_layers);

class PlannedForward;

// Rings the doorbells of planned forwards whose deadline passed (PlannedForward::Expire), so
// that their streams drain: one thread for all of them, asleep until the earliest deadline.
// Thread-safe.
class PlanWatch {
 public:
  static PlanWatch& Default();  // the process's
  PlanWatch();
  ~PlanWatch();
  PlanWatch(const PlanWatch&) = delete;
  PlanWatch& operator=(const PlanWatch&) = delete;

  void Add(PlannedForward* forward, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Once it returns, `forward` is not touched any more (an Expire in progress has ended).
  void Remove(PlannedForward* forward) ABSL_LOCKS_EXCLUDED(mu_);
  // Expires the forward of this id now, as its deadline would (its client went away): a no-op
  // once it is gone or expired. By id, not pointer: any thread may ask, with an id read
  // while the forward was alive (a pointer could name another stream's forward by then).
  void ExpireNow(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();
  // Drops `forward` from every map (a no-op once it is gone).
  void ForgetLocked(PlannedForward* forward) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool changed_ ABSL_GUARDED_BY(mu_) = false;  // the earliest deadline moved earlier
  std::multimap<absl::Time, PlannedForward*> deadlines_ ABSL_GUARDED_BY(mu_);
  std::map<PlannedForward*, std::multimap<absl::Time, PlannedForward*>::iterator> at_
      ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, PlannedForward*> ids_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// A thread that queues planned forwards' layers, one forward at a time: a stream's forwards
// reuse it (a thread started and joined per forward measured slower on the H200 host:
// bench/results/dataplane.md, "What made the difference").
// Queueing may block (CPU backend: each wait polls its doorbell; CUDA: a launch that loads a
// module), so it never runs on the thread that answers the begin. Thread-safe.
class QueueWorker {
 public:
  QueueWorker();
  ~QueueWorker();  // waits for the job in progress
  QueueWorker(const QueueWorker&) = delete;
  QueueWorker& operator=(const QueueWorker&) = delete;

  // Runs `job` on the worker; the previous job must have ended (WaitIdle).
  void Post(std::function<void()> job) ABSL_LOCKS_EXCLUDED(mu_);
  void WaitIdle() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run();

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> job_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

class PlannedForward {
 public:
  // Queues `plan` on `forward` (which it owns from now on) on `worker` (null: a thread of its
  // own), so that this returns at once. `watch` rings the doorbells once `timeout` has passed.
  // `predecessor`: the planned forward this one continues (Continue), kept until this one
  // ends: its regions stay leased while its work may still run.
  PlannedForward(std::unique_ptr<cache::Forward> forward, ResolvedPlan plan, absl::Duration timeout,
                 QueueWorker* worker = nullptr, PlanWatch& watch = PlanWatch::Default(),
                 std::unique_ptr<PlannedForward> predecessor = nullptr);
  ~PlannedForward();  // abandons the forward unless Commit succeeded
  PlannedForward(const PlannedForward&) = delete;
  PlannedForward& operator=(const PlannedForward&) = delete;

  // Waits for every layer (until the deadline at most) and commits the cache forward.
  // DEADLINE_EXCEEDED names the first layer whose doorbell was never rung; any failure
  // abandons the forward (no cursor moves).
  absl::Status Commit();

  // The next decode forward over the same rows, without waiting for this one's device work
  // (StateCache::ContinueForward): once every layer of this one is queued (waiting until its
  // deadline at most), this forward is committed in the cache and the returned one is queued
  // behind it. Null when that cannot be done (this one is left as it was: Commit it); an
  // error once this forward has been consumed (the cache committed it; the new one failed).
  // After a non-null result this object only holds its regions: hand it to the new
  // PlannedForward as its predecessor.
  absl::StatusOr<std::unique_ptr<cache::Forward>> Continue(cache::StateCache& cache,
                                                           absl::Span<const cache::DecodeRow> rows);
  uint32_t value() const { return plan_.value; }
  uint64_t id() const { return id_; }  // unique in the process (PlanWatch::ExpireNow)
  // Past --forward-timeout: its doorbells are rung (or being rung) and nothing of it can
  // count any more, so a stream that then goes quiet is ended (ForwardSession::AwaitsMessage).
  bool PastDeadline(absl::Time now) const { return now >= deadline_; }

 private:
  friend class PlanWatch;
  void Queue();   // every layer: wait ready, run, signal done
  void Expire();  // the deadline passed: ring the doorbells unless the owner has taken over
  void Release() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Finish();  // stops the watch and the thread (ringing the doorbells if not done)

  const uint64_t id_;
  std::unique_ptr<cache::Forward> forward_;
  const ResolvedPlan plan_;
  const absl::Time deadline_;
  QueueWorker* const worker_;
  PlanWatch& watch_;
  bool finished_ = false;  // Finish ran (owner only)
  absl::Mutex mu_;
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;  // the owner has taken over (commit/abandon)
  bool released_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status queue_status_ ABSL_GUARDED_BY(mu_);
  absl::Notification queued_;
  std::thread thread_;  // without a worker
  // Continue's husk: destroyed with this object, after the destructor body has ended our cache
  // forward (which waited for the predecessor's work, queued before ours).
  std::unique_ptr<PlannedForward> predecessor_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_PLANNED_FORWARD_H_
