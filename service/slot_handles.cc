#include "service/slot_handles.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace replayssm::service {

namespace {

uint32_t IndexOf(cache::SlotId id) { return static_cast<uint32_t>(id & 0xffffffffu); }
// Whether a's generation (the high half) is later than b's, across the 32-bit wrap.
bool GenerationAfter(cache::SlotId a, cache::SlotId b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a >> 32) - static_cast<uint32_t>(b >> 32)) > 0;
}

// 64 bits from the kernel's CSPRNG. getrandom(2) of 8 bytes neither blocks after boot nor
// returns short; a failure here (no such syscall) leaves the server no safe handle to give.
uint64_t RandomHandle() {
  uint64_t h = 0;
  ssize_t n;
  do {
    n = getrandom(&h, sizeof(h), 0);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(sizeof(h))) std::abort();
  return h;
}

}  // namespace

uint64_t SlotHandles::ToWire(cache::SlotId id, TenantId tenant) {
  if (id == cache::kPaddingSlot) return 0;
  absl::MutexLock lock(&mu_);
  return ToWireLocked(id, tenant);
}

uint64_t SlotHandles::ToWireLocked(cache::SlotId id, TenantId tenant) {
  // A slot freed since (its handle retired): that handle, which now answers NOT_FOUND.
  if (auto r = retired_ids_.find(id); r != retired_ids_.end()) return r->second;
  Issued& e = by_index_[IndexOf(id)];
  if (e.slot == id && e.handle != 0) {
    e.last_use = absl::Now();
    return e.handle;
  }
  uint64_t h = RandomHandle();
  while (h == 0 || by_handle_.contains(h) || retired_.contains(h)) h = RandomHandle();
  if (e.handle != 0 && GenerationAfter(e.slot, id)) {
    // The index holds a newer slot: `id` is dead and never had a handle here. A retired one
    // names it; the newer slot's handle stays as it is.
    RememberRetiredLocked({h, id, absl::Now(), tenant});
    return h;
  }
  if (e.handle != 0) RetireLocked(e);  // the index's older slot, freed meanwhile
  e = {h, id, absl::Now(), tenant};
  by_handle_[h] = id;
  return h;
}

cache::SlotId SlotHandles::FromWire(uint64_t handle, TenantId tenant) {
  if (handle == 0) return cache::kPaddingSlot;
  absl::MutexLock lock(&mu_);
  auto it = by_handle_.find(handle);
  if (it != by_handle_.end()) {
    Issued& e = by_index_[IndexOf(it->second)];
    if (e.tenant != tenant) return MissLocked(handle);
    e.last_use = absl::Now();
    return it->second;
  }
  if (auto r = retired_.find(handle); r != retired_.end() && r->second.tenant == tenant) {
    return r->second.slot;
  }
  return MissLocked(handle);
}

cache::SlotId SlotHandles::MissLocked(uint64_t handle) {
  const uint32_t n = next_miss_++;
  const cache::SlotId miss = (static_cast<uint64_t>(n) << 32) | kMissIndex;
  misses_[n % kMisses] = {handle, miss, absl::InfinitePast()};
  return miss;
}

void SlotHandles::Forget(cache::SlotId id) {
  absl::MutexLock lock(&mu_);
  auto it = by_index_.find(IndexOf(id));
  if (it == by_index_.end() || it->second.slot != id) return;
  RetireLocked(it->second);
  by_index_.erase(it);
}

void SlotHandles::RetireLocked(const Issued& e) {
  by_handle_.erase(e.handle);
  RememberRetiredLocked(e);
}

void SlotHandles::RememberRetiredLocked(const Issued& e) {
  retired_[e.handle] = e;
  retired_ids_[e.slot] = e.handle;
  retired_order_.push_back(e.handle);
  if (retired_order_.size() <= kRetired) return;
  auto old = retired_.find(retired_order_.front());
  retired_ids_.erase(old->second.slot);
  retired_.erase(old);
  retired_order_.pop_front();
}

std::string SlotHandles::Describe(cache::SlotId id) const {
  // Handle 0 pads a batch and never names a slot (an outside review: "got (a slot without a
  // handle)" for slot 0 named nothing the caller sent).
  if (id == cache::kPaddingSlot) return "0, the padding handle";
  absl::MutexLock lock(&mu_);
  if (IndexOf(id) == kMissIndex) {
    const Issued& m = misses_[static_cast<uint32_t>(id >> 32) % kMisses];
    if (m.slot == id) return absl::StrCat(m.handle);
  } else {
    auto it = by_index_.find(IndexOf(id));
    if (it != by_index_.end() && it->second.slot == id) return absl::StrCat(it->second.handle);
    if (auto r = retired_ids_.find(id); r != retired_ids_.end()) return absl::StrCat(r->second);
  }
  return "(a slot without a handle)";
}

std::vector<SlotHandles::Issued> SlotHandles::List() const {
  absl::MutexLock lock(&mu_);
  std::vector<Issued> out;
  out.reserve(by_index_.size());
  for (const auto& [index, e] : by_index_) out.push_back(e);
  return out;
}

int64_t SlotHandles::Count(TenantId tenant) const {
  absl::MutexLock lock(&mu_);
  return CountLocked(tenant);
}

int64_t SlotHandles::CountLocked(TenantId tenant) const {
  int64_t n = 0;
  for (const auto& [index, e] : by_index_) n += e.handle != 0 && e.tenant == tenant ? 1 : 0;
  return n;
}

int64_t SlotHandles::Held(TenantId tenant) const {
  absl::MutexLock lock(&mu_);
  auto r = reserved_.find(tenant);
  return CountLocked(tenant) + (r == reserved_.end() ? 0 : r->second);
}

bool SlotHandles::Reserve(TenantId tenant, int64_t max) {
  absl::MutexLock lock(&mu_);
  int64_t& reserved = reserved_[tenant];
  if (max > 0 && CountLocked(tenant) + reserved >= max) return false;
  ++reserved;
  return true;
}

void SlotHandles::Settle(TenantId tenant, cache::SlotId slot) {
  absl::MutexLock lock(&mu_);
  if (auto r = reserved_.find(tenant); r != reserved_.end() && --r->second <= 0) {
    reserved_.erase(r);
  }
  if (slot != cache::kPaddingSlot) ToWireLocked(slot, tenant);
}

bool SlotHandles::IdleSince(cache::SlotId id, absl::Time cutoff) const {
  absl::MutexLock lock(&mu_);
  auto it = by_index_.find(IndexOf(id));
  return it != by_index_.end() && it->second.slot == id && it->second.last_use <= cutoff;
}

}  // namespace replayssm::service
