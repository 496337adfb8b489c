// A slot's state in and out of the cache: Import/Export and their buffer forms, and the moves
// (OpenExport/OpenImport) with the SlotIoOwner calls that end them.
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "state_cache_impl.h"

namespace replayssm::cache {
namespace internal {

absl::Status StateCacheImpl::ImportFrom(SlotId id, absl::Span<const int32_t> tokens,
                                        absl::Span<const void* const> checkpoints,
                                        IoMemory memory) {
  if (absl::Status st = model_.CheckLayerCount(checkpoints.size(), "checkpoints"); !st.ok()) {
    return st;
  }
  int32_t index = -1;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", false);
    if (!i.ok()) return i.status();
    index = *i;
  }
  absl::Status st = OnLane([&](Lane& lane) {
    absl::Status r = absl::OkStatus();
    for (int32_t l = 0; r.ok() && l < model_.num_layers; ++l) {
      r = pool_->WriteCheckpoint(index, l, checkpoints[l], memory, lane);
    }
    return r;
  });
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[index];
  s.busy = false;
  if (!st.ok()) {
    s.broken = true;
    return st;
  }
  s.write_pos = 0;
  s.seq_len = static_cast<int64_t>(tokens.size());
  s.tokens.assign(tokens.begin(), tokens.end());
  return absl::OkStatus();
}

absl::StatusOr<ExportedState> StateCacheImpl::ExportInto(SlotId id,
                                                         absl::Span<void* const> checkpoints,
                                                         IoMemory memory) {
  if (absl::Status st = model_.CheckLayerCount(checkpoints.size(), "checkpoints"); !st.ok()) {
    return st;
  }
  int32_t index = -1;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", /*allow_pending=*/true);
    if (!i.ok()) return i.status();
    index = *i;
  }
  ExportedState out;
  absl::Status st = OnLane([&](Lane& lane) {
    absl::Status r = Materialize(index, "export", lane);
    for (int32_t l = 0; r.ok() && l < model_.num_layers; ++l) {
      r = pool_->ReadCheckpoint(index, l, checkpoints[l], memory, lane);
    }
    return r;
  });
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[index];
  s.busy = false;
  if (!st.ok()) return st;
  out.seq_len = s.seq_len;
  out.tokens = s.tokens;
  return out;
}

absl::StatusOr<std::unique_ptr<SlotReader>> StateCacheImpl::OpenExport(
    SlotId id, absl::string_view move_id, const SlotIoOptions& options) {
  if (move_id.empty()) {
    return absl::InvalidArgumentError("move_id: expected a non-empty id naming the move, got \"\"");
  }
  absl::StatusOr<SlotIoSpec> spec = ResolveSlotIo(options_.backend, options);
  if (!spec.ok()) return spec.status();
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", /*allow_pending=*/true);
    if (!i.ok()) return i.status();
    spec->index = *i;
  }
  // The guarded path: what leaves is the whole state (write_pos 0), or nothing; and never a
  // state with a NaN or Inf (it would reach another server's requests).
  absl::Status st = OnLane([&](Lane& lane) {
    absl::Status r = Materialize(spec->index, "export", lane);
    return r.ok() ? CheckShareable(spec->index, "move out", lane) : r;
  });
  int64_t seq_len = 0;
  std::vector<int32_t> tokens;
  {
    absl::MutexLock lock(&mu_);
    Slot& s = slots_[spec->index];
    s.busy = false;
    if (!st.ok()) return st;
    s.moving = std::string(move_id);
    seq_len = s.seq_len;
    tokens = s.tokens;
  }
  absl::StatusOr<std::unique_ptr<SlotReader>> reader =
      NewSlotReader(this, *spec, seq_len, std::move(tokens));
  if (!reader.ok()) EndExport(spec->index, /*moved=*/false);
  return reader;
}

absl::StatusOr<std::unique_ptr<SlotWriter>> StateCacheImpl::OpenImport(
    int64_t seq_len, const SlotIoOptions& options) {
  if (seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len: expected >= 0, got ", seq_len));
  }
  absl::StatusOr<SlotIoSpec> spec = ResolveSlotIo(options_.backend, options);
  if (!spec.ok()) return spec.status();
  MakeRoom(1);
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = TakeFreeLocked();
    if (!i.ok()) return i.status();
    spec->index = *i;
    slots_[*i].kind = Kind::kImporting;  // no id reaches it: not zeroed, nobody's
  }
  absl::StatusOr<std::unique_ptr<SlotWriter>> writer = NewSlotWriter(this, *spec, seq_len);
  if (!writer.ok()) DropImport(spec->index);
  return writer;
}

void StateCacheImpl::EndExport(int32_t index, bool moved) {
  absl::MutexLock lock(&mu_);
  slots_[index].moving.clear();
  if (moved) ReleaseLocked(index);
}

SlotId StateCacheImpl::CommitImport(int32_t index, absl::Span<const int32_t> tokens) {
  absl::MutexLock lock(&mu_);
  StartLiveLocked(index, std::vector<int32_t>(tokens.begin(), tokens.end()));
  slots_[index].busy = false;
  return MakeId(index, slots_[index].generation);
}

void StateCacheImpl::DropImport(int32_t index) {
  absl::MutexLock lock(&mu_);
  ReleaseLocked(index);
}

}  // namespace internal

absl::Status StateCache::Import(SlotId id, absl::Span<const int32_t> tokens,
                                absl::Span<const absl::Span<const uint8_t>> checkpoints) {
  const ModelSpec& m = model();
  if (absl::Status st = m.CheckLayerCount(checkpoints.size(), "checkpoints"); !st.ok()) {
    return st;
  }
  const size_t bytes = static_cast<size_t>(m.LayerStateBytes());
  std::vector<const void*> ptrs;
  for (size_t l = 0; l < checkpoints.size(); ++l) {
    if (checkpoints[l].size() != bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoints[", l, "]: expected ", bytes, " bytes ([HV, V, K] in ",
          rssm_dtype_name(m.shape.state_dtype),
          m.conv_width > 0
              ? absl::StrCat(", then the conv window [", m.conv_width - 1, ", ", m.QkvWidth(),
                             "] in ", rssm_dtype_name(m.shape.act_dtype))
              : std::string(),
          "), got ", checkpoints[l].size()));
    }
    ptrs.push_back(checkpoints[l].data());
  }
  return ImportFrom(id, tokens, ptrs, IoMemory::kHost);
}

absl::StatusOr<ExportedState> StateCache::Export(SlotId id) {
  const ModelSpec& m = model();
  std::vector<std::vector<uint8_t>> checkpoints(
      m.num_layers, std::vector<uint8_t>(static_cast<size_t>(m.LayerStateBytes())));
  std::vector<void*> ptrs;
  for (std::vector<uint8_t>& c : checkpoints) ptrs.push_back(c.data());
  absl::StatusOr<ExportedState> out = ExportInto(id, ptrs, IoMemory::kHost);
  if (out.ok()) out->checkpoints = std::move(checkpoints);
  return out;
}

}  // namespace replayssm::cache
