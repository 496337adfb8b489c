// Forwards: ForwardImpl (layers, recorded sequences, doorbells, commit and abandonment), the
// cache's Begin*/Continue/Prefill/Verify entry points, and EndForward / AfterAdvance.
//
// Fold policy (docs/cache.md, "Forwards and the fold policy"): decode and verify kernels never
// fold. A row whose ring cannot take the step's record is folded for all layers by rssm_fold
// BEFORE the forward's first layer runs; a fold does not change the logical state, so it is
// committed at once and an abandoned forward leaves nothing half-done (its ring appends sit
// past the cursor, invisible; a verify's rows keep their waiting drafts until its first layer
// runs). Rows that reach a track boundary are folded after Commit advanced the cursors,
// then snapshotted. The price: a folding row's checkpoint is read once more than with a fold
// fused into the decode kernel (about 1/(L-1) more checkpoint reads); that buys abandonment
// safety without a spare-buffer table.
//
// Prefill writes each layer's final state into its checkpoint, so a layer-by-layer prefill
// first copies the checkpoint it overwrites into a spare slot of the row's (taken from the
// pool at begin); an abandoned prefill copies back every layer it touched. All three kinds
// of forward (decode, prefill, verify) are one ForwardImpl: they differ in the kernel a layer
// runs and in what Commit books.
#include <algorithm>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "state_cache_impl.h"

namespace replayssm::cache::internal {
namespace {

// One layer's buffers (shapes are the caller's contract: the service checks them).
absl::Status CheckLayerIo(const LayerIo& io, const std::string& field, bool need_out) {
  if (io.mixed_qkv == nullptr || io.a == nullptr || io.b == nullptr ||
      (need_out && io.out == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected mixed_qkv, a, b",
                                                   need_out ? " and out" : "",
                                                   " buffers, got a missing one"));
  }
  if (io.memory != IoMemory::kHost && io.memory != IoMemory::kBackend) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".memory: expected kHost or kBackend, got ",
                                                   static_cast<int32_t>(io.memory)));
  }
  return absl::OkStatus();
}

absl::Status CheckIo(const ModelSpec& m, absl::Span<const LayerIo> layers, bool need_out) {
  if (static_cast<int32_t>(layers.size()) != m.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layers: expected ", m.num_layers,
                                                   " layers of inputs, got ", layers.size()));
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    absl::Status s = CheckLayerIo(layers[l], absl::StrCat("layers[", l, "]"), need_out);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Whether a lane's scratch holds n tokens of activations and outputs.
bool ScratchHolds(const Scratch& s, const ModelSpec& m, int64_t n) {
  const size_t es = rssm_dtype_size(m.shape.act_dtype);
  auto holds = [&](const DeviceBuffer& buf, int64_t width) {
    return buf.size() >= static_cast<size_t>(n * width) * es;
  };
  return holds(s.qkv, m.QkvWidth()) && holds(s.a, m.AWidth()) && holds(s.b, m.BWidth()) &&
         holds(s.out, m.OutWidth()) && (m.conv_width == 0 || holds(s.conv, m.QkvWidth()));
}

// The kernel's view of n tokens of io's inputs: io's own buffers when they are backend
// memory, else the lane's scratch, into which they are uploaded (queued).
absl::StatusOr<rssm_token_inputs> StageInputs(Lane& lane, const ModelSpec& m, const LayerIo& io,
                                              int64_t n) {
  if (io.memory == IoMemory::kBackend) return rssm_token_inputs{io.mixed_qkv, io.a, io.b, 0, 0, 0};
  const size_t es = rssm_dtype_size(m.shape.act_dtype);
  Scratch& s = lane.scratch;
  absl::Status st = lane.Upload(s.qkv.data(), io.mixed_qkv, n * m.QkvWidth() * es);
  if (st.ok()) st = lane.Upload(s.a.data(), io.a, n * m.AWidth() * es);
  if (st.ok()) st = lane.Upload(s.b.data(), io.b, n * m.BWidth() * es);
  if (!st.ok()) return st;
  return rssm_token_inputs{s.qkv.data(), s.a.data(), s.b.data(), 0, 0, 0};
}

// Where the kernel writes io's outputs: io.out itself (backend memory), the lane's scratch
// (host memory: StageOutputs copies them on), or nowhere (NULL).
rssm_token_outputs OutputTarget(Lane& lane, const LayerIo& io) {
  if (io.out == nullptr || io.memory == IoMemory::kBackend) return {io.out, 0};
  return {lane.scratch.out.data(), 0};
}

// Queues the copy of n tokens of outputs into io.out when it is host memory: it is there
// once the lane has been waited for.
absl::Status StageOutputs(Lane& lane, const ModelSpec& m, const LayerIo& io, int64_t n) {
  if (io.out == nullptr || io.memory == IoMemory::kBackend) return absl::OkStatus();
  const size_t bytes = n * m.OutWidth() * rssm_dtype_size(m.shape.act_dtype);
  return lane.Download(io.out, lane.scratch.out.data(), bytes);
}

std::string RowSlotField(size_t r) { return absl::StrCat("rows[", r, "].slot"); }

// A doorbell of RunLayers' `bells` (field names it): a 4-byte aligned word.
absl::Status CheckBell(const void* addr, const std::string& field) {
  if (addr == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected a doorbell word, got NULL"));
  }
  const uintptr_t past = reinterpret_cast<uintptr_t>(addr) % 4;
  if (past != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected a 4-byte aligned word, got one ", past, " bytes past it"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status StateCacheImpl::Prefill(SlotId id, absl::Span<const int32_t> tokens,
                                     absl::Span<const LayerIo> layers) {
  if (tokens.empty()) {  // a no-op, on a slot that could take a prefill
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", false);
    if (!i.ok()) return i.status();
    slots_[*i].busy = false;
    return absl::OkStatus();
  }
  if (absl::Status st = CheckIo(model_, layers, false); !st.ok()) return st;
  absl::StatusOr<std::unique_ptr<Forward>> f = BeginPrefillInPlace(id, tokens);
  if (!f.ok()) return f.status();
  return (*f)->RunEveryLayer(layers);
}

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::BeginPrefillInPlace(
    SlotId id, absl::Span<const int32_t> tokens) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  if (T < 1 || T > options_.max_prefill_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: expected 1 to ", options_.max_prefill_tokens, " tokens, got ", T));
  }
  ForwardRows rows{ForwardKind::kPrefill};
  rows.cu = {0, static_cast<int32_t>(T)};
  rows.tokens.assign(tokens.begin(), tokens.end());
  const SlotId ids[1] = {id};
  // No spare slot: only a device error, or a caller driving the layers that gives up, can
  // stop it halfway (the slot is then broken, as after any failed launch).
  return Open(
      std::move(rows), ids, [](size_t) { return std::string("slot"); },
      /*spares=*/false, /*layer_waits=*/false);
}

absl::Status StateCacheImpl::AcquireRowsLocked(absl::Span<const SlotId> ids,
                                               absl::FunctionRef<std::string(size_t)> field,
                                               bool allow_pending, std::vector<int32_t>* index) {
  std::unordered_set<SlotId> seen;
  absl::Status st = absl::OkStatus();
  for (size_t r = 0; r < ids.size() && st.ok(); ++r) {
    if (ids[r] == kPaddingSlot) continue;
    if (!seen.insert(ids[r]).second) {
      st = absl::InvalidArgumentError(
          absl::StrCat(field(r), ": expected a slot not already in this batch, got ",
                       SlotName(ids[r]), " twice"));
      break;
    }
    absl::StatusOr<int32_t> i = AcquireLocked(ids[r], field(r), allow_pending);
    if (!i.ok()) {
      st = i.status();
      break;
    }
    (*index)[r] = *i;
  }
  if (!st.ok()) ReleaseRowsLocked(*index);  // nothing happened: release what was taken
  return st;
}

void StateCacheImpl::ReleaseRowsLocked(std::vector<int32_t>& index) {
  for (int32_t& i : index) {
    if (i >= 0) slots_[i].busy = false;
    i = -1;
  }
}

namespace {

absl::Status NoSpareFor(size_t r, absl::string_view why) {
  constexpr char kWhy[] =
      "]: a layer-by-layer prefill keeps one spare slot per row until it commits, and none "
      "is free (";
  return absl::ResourceExhaustedError(
      absl::StrCat("rows[", r, kWhy, why, "); prefill fewer rows at once or use Prefill"));
}

}  // namespace

absl::Status StateCacheImpl::SparesRefusalLocked(const std::vector<int32_t>& index,
                                                 size_t coming) const {
  size_t rows = 0;
  for (int32_t i : index) rows += i >= 0 ? 1 : 0;
  const size_t takable = TakableLocked(rows) + coming;
  for (size_t r = 0, row = 0; takable < rows && r < index.size(); ++r) {  // the first left out
    if (index[r] >= 0 && row++ == takable) return NoSpareFor(r, NoFreeSlotLocked().message());
  }
  return absl::OkStatus();
}

absl::Status StateCacheImpl::TakeSparesLocked(const std::vector<int32_t>& index,
                                              std::vector<int32_t>* spare) {
  spare->assign(index.size(), -1);
  // Counted before any is taken: a refusal evicts no snapshot for rows it then gives up.
  if (absl::Status st = SparesRefusalLocked(index, 0); !st.ok()) return st;
  for (size_t r = 0; r < index.size(); ++r) {
    if (index[r] < 0) continue;
    absl::StatusOr<int32_t> i = TakeFreeLocked();
    if (!i.ok()) {
      for (int32_t& s : *spare) {
        if (s >= 0) ReleaseLocked(s);
        s = -1;
      }
      return NoSpareFor(r, i.status().message());
    }
    Slot& s = slots_[*i];
    s.kind = Kind::kSpare;
    s.busy = true;
    (*spare)[r] = *i;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::Open(
    ForwardRows rows, absl::Span<const SlotId> ids, absl::FunctionRef<std::string(size_t)> field,
    bool spares, bool layer_waits) {
  absl::StatusOr<LanePool::Lease> lane = lanes_.Take();  // before anything moves
  if (!lane.ok()) return lane.status();
  rows.index.assign(ids.size(), -1);
  rows.spare.assign(ids.size(), -1);
  {
    absl::MutexLock lock(&mu_);
    const bool verify = rows.kind == ForwardKind::kVerify;
    absl::Status st = AcquireRowsLocked(ids, field, /*allow_pending=*/verify, &rows.index);
    // The rows are checked (and the spares counted) before room is made for the spares: with
    // the host tier, making room spills snapshots to the host (a host eviction can drop one
    // for good), which a begin refused for its rows used to do all the same (an outside
    // review).
    if (st.ok() && spares) {
      // Snapshots being copied to the host are busy, not gone: making room waits for them
      // and evicts them without loss (counted out here, a begin beside a spill was refused).
      st = SparesRefusalLocked(rows.index, static_cast<size_t>(spills_in_flight_));
      if (!st.ok()) ReleaseRowsLocked(rows.index);
    }
    if (!st.ok()) return st;
    // A verify's rows keep their waiting drafts until its first layer runs (RunLayer).
  }
  if (spares) {
    size_t n = 0;
    for (int32_t i : rows.index) n += i >= 0 ? 1 : 0;
    MakeRoom(n);
    absl::MutexLock lock(&mu_);
    if (absl::Status st = TakeSparesLocked(rows.index, &rows.spare); !st.ok()) {
      ReleaseRowsLocked(rows.index);
      return st;
    }
  }
  // From here on the forward owns the rows: destroying it on an error abandons it.
  auto f = std::make_unique<ForwardImpl>(this, std::move(rows), *std::move(lane), layer_waits);
  absl::Status st = f->Start();
  if (!st.ok()) return st;
  return std::unique_ptr<Forward>(std::move(f));
}

absl::Status StateCacheImpl::CheckBatch(size_t rows, const char* field) const {
  if (rows < 1 || static_cast<int64_t>(rows) > options_.max_batch) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected 1 to ", options_.max_batch, " rows, got ", rows));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::BeginForward(
    absl::Span<const DecodeRow> rows) {
  absl::Status st = CheckBatch(rows.size(), "rows");
  if (!st.ok()) return st;
  ForwardRows f{ForwardKind::kDecode};
  std::vector<SlotId> ids;
  for (const DecodeRow& row : rows) {
    f.cu.push_back(static_cast<int32_t>(f.tokens.size()));
    f.tokens.push_back(row.token_id);
    ids.push_back(row.slot);
  }
  f.cu.push_back(static_cast<int32_t>(f.tokens.size()));
  return Open(std::move(f), ids, RowSlotField, /*spares=*/false, /*layer_waits=*/true);
}

bool StateCacheImpl::CanContinueForward(Forward& previous, absl::Span<const DecodeRow> rows) {
  auto* prev = dynamic_cast<ForwardImpl*>(&previous);
  if (prev == nullptr || prev->cache_ != this || !prev->Continuable() ||
      rows.size() != prev->rows_.index.size()) {
    return false;
  }
  // A chain holds one forward behind the open one: previous's own predecessor must be done
  // (with a one-forward lead it is: previous's first layer waited for the engine's doorbell,
  // rung after that forward's last output), else previous is committed the usual way. Done
  // by the event recorded when previous took it over, not by its last done word: that word is
  // in the engine's memory, and an engine that wrote it itself would have the predecessor's
  // regions let go (the caller's leases) under its work still queued.
  // Only checked here: a check that fails later must leave previous as it was (its
  // ReleaseWaits counts the predecessor's waits first, and the caller reads the index that
  // way), so the predecessor is let go by ContinueForward, once every check passed.
  if (prev->predecessor_ != nullptr &&
      (prev->predecessor_incomplete_ || !prev->predecessor_->doorbells_.WorkDone() ||
       prev->predecessor_->doorbells_.FirstUnrung() >= 0)) {
    return false;
  }
  // The new forward's uploads (its rows' slots and cursors, and a fold's) must not wait for
  // the pinned buffer: that wait would be for previous's work, so for the engine's doorbells,
  // on the thread that hands the forward over (a chain never synchronizes its lane, so the
  // buffer fills after some thousands of forwards; then previous is committed the usual way).
  if (!prev->lane_->FitsWithoutWait(4, rows.size() * sizeof(int32_t))) return false;
  absl::MutexLock lock(&mu_);
  for (size_t r = 0; r < rows.size(); ++r) {
    const int32_t held = prev->rows_.index[r];
    if (rows[r].slot == kPaddingSlot || held < 0) {
      if (rows[r].slot != kPaddingSlot || held >= 0) return false;
      continue;
    }
    absl::StatusOr<int32_t> i = LookupLocked(rows[r].slot, RowSlotField(r));
    if (!i.ok() || *i != held) return false;
    if (options_.track_interval > 0 && (slots_[held].seq_len + 1) % options_.track_interval == 0) {
      return false;  // AfterAdvance must snapshot it: that needs the state
    }
  }
  return true;
}

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::ContinueForward(
    std::unique_ptr<Forward>& previous, absl::Span<const DecodeRow> rows) {
  if (previous == nullptr || !CanContinueForward(*previous, rows)) return nullptr;
  auto* prev = static_cast<ForwardImpl*>(previous.get());
  prev->predecessor_.reset();  // confirmed done above (already committed: no effect)
  // The end of previous's work on the lane, for the forward after the new one to confirm.
  if (!prev->doorbells_.MarkEnd(prev->lane_->Launch()).ok()) return nullptr;
  // Committed from here on, as by its Commit but for the wait and the release of the rows.
  prev->finished_ = true;
  EndForward(prev->rows_, /*commit=*/true, /*broken=*/false);
  ForwardRows f{ForwardKind::kDecode};
  f.index = prev->rows_.index;
  for (const DecodeRow& row : rows) {
    f.cu.push_back(static_cast<int32_t>(f.tokens.size()));
    f.tokens.push_back(row.token_id);
  }
  f.cu.push_back(static_cast<int32_t>(f.tokens.size()));
  std::vector<int32_t> folds = std::move(prev->unconfirmed_folds_);
  auto next = std::make_unique<ForwardImpl>(this, std::move(f), std::move(prev->lane_),
                                            /*layer_waits=*/true);
  next->predecessor_.reset(prev);
  previous.release();
  absl::Status st = next->Start();  // queued behind the predecessor on the same stream
  next->unconfirmed_folds_.insert(next->unconfirmed_folds_.end(), folds.begin(), folds.end());
  if (!st.ok()) return st;  // destroying `next` abandons it (and judges the predecessor)
  return std::unique_ptr<Forward>(std::move(next));
}

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::BeginPrefill(
    absl::Span<const PrefillRow> rows) {
  absl::Status st = CheckBatch(rows.size(), "rows");
  if (!st.ok()) return st;
  ForwardRows f{ForwardKind::kPrefill};
  std::vector<SlotId> ids;
  int64_t total = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t n = static_cast<int64_t>(rows[r].tokens.size());
    total += n;
    if (n < 1 || total > options_.max_prefill_tokens) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rows[", r, "].tokens: expected 1 or more tokens, at most ", options_.max_prefill_tokens,
          " in all rows, got ", n, " (", total, " so far)"));
    }
    f.cu.push_back(static_cast<int32_t>(f.tokens.size()));
    f.tokens.insert(f.tokens.end(), rows[r].tokens.begin(), rows[r].tokens.end());
    ids.push_back(rows[r].slot);
  }
  f.cu.push_back(static_cast<int32_t>(f.tokens.size()));
  return Open(std::move(f), ids, RowSlotField, /*spares=*/true, /*layer_waits=*/true);
}

absl::Status StateCacheImpl::CheckVerify(size_t rows, int32_t num_draft,
                                         size_t draft_tokens) const {
  const int32_t L = model_.shape.ring_len;
  if (num_draft < 1 || num_draft > L) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_draft: expected 1 to ", L, " (the ring length), got ", num_draft));
  }
  absl::Status st = CheckBatch(rows, "slots");
  if (!st.ok()) return st;
  const int64_t B = static_cast<int64_t>(rows);
  if (static_cast<int64_t>(draft_tokens) != B * num_draft) {
    return absl::InvalidArgumentError(absl::StrCat("draft_tokens: expected ", B * num_draft,
                                                   " (rows x num_draft), got ", draft_tokens));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::OpenVerify(
    absl::Span<const SlotId> ids, int32_t num_draft, absl::Span<const int32_t> draft_tokens,
    bool layer_waits) {
  absl::Status st = CheckVerify(ids.size(), num_draft, draft_tokens.size());
  if (!st.ok()) return st;
  ForwardRows f{ForwardKind::kVerify};
  for (size_t r = 0; r <= ids.size(); ++r) f.cu.push_back(static_cast<int32_t>(r) * num_draft);
  f.tokens.assign(draft_tokens.begin(), draft_tokens.end());
  f.num_draft = num_draft;
  return Open(
      std::move(f), ids, [](size_t r) { return absl::StrCat("slots[", r, "]"); },
      /*spares=*/false, layer_waits);
}

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::BeginVerify(
    absl::Span<const SlotId> ids, int32_t num_draft, absl::Span<const int32_t> draft_tokens) {
  return OpenVerify(ids, num_draft, draft_tokens, /*layer_waits=*/true);
}

absl::Status StateCacheImpl::Verify(absl::Span<const SlotId> ids, int32_t num_draft,
                                    absl::Span<const int32_t> draft_tokens,
                                    absl::Span<const LayerIo> layers) {
  absl::Status st = CheckVerify(ids.size(), num_draft, draft_tokens.size());
  if (st.ok()) st = CheckIo(model_, layers, true);
  if (!st.ok()) return st;
  absl::StatusOr<std::unique_ptr<Forward>> f =
      OpenVerify(ids, num_draft, draft_tokens, /*layer_waits=*/false);
  if (!f.ok()) return f.status();
  return (*f)->RunEveryLayer(layers);
}

void StateCacheImpl::EndForward(const ForwardRows& rows, bool commit, bool broken) {
  absl::MutexLock lock(&mu_);
  for (int32_t r = 0; r < rows.batch(); ++r) {
    if (rows.index[r] < 0) continue;
    Slot& s = slots_[rows.index[r]];
    const auto begin = rows.tokens.begin() + rows.cu[r], end = rows.tokens.begin() + rows.cu[r + 1];
    if (!commit) {
      s.busy = false;
      s.broken = s.broken || broken;
      continue;
    }
    switch (rows.kind) {
      case ForwardKind::kDecode:  // released by AfterAdvance
        s.write_pos += 1;
        break;
      case ForwardKind::kPrefill:  // the checkpoints hold the whole state now
        s.write_pos = 0;
        break;
      case ForwardKind::kVerify:  // nothing advances until Accept
        s.pending = rows.num_draft;
        s.drafts.assign(begin, end);
        s.busy = false;
        continue;
    }
    s.seq_len += end - begin;
    s.tokens.insert(s.tokens.end(), begin, end);
  }
  for (int32_t spare : rows.spare) {
    if (spare >= 0) ReleaseLocked(spare);
  }
  if (rows.kind != ForwardKind::kDecode) return;  // the counters are decode steps'
  if (commit) {
    ++stats_.forwards_committed;
  } else {
    ++stats_.forwards_abandoned;
  }
}

absl::Status StateCacheImpl::AfterAdvance(const std::vector<int32_t>& index, Lane& lane) {
  std::vector<int32_t> boundary, folded;
  if (options_.track_interval > 0) {
    absl::MutexLock lock(&mu_);
    for (int32_t i : index) {
      if (i >= 0 && slots_[i].seq_len % options_.track_interval == 0) boundary.push_back(i);
    }
  }
  absl::Status st = FoldRows(boundary, 0, &CacheStats::folds_track, lane, &folded);
  const absl::Status done = lane.Synchronize();
  if (st.ok() && !done.ok()) {
    MarkBroken(folded);
    st = done;
  }
  // A snapshot is an optimization, and the forward has moved its rows' cursors already: one
  // that fails (its scan, its copy) is dropped and the commit stands. Reported as the
  // commit's failure, it released the request id and a retry applied the step twice (an
  // outside review). A device that failed is the device check's to report.
  for (int32_t i : boundary) {
    if (!st.ok()) break;
    TakeSnapshot(i, lane).IgnoreError();
  }
  absl::MutexLock lock(&mu_);
  for (int32_t i : index) {
    if (i >= 0) slots_[i].busy = false;
  }
  return st;
}

ForwardImpl::ForwardImpl(StateCacheImpl* cache, ForwardRows rows, LanePool::Lease lane,
                         bool layer_waits)
    : cache_(cache),
      rows_(std::move(rows)),
      lane_(std::move(lane)),
      layer_waits_(layer_waits),
      done_(cache->model().num_layers, false),
      longest_(rows_.longest()),
      touched_(cache->model().num_layers, false) {
  doorbells_.Bind(lane_->release_word(), lane_->NextTicket(), lane_->outcomes(),
                  lane_->max_waits());
}

ForwardImpl::~ForwardImpl() {
  if (finished_) return;
  // Abandoned: release the doorbell waits nobody will ring any more (or the stream would
  // never drain), put back what a prefill overwrote, then wait for everything queued (ring appends
  // past the cursors, the copies, and the scratch the lane is about to lend out again) before
  // the rows are released.
  ReleaseWaits();
  const bool restored = Restore();
  const bool done = Synchronize().ok();
  ReleaseWaits();  // again, now that every wait has run: whether the predecessor's all rang
  lane_.reset();
  // A committed predecessor that did not complete left records past its rows' cursors that
  // are not what they say.
  const bool lost = predecessor_ && (!done || predecessor_incomplete_);
  predecessor_.reset();
  cache_->EndForward(
      rows_, false,
      /*broken=*/!restored || lost || (!done && rows_.kind == ForwardKind::kPrefill));
}

absl::Status ForwardImpl::Start() {
  const ModelSpec& m = cache_->model();
  Lane& lane = *lane_;
  const int64_t B = batch();
  Scratch& s = lane.scratch;
  // Activations of up to max_batch tokens (every decode) are reserved now; more, on the first
  // host-memory layer that needs them (ReserveTokens).
  const int64_t staged = tokens() <= cache_->options().max_batch ? tokens() : 0;
  absl::Status st = s.Reserve(cache_->options().backend, m, staged, B);
  if (!st.ok()) return st;
  // A ring that cannot take this forward's records is folded now (committed; see the top).
  // Prefill reads the ring wherever its cursor is and appends nothing: it never folds here.
  const int32_t L = m.shape.ring_len;
  const int32_t max_pos = rows_.kind == ForwardKind::kDecode   ? L - 2
                          : rows_.kind == ForwardKind::kVerify ? L - rows_.num_draft
                                                               : L;
  st = cache_->FoldRows(rows_.index, max_pos, &CacheStats::folds_ring_full, lane,
                        &unconfirmed_folds_);
  if (!st.ok()) return st;
  const std::vector<int32_t> write_pos = cache_->Cursors(rows_.index);
  st = lane.Upload(s.slot_idx.data(), rows_.index.data(), B * 4);
  if (st.ok()) st = lane.Upload(s.write_pos.data(), write_pos.data(), B * 4);
  if (st.ok() && rows_.kind == ForwardKind::kPrefill) {
    const std::vector<uint8_t> initial(B, 1);  // every row continues from its slot's state
    st = lane.Upload(s.cu.data(), rows_.cu.data(), (B + 1) * 4);
    if (st.ok()) st = lane.Upload(s.flags.data(), initial.data(), B);
  }
  return st;
}

absl::Status ForwardImpl::Synchronize() {
  if (!sync_error_.ok()) return sync_error_;
  if (!lane_) return absl::OkStatus();
  absl::Status st = lane_->Synchronize();
  if (!st.ok()) {
    cache_->MarkBroken(unconfirmed_folds_);
    sync_error_ = st;
  }
  unconfirmed_folds_.clear();
  return st;
}

absl::Status ForwardImpl::ReserveTokens() {
  const ModelSpec& m = cache_->model();
  if (ScratchHolds(lane_->scratch, m, tokens())) return absl::OkStatus();
  absl::Status st = Synchronize();
  if (st.ok()) st = lane_->scratch.Reserve(cache_->options().backend, m, tokens(), batch());
  return st;
}

absl::Status ForwardImpl::ReserveConv() {
  const ModelSpec& m = cache_->model();
  const size_t need = static_cast<size_t>(tokens() * m.QkvWidth()) * rssm_dtype_size(m.shape.act_dtype);
  if (m.conv_width == 0 || lane_->scratch.conv.size() >= need) return absl::OkStatus();
  absl::Status st = Synchronize();  // queued layers may still read the old buffer
  if (st.ok()) st = lane_->scratch.ReserveConv(cache_->options().backend, m, tokens());
  return st;
}

absl::Status ForwardImpl::CopySpares(int32_t layer, bool restore) {
  SlotPool& pool = cache_->pool();
  const size_t bytes = pool.CheckpointBytes();
  char* base = static_cast<char*>(pool.LayerPool(layer).checkpoint);
  for (int32_t r = 0; r < batch(); ++r) {
    if (rows_.spare[r] < 0) continue;
    char* row = base + static_cast<size_t>(rows_.index[r]) * bytes;
    char* spare = base + static_cast<size_t>(rows_.spare[r]) * bytes;
    const rssm_launch l = lane_->Launch();
    absl::Status st = KernelStatus(rssm_memcpy(&l, restore ? row : spare, restore ? spare : row,
                                               bytes, RSSM_COPY_DEVICE_TO_DEVICE),
                                   restore ? "restore checkpoint" : "save checkpoint");
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

bool ForwardImpl::Restore() {
  if (rows_.kind != ForwardKind::kPrefill) return true;  // only ring appends past the cursors
  const bool spares =
      std::any_of(rows_.spare.begin(), rows_.spare.end(), [](int32_t s) { return s >= 0; });
  for (size_t l = 0; l < touched_.size(); ++l) {
    if (!touched_[l]) continue;
    if (!spares || !CopySpares(static_cast<int32_t>(l), /*restore=*/true).ok()) return false;
  }
  return true;
}

absl::Status ForwardImpl::Convolve(int32_t layer, rssm_token_inputs& in) {
  const ModelSpec& m = cache_->model();
  SlotPool& pool = cache_->pool();
  const Scratch& s = lane_->scratch;
  rssm_conv_args a{};
  a.launch = lane_->Launch();
  a.shape = m.ConvShape();
  a.weight = pool.ConvWeight(layer);
  a.bias = pool.ConvBias(layer);
  a.state = pool.LayerConv(layer);
  a.batch = batch();
  a.slot_idx = s.slot_idx.as<const int32_t>();
  a.write_pos = s.write_pos.as<const int32_t>();
  if (rows_.kind == ForwardKind::kPrefill) {
    // From each slot's history (initial 1, as the recurrence); the window moves to the end.
    a.mode = RSSM_CONV_PREFILL;
    a.cu_seqlens = s.cu.as<const int32_t>();
    a.initial = s.flags.as<const uint8_t>();
    a.num_tokens = longest_;
  } else {
    // Verify (decode joins its convolution to its step, Launch): the drafts' inputs are ring
    // records past the cursor, like theirs.
    a.mode = RSSM_CONV_APPEND;
    a.num_tokens = rows_.num_draft;
  }
  a.x = in.mixed_qkv;
  a.x_token_stride = in.qkv_token_stride;
  a.y = s.conv.data();
  a.y_token_stride = 0;
  absl::Status st = KernelStatus(rssm_short_conv(&a), "short convolution");
  if (!st.ok()) return st;
  in.mixed_qkv = s.conv.data();
  in.qkv_token_stride = 0;
  return absl::OkStatus();
}

absl::Status ForwardImpl::Launch(int32_t layer, rssm_token_inputs in,
                                 const rssm_token_outputs& out) {
  const ModelSpec& m = cache_->model();
  SlotPool& pool = cache_->pool();
  const Scratch& s = lane_->scratch;
  if (rows_.kind == ForwardKind::kPrefill) {
    // Before the convolution too: it rewrites the window kept after the checkpoint.
    absl::Status st = CopySpares(layer, /*restore=*/false);
    if (!st.ok()) return st;
  }
  // Decode joins its convolution to the step (rssm_decode_args.conv: the step overlaps it);
  // verify and prefill convolve first.
  if (pool.has_conv() && rows_.kind != ForwardKind::kDecode) {
    absl::Status st = Convolve(layer, in);
    if (!st.ok()) return st;
  }
  switch (rows_.kind) {
    case ForwardKind::kDecode: {
      rssm_decode_args a{lane_->Launch(), m.shape, pool.LayerParams(layer), pool.LayerPool(layer)};
      a.batch = batch();
      a.slot_idx = s.slot_idx.as<const int32_t>();
      a.write_pos = s.write_pos.as<const int32_t>();
      a.force_fold = nullptr;  // never folds: every row has room (Start)
      a.in = in;
      a.out = out;
      rssm_decode_conv conv{};
      if (pool.has_conv()) {
        conv = {m.conv_width, pool.ConvWeight(layer), pool.ConvBias(layer), pool.LayerConv(layer),
                s.conv.data()};
        a.conv = &conv;
      }
      return KernelStatus(rssm_replay_decode(&a), "decode");
    }
    case ForwardKind::kVerify: {
      rssm_verify_args a{lane_->Launch(), m.shape, pool.LayerParams(layer), pool.LayerPool(layer)};
      a.batch = batch();
      a.num_draft = rows_.num_draft;
      a.slot_idx = s.slot_idx.as<const int32_t>();
      a.write_pos = s.write_pos.as<const int32_t>();
      a.in = in;
      a.out = out;
      return KernelStatus(rssm_verify(&a), "verify");
    }
    case ForwardKind::kPrefill: {
      rssm_prefill_args a{lane_->Launch(), m.shape, pool.LayerParams(layer), pool.LayerPool(layer)};
      a.batch = batch();
      a.slot_idx = s.slot_idx.as<const int32_t>();
      a.cu_seqlens = s.cu.as<const int32_t>();
      a.initial = s.flags.as<const uint8_t>();
      a.write_pos = s.write_pos.as<const int32_t>();
      a.max_seqlen = longest_;
      a.in = in;
      a.out = out;
      return KernelStatus(rssm_prefill(&a), "prefill");
    }
  }
  return absl::InternalError("forward: unknown kind");
}

absl::Status ForwardImpl::RunLayer(int32_t layer, const LayerIo& io) {
  const ModelSpec& m = cache_->model();
  if (finished_) return absl::FailedPreconditionError("forward: already committed");
  if (!failed_.ok()) return failed_;
  if (layer < 0 || layer >= m.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: expected 0 to ", m.num_layers - 1, ", got ", layer));
  }
  if (done_[layer]) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer: layer ", layer, " already ran in this forward"));
  }
  absl::Status st = CheckLayerIo(io, "io", /*need_out=*/rows_.kind != ForwardKind::kPrefill);
  if (!st.ok()) return st;
  const bool host = io.memory == IoMemory::kHost;
  if (host) st = ReserveTokens();
  if (!host && rows_.kind != ForwardKind::kDecode) st = ReserveConv();
  if (!st.ok()) return st;
  absl::StatusOr<rssm_token_inputs> in = StageInputs(*lane_, m, io, tokens());
  if (!in.ok()) return in.status();
  if (rows_.kind == ForwardKind::kVerify && !drafts_discarded_) {
    cache_->DiscardDrafts(rows_.index);  // this layer's records overwrite theirs
    drafts_discarded_ = true;
  }
  touched_[layer] = true;
  st = Launch(layer, *in, OutputTarget(*lane_, io));
  if (st.ok()) st = StageOutputs(*lane_, m, io, tokens());
  if (st.ok() && host && layer_waits_) st = Synchronize();  // the caller reads io.out on return
  if (!st.ok()) {
    failed_ = absl::FailedPreconditionError(
        absl::StrCat("forward: layer ", layer, " failed (", st.message(), "); abandon it"));
    return st;
  }
  done_[layer] = true;
  return st;
}

absl::Status ForwardImpl::RunLayers(absl::Span<const LayerIo> layers,
                                    absl::Span<const LayerDoorbells> bells, uint32_t value) {
  const ModelSpec& m = cache_->model();
  if (finished_) return absl::FailedPreconditionError("forward: already committed");
  if (!failed_.ok()) return failed_;
  absl::Status st = CheckIo(m, layers, /*need_out=*/rows_.kind != ForwardKind::kPrefill);
  if (!st.ok()) return st;
  if (!bells.empty() && bells.size() != layers.size()) {
    return absl::InvalidArgumentError(absl::StrCat("bells: expected none or ", m.num_layers,
                                                   " layers' doorbells, got ", bells.size()));
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    if (done_[l]) {
      return absl::FailedPreconditionError(
          absl::StrCat("layer: layer ", l, " already ran in this forward"));
    }
    if (bells.empty()) continue;
    st = CheckBell(bells[l].ready, absl::StrCat("bells[", l, "].ready"));
    if (st.ok()) st = CheckBell(bells[l].done, absl::StrCat("bells[", l, "].done"));
    if (!st.ok()) return st;
  }
  bool ran = false;
  st = RunGraphed(layers, bells, value, &ran);
  if (!st.ok() || ran) return st;
  for (size_t l = 0; l < layers.size() && st.ok(); ++l) {
    if (!bells.empty()) st = QueueWait(bells[l].ready, value);  // CPU: blocks until rung
    if (st.ok()) st = RunLayer(static_cast<int32_t>(l), layers[l]);
    if (st.ok() && !bells.empty()) st = QueueSignal(bells[l].done, value);
  }
  return st;
}

absl::Status ForwardImpl::RunGraphed(absl::Span<const LayerIo> layers,
                                     absl::Span<const LayerDoorbells> bells, uint32_t value,
                                     bool* ran) {
  *ran = false;
  ForwardGraphs& graphs = lane_->graphs;
  if (rows_.kind != ForwardKind::kDecode || !cache_->options().forward_graphs ||
      graphs.disabled()) {
    return absl::OkStatus();
  }
  for (const LayerIo& io : layers) {
    if (io.memory != IoMemory::kBackend) return absl::OkStatus();
  }
  // What the calls take that can change between forwards (ForwardGraphs, at the top).
  const Scratch& s = lane_->scratch;
  std::string key;
  auto put = [&key](auto v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put(batch());
  put(lane_->stream());
  put(s.slot_idx.data());
  put(s.write_pos.data());
  put(s.conv.data());
  put(bells.empty());
  for (size_t l = 0; l < layers.size(); ++l) {
    put(layers[l].mixed_qkv);
    put(layers[l].a);
    put(layers[l].b);
    put(layers[l].out);
    if (!bells.empty()) {
      put(bells[l].ready);
      put(bells[l].done);
    }
  }
  rssm_graph* graph = graphs.Find(key);
  if (graph == nullptr) {
    if (!graphs.Repeats(key)) return absl::OkStatus();  // its first forward runs call by call
    graph = Record(layers, bells, value);
    if (graph == nullptr) return absl::OkStatus();
    graphs.Add(std::move(key), graph);
    cache_->Count(&CacheStats::forward_recordings);
  }
  // Its waits are the forward's first (else call by call).
  if (!bells.empty() && !doorbells_.Expect(static_cast<int32_t>(bells.size()))) {
    return absl::OkStatus();
  }
  std::fill(touched_.begin(), touched_.end(), true);
  const rssm_launch launch = lane_->Launch();
  absl::Status st = KernelStatus(rssm_graph_launch(&launch, graph, value, doorbells_.ticket()),
                                 "recorded forward");
  if (!st.ok()) {
    failed_ = absl::FailedPreconditionError(
        absl::StrCat("forward: its recorded layers failed (", st.message(), "); abandon it"));
    return st;
  }
  std::fill(done_.begin(), done_.end(), true);
  cache_->Count(&CacheStats::forwards_graphed);
  *ran = true;
  return absl::OkStatus();
}

rssm_graph* ForwardImpl::Record(absl::Span<const LayerIo> layers,
                                absl::Span<const LayerDoorbells> bells, uint32_t value) {
  const rssm_launch launch = lane_->Launch();
  if (rssm_capture_begin(&launch) != RSSM_OK) {
    lane_->graphs.Disable();  // CPU, or a device that cannot record
    return nullptr;
  }
  absl::Status st;
  for (size_t l = 0; l < layers.size() && st.ok(); ++l) {
    const LayerIo& io = layers[l];
    if (!bells.empty()) {  // recorded with this forward's release; launched with each one's
      const rssm_release release = doorbells_.ReleaseOf(static_cast<int32_t>(l));
      st = KernelStatus(rssm_stream_wait_value32_or(&launch, bells[l].ready, value, &release),
                        "doorbell wait");
    }
    if (st.ok()) {
      st = Launch(static_cast<int32_t>(l), rssm_token_inputs{io.mixed_qkv, io.a, io.b, 0, 0, 0},
                  rssm_token_outputs{io.out, 0});
    }
    if (st.ok() && !bells.empty()) {
      st =
          KernelStatus(rssm_stream_write_value32(&launch, bells[l].done, value), "doorbell signal");
    }
  }
  rssm_graph* graph = nullptr;
  const rssm_status ended = rssm_capture_end(&launch, st.ok() ? 1 : 0, &graph);
  // Every doorbell operation must be one the launch can set (else a later forward's value
  // would not reach it).
  const int64_t doorbells = bells.empty() ? 0 : 2 * static_cast<int64_t>(bells.size());
  if (!st.ok() || ended != RSSM_OK || graph == nullptr ||
      rssm_graph_doorbells(graph) != doorbells) {
    rssm_graph_destroy(graph);
    lane_->graphs.Disable();
    cache_->Count(&CacheStats::forward_recording_failures);
    return nullptr;
  }
  return graph;
}

int32_t ForwardImpl::ReleaseWaits() {
  int32_t first = -1;
  int32_t before = 0;  // the predecessor's waits come first in queue order
  if (predecessor_) {
    first = predecessor_->doorbells_.Release();
    if (first >= 0) predecessor_incomplete_ = true;
    before = cache_->model().num_layers;
  }
  const int32_t own = doorbells_.Release();
  if (first < 0 && own >= 0) first = before + own;
  return first;
}

absl::Status ForwardImpl::Commit() {
  if (absl::Status st = CheckCommit(); !st.ok()) return st;
  return ApplyCommit();
}

absl::Status ForwardImpl::CheckCommit() {
  if (finished_) return absl::FailedPreconditionError("forward: already committed");
  if (!failed_.ok()) return failed_;
  for (size_t l = 0; l < done_.size(); ++l) {
    if (!done_[l]) {
      return absl::FailedPreconditionError(absl::StrCat("commit: layer ", l, " has not run"));
    }
  }
  absl::Status st = Synchronize();  // the layers' device work is done before cursors move
  if (!st.ok()) {
    failed_ = st;  // it can only be abandoned now
    return st;
  }
  // The predecessor's waits have all run now: one that ended on a release never got its input.
  if (predecessor_ && predecessor_->doorbells_.FirstUnrung() >= 0) predecessor_incomplete_ = true;
  if (predecessor_incomplete_) {
    failed_ = absl::DataLossError(
        "forward: the forward before this one (committed when this one began) never got all "
        "its inputs: its rows are broken");
    return failed_;  // destroying it abandons it and marks the rows broken
  }
  return absl::OkStatus();
}

absl::Status ForwardImpl::ApplyCommit() {
  predecessor_.reset();  // its work is confirmed
  finished_ = true;
  cache_->EndForward(rows_, true, false);
  absl::Status st = absl::OkStatus();
  if (rows_.kind != ForwardKind::kVerify) st = cache_->AfterAdvance(rows_.index, *lane_);
  lane_.reset();
  return st;
}

}  // namespace replayssm::cache::internal

namespace replayssm::cache {

absl::Status Forward::RunEveryLayer(absl::Span<const LayerIo> layers) {
  for (size_t l = 0; l < layers.size(); ++l) {
    if (absl::Status st = RunLayer(static_cast<int32_t>(l), layers[l]); !st.ok()) return st;
  }
  return Commit();
}

}  // namespace replayssm::cache
