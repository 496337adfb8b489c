// SlotHandles: what clients hold of a slot. Every live slot the service hands out gets a
// handle of 64 random bits from the OS's CSPRNG (getrandom), never 0 (0 is the padding row),
// mapped to the cache's SlotId here. The cache's ids are guessable (an index and a small
// generation); handles are not: a handle that was never issued, or whose slot was freed,
// donated or moved away, is NOT_FOUND, and one client cannot find another's slots by trying
// neighbours. Errors name the caller's handle, never the cache's id (Describe, installed as
// the cache's CacheOptions::slot_name).
//
// Tenants (tenants.h): each handle belongs to the tenant it was issued to. A handle named by
// another tenant is exactly an unknown handle (NOT_FOUND, the same message, no lease renewed):
// a tenant cannot tell another's live handle from one that was never issued.
//
// Invariants: one entry per slot index (a SlotId's low half). Issuing a handle for a newer
// generation of an index retires the older one, so the table never outgrows the pool, and a
// path that frees a slot without Forget leaves no handle that reaches the index's next slot
// (the cache bumps the generation on every free). Retired handles map to their dead ids,
// which the cache never issues again; the last kRetired are kept.
//
// Thread safety: thread-safe. Its lock is a leaf: nothing is called while it is held, so the
// cache may call Describe under its own lock.
#ifndef REPLAYSSM_SERVICE_SLOT_HANDLES_H_
#define REPLAYSSM_SERVICE_SLOT_HANDLES_H_

#include <array>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
#include "service/tenants.h"

namespace replayssm::service {

class SlotHandles {
 public:
  SlotHandles() = default;
  SlotHandles(const SlotHandles&) = delete;
  SlotHandles& operator=(const SlotHandles&) = delete;

  // The handle of live slot `id`, issued to `tenant` on first use; kPaddingSlot -> 0. A slot
  // keeps the tenant of its first handle.
  uint64_t ToWire(cache::SlotId id, TenantId tenant = kImplicitTenant);
  // The slot behind `tenant`'s `handle`, and a use of it (renews its lease); 0 -> kPaddingSlot.
  // An unknown handle, or another tenant's, maps to an id no slot can have (the cache answers
  // NOT_FOUND) that Describe names as `handle`.
  cache::SlotId FromWire(uint64_t handle, TenantId tenant = kImplicitTenant);
  // Retires the handle of `id`: its slot was freed, donated or moved away. The handle keeps
  // naming that dead slot (NOT_FOUND, errors name the handle) for the last kRetired ones, so
  // that a retried TransferSlot finds the move it names; it no longer counts as issued.
  void Forget(cache::SlotId id);
  // `id` as errors name it: the caller's handle in decimal, as the wire shows it.
  std::string Describe(cache::SlotId id) const;

  struct Issued {
    uint64_t handle = 0;
    cache::SlotId slot = cache::kPaddingSlot;
    absl::Time last_use = absl::InfinitePast();  // issued, or named by a call (FromWire)
    TenantId tenant = kImplicitTenant;
  };
  // Every handle issued and not forgotten (its slot may have been freed since). Not a use.
  std::vector<Issued> List() const;
  // Handles issued to `tenant` and not forgotten: its live slots.
  int64_t Count(TenantId tenant) const;
  // What counts against `tenant`'s --tenant-max-slots: its live slots and the incoming
  // transfers reserved for it (Reserve, until Settle).
  int64_t Held(TenantId tenant) const;
  // An incoming transfer's slot for `tenant`: counted in Held from now on; false (nothing
  // counted) when Held is at `max` already (max <= 0: no bound).
  bool Reserve(TenantId tenant, int64_t max);
  // Ends a Reserve: `slot` is the transfer's committed slot, whose handle is issued to
  // `tenant` in the same step (Held does not dip between the two), or kPaddingSlot (aborted).
  void Settle(TenantId tenant, cache::SlotId slot);
  // Whether `id` has a handle that no call named since `cutoff` (slot leases).
  bool IdleSince(cache::SlotId id, absl::Time cutoff) const;

 private:
  // Unknown handles recently asked for, so that errors can name them; a ring.
  static constexpr uint32_t kMisses = 1024;
  static constexpr uint32_t kMissIndex = 0xffffffffu;  // an index no pool reaches
  // Retired handles remembered (as many as the transfer manager remembers moves).
  static constexpr size_t kRetired = 4096;

  uint64_t ToWireLocked(cache::SlotId id, TenantId tenant) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int64_t CountLocked(TenantId tenant) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RetireLocked(const Issued& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps `e` among the last kRetired retired handles.
  void RememberRetiredLocked(const Issued& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An id that Describe names as `handle` and the cache answers NOT_FOUND for.
  cache::SlotId MissLocked(uint64_t handle) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  absl::flat_hash_map<uint32_t, Issued> by_index_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, cache::SlotId> by_handle_ ABSL_GUARDED_BY(mu_);
  std::array<Issued, kMisses> misses_ ABSL_GUARDED_BY(mu_){};
  uint32_t next_miss_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, Issued> retired_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<cache::SlotId, uint64_t> retired_ids_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> retired_order_ ABSL_GUARDED_BY(mu_);  // oldest first
  absl::flat_hash_map<TenantId, int64_t> reserved_ ABSL_GUARDED_BY(mu_);  // Reserve - Settle
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SLOT_HANDLES_H_
