// The slot table: allocation and release, generation-checked ids, the guard (Materialize),
// folds, and Accept.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "state_cache_impl.h"

namespace replayssm::cache {
namespace {
constexpr absl::string_view kNonfiniteRefusalUrl = "type.replayssm/cache.NonfiniteRefusal";
}  // namespace

bool IsNonfiniteRefusal(const absl::Status& st) {
  return st.GetPayload(kNonfiniteRefusalUrl).has_value();
}

namespace internal {

absl::StatusOr<SlotId> StateCacheImpl::Allocate() {
  MakeRoom(1);
  int32_t index;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = TakeFreeLocked();
    if (!i.ok()) return i.status();
    index = *i;
    StartLiveLocked(index, {});
  }
  absl::Status s = OnLane([&](Lane& lane) { return pool_->ZeroCheckpoints(index, lane); });
  absl::MutexLock lock(&mu_);
  if (!s.ok()) {
    ReleaseLocked(index);
    return s;
  }
  slots_[index].busy = false;
  return MakeId(index, slots_[index].generation);
}

absl::Status StateCacheImpl::Free(SlotId id) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<int32_t> i = LookupLocked(id, "slot", /*allow_broken=*/true);
  if (!i.ok()) return i.status();
  if (!slots_[*i].moving.empty()) return MovingLocked(id, *i, "slot");
  if (slots_[*i].busy) {
    return absl::FailedPreconditionError(
        absl::StrCat("slot: ", SlotName(id), " is in an open operation; finish it first"));
  }
  ReleaseLocked(*i);
  return absl::OkStatus();
}

absl::StatusOr<SlotInfo> StateCacheImpl::Info(SlotId id) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<int32_t> i = LookupLocked(id, "slot", /*allow_broken=*/true);
  if (!i.ok()) return i.status();
  const Slot& s = slots_[*i];
  return SlotInfo{s.seq_len, s.write_pos, s.pending};
}

absl::StatusOr<int32_t> StateCacheImpl::LookupLocked(SlotId id, const std::string& field,
                                                     bool allow_broken) const {
  const uint64_t index = id & 0xffffffffULL;
  const uint32_t gen = static_cast<uint32_t>(id >> 32);
  if (id == kPaddingSlot || index >= slots_.size() || slots_[index].generation != gen ||
      slots_[index].kind != Kind::kLive) {
    return absl::NotFoundError(absl::StrCat(field, ": expected a live slot id, got ",
                                            SlotName(id), " (unknown, freed or donated)"));
  }
  if (slots_[index].broken && !allow_broken) {
    return absl::DataLossError(absl::StrCat(field, ": slot ", SlotName(id),
                                            " lost its state in a device error; free it"));
  }
  return static_cast<int32_t>(index);
}

absl::Status StateCacheImpl::MovingLocked(SlotId id, int32_t index,
                                          const std::string& field) const {
  return absl::FailedPreconditionError(
      absl::StrCat(field, ": slot ", SlotName(id), " is being transferred (request id ",
                   slots_[index].moving, "); it accepts no change until the transfer ends"));
}

absl::StatusOr<int32_t> StateCacheImpl::AcquireLocked(SlotId id, const std::string& field,
                                                      bool allow_pending) {
  absl::StatusOr<int32_t> i = LookupLocked(id, field);
  if (!i.ok()) return i;
  Slot& s = slots_[*i];
  if (!s.moving.empty()) return MovingLocked(id, *i, field);
  if (s.busy) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": slot ", SlotName(id), " is in another open operation"));
  }
  if (!allow_pending && s.pending > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": slot ", SlotName(id), " has ", s.pending,
                     " verified drafts: Accept them (n may be 0) first"));
  }
  s.busy = true;
  return i;
}

absl::StatusOr<int32_t> StateCacheImpl::TakeFreeLocked() {
  if (free_.empty() && host_ != nullptr) {
    EvictLruLocked(
        [this](const Slot& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return HostBackedLocked(s); });
  }
  if (free_.empty()) EvictLruLocked([](const Slot&) { return true; });
  if (free_.empty()) return NoFreeSlotLocked();
  const int32_t index = free_.back();
  free_.pop_back();
  ++slots_taken_;  // the spiller looks again
  return index;
}

absl::Status StateCacheImpl::NoFreeSlotLocked() const {
  return absl::ResourceExhaustedError(absl::StrCat(
      "no free slot: all ", slots_.size(), " slots (", model_.SlotBytes(),
      " bytes each) are live or pinned snapshots; free slots or raise --memory-budget"));
}

size_t StateCacheImpl::TakableLocked(size_t need) const {
  size_t n = free_.size();
  for (auto it = lru_.begin(); it != lru_.end() && n < need; ++it) {
    const Slot& s = slots_[*it];
    if (s.refs == 0 && !s.busy) ++n;  // what EvictLruLocked may take
  }
  return n;
}

void StateCacheImpl::StartLiveLocked(int32_t index, std::vector<int32_t> tokens) {
  Slot& s = slots_[index];
  s.kind = Kind::kLive;
  s.write_pos = 0;
  s.seq_len = static_cast<int64_t>(tokens.size());
  s.tokens = std::move(tokens);
  s.busy = true;
  s.broken = false;
  s.moving.clear();
  s.pending = 0;
  s.drafts.clear();
}

absl::Status StateCacheImpl::Materialize(int32_t index, const char* purpose, Lane& lane) {
  int32_t w;
  {
    absl::MutexLock lock(&mu_);
    ++stats_.guard_calls;
    const Slot& s = slots_[index];
    if (s.pending > 0) {
      ++stats_.invariant_refusals;
      return absl::FailedPreconditionError(absl::StrCat(
          purpose, ": the slot has ", s.pending,
          " verified drafts that are neither accepted nor rejected; Accept first"));
    }
    w = s.write_pos;
  }
  if (w == 0) return absl::OkStatus();
  const int32_t one[1] = {index}, pos[1] = {w};
  absl::Status st = pool_->Fold(one, pos, lane);
  absl::Status done = lane.Synchronize();
  if (st.ok()) st = done;
  absl::MutexLock lock(&mu_);
  if (!st.ok()) {
    slots_[index].broken = true;
    return st;
  }
  slots_[index].write_pos = 0;
  ++stats_.folds_materialize;
  return absl::OkStatus();
}

absl::Status StateCacheImpl::CheckShareable(int32_t index, const char* purpose, Lane& lane) {
  uint32_t counts[2] = {0, 0};
  absl::Status st = pool_->CountNonfinite(index, counts, lane);
  const absl::Status done = lane.Synchronize();
  if (st.ok()) st = done;
  if (!st.ok()) return st;
  return ShareRefusal(purpose, counts);
}

absl::Status StateCacheImpl::ShareRefusal(const char* purpose, const uint32_t counts[2]) {
  if (counts[0] == 0 && counts[1] == 0) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  ++stats_.nonfinite_refusals;
  absl::Status refused = absl::FailedPreconditionError(
      absl::StrCat(purpose, ": the slot's state is not finite (", counts[0],
                   " NaN or Inf values in its checkpoints, ", counts[1],
                   " in its conv windows); it is never shared with another request (free it)"));
  refused.SetPayload(kNonfiniteRefusalUrl, absl::Cord("1"));
  return refused;
}

absl::Status StateCacheImpl::FoldRows(const std::vector<int32_t>& rows, int32_t max_pos,
                                      int64_t CacheStats::*counter, Lane& lane,
                                      std::vector<int32_t>* folded) {
  std::vector<int32_t> fold_pos;
  folded->clear();
  {
    absl::MutexLock lock(&mu_);
    for (int32_t i : rows) {
      if (i >= 0 && slots_[i].write_pos > max_pos) {
        folded->push_back(i);
        fold_pos.push_back(slots_[i].write_pos);
      }
    }
  }
  if (folded->empty()) return absl::OkStatus();
  absl::Status st = pool_->Fold(*folded, fold_pos, lane);
  absl::MutexLock lock(&mu_);
  for (int32_t i : *folded) {
    if (!st.ok()) {
      slots_[i].broken = true;
      continue;
    }
    slots_[i].write_pos = 0;
    slots_[i].pending = 0;  // waiting drafts sat past the cursor the fold resets
    slots_[i].drafts.clear();
    ++(stats_.*counter);
  }
  return st;
}

void StateCacheImpl::DiscardDrafts(const std::vector<int32_t>& index) {
  absl::MutexLock lock(&mu_);
  for (int32_t i : index) {
    if (i < 0) continue;
    slots_[i].pending = 0;
    slots_[i].drafts.clear();
  }
}

absl::Status StateCacheImpl::Accept(SlotId id, int32_t n) {
  int32_t index = -1;
  absl::StatusOr<LanePool::Lease> lane = lanes_.Take();  // before anything moves
  if (!lane.ok()) return lane.status();
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", /*allow_pending=*/true);
    if (!i.ok()) return i.status();
    index = *i;
    Slot& s = slots_[index];
    if (n < 0 || n > s.pending) {
      s.busy = false;
      return absl::InvalidArgumentError(absl::StrCat("num_accepted: expected 0 to ", s.pending,
                                                     " (the drafts verified), got ", n));
    }
    s.write_pos += n;
    s.seq_len += n;
    s.tokens.insert(s.tokens.end(), s.drafts.begin(), s.drafts.begin() + n);
    s.pending = 0;
    s.drafts.clear();
    if (n == 0) {
      s.busy = false;
      return absl::OkStatus();
    }
  }
  return AfterAdvance({index}, **lane);
}

}  // namespace internal
}  // namespace replayssm::cache
