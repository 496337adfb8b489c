// StateCache implementation. Design notes: docs/cache.md.
//
// Fold policy (DESIGN §2, design (b)): decode and verify kernels never fold. A row whose ring
// cannot take the step's record is folded for all layers by rssm_fold BEFORE the forward's
// first layer runs; a fold does not change the logical state, so it is committed at once and
// an abandoned forward leaves nothing half-done (its ring appends sit past the cursor,
// invisible). Rows that reach a track boundary are folded after Commit advanced the cursors,
// then snapshotted. The price: a folding row's checkpoint is read once more than with a fold
// fused into the decode kernel (about 1/(L-1) more checkpoint reads); that buys abandonment
// safety without a spare-buffer table.
//
// Prefill writes each layer's final state into its checkpoint, so a layer-by-layer prefill
// first copies the checkpoint it overwrites into a spare slot of the row's (taken from the
// pool at begin); an abandoned prefill copies back every layer it touched. All three kinds
// of forward (decode, prefill, verify) are one ForwardImpl: they differ in the kernel a layer
// runs and in what Commit books.
//
// Streams (lane.h): every operation runs on a lane of its own (stream + pinned staging +
// scratch) and waits for it only where results must be seen: a host-memory decode layer's
// outputs, the end of every operation but a forward's layers, and before any slot is
// released. A fold queued ahead of a forward's layers is booked at once (cursor 0) and
// confirmed by the next wait; a device error there marks its rows broken.
#include <algorithm>
#include <atomic>
#include <list>
#include <string>
#include <unordered_set>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "doorbells.h"
#include "host_tier.h"
#include "radix_tree.h"
#include "replayssm/cache/state_cache.h"
#include "slot_io_internal.h"
#include "slot_pool.h"
#include "tp_group.h"

namespace replayssm::cache {
namespace {

// kSpare: a prefill forward's copy of a row's checkpoints; kImporting: taken by an import
// (SlotWriter) that has not committed. Neither is reachable by an id.
enum class Kind { kFree, kLive, kSnapshot, kSpare, kImporting };

struct Slot {
  Kind kind = Kind::kFree;
  uint32_t generation = 1;
  int32_t write_pos = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> tokens;  // live: the history; snapshot: its key. size() == seq_len
  PrefixNamespace ns = kDefaultNamespace;  // whose prefix cache its snapshots join
  bool busy = false;            // in a forward, verify, prefill, copy or export
  bool broken = false;          // a device error left its state unknown
  std::string moving;           // being moved out (a SlotReader): the move's id; else empty
  int32_t pending = 0;          // drafts verified, awaiting Accept
  std::vector<int32_t> drafts;
  int32_t refs = 0;  // snapshots: copies in progress
  std::list<int32_t>::iterator lru;
  int32_t host = -1;  // snapshots: the host tier's entry holding the same state, or -1
};

SlotId MakeId(int32_t index, uint32_t generation) {
  return (static_cast<uint64_t>(generation) << 32) | static_cast<uint32_t>(index);
}

class StateCacheImpl;

enum class ForwardKind { kDecode, kPrefill, kVerify };

// What a forward holds of its rows: their slots, their tokens, and a prefill's spare slots.
struct ForwardRows {
  ForwardKind kind = ForwardKind::kDecode;
  std::vector<int32_t> index;   // [B] slot index, -1 = padding
  std::vector<int32_t> cu;      // [B+1] row r's tokens are tokens[cu[r] .. cu[r+1])
  std::vector<int32_t> tokens;  // [N] token ids, packed in row order
  std::vector<int32_t> spare;   // prefill: [B] the slot keeping row r's checkpoints, -1 = none
  int32_t num_draft = 0;        // verify: T

  int32_t batch() const { return static_cast<int32_t>(index.size()); }
  int64_t n() const { return cu.back(); }
  // The most tokens of one row (a prefill's launch hint for its kernels).
  int32_t longest() const {
    int32_t most = 0;
    for (size_t r = 0; r + 1 < cu.size(); ++r) most = std::max(most, cu[r + 1] - cu[r]);
    return most;
  }
};

class ForwardImpl final : public Forward {
 public:
  // Takes over rows the cache marked busy; `Start` must run before anything else.
  // layer_waits: a host-memory RunLayer waits for its outputs (else Commit does: the unary
  // calls, which read no output before the end).
  ForwardImpl(StateCacheImpl* cache, ForwardRows rows, LanePool::Lease lane, bool layer_waits);
  ~ForwardImpl() override;
  // Folds the rows whose ring cannot take this forward's records and uploads the rows' slots,
  // cursors (and a prefill's token offsets): queued only.
  absl::Status Start();
  // ContinueForward's conditions on this side: a decode forward, every layer queued, not
  // committed nor failed.
  bool Continuable() const {
    if (rows_.kind != ForwardKind::kDecode || finished_ || !failed_.ok() || !lane_) return false;
    for (bool d : done_) {
      if (!d) return false;
    }
    return true;
  }
  int32_t batch() const override { return rows_.batch(); }
  int64_t tokens() const override { return rows_.n(); }
  absl::Status RunLayer(int32_t layer, const LayerIo& io) override;
  absl::Status RunLayers(absl::Span<const LayerIo> layers, absl::Span<const LayerDoorbells> bells,
                         uint32_t value) override;
  absl::Status Synchronize() override;
  void* stream() const override { return lane_ ? lane_->stream() : nullptr; }
  absl::Status QueueWait(const uint32_t* addr, uint32_t value) override {
    if (finished_) return absl::FailedPreconditionError("forward: already committed");
    return doorbells_.Wait(lane_->Launch(), addr, value);
  }
  absl::Status QueueSignal(uint32_t* addr, uint32_t value) override {
    if (finished_) return absl::FailedPreconditionError("forward: already committed");
    return doorbells_.Signal(lane_->Launch(), addr, value);
  }
  int32_t ReleaseWaits() override;
  absl::Status Commit() override;

 private:
  // Grows the lane's activation scratch to tokens() for a host-memory layer. Growing replaces
  // buffers that queued layers may still read, so it waits for them first.
  absl::Status ReserveTokens();
  // The same for a prefill's or verify's layer on backend memory: only the convolution's
  // outputs go to the lane's scratch (Start reserved max_batch tokens of them).
  absl::Status ReserveConv();
  // Queues `layer`'s kernels for every row (a prefill first saves the checkpoints it writes):
  // the short convolution (a model with one; decode's is joined to its step), then the
  // recurrence.
  absl::Status Launch(int32_t layer, rssm_token_inputs in, const rssm_token_outputs& out);
  // RunLayers as one recorded sequence of the lane (ForwardGraphs): *ran false when it was not
  // (not a decode on backend memory, the key's first forward, the backend cannot record, the
  // doorbells released): then nothing was queued and the caller queues it call by call.
  absl::Status RunGraphed(absl::Span<const LayerIo> layers, absl::Span<const LayerDoorbells> bells,
                          uint32_t value, bool* ran);
  // Records RunLayers' calls on the lane's stream (nothing runs); null when the backend cannot
  // (the lane's forwards then run call by call from now on).
  rssm_graph* Record(absl::Span<const LayerIo> layers, absl::Span<const LayerDoorbells> bells,
                     uint32_t value);
  // Queues the short convolution of `layer` over in.mixed_qkv into the lane's scratch, and
  // points `in` at its outputs (verify and prefill; decode's is joined to its step).
  absl::Status Convolve(int32_t layer, rssm_token_inputs& in);
  // Queues copies of layer `layer`'s checkpoints between the rows and their spare slots.
  absl::Status CopySpares(int32_t layer, bool restore);
  // Abandoned: puts back every checkpoint a prefill's layers may have written. False when
  // some state could not be put back (the rows are then broken).
  bool Restore();

  StateCacheImpl* cache_;
  ForwardRows rows_;
  LanePool::Lease lane_;
  const bool layer_waits_;
  std::vector<int32_t> unconfirmed_folds_;  // queued by Start, not yet waited for
  std::vector<bool> done_;                  // [layers] ran
  const int32_t longest_;                   // rows_.longest(), once
  std::vector<bool> touched_;  // [layers] a kernel was queued (a prefill's checkpoint written)
  absl::Status failed_;        // a launch failed: the forward can only be abandoned
  bool finished_ = false;
  Doorbells doorbells_;
  // ContinueForward: the forward committed when this one began, its work queued before ours
  // on the same stream; kept until ours ends (its doorbells, and whether they all rang).
  std::unique_ptr<ForwardImpl> predecessor_;
  std::atomic<bool> predecessor_incomplete_{false};  // ReleaseWaits found one of its waits unrung

  friend class StateCacheImpl;
};

class StateCacheImpl final : public StateCache, private SlotIoOwner {
 public:
  StateCacheImpl(ModelSpec model, CacheOptions options, std::unique_ptr<SlotPool> pool)
      : model_(std::move(model)),
        options_(options),
        pool_(std::move(pool)),
        lanes_(options_.backend, LaneHostBytes(model_, options_.max_batch)),
        staging_(options_.backend, kIdleStagingRings) {
    slots_.resize(pool_->num_slots());
    for (int64_t i = pool_->num_slots() - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
    const int64_t host_entries =
        options_.host_snapshot_bytes / static_cast<int64_t>(pool_->StateBytes());
    if (host_entries > 0) {
      host_ = std::make_unique<HostTier>(options_.backend, pool_->StateBytes(), host_entries,
                                         options_.host_policy,
                                         options_.max_snapshots_per_namespace);
    }
  }

  const ModelSpec& model() const override { return model_; }
  const CacheOptions& options() const override { return options_; }
  // How errors name a slot: options_.slot_name, else the id in hex.
  std::string SlotName(SlotId id) const {
    return options_.slot_name ? options_.slot_name(id) : absl::StrCat("0x", absl::Hex(id));
  }
  int64_t capacity() const override { return pool_->num_slots(); }

  CacheStats stats() const override {
    absl::MutexLock lock(&mu_);
    CacheStats s = stats_;
    s.slots_total = capacity();
    s.slots_free = static_cast<int64_t>(free_.size());
    s.slots_snapshot = radix_.size();
    s.slots_live = s.slots_total - s.slots_free - s.slots_snapshot;
    s.lanes = lanes_.size();
    s.backend_snapshot_bytes = s.slots_snapshot * model_.SlotBytes();
    if (host_ != nullptr) {
      const int64_t entry = static_cast<int64_t>(host_->entry_bytes());
      s.host_snapshots = host_->stored();
      s.host_bytes = s.host_snapshots * entry;
      s.host_capacity_bytes = host_->capacity() * entry;
    }
    return s;
  }

  absl::StatusOr<SlotId> Allocate() override {
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

  absl::StatusOr<PrefixAllocation> AllocateFromPrefix(absl::Span<const int32_t> tokens) override {
    return AllocateFromPrefixIn(kDefaultNamespace, tokens);
  }

  absl::StatusOr<PrefixAllocation> AllocateFromPrefixIn(PrefixNamespace ns,
                                                        absl::Span<const int32_t> tokens) override {
    int32_t src = -1, index = -1, entry = -1;
    RadixTree::Match m;
    {
      absl::MutexLock lock(&mu_);
      m = radix_.LongestPrefix(ns, tokens);
      const RadixTree::Match h =
          host_ != nullptr ? host_->LongestPrefix(ns, tokens) : RadixTree::Match{};
      if (h.length > m.length) {
        m = h;
        entry = h.value;
        ++host_->entry(entry).refs;  // pins it: no host eviction takes it
      } else if (m.length == 0) {
        ++stats_.snapshot_misses;
        if (host_ != nullptr) ++stats_.host_misses;
      } else {
        src = m.value;
        ++slots_[src].refs;  // pins the snapshot while it is copied
        TouchLocked(src);
      }
    }
    if (entry >= 0) return PromoteFromHost(ns, tokens.subspan(0, m.length), entry);
    if (m.length == 0) {
      absl::StatusOr<SlotId> id = Allocate();
      if (!id.ok()) return id.status();
      if (absl::Status s = SetPrefixNamespace(*id, ns); !s.ok()) return s;
      return PrefixAllocation{*id, 0};
    }
    MakeRoom(1);  // the pinned snapshot is no victim
    {
      absl::MutexLock lock(&mu_);
      absl::StatusOr<int32_t> i = TakeFreeLocked();
      if (!i.ok()) {
        --slots_[src].refs;
        return i.status();
      }
      index = *i;
      StartLiveLocked(index, std::vector<int32_t>(tokens.begin(), tokens.begin() + m.length));
      slots_[index].ns = ns;
    }
    absl::Status s = OnLane([&](Lane& lane) {
      absl::Status st = Materialize(src, "copy-on-write from a snapshot", lane);
      return st.ok() ? pool_->CopyCheckpoints(index, src, lane) : st;
    });
    absl::MutexLock lock(&mu_);
    --slots_[src].refs;
    if (!s.ok()) {
      ReleaseLocked(index);
      return s;
    }
    ++stats_.snapshot_hits;
    slots_[index].busy = false;
    return PrefixAllocation{MakeId(index, slots_[index].generation), m.length};
  }

  absl::Status Free(SlotId id) override {
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

  absl::StatusOr<SlotInfo> Info(SlotId id) const override {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = LookupLocked(id, "slot", /*allow_broken=*/true);
    if (!i.ok()) return i.status();
    const Slot& s = slots_[*i];
    return SlotInfo{s.seq_len, s.write_pos, s.pending};
  }

  absl::Status Prefill(SlotId id, absl::Span<const int32_t> tokens,
                       absl::Span<const LayerIo> layers) override;
  absl::Status ImportFrom(SlotId id, absl::Span<const int32_t> tokens,
                          absl::Span<const void* const> checkpoints, IoMemory memory) override;
  absl::StatusOr<ExportedState> ExportInto(SlotId id, absl::Span<void* const> checkpoints,
                                           IoMemory memory) override;
  absl::StatusOr<std::unique_ptr<SlotReader>> OpenExport(SlotId id, absl::string_view move_id,
                                                         const SlotIoOptions& options) override;
  absl::StatusOr<std::unique_ptr<SlotWriter>> OpenImport(int64_t seq_len,
                                                         const SlotIoOptions& options) override;
  absl::StatusOr<std::unique_ptr<BackendBuffer>> AllocateBackendBuffer(size_t bytes) override {
    return NewBackendBuffer(options_.backend, bytes);
  }
  absl::StatusOr<std::unique_ptr<Forward>> BeginForward(absl::Span<const DecodeRow> rows) override;
  absl::StatusOr<std::unique_ptr<Forward>> ContinueForward(
      std::unique_ptr<Forward>& previous, absl::Span<const DecodeRow> rows) override;
  absl::StatusOr<std::unique_ptr<Forward>> BeginPrefill(absl::Span<const PrefillRow> rows) override;
  absl::StatusOr<std::unique_ptr<Forward>> BeginVerify(
      absl::Span<const SlotId> ids, int32_t num_draft,
      absl::Span<const int32_t> draft_tokens) override;
  absl::Status Verify(absl::Span<const SlotId> ids, int32_t num_draft,
                      absl::Span<const int32_t> draft_tokens,
                      absl::Span<const LayerIo> layers) override;
  absl::Status Accept(SlotId id, int32_t n) override;

  int64_t MatchPrefix(absl::Span<const int32_t> tokens) const override {
    return MatchPrefixIn(kDefaultNamespace, tokens);
  }
  int64_t MatchPrefixIn(PrefixNamespace ns, absl::Span<const int32_t> tokens) const override {
    absl::MutexLock lock(&mu_);
    const int64_t backend = radix_.LongestPrefix(ns, tokens).length;
    return host_ == nullptr ? backend : std::max(backend, host_->LongestPrefix(ns, tokens).length);
  }
  absl::Status SetPrefixNamespace(SlotId id, PrefixNamespace ns) override {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = LookupLocked(id, "slot", /*allow_broken=*/true);
    if (!i.ok()) return i.status();
    slots_[*i].ns = ns;
    return absl::OkStatus();
  }

  absl::Status Donate(SlotId id) override;

  // Makes the first lane, so that a cache that cannot get one fails at Create.
  absl::Status WarmLanes() { return lanes_.Take().status(); }

  // --- used by ForwardImpl ---
  SlotPool& pool() override { return *pool_; }
  // Books a forward's end: Commit's effect on every row (commit), or releases the rows
  // unchanged (marked broken when `broken`). Returns the spare slots to the pool either way.
  void EndForward(const ForwardRows& rows, bool commit, bool broken);
  // After cursors advanced (commit, accept): folds and snapshots the rows at a track
  // boundary, waits for the lane, then releases every row.
  absl::Status AfterAdvance(const std::vector<int32_t>& index, Lane& lane);
  // Folds rows[i] (busy, owned by the caller) whose cursor is past `max_pos`: queued on the
  // lane and booked at once (cursor 0, `counter`); the caller waits for the lane and on an
  // error calls MarkBroken(*folded). A fold that cannot be queued marks its rows broken.
  absl::Status FoldRows(const std::vector<int32_t>& rows, int32_t max_pos,
                        int64_t CacheStats::*counter, Lane& lane, std::vector<int32_t>* folded);
  // The cursors of busy slots (0 for padding rows, index -1).
  std::vector<int32_t> Cursors(const std::vector<int32_t>& index) const {
    std::vector<int32_t> w(index.size(), 0);
    absl::MutexLock lock(&mu_);
    for (size_t r = 0; r < index.size(); ++r) {
      if (index[r] >= 0) w[r] = slots_[index[r]].write_pos;
    }
    return w;
  }
  void MarkBroken(const std::vector<int32_t>& rows) {
    absl::MutexLock lock(&mu_);
    for (int32_t i : rows) slots_[i].broken = true;
  }
  void Count(int64_t CacheStats::*counter) {
    absl::MutexLock lock(&mu_);
    ++(stats_.*counter);
  }

 private:
  // Runs `work(lane)` on a lane of its own and waits for it.
  template <typename F>
  absl::Status OnLane(F&& work) {
    absl::StatusOr<LanePool::Lease> lane = lanes_.Take();
    if (!lane.ok()) return lane.status();
    absl::Status s = work(**lane);
    absl::Status w = (*lane)->Synchronize();
    return s.ok() ? w : s;
  }

  // The live slot behind `id`, or NOT_FOUND. `field` names the request field in errors.
  absl::StatusOr<int32_t> LookupLocked(SlotId id, const std::string& field,
                                       bool allow_broken = false) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // The refusal of any change to a slot that is being moved out.
  absl::Status MovingLocked(SlotId id, int32_t index, const std::string& field) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": slot ", SlotName(id), " is being transferred (request id ",
                     slots_[index].moving, "); it accepts no change until the transfer ends"));
  }

  // Marks a live slot busy for an operation; refuses a slot that is busy, being moved out or
  // has drafts.
  absl::StatusOr<int32_t> AcquireLocked(SlotId id, const std::string& field, bool allow_pending)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // A free slot, evicting the least recently used unreferenced snapshot when none is free:
  // with the host tier, one whose state the host holds first (no loss), then any (dropped:
  // this path never waits for a spill; MakeRoom is the one that spills).
  absl::StatusOr<int32_t> TakeFreeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (free_.empty() && host_ != nullptr) {
      EvictLruLocked([this](const Slot& s) {
        return s.host >= 0 || host_->Find(s.ns, s.tokens) >= 0;
      });
    }
    if (free_.empty()) EvictLruLocked([](const Slot&) { return true; });
    if (free_.empty()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no free slot: all ", slots_.size(), " slots (", model_.SlotBytes(),
          " bytes each) are live or pinned snapshots; free slots or raise --memory-budget"));
    }
    const int32_t index = free_.back();
    free_.pop_back();
    return index;
  }

  // Evicts the least recently used snapshot that `which` accepts and nothing uses; false when
  // there is none.
  template <typename Which>
  bool EvictLruLocked(Which which) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
      Slot& s = slots_[*it];
      if (s.refs > 0 || s.busy || !which(s)) continue;
      DropBackendLocked(*it);
      return true;
    }
    return false;
  }

  // Takes an unused snapshot out of backend memory: reported removed there; when the host tier
  // holds its state it stays findable there (reported stored in kHost if it was not), else it
  // is gone.
  void DropBackendLocked(int32_t victim) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Slot& s = slots_[victim];
    radix_.Erase(s.ns, s.tokens);
    EmitLocked(CacheEvent::Type::kRemoved, s.ns, s.tokens, Medium::kBackend);
    const int32_t e = s.host >= 0 ? s.host : host_ != nullptr ? host_->Find(s.ns, s.tokens) : -1;
    if (e >= 0) {
      HostTier::Entry& h = host_->entry(e);
      h.backend_slot = -1;
      if (!h.reported) EmitLocked(CacheEvent::Type::kStored, h.ns, h.tokens, Medium::kHost);
      h.reported = true;
      ++stats_.snapshot_spills;
    }
    lru_.erase(s.lru);
    --ns_snapshots_[s.ns];
    ++stats_.snapshot_evictions;
    s = Slot{Kind::kFree, s.generation + 1};
    free_.push_back(victim);
  }

  // The least recently used snapshot nothing uses, or -1.
  int32_t LruVictimLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (auto it = lru_.rbegin(); it != lru_.rend(); ++it) {
      const Slot& s = slots_[*it];
      if (s.refs == 0 && !s.busy) return *it;
    }
    return -1;
  }

  // Books host entries that HostTier::Reserve evicted: reported removed from kHost, unlinked
  // from a backend snapshot holding the same state.
  void HostEvictedLocked(const std::vector<HostTier::Entry>& evicted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const HostTier::Entry& h : evicted) {
      if (h.reported) EmitLocked(CacheEvent::Type::kRemoved, h.ns, h.tokens, Medium::kHost);
      if (h.backend_slot >= 0) slots_[h.backend_slot].host = -1;
      ++stats_.host_evictions;
    }
  }

  // A new backend snapshot at `index` whose key the host tier holds shares that entry (its
  // eviction then costs no copy).
  void LinkHostLocked(int32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (host_ == nullptr) return;
    Slot& s = slots_[index];
    s.host = host_->Find(s.ns, s.tokens);
    if (s.host >= 0) host_->entry(s.host).backend_slot = index;
  }

  // Spills the least recently used snapshots to the host tier until `n` slots are free (or
  // none can be spilled: everything live or in use, the host tier full of entries in use).
  // Each copy runs on a lane of its own without the lock; the snapshot stays findable in
  // backend memory until its state is on the host. Nothing without the host tier.
  void MakeRoom(size_t n) ABSL_LOCKS_EXCLUDED(mu_);
  // Spills snapshot `victim` (busy) into host entry `e` (reserved): the copy, waited for.
  absl::Status Spill(int32_t victim, int32_t e);
  // AllocateFromPrefixIn's host hit: the new slot (busy), the host entry it comes from
  // (pinned) and the backend snapshot it is promoted into (busy; -1 when no slot was free).
  struct Promotion {
    int32_t entry = -1, slot = -1, snapshot = -1;
    int64_t matched = 0;
  };
  // A host hit on entry `e` (pinned by the caller; key `prefix`): room for the slot and the
  // promoted snapshot, then StartPromotionLocked and FinishPromotion.
  absl::StatusOr<PrefixAllocation> PromoteFromHost(PrefixNamespace ns,
                                                   absl::Span<const int32_t> prefix, int32_t e)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Takes what a host hit on entry `e` (key `prefix`) needs; counts the hit.
  absl::Status StartPromotionLocked(PrefixNamespace ns, absl::Span<const int32_t> prefix,
                                    int32_t e, Promotion* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The copies (without the lock, on a lane of their own), then the bookkeeping: the slot is
  // the caller's, the snapshot findable in backend memory beside its host copy.
  absl::StatusOr<PrefixAllocation> FinishPromotion(const Promotion& p) ABSL_LOCKS_EXCLUDED(mu_);

  // Room for one more snapshot in namespace `ns` (CacheOptions::max_snapshots_per_namespace):
  // true when it is under its bound, or once its own least recently used snapshot is evicted.
  // A true answer counts the new snapshot; SnapshotDroppedLocked takes it back.
  bool ReserveSnapshotLocked(PrefixNamespace ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int64_t bound = options_.max_snapshots_per_namespace;
    if (bound > 0 && ns_snapshots_[ns] >= bound &&
        !EvictLruLocked([ns](const Slot& s) { return s.ns == ns; })) {
      return false;
    }
    ++ns_snapshots_[ns];
    return true;
  }
  void SnapshotDroppedLocked(PrefixNamespace ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    --ns_snapshots_[ns];
  }

  void StartLiveLocked(int32_t index, std::vector<int32_t> tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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

  // Returns a live slot to the free list; its id stops working.
  void ReleaseLocked(int32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    slots_[index] = Slot{Kind::kFree, slots_[index].generation + 1};
    free_.push_back(index);
  }

  // Reports a snapshot stored in or removed from the prefix cache (CacheOptions::event_sink).
  void EmitLocked(CacheEvent::Type type, PrefixNamespace ns, const std::vector<int32_t>& tokens,
                  Medium medium) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!options_.event_sink) return;
    CacheEvent e;
    e.type = type;
    e.ns = ns;
    e.medium = medium;
    e.tokens = tokens;
    options_.event_sink(e);
  }

  void TouchLocked(int32_t snapshot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    lru_.splice(lru_.begin(), lru_, slots_[snapshot].lru);
  }

  // Opens a forward over rows.index's slots `ids` (one per row): takes a lane, marks every
  // non-padding slot busy (field(r) names row r's slot in errors; nothing is taken if any row
  // fails), takes a prefill's spare slots when `spares`, discards a verify's waiting drafts,
  // and starts the forward.
  absl::StatusOr<std::unique_ptr<Forward>> Open(ForwardRows rows, absl::Span<const SlotId> ids,
                                                absl::FunctionRef<std::string(size_t)> field,
                                                bool spares, bool layer_waits);
  // Marks rows busy as Open does; on an error releases what it took.
  absl::Status AcquireRowsLocked(absl::Span<const SlotId> ids,
                                 absl::FunctionRef<std::string(size_t)> field, bool allow_pending,
                                 std::vector<int32_t>* index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One spare slot per non-padding row, or RESOURCE_EXHAUSTED (none taken).
  absl::Status TakeSparesLocked(const std::vector<int32_t>& index, std::vector<int32_t>* spare)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // 1..max_batch rows, or INVALID_ARGUMENT naming `field`.
  absl::Status CheckBatch(size_t rows, const char* field) const;
  // Verify's arguments, before any slot is looked at.
  absl::Status CheckVerify(size_t rows, int32_t num_draft, size_t draft_tokens) const;
  absl::StatusOr<std::unique_ptr<Forward>> OpenVerify(absl::Span<const SlotId> ids,
                                                      int32_t num_draft,
                                                      absl::Span<const int32_t> draft_tokens,
                                                      bool layer_waits);

  // THE guard: the only path by which a state leaves a slot (copy-on-write, snapshot,
  // donation, export, transfer). The caller holds the slot (busy, or a pinned snapshot). It
  // folds the slot when write_pos != 0, so what leaves is the whole state, and refuses a slot
  // whose verified drafts are not yet accepted or rejected. It waits for its fold.
  absl::Status Materialize(int32_t index, const char* purpose, Lane& lane);
  // The finiteness policy: OK when slot `index`'s folded state holds no NaN or Inf, else
  // FAILED_PRECONDITION naming `purpose` (counted). Run on every state about to be shared
  // with another request (a snapshot, a donation, a move out), after Materialize.
  absl::Status CheckShareable(int32_t index, const char* purpose, Lane& lane);
  // OK for counts[] (CountNonfinite's) of zero, else the refusal (counted).
  absl::Status ShareRefusal(const char* purpose, const uint32_t counts[2]);

  // Copies a folded slot's state into a new snapshot keyed by its tokens (skipped when that
  // key is cached already or no slot can be had). Waits for the copy.
  absl::Status TakeSnapshot(int32_t index, Lane& lane);

  // --- SlotIoOwner: what the slot readers and writers call back ---
  // pool() is above (ForwardImpl uses it too).
  LanePool& lanes() override { return lanes_; }
  StagingPool& staging() override { return staging_; }
  void EndExport(int32_t index, bool moved) override;
  SlotId CommitImport(int32_t index, absl::Span<const int32_t> tokens) override;
  void DropImport(int32_t index) override;

  // Idle staging rings kept for the next move (pinned memory is costly to allocate).
  static constexpr int32_t kIdleStagingRings = 8;

  const ModelSpec model_;
  const CacheOptions options_;
  std::unique_ptr<SlotPool> pool_;

  mutable absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);
  std::list<int32_t> lru_ ABSL_GUARDED_BY(mu_);  // snapshots, most recent first
  // Snapshots per namespace (taken or being taken), for max_snapshots_per_namespace.
  absl::flat_hash_map<PrefixNamespace, int64_t> ns_snapshots_ ABSL_GUARDED_BY(mu_);
  PrefixForest radix_ ABSL_GUARDED_BY(mu_);      // snapshots by namespace
  // The host tier (CacheOptions::host_snapshot_bytes > 0), else null. Guarded by mu_ but for
  // the buffers of the entries an operation holds (HostTier).
  std::unique_ptr<HostTier> host_;
  CacheStats stats_ ABSL_GUARDED_BY(mu_);
  LanePool lanes_;  // one lane per operation in flight
  StagingPool staging_;  // slot I/O's staged path

  friend class ForwardImpl;
};

void StateCacheImpl::MakeRoom(size_t n) {
  if (host_ == nullptr) return;
  for (;;) {
    int32_t victim = -1, e = -1;
    {
      absl::MutexLock lock(&mu_);
      if (free_.size() >= n) return;
      victim = LruVictimLocked();
      if (victim < 0) return;
      Slot& s = slots_[victim];
      if (s.host >= 0 || host_->Find(s.ns, s.tokens) >= 0) {  // on the host already: no copy
        DropBackendLocked(victim);
        continue;
      }
      std::vector<HostTier::Entry> evicted;
      e = host_->Reserve(s.ns, &evicted);
      HostEvictedLocked(evicted);
      if (e < 0) return;  // every host entry in use: an eviction now drops
      s.busy = true;      // no other eviction takes it; prefix hits still copy from it
    }
    const absl::Status st = Spill(victim, e);
    absl::MutexLock lock(&mu_);
    Slot& s = slots_[victim];
    s.busy = false;
    if (!st.ok()) {  // the snapshot stays in backend memory
      host_->Unreserve(e);
      return;
    }
    host_->Store(e, s.ns, s.tokens);
    s.host = e;
    host_->entry(e).backend_slot = victim;
    if (s.refs == 0) DropBackendLocked(victim);  // else a copy from it goes on: it stays, clean
  }
}

absl::Status StateCacheImpl::Spill(int32_t victim, int32_t e) {
  absl::StatusOr<void*> buffer = host_->Buffer(e);
  if (!buffer.ok()) return buffer.status();
  return OnLane([&](Lane& lane) { return pool_->SaveState(victim, *buffer, lane); });
}

absl::StatusOr<StateCache::PrefixAllocation> StateCacheImpl::PromoteFromHost(
    PrefixNamespace ns, absl::Span<const int32_t> prefix, int32_t e) {
  MakeRoom(2);
  Promotion p;
  {
    absl::MutexLock lock(&mu_);
    absl::Status st = StartPromotionLocked(ns, prefix, e, &p);
    if (!st.ok()) {
      --host_->entry(e).refs;
      return st;
    }
  }
  return FinishPromotion(p);
}

absl::Status StateCacheImpl::StartPromotionLocked(PrefixNamespace ns,
                                                  absl::Span<const int32_t> prefix, int32_t e,
                                                  Promotion* p) {
  absl::StatusOr<int32_t> i = TakeFreeLocked();
  if (!i.ok()) return i.status();
  ++stats_.snapshot_misses;  // the backend's
  ++stats_.host_hits;
  p->entry = e;
  p->slot = *i;
  p->matched = static_cast<int64_t>(prefix.size());
  StartLiveLocked(p->slot, std::vector<int32_t>(prefix.begin(), prefix.end()));
  slots_[p->slot].ns = ns;
  host_->Hit(e);
  // A promotion never evicts: it takes a free slot, within the namespace's bound.
  if (free_.empty() || !ReserveSnapshotLocked(ns)) return absl::OkStatus();
  p->snapshot = free_.back();
  free_.pop_back();
  Slot& d = slots_[p->snapshot];
  d.kind = Kind::kSnapshot;
  d.busy = true;
  d.seq_len = p->matched;
  d.tokens = slots_[p->slot].tokens;
  d.ns = ns;
  return absl::OkStatus();
}

absl::StatusOr<StateCache::PrefixAllocation> StateCacheImpl::FinishPromotion(const Promotion& p) {
  const void* data = nullptr;
  {
    absl::MutexLock lock(&mu_);
    data = host_->entry(p.entry).data;
  }
  const absl::Time start = absl::Now();
  const absl::Status st = OnLane([&](Lane& lane) {
    if (p.snapshot < 0) return pool_->LoadState(p.slot, data, lane);
    absl::Status s = pool_->LoadState(p.snapshot, data, lane);
    return s.ok() ? pool_->CopyCheckpoints(p.slot, p.snapshot, lane) : s;
  });
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  absl::MutexLock lock(&mu_);
  --host_->entry(p.entry).refs;
  if (p.snapshot >= 0) {
    Slot& d = slots_[p.snapshot];
    // Another promotion or snapshot of the same key may have got there first: keep that one.
    if (!st.ok() || !radix_.Insert(d.ns, d.tokens, p.snapshot)) {
      SnapshotDroppedLocked(d.ns);
      ReleaseLocked(p.snapshot);
    } else {
      d.busy = false;
      lru_.push_front(p.snapshot);
      d.lru = lru_.begin();
      d.host = p.entry;
      host_->entry(p.entry).backend_slot = p.snapshot;
      ++stats_.host_promotions;
      EmitLocked(CacheEvent::Type::kStored, d.ns, d.tokens, Medium::kBackend);
    }
  }
  if (!st.ok()) {
    ReleaseLocked(p.slot);
    return st;
  }
  const auto bucket = std::lower_bound(kPromotionLatencyBounds.begin(),
                                       kPromotionLatencyBounds.end(), seconds);
  ++stats_.promotion_latency_counts[bucket - kPromotionLatencyBounds.begin()];
  stats_.promotion_seconds += seconds;
  slots_[p.slot].busy = false;
  return PrefixAllocation{MakeId(p.slot, slots_[p.slot].generation), p.matched};
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
  return absl::FailedPreconditionError(absl::StrCat(
      purpose, ": the slot's state is not finite (", counts[0],
      " NaN or Inf values in its checkpoints, ", counts[1],
      " in its conv windows); it is never shared with another request (free it)"));
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
    ++(stats_.*counter);
  }
  return st;
}

absl::Status StateCacheImpl::TakeSnapshot(int32_t index, Lane& lane) {
  absl::Status st = Materialize(index, "snapshot", lane);
  if (!st.ok()) return st;
  int32_t snap = -1;
  {
    absl::MutexLock lock(&mu_);
    const Slot& s = slots_[index];
    if (radix_.Find(s.ns, s.tokens) >= 0) {
      TouchLocked(radix_.Find(s.ns, s.tokens));
      return absl::OkStatus();
    }
    // No room (in the pool, or in the namespace's share): a snapshot is an optimization.
    if (!ReserveSnapshotLocked(s.ns)) return absl::OkStatus();
    absl::StatusOr<int32_t> i = TakeFreeLocked();
    if (!i.ok()) {
      SnapshotDroppedLocked(s.ns);
      return absl::OkStatus();
    }
    snap = *i;
    Slot& d = slots_[snap];
    d.kind = Kind::kSnapshot;
    d.busy = true;
    d.seq_len = s.seq_len;
    d.tokens = s.tokens;
    d.ns = s.ns;
  }
  // The finiteness scan and the copy are queued together and waited for once: a state with a
  // NaN or Inf never becomes a snapshot (counted); the request goes on.
  uint32_t counts[2] = {0, 0};
  st = pool_->CountNonfinite(index, counts, lane);
  if (st.ok()) st = pool_->CopyCheckpoints(snap, index, lane);
  absl::Status done = lane.Synchronize();
  if (st.ok()) st = done;
  const bool shareable = st.ok() && ShareRefusal("snapshot", counts).ok();
  absl::MutexLock lock(&mu_);
  Slot& d = slots_[snap];
  if (!shareable || !radix_.Insert(d.ns, d.tokens, snap)) {
    SnapshotDroppedLocked(d.ns);
    slots_[snap] = Slot{Kind::kFree, d.generation + 1};
    free_.push_back(snap);
    return st;
  }
  d.busy = false;
  lru_.push_front(snap);
  d.lru = lru_.begin();
  ++stats_.snapshots_taken;
  LinkHostLocked(snap);
  EmitLocked(CacheEvent::Type::kStored, d.ns, d.tokens, Medium::kBackend);
  return absl::OkStatus();
}

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

// Runs every layer of a forward (layers[l] for layer l), then commits it; an error abandons it.
absl::Status RunAllLayers(Forward& f, absl::Span<const LayerIo> layers) {
  for (size_t l = 0; l < layers.size(); ++l) {
    absl::Status st = f.RunLayer(static_cast<int32_t>(l), layers[l]);
    if (!st.ok()) return st;
  }
  return f.Commit();
}

absl::Status StateCacheImpl::Prefill(SlotId id, absl::Span<const int32_t> tokens,
                                     absl::Span<const LayerIo> layers) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  if (T > options_.max_prefill_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: expected at most ",
                                                   options_.max_prefill_tokens, " tokens, got ", T));
  }
  if (T == 0) {  // a no-op, on a slot that could take a prefill
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", false);
    if (!i.ok()) return i.status();
    slots_[*i].busy = false;
    return absl::OkStatus();
  }
  absl::Status st = CheckIo(model_, layers, false);
  if (!st.ok()) return st;
  ForwardRows rows{ForwardKind::kPrefill};
  rows.cu = {0, static_cast<int32_t>(T)};
  rows.tokens.assign(tokens.begin(), tokens.end());
  const SlotId ids[1] = {id};
  // No spare slot: every layer runs in this call, so only a device error can stop it halfway
  // (the slot is then broken, as after any failed launch).
  absl::StatusOr<std::unique_ptr<Forward>> f = Open(
      std::move(rows), ids, [](size_t) { return std::string("slot"); },
      /*spares=*/false, /*layer_waits=*/false);
  if (!f.ok()) return f.status();
  return RunAllLayers(**f, layers);
}

absl::Status StateCacheImpl::ImportFrom(SlotId id, absl::Span<const int32_t> tokens,
                                        absl::Span<const void* const> checkpoints,
                                        IoMemory memory) {
  if (static_cast<int32_t>(checkpoints.size()) != model_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoints: expected ", model_.num_layers,
                                                   " layers, got ", checkpoints.size()));
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
  if (static_cast<int32_t>(checkpoints.size()) != model_.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoints: expected ", model_.num_layers,
                                                   " layers, got ", checkpoints.size()));
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

absl::Status StateCacheImpl::Donate(SlotId id) {
  int32_t index = -1;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<int32_t> i = AcquireLocked(id, "slot", /*allow_pending=*/true);
    if (!i.ok()) return i.status();
    index = *i;
  }
  absl::Status st = OnLane([&](Lane& lane) {
    absl::Status r = Materialize(index, "donate", lane);
    return r.ok() ? CheckShareable(index, "donate", lane) : r;
  });
  absl::MutexLock lock(&mu_);
  Slot& s = slots_[index];
  if (!st.ok()) {
    s.busy = false;
    return st;
  }
  ++stats_.donations;
  if (s.seq_len == 0 || radix_.Find(s.ns, s.tokens) >= 0) {  // nothing new to keep
    if (s.seq_len > 0) TouchLocked(radix_.Find(s.ns, s.tokens));
    ReleaseLocked(index);
    return absl::OkStatus();
  }
  if (!ReserveSnapshotLocked(s.ns)) {  // the namespace's share is full and all in use
    ReleaseLocked(index);
    return absl::OkStatus();
  }
  s.kind = Kind::kSnapshot;
  s.generation += 1;  // the request's id stops working
  s.busy = false;
  radix_.Insert(s.ns, s.tokens, index);
  lru_.push_front(index);
  s.lru = lru_.begin();
  LinkHostLocked(index);
  EmitLocked(CacheEvent::Type::kStored, s.ns, s.tokens, Medium::kBackend);
  return absl::OkStatus();
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
  if (!st.ok()) {  // nothing happened: release what was taken
    for (int32_t& i : *index) {
      if (i >= 0) slots_[i].busy = false;
      i = -1;
    }
  }
  return st;
}

absl::Status StateCacheImpl::TakeSparesLocked(const std::vector<int32_t>& index,
                                              std::vector<int32_t>* spare) {
  spare->assign(index.size(), -1);
  for (size_t r = 0; r < index.size(); ++r) {
    if (index[r] < 0) continue;
    absl::StatusOr<int32_t> i = TakeFreeLocked();
    if (!i.ok()) {
      for (int32_t& s : *spare) {
        if (s >= 0) ReleaseLocked(s);
        s = -1;
      }
      constexpr char kWhy[] =
          "]: a layer-by-layer prefill keeps one spare slot per row until it commits, and none "
          "is free (";
      return absl::ResourceExhaustedError(absl::StrCat(
          "rows[", r, kWhy, i.status().message(), "); prefill fewer rows at once or use Prefill"));
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
    if (st.ok() && spares) {
      st = TakeSparesLocked(rows.index, &rows.spare);
      if (!st.ok()) {
        for (int32_t i : rows.index) {
          if (i >= 0) slots_[i].busy = false;
        }
      }
    }
    if (!st.ok()) return st;
    for (int32_t i : rows.index) {
      if (i >= 0 && verify) {  // a new verify replaces drafts not yet accepted
        slots_[i].pending = 0;
        slots_[i].drafts.clear();
      }
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

std::string RowSlotField(size_t r) { return absl::StrCat("rows[", r, "].slot"); }

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

absl::StatusOr<std::unique_ptr<Forward>> StateCacheImpl::ContinueForward(
    std::unique_ptr<Forward>& previous, absl::Span<const DecodeRow> rows) {
  auto* prev = dynamic_cast<ForwardImpl*>(previous.get());
  if (prev == nullptr || prev->cache_ != this || !prev->Continuable() ||
      rows.size() != prev->rows_.index.size()) {
    return nullptr;
  }
  // A chain holds one forward behind the open one: previous's own predecessor must be done
  // (with a one-forward lead it is: previous's first layer waited for the engine's doorbell,
  // rung after that forward's last output), else previous is committed the usual way.
  if (prev->predecessor_ != nullptr) {
    // Read on an idle lane's stream (previous's own stream is behind previous's waits).
    bool done = false;
    OnLane([&](Lane& lane) {
      done = prev->predecessor_->doorbells_.LastSignalReached(lane.Launch());
      return absl::OkStatus();
    }).IgnoreError();
    if (prev->predecessor_incomplete_ || !done) return nullptr;
    prev->predecessor_.reset();  // confirmed: its work is done
  }
  {
    absl::MutexLock lock(&mu_);
    for (size_t r = 0; r < rows.size(); ++r) {
      const int32_t held = prev->rows_.index[r];
      if (rows[r].slot == kPaddingSlot || held < 0) {
        if (rows[r].slot != kPaddingSlot || held >= 0) return nullptr;
        continue;
      }
      absl::StatusOr<int32_t> i = LookupLocked(rows[r].slot, RowSlotField(r));
      if (!i.ok() || *i != held) return nullptr;
      if (options_.track_interval > 0 &&
          (slots_[held].seq_len + 1) % options_.track_interval == 0) {
        return nullptr;  // AfterAdvance must snapshot it: that needs the state
      }
    }
  }
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
  MakeRoom(ids.size());  // the spare slots
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
  return RunAllLayers(**f, layers);
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
  for (int32_t i : boundary) {
    if (!st.ok()) break;
    st = TakeSnapshot(i, lane);
  }
  absl::MutexLock lock(&mu_);
  for (int32_t i : index) {
    if (i >= 0) slots_[i].busy = false;
  }
  return st;
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

ForwardImpl::ForwardImpl(StateCacheImpl* cache, ForwardRows rows, LanePool::Lease lane,
                         bool layer_waits)
    : cache_(cache),
      rows_(std::move(rows)),
      lane_(std::move(lane)),
      layer_waits_(layer_waits),
      done_(cache->model().num_layers, false),
      longest_(rows_.longest()),
      touched_(cache->model().num_layers, false) {}

ForwardImpl::~ForwardImpl() {
  if (finished_) return;
  // Abandoned: ring the doorbells nobody will ring any more (or the stream would never
  // drain), put back what a prefill overwrote, then wait for everything queued (ring appends
  // past the cursors, the copies, and the scratch the lane is about to lend out again) before
  // the rows are released.
  ReleaseWaits();
  const bool restored = Restore();
  const bool done = Synchronize().ok();
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
  if (!lane_) return absl::OkStatus();
  absl::Status st = lane_->Synchronize();
  if (!st.ok()) cache_->MarkBroken(unconfirmed_folds_);
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
  if (!bells.empty()) {
    std::vector<const uint32_t*> waits(bells.size());
    for (size_t l = 0; l < bells.size(); ++l) waits[l] = bells[l].ready;
    // Released already: call by call, which skips the waits.
    if (!doorbells_.Expect(waits, bells.back().done, value)) return absl::OkStatus();
  }
  std::fill(touched_.begin(), touched_.end(), true);
  const rssm_launch launch = lane_->Launch();
  absl::Status st = KernelStatus(rssm_graph_launch(&launch, graph, value), "recorded forward");
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
    if (!bells.empty()) {
      st = KernelStatus(rssm_stream_wait_value32(&launch, bells[l].ready, value), "doorbell wait");
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
  const int32_t backend = cache_->options().backend;
  int32_t first = -1;
  int32_t before = 0;  // the predecessor's waits come first in queue order
  if (predecessor_) {
    first = predecessor_->doorbells_.Release(backend);
    if (first >= 0) predecessor_incomplete_ = true;
    before = cache_->model().num_layers;
  }
  const int32_t own = doorbells_.Release(backend);
  if (first < 0 && own >= 0) first = before + own;
  return first;
}

absl::Status ForwardImpl::Commit() {
  if (finished_) return absl::FailedPreconditionError("forward: already committed");
  if (!failed_.ok()) return failed_;
  for (size_t l = 0; l < done_.size(); ++l) {
    if (!done_[l]) {
      return absl::FailedPreconditionError(absl::StrCat("commit: layer ", l, " has not run"));
    }
  }
  absl::Status st = Synchronize();  // the layers' device work is done before cursors move
  if (!st.ok()) return st;
  if (predecessor_incomplete_) {
    failed_ = absl::DataLossError(
        "forward: the forward before this one (committed when this one began) never got all "
        "its inputs: its rows are broken");
    return failed_;  // destroying it abandons it and marks the rows broken
  }
  predecessor_.reset();  // its work is confirmed
  finished_ = true;
  cache_->EndForward(rows_, true, false);
  if (rows_.kind != ForwardKind::kVerify) st = cache_->AfterAdvance(rows_.index, *lane_);
  lane_.reset();
  return st;
}

}  // namespace

absl::Status StateCache::Import(SlotId id, absl::Span<const int32_t> tokens,
                                absl::Span<const absl::Span<const uint8_t>> checkpoints) {
  const ModelSpec& m = model();
  if (static_cast<int32_t>(checkpoints.size()) != m.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoints: expected ", m.num_layers,
                                                   " layers, got ", checkpoints.size()));
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

absl::StatusOr<std::unique_ptr<StateCache>> StateCache::Create(ModelSpec model,
                                                               CacheOptions options) {
  if (options.tp_size != 1) return CreateTpGroup(std::move(model), std::move(options));
  if (rssm_check_shape(&model.shape) != RSSM_OK) {
    return absl::InvalidArgumentError(absl::StrCat("model.", rssm_last_error()));
  }
  if (model.shape.ring_len < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring_len: expected >= 2 (the cache keeps decode kernels from folding, so a ring holds "
        "L-1 decode records), got ", model.shape.ring_len));
  }
  if (model.num_layers < 1 || static_cast<int32_t>(model.layers.size()) != model.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("model.layers: expected ", model.num_layers,
                                                   " layers of parameters, got ", model.layers.size()));
  }
  if (model.conv_width != 0) {
    if (model.conv_width < 2 || model.conv_width > RSSM_MAX_CONV_WIDTH) {
      return absl::InvalidArgumentError(absl::StrCat("model.conv_width: expected 0 (none) or 2 to ",
                                                     RSSM_MAX_CONV_WIDTH, ", got ",
                                                     model.conv_width));
    }
    const size_t c = static_cast<size_t>(model.QkvWidth());
    for (int32_t l = 0; l < model.num_layers; ++l) {
      const LayerParams& p = model.layers[l];
      if (p.conv_weight.size() != c * model.conv_width) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.layers[", l, "].conv_weight: expected ", c * model.conv_width, " values ([", c,
            ", ", model.conv_width, "]), got ", p.conv_weight.size()));
      }
      if (!p.conv_bias.empty() && p.conv_bias.size() != c) {
        return absl::InvalidArgumentError(absl::StrCat("model.layers[", l,
                                                       "].conv_bias: expected none or ", c,
                                                       " values, got ", p.conv_bias.size()));
      }
    }
  }
  if (!rssm_backend_available(options.backend)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "backend: ", options.backend == RSSM_BACKEND_CUDA ? "CUDA" : "unknown",
        " is not available in this build or on this machine"));
  }
  if (options.max_batch < 1 || options.track_interval < 0 || options.max_prefill_tokens < 1) {
    return absl::InvalidArgumentError("options: max_batch and max_prefill_tokens must be >= 1 and track_interval >= 0");
  }
  const int64_t slot_bytes = model.SlotBytes();
  const int64_t state_bytes = model.LayerStateBytes() * model.num_layers;
  if (options.host_snapshot_bytes != 0 && options.host_snapshot_bytes < state_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_snapshot_bytes: expected 0 (no host tier) or at least one snapshot (", state_bytes,
        " bytes: checkpoints and conv windows of ", model.num_layers, " layers), got ",
        options.host_snapshot_bytes));
  }
  if (options.host_snapshot_bytes / state_bytes > 0x7fffffff) {
    return absl::InvalidArgumentError("host_snapshot_bytes: more than 2^31 snapshots");
  }
  if (options.host_policy != HostPolicy::kLru && options.host_policy != HostPolicy::kValue) {
    return absl::InvalidArgumentError(absl::StrCat("host_policy: expected kLru or kValue, got ",
                                                   static_cast<int32_t>(options.host_policy)));
  }
  const int64_t n = options.memory_budget_bytes / slot_bytes;
  if (n < 1) {
    return absl::ResourceExhaustedError(absl::StrCat("memory_budget: expected at least one slot (",
                                                     slot_bytes, " bytes), got ", options.memory_budget_bytes));
  }
  if (n > 0x7fffffff) return absl::InvalidArgumentError("memory_budget: more than 2^31 slots");
  absl::StatusOr<std::unique_ptr<SlotPool>> pool = SlotPool::Create(model, options.backend, n);
  if (!pool.ok()) return pool.status();
  auto cache = std::make_unique<StateCacheImpl>(std::move(model), options, std::move(*pool));
  absl::Status st = cache->WarmLanes();
  if (!st.ok()) return st;
  return std::unique_ptr<StateCache>(std::move(cache));
}

}  // namespace replayssm::cache
