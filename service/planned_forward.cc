#include "service/planned_forward.h"

#include <atomic>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"

namespace replayssm::service {
namespace {

// One range of a region for a plan: each region is looked up once per plan (its whole lease
// kept in `plan.leases`), every range then checked against it. bytes == 0 is refused.
// `field` builds the field's name, only for an error.
absl::StatusOr<void*> Take(const v1::RegionRef& ref, absl::FunctionRef<std::string()> field,
                           uint64_t bytes, uint64_t alignment, const cache::RegionTable& regions,
                           ResolvedPlan& plan) {
  auto it = plan.leases.find(ref.region());
  if (it != plan.leases.end()) {
    void* p = it->second.Contains(ref.offset(), bytes, alignment);
    if (p != nullptr) return p;
    return it->second.Within(ref.offset(), bytes, alignment, field());
  }
  if (ref.region().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(field(), ".region: expected a registered region's name, got \"\""));
  }
  {
    absl::StatusOr<cache::RegionLease> lease = regions.AcquireWhole(ref.region(), field());
    if (!lease.ok()) return lease.status();
    if (lease->memory() != cache::IoMemory::kBackend) {
      return absl::InvalidArgumentError(absl::StrCat(
          field(),
          ".region: expected memory this server's backend uses in place (CUDA IPC on the "
          "CUDA backend, POSIX shared memory on the CPU backend), got region \"",
          ref.region(), "\" which would need a copy (a planned forward never waits on the host)"));
    }
    it = plan.leases.emplace(ref.region(), *std::move(lease)).first;
  }
  return it->second.Within(ref.offset(), bytes, alignment, field());
}

}  // namespace

namespace {

// One set of layers and doorbells (the plan's own, or one rank's) into r.layers; `ranks`: the
// share of each tensor's width these layers hold (1, or T for one rank of a TP group).
template <typename Layers>
absl::Status ResolveLayers(const Layers& layers, const v1::RegionRef& ready_ref,
                           const v1::RegionRef& done_ref, const std::string& field,
                           const cache::RegionTable& regions, const cache::ModelSpec& m, int64_t n,
                           int32_t ranks, ResolvedPlan& r) {
  const int32_t L = m.num_layers;
  if (layers.size() != L) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".layers: expected ", L,
                                                   " (one per layer), got ", layers.size()));
  }
  const uint64_t es = rssm_dtype_size(m.shape.act_dtype);
  const uint64_t un = static_cast<uint64_t>(n);
  absl::StatusOr<void*> ready = Take(
      ready_ref, [&] { return field + ".ready"; }, 4 * L, 4, regions, r);
  if (!ready.ok()) return ready.status();
  absl::StatusOr<void*> done = Take(
      done_ref, [&] { return field + ".done"; }, 4 * L, 4, regions, r);
  if (!done.ok()) return done.status();
  for (int32_t l = 0; l < L; ++l) {
    const v1::PlannedLayer& p = layers[l];
    ResolvedPlan::Layer& out = r.layers.emplace_back();
    struct Part {
      const v1::RegionRef& ref;
      const char* name;
      int64_t width;
    };
    void* ptrs[4] = {};
    const Part parts[4] = {{p.mixed_qkv(), ".mixed_qkv", m.QkvWidth() / ranks},
                           {p.a(), ".a", m.AWidth() / ranks},
                           {p.b(), ".b", m.BWidth() / ranks},
                           {p.out(), ".out", m.OutWidth() / ranks}};
    for (int i = 0; i < 4; ++i) {
      absl::StatusOr<void*> ptr = Take(
          parts[i].ref, [&] { return absl::StrCat(field, ".layers[", l, "]", parts[i].name); },
          un * static_cast<uint64_t>(parts[i].width) * es, 16, regions, r);
      if (!ptr.ok()) return ptr.status();
      ptrs[i] = *ptr;
    }
    out.io = cache::LayerIo{ptrs[0], ptrs[1], ptrs[2], ptrs[3], cache::IoMemory::kBackend};
    out.ready = static_cast<const uint32_t*>(*ready) + l;
    out.done = static_cast<uint32_t*>(*done) + l;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ResolvedPlan> ResolvePlan(const v1::ForwardPlan& plan, const std::string& field,
                                         const cache::RegionTable& regions,
                                         const cache::ModelSpec& m, int64_t n) {
  ResolvedPlan r;
  r.value = plan.value();
  r.num_layers = m.num_layers;
  if (plan.ranks_size() == 0) {
    absl::Status st =
        ResolveLayers(plan.layers(), plan.ready(), plan.done(), field, regions, m, n, 1, r);
    if (!st.ok()) return st;
    return r;
  }
  if (plan.ranks_size() != m.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".ranks: expected ", m.tp_size, " (one per TP rank, --tp-size) or none, got ",
        plan.ranks_size()));
  }
  if (plan.layers_size() > 0 || !plan.ready().region().empty() || !plan.done().region().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".layers, .ready, .done: expected none beside ranks (each rank names its own), got ",
        plan.layers_size(), " layers"));
  }
  for (int32_t k = 0; k < plan.ranks_size(); ++k) {
    const v1::RankPlan& rank = plan.ranks(k);
    absl::Status st = ResolveLayers(rank.layers(), rank.ready(), rank.done(),
                                    absl::StrCat(field, ".ranks[", k, "]"), regions, m, n,
                                    m.tp_size, r);
    if (!st.ok()) return st;
  }
  return r;
}

absl::StatusOr<cache::LayerIo> ResolveLayerRegions(const v1::LayerInput& input,
                                                   const std::string& field,
                                                   const cache::RegionTable& regions,
                                                   const cache::ModelSpec& m, int64_t n,
                                                   std::map<std::string, cache::RegionLease>* leases) {
  const uint64_t es = rssm_dtype_size(m.shape.act_dtype);
  const struct {
    const v1::RegionRef& ref;
    std::string name;
    int64_t width;
  } parts[4] = {{input.mixed_qkv().region(), field + ".mixed_qkv.region", m.QkvWidth()},
                {input.a().region(), field + ".a.region", m.AWidth()},
                {input.b().region(), field + ".b.region", m.BWidth()},
                {input.out(), field + ".out", m.OutWidth()}};
  void* ptrs[4] = {};
  cache::IoMemory memory = cache::IoMemory::kBackend;
  for (int i = 0; i < 4; ++i) {
    if (parts[i].ref.region().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(parts[i].name, ": expected a registered region's name, got \"\""));
    }
    absl::StatusOr<cache::RegionLease> lease = regions.Acquire(
        parts[i].ref.region(), parts[i].ref.offset(),
        static_cast<uint64_t>(n) * static_cast<uint64_t>(parts[i].width) * es, 16,
        parts[i].name);
    if (!lease.ok()) return lease.status();
    if (i > 0 && lease->memory() != memory) {
      return absl::InvalidArgumentError(absl::StrCat(
          parts[i].name, ": expected a region of the same kind as mixed_qkv's (one memory per "
                         "layer), got another kind"));
    }
    memory = lease->memory();
    ptrs[i] = lease->data();
    // One hold per name: a name held already must still be the same mapping, or the held
    // lease would keep the old one while ptrs[i] points into a new one nobody holds.
    auto held = leases->find(parts[i].ref.region());
    if (held == leases->end()) {
      leases->emplace(parts[i].ref.region(), *std::move(lease));
    } else if (!held->second.SameMapping(*lease)) {
      return absl::AbortedError(
          absl::StrCat(parts[i].name, ": region \"", parts[i].ref.region(),
                       "\" was unregistered and registered again during this call; send it again"));
    }
  }
  return cache::LayerIo{ptrs[0], ptrs[1], ptrs[2], ptrs[3], memory};
}

void RingRefused(const v1::ForwardPlan& plan, const cache::RegionTable& regions,
                 int32_t num_layers) {
  auto ring = [&](const v1::RegionRef& done) {
    if (num_layers <= 0 || done.region().empty()) return;
    absl::StatusOr<cache::RegionLease> lease = regions.Acquire(
        done.region(), done.offset(), 4 * static_cast<uint64_t>(num_layers), 4, "plan.done");
    if (lease.ok()) regions.RingAll(*lease, plan.value()).IgnoreError();
  };
  ring(plan.done());
  for (const v1::RankPlan& rank : plan.ranks()) ring(rank.done());
}

PlanWatch& PlanWatch::Default() {
  static PlanWatch* const watch = new PlanWatch();  // lives as long as the process
  return *watch;
}

PlanWatch::PlanWatch() : thread_([this] { Run(); }) {}

PlanWatch::~PlanWatch() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void PlanWatch::Add(PlannedForward* forward, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  // Every deadline is begin + the same timeout, so a new one is almost always the latest:
  // the thread needs waking only when it would otherwise sleep past this one.
  if (deadlines_.empty() || deadline < deadlines_.begin()->first) changed_ = true;
  at_[forward] = deadlines_.emplace(deadline, forward);
  ids_[forward->id()] = forward;
}

void PlanWatch::ExpireNow(uint64_t id) {
  absl::MutexLock lock(&mu_);
  auto f = ids_.find(id);
  if (f == ids_.end()) return;
  PlannedForward* forward = f->second;
  ForgetLocked(forward);
  forward->Expire();  // under mu_, as Run's: Remove(forward) waits for it
}

void PlanWatch::Remove(PlannedForward* forward) {
  absl::MutexLock lock(&mu_);  // an Expire in progress holds it: we return after it
  ForgetLocked(forward);
}

void PlanWatch::ForgetLocked(PlannedForward* forward) {
  auto it = at_.find(forward);
  if (it == at_.end()) return;
  ids_.erase(forward->id());
  deadlines_.erase(it->second);
  at_.erase(it);
}

void PlanWatch::Run() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    const auto wake = [this] { return stop_ || changed_; };
    if (deadlines_.empty()) {
      mu_.Await(absl::Condition(&wake));
    } else {
      mu_.AwaitWithDeadline(absl::Condition(&wake), deadlines_.begin()->first);
    }
    changed_ = false;
    const absl::Time now = absl::Now();
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      PlannedForward* f = deadlines_.begin()->second;
      ForgetLocked(f);
      f->Expire();  // under mu_: Remove(f) waits for it
    }
  }
}

QueueWorker::QueueWorker() : thread_([this] { Run(); }) {}

QueueWorker::~QueueWorker() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void QueueWorker::Post(std::function<void()> job) {
  absl::MutexLock lock(&mu_);
  job_ = std::move(job);
}

void QueueWorker::WaitIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](std::function<void()>* job) { return !*job; }, &job_));
}

void QueueWorker::Run() {
  absl::MutexLock lock(&mu_);
  while (true) {
    mu_.Await(absl::Condition(
        +[](QueueWorker* w) ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->stop_ || w->job_; }, this));
    if (!job_) return;  // stopping, idle
    std::function<void()> job = job_;
    mu_.Unlock();
    job();
    mu_.Lock();
    job_ = nullptr;
  }
}

namespace {
uint64_t NextId() {
  static std::atomic<uint64_t> next{0};
  return ++next;
}
}  // namespace

PlannedForward::PlannedForward(std::unique_ptr<cache::Forward> forward, ResolvedPlan plan,
                               absl::Duration timeout, QueueWorker* worker, PlanWatch& watch,
                               std::unique_ptr<PlannedForward> predecessor)
    : id_(NextId()),
      forward_(std::move(forward)),
      plan_(std::move(plan)),
      deadline_(absl::Now() + timeout),
      worker_(worker),
      watch_(watch),
      predecessor_(std::move(predecessor)) {
  watch_.Add(this, deadline_);
  if (worker_ != nullptr) {
    worker_->Post([this] { Queue(); });
  } else {
    thread_ = std::thread([this] { Queue(); });
  }
}

PlannedForward::~PlannedForward() {
  Finish();
  forward_.reset();  // abandons an uncommitted forward: its doorbells are all rung by now
}

void PlannedForward::Queue() {
  // One call for every layer (CUDA: a recorded sequence once the plan repeats; CPU: blocks on
  // each layer's doorbell in turn).
  std::vector<cache::LayerIo> ios;
  std::vector<cache::LayerDoorbells> bells;
  ios.reserve(plan_.layers.size());
  bells.reserve(plan_.layers.size());
  for (const ResolvedPlan::Layer& layer : plan_.layers) {
    ios.push_back(layer.io);
    bells.push_back({layer.ready, layer.done});
  }
  const absl::Status st = forward_->RunLayers(ios, bells, plan_.value);
  absl::MutexLock lock(&mu_);
  queue_status_ = st;
  queued_.Notify();
}

void PlannedForward::Expire() {
  absl::MutexLock lock(&mu_);
  if (!finishing_) Release();  // the owner has not taken over by the deadline
}

void PlannedForward::Release() {
  if (released_) return;
  released_ = true;
  forward_->ReleaseWaits();  // asked again by Commit, once every wait was issued
}

void PlannedForward::Finish() {
  if (finished_) return;
  finished_ = true;
  {
    absl::MutexLock lock(&mu_);
    // Abandoned (neither committed nor handed over), or still queueing (CPU: blocked on a
    // doorbell): nobody rings its doorbells any more once we give up, and a wait queued on a
    // GPU stream ends only when rung -- so ring them now, or abandoning would wait for ever.
    if (!finishing_ || !queued_.HasBeenNotified()) Release();
    finishing_ = true;
  }
  watch_.Remove(this);
  if (worker_ != nullptr) worker_->WaitIdle();
  if (thread_.joinable()) thread_.join();
}

absl::StatusOr<std::unique_ptr<cache::Forward>> PlannedForward::Continue(
    cache::StateCache& cache, absl::Span<const cache::DecodeRow> rows) {
  if (!queued_.WaitForNotificationWithDeadline(deadline_)) return nullptr;
  absl::StatusOr<std::unique_ptr<cache::Forward>> next;
  {
    // Under mu_: the watch (Expire) must not release a forward that is being handed over.
    absl::MutexLock lock(&mu_);
    if (released_ || finishing_ || !queue_status_.ok()) return nullptr;
    next = cache.ContinueForward(forward_, rows);
    if (forward_ != nullptr) return next;  // not continuable (null) or refused: ours as before
    finishing_ = true;                     // consumed: nothing may touch forward_ any more
  }
  Finish();
  // The cache keeps one forward behind the open one and confirmed ours's predecessor done
  // (else it would not have continued): its regions may go.
  predecessor_.reset();
  return next;
}

absl::Status PlannedForward::Commit() {
  if (!queued_.WaitForNotificationWithDeadline(deadline_)) {
    {
      absl::MutexLock lock(&mu_);
      Release();  // the queue thread is stuck on a doorbell: free it
    }
    queued_.WaitForNotification();  // the forward is ours alone from here
  }
  absl::Status st;
  {
    absl::MutexLock lock(&mu_);
    st = queue_status_;
  }
  // Ends when every layer ran, or once the deadline rang the doorbells in their stead.
  if (st.ok()) st = forward_->Synchronize();
  int32_t unrung = -1;
  {
    absl::MutexLock lock(&mu_);
    // Layers that all ran before a late Release are complete: only an unrung doorbell fails.
    // Asked again now that every wait was issued: a release that landed between two waits
    // counted only the first (the later ones were skipped, each unrung unless rung by now).
    if (released_) unrung = forward_->ReleaseWaits();
    finishing_ = true;
  }
  Finish();
  const int32_t layers = plan_.num_layers;  // a wait's index counts one rank's layers
  if (unrung >= 0 && predecessor_ != nullptr && unrung < layers) {
    return absl::DataLossError(absl::StrCat(
        "plan.ready: layer ", unrung, "'s doorbell of the forward before this one (value ",
        predecessor_->value(),
        ", committed when this one began) never rang within the forward "
        "timeout (--forward-timeout): its rows are broken; this forward was abandoned"));
  }
  if (unrung >= 0 && predecessor_ != nullptr) unrung -= layers;  // its waits came first
  if (unrung >= 0) {
    return absl::DeadlineExceededError(absl::StrCat(
        "plan.ready: layer ", unrung, "'s doorbell never reached ", plan_.value,
        " within the forward timeout (--forward-timeout); the forward was abandoned, no cursor "
        "moved"));
  }
  if (!st.ok()) return st;
  return forward_->Commit();
}

}  // namespace replayssm::service
