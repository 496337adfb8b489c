// What every handler of one server shares: the cache, the request-id log, the metrics, the
// drain gate and the slot-handle codec. Owned by the Server; handlers hold a pointer.
#ifndef REPLAYSSM_SERVICE_SERVICE_CONTEXT_H_
#define REPLAYSSM_SERVICE_SERVICE_CONTEXT_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "replayssm/cache/regions.h"
#include "replayssm/cache/state_cache.h"
#include "service/metrics.h"
#include "service/request_log.h"
#include "service/slot_handles.h"
#include "service/tenants.h"

namespace replayssm::service {

class CacheEventLog;
class TenantRegions;

// The wire face of the server's SlotHandles (slot_handles.h) for one tenant, a value so that
// handlers write ctx->slots.FromWire(h): random 64-bit handles, errors naming them, never the
// cache's ids; another tenant's handles are unknown ones.
class SlotCodec {
 public:
  SlotCodec() = default;
  explicit SlotCodec(SlotHandles* handles, TenantId tenant = kImplicitTenant)
      : handles_(handles), tenant_(tenant) {}
  uint64_t ToWire(cache::SlotId id) const { return handles_->ToWire(id, tenant_); }
  cache::SlotId FromWire(uint64_t handle) const { return handles_->FromWire(handle, tenant_); }
  // The slot was freed, donated or moved away: its handle stops working.
  void Forget(cache::SlotId id) const { handles_->Forget(id); }
  SlotHandles* handles() const { return handles_; }
  TenantId tenant() const { return tenant_; }

 private:
  SlotHandles* handles_ = nullptr;
  TenantId tenant_ = kImplicitTenant;
};

// What the calls that need the device but run while draining say once it has failed.
inline constexpr char kNoDeviceWork[] = "no device work";

// Counts open forwards (decode, verify, prefill) and refuses new work once draining, or once the
// device has failed (Fail: the server's device check). Thread-safe.
class ForwardGate {
 public:
  // An open forward; leaving its scope closes it.
  class Ticket {
   public:
    Ticket() = default;
    Ticket(ForwardGate* gate, bool planned) : gate_(gate), planned_(planned) {}
    Ticket(Ticket&& o) noexcept : gate_(o.gate_), planned_(o.planned_) { o.gate_ = nullptr; }
    Ticket& operator=(Ticket&& o) noexcept {
      Reset();
      gate_ = o.gate_;
      planned_ = o.planned_;
      o.gate_ = nullptr;
      return *this;
    }
    ~Ticket() { Reset(); }
    void Reset() {
      if (gate_ != nullptr) gate_->Leave(planned_);
      gate_ = nullptr;
    }

   private:
    ForwardGate* gate_ = nullptr;
    bool planned_ = false;
  };

  // Planned forwards open at once (a stream's chain of continued ones counts once); 0: no
  // bound. Set before the server serves (--max-planned-forwards).
  void set_max_planned(int64_t n) {
    absl::MutexLock lock(&mutex_);
    max_planned_ = n;
  }

  // UNAVAILABLE "server is draining: <what>" once draining, "device failed (<reason>): <what>"
  // once the device has failed: every refusal of new work (forwards, allocations, imports,
  // incoming transfers) says it the same way.
  absl::Status Refuse(absl::string_view what) const {
    absl::MutexLock lock(&mutex_);
    return RefuseLocked(what);
  }
  // UNAVAILABLE "device failed (<reason>): <what>" once the device has failed, draining or not:
  // the calls a drain lets run because they move states out or wind a slot down (Export,
  // Accept, Donate, outgoing transfers, CUDA regions) still need the device.
  absl::Status RefuseIfFailed(absl::string_view what) const {
    absl::MutexLock lock(&mutex_);
    if (failure_.empty()) return absl::OkStatus();
    return FailedLocked(what);
  }
  // UNAVAILABLE when draining or failed; RESOURCE_EXHAUSTED naming --max-planned-forwards for a
  // planned forward past that bound.
  absl::Status Enter(Ticket* ticket, bool planned = false) {
    absl::MutexLock lock(&mutex_);
    if (absl::Status s = RefuseLocked("no new forwards"); !s.ok()) return s;
    if (planned && max_planned_ > 0 && open_planned_ >= max_planned_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "--max-planned-forwards: expected at most ", max_planned_,
          " planned forwards open at once, got one more (each holds a GPU work queue until its "
          "doorbells ring): commit one first, or begin this one inline"));
    }
    ++open_;
    if (planned) ++open_planned_;
    *ticket = Ticket(this, planned);
    return absl::OkStatus();
  }
  void Drain(absl::Time now = absl::Now()) {
    absl::MutexLock lock(&mutex_);
    if (!draining_) drain_started_ = now;
    draining_ = true;
  }
  bool draining() const {
    absl::MutexLock lock(&mutex_);
    return draining_;
  }
  // How long the drain has run at `now`; zero when not draining.
  absl::Duration draining_for(absl::Time now) const {
    absl::MutexLock lock(&mutex_);
    return draining_ ? now - drain_started_ : absl::ZeroDuration();
  }
  // The device no longer takes work (the first reason is kept): refuses all new work for good.
  void Fail(absl::string_view reason) {
    absl::MutexLock lock(&mutex_);
    if (failure_.empty()) failure_ = std::string(reason);
  }
  bool failed() const {
    absl::MutexLock lock(&mutex_);
    return !failure_.empty();
  }
  int64_t open() const {
    absl::MutexLock lock(&mutex_);
    return open_;
  }
  int64_t open_planned() const {
    absl::MutexLock lock(&mutex_);
    return open_planned_;
  }
  // True when no forward is open (before the timeout).
  bool WaitIdle(absl::Duration timeout) {
    absl::MutexLock lock(&mutex_);
    return mutex_.AwaitWithTimeout(absl::Condition(
                                       +[](int64_t* open) { return *open == 0; }, &open_),
                                   timeout);
  }

 private:
  absl::Status RefuseLocked(absl::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    if (!failure_.empty()) return FailedLocked(what);
    if (!draining_) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat("server is draining: ", what));
  }
  absl::Status FailedLocked(absl::string_view what) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_) {
    return absl::UnavailableError(absl::StrCat("device failed (", failure_, "): ", what));
  }
  void Leave(bool planned) {
    absl::MutexLock lock(&mutex_);
    --open_;
    if (planned) --open_planned_;
  }
  mutable absl::Mutex mutex_;
  bool draining_ ABSL_GUARDED_BY(mutex_) = false;
  absl::Time drain_started_ ABSL_GUARDED_BY(mutex_);
  std::string failure_ ABSL_GUARDED_BY(mutex_);  // empty: the device works
  int64_t open_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t open_planned_ ABSL_GUARDED_BY(mutex_) = 0;
  int64_t max_planned_ ABSL_GUARDED_BY(mutex_) = 0;
};

struct ServiceLimits {
  int32_t max_batch = 256;
  int32_t max_prefill_tokens = 1 << 16;
  int64_t max_message_bytes = 64 << 20;
  int64_t max_import_tokens = 1 << 20;  // the history an Import or a transfer brings
  int64_t tenant_max_slots = 0;  // live slots one tenant may hold (with tokens); 0: no bound
};

// INVALID_ARGUMENT naming `field` when an imported history is longer than the limit: the
// cache keeps every slot's tokens in host memory.
inline absl::Status CheckImportTokens(int64_t tokens, const ServiceLimits& limits,
                                      absl::string_view field = "tokens") {
  if (tokens <= limits.max_import_tokens) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected at most ",
                                                 limits.max_import_tokens,
                                                 " tokens (--max-import-tokens), got ", tokens));
}

// Open streams of one RPC (`method`) against their limit (`flag`, e.g. --max-streams) and
// each tenant's (`tenant_flag`, e.g. --tenant-max-streams; 0: none), so that one tenant
// cannot hold every stream. Thread-safe.
class StreamLimit {
 public:
  StreamLimit(int32_t max, int32_t tenant_max, std::string method, std::string flag,
              std::string tenant_flag)
      : max_(max),
        tenant_max_(tenant_max),
        method_(std::move(method)),
        flag_(std::move(flag)),
        tenant_flag_(std::move(tenant_flag)) {}
  // RESOURCE_EXHAUSTED when `max` streams are open, or `tenant_max` of `tenant`'s; else counts
  // one more.
  absl::Status Open(TenantId tenant) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    if (open_ >= max_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          method_, ": ", max_, " streams are open, the limit (", flag_, "); close one"));
    }
    int32_t& mine = by_tenant_[tenant];
    if (tenant_max_ > 0 && mine >= tenant_max_) {
      return absl::ResourceExhaustedError(absl::StrCat(method_, ": the caller's tenant has ", mine,
                                                       " streams open, the most one may (",
                                                       tenant_flag_, "); close one"));
    }
    ++mine;
    ++open_;
    return absl::OkStatus();
  }
  // Streams open now (the replayssm_open_streams gauge).
  int32_t open() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return open_;
  }
  void Close(TenantId tenant) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    --open_;
    if (--by_tenant_[tenant] == 0) by_tenant_.erase(tenant);
  }

 private:
  const int32_t max_, tenant_max_;
  const std::string method_, flag_, tenant_flag_;
  mutable absl::Mutex mu_;
  int32_t open_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<TenantId, int32_t> by_tenant_ ABSL_GUARDED_BY(mu_);
};

struct ServiceContext {
  cache::StateCache* cache = nullptr;
  cache::RegionTable* regions = nullptr;  // memory co-located clients registered
  RequestLog* requests = nullptr;
  Metrics* metrics = nullptr;
  ForwardGate* gate = nullptr;
  StreamLimit* streams = nullptr;  // open DecodeStream streams
  CacheEventLog* events = nullptr;  // the cache events (WatchCache)
  StreamLimit* watchers = nullptr;  // open WatchCache streams
  SlotCodec slots;                 // the server's handle table, as the caller's tenant sees it
  // --auth-tokens; null: every call is kImplicitTenant. CallerContext (caller.h) binds a copy
  // to the caller's tenant (ForTenant).
  TokenStore* tokens = nullptr;
  TenantRegions* tenant_regions = nullptr;  // with tokens: each tenant's regions (caller.h)
  ServiceLimits limits;
  std::string backend_name;  // "cpu", "cuda:0"
  bool mps = false;          // CUDA work goes through MPS (docs/data-plane.md)
  absl::Duration forward_timeout = absl::Seconds(10);  // a planned forward, begin to commit
  absl::Duration stream_idle_timeout = absl::Seconds(60);  // --stream-idle-timeout
  absl::Duration slot_ttl = absl::ZeroDuration();      // leases (slot_leases.h); 0 = off

  TenantId tenant() const { return slots.tenant(); }
  // The prefix-cache namespace of the caller's slots: its tenant's (never shared).
  cache::PrefixNamespace prefix_namespace() const { return tenant(); }
  // The request log's id space of `method` for the caller: tenants never see each other's
  // request ids (a retry of another tenant's id would replay its reply), and share the log's
  // bounds fairly (one tenant's flood of ids forgets its own, not another's).
  RequestLog::Scope RequestScope(absl::string_view method) const {
    return RequestLog::Scope(method, tenant());
  }
  // This context as `tenant` sees it (a copy: handlers keep it for the call): its handles,
  // its regions (caller.cc).
  ServiceContext ForTenant(TenantId tenant) const;
  // With tokens and --tenant-max-slots: RESOURCE_EXHAUSTED naming the flag when the caller's
  // tenant's live slots, the incoming transfers reserved for it and `adding` more exceed the
  // bound (1 before making a slot; 0 after, to catch a race past it) (caller.cc).
  absl::Status CheckSlotQuota(int64_t adding) const;
  // An incoming transfer's slot for tenant `owner`, counted against the bound at once
  // (SlotHandles::Reserve; its end is SlotHandles::Settle); RESOURCE_EXHAUSTED as above.
  // Called under the transfer receiver's lock: it takes only the handle table's.
  absl::Status ReserveIncomingSlot(TenantId owner) const;
  absl::Status SlotQuotaError(TenantId owner, int64_t held) const;
  // Whether counters must be the caller's tenant's only (GetStats with tokens).
  bool tenant_view() const { return tokens != nullptr; }
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SERVICE_CONTEXT_H_
