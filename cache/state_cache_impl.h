// StateCacheImpl, the StateCache of one rank, and ForwardImpl, its Forward: their declarations
// and the slot record they share (private to cache/). Design notes: docs/cache.md.
//
// Streams (lane.h): every operation runs on a lane of its own (stream + pinned staging +
// scratch) and waits for it only where results must be seen: a host-memory decode layer's
// outputs, the end of every operation but a forward's layers, and before any slot is
// released. A fold queued ahead of a forward's layers is booked at once (cursor 0) and
// confirmed by the next wait; a device error there marks its rows broken.
#ifndef REPLAYSSM_CACHE_STATE_CACHE_IMPL_H_
#define REPLAYSSM_CACHE_STATE_CACHE_IMPL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "doorbells.h"
#include "host_tier.h"
#include "lane.h"
#include "radix_tree.h"
#include "replayssm/cache/state_cache.h"
#include "slot_io_internal.h"
#include "slot_pool.h"

namespace replayssm::cache::internal {

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

inline SlotId MakeId(int32_t index, uint32_t generation) {
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
  // Commit in two steps, for a TP group that must commit every rank or none: CheckCommit waits
  // for the device work and refuses (every layer ran, no failure, the predecessor complete)
  // while nothing has moved; ApplyCommit, after an OK check, moves the cursors (it cannot be
  // refused any more: an error from it is a fold's or a snapshot's after the move, the rows it
  // broke marked so).
  absl::Status CheckCommit();
  absl::Status ApplyCommit();

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
  bool drafts_discarded_ = false;  // a verify's: its rows' earlier drafts are gone (RunLayer)
  absl::Status failed_;        // a launch failed: the forward can only be abandoned
  // The lane's wait failed once (a device error): every later wait of this forward says so.
  // The lane forgets it (it is idle again after the failed wait), and a second Commit took
  // that for success and moved the cursors over failed work (an outside review).
  absl::Status sync_error_;
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
  StateCacheImpl(ModelSpec model, CacheOptions options, std::unique_ptr<SlotPool> pool);
  ~StateCacheImpl() override;  // stops the spiller first

  const ModelSpec& model() const override { return model_; }
  const CacheOptions& options() const override { return options_; }
  // How errors name a slot: options_.slot_name, else the id in hex.
  std::string SlotName(SlotId id) const {
    return options_.slot_name ? options_.slot_name(id) : absl::StrCat("0x", absl::Hex(id));
  }
  int64_t capacity() const override { return pool_->num_slots(); }

  CacheStats stats() const override;

  absl::StatusOr<SlotId> Allocate() override;
  absl::StatusOr<PrefixAllocation> AllocateFromPrefix(absl::Span<const int32_t> tokens) override {
    return AllocateFromPrefixIn(kDefaultNamespace, tokens);
  }
  absl::StatusOr<PrefixAllocation> AllocateFromPrefixIn(PrefixNamespace ns,
                                                        absl::Span<const int32_t> tokens) override;
  absl::Status Free(SlotId id) override;
  absl::StatusOr<SlotInfo> Info(SlotId id) const override;

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
  bool CanContinueForward(Forward& previous, absl::Span<const DecodeRow> rows) override;
  absl::StatusOr<std::unique_ptr<Forward>> BeginPrefill(absl::Span<const PrefillRow> rows) override;
  absl::StatusOr<std::unique_ptr<Forward>> BeginPrefillInPlace(
      SlotId id, absl::Span<const int32_t> tokens) override;
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
  int64_t MatchPrefixIn(PrefixNamespace ns, absl::Span<const int32_t> tokens) const override;
  absl::Status SetPrefixNamespace(SlotId id, PrefixNamespace ns) override;

  absl::Status Donate(SlotId id) override;
  absl::Status CheckFinite(SlotId id, const char* purpose) override;

  // Makes the first lane, so that a cache that cannot get one fails at Create.
  // Makes `count` lanes (at least one): as many taken at once, then given back idle.
  absl::Status WarmLanes(int32_t count) {
    std::vector<LanePool::Lease> held;
    for (int32_t i = 0; i < std::max(count, 1); ++i) {
      absl::StatusOr<LanePool::Lease> lane = lanes_.Take();
      if (!lane.ok()) return lane.status();
      held.push_back(*std::move(lane));
    }
    return absl::OkStatus();
  }
  // Every host entry's pinned buffer allocated now (CacheOptions::host_pin_at_start).
  absl::Status PinHostTier() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    for (int32_t e = 0; host_ != nullptr && e < host_->capacity(); ++e) {
      if (absl::StatusOr<void*> b = host_->Buffer(e); !b.ok()) return b.status();
    }
    return absl::OkStatus();
  }

  // --- used by ForwardImpl ---
  SlotPool& pool() override { return *pool_; }
  // Books a forward's end: Commit's effect on every row (commit), or releases the rows
  // unchanged (marked broken when `broken`). Returns the spare slots to the pool either way.
  void EndForward(const ForwardRows& rows, bool commit, bool broken);
  // After cursors advanced (commit, accept): folds and snapshots the rows at a track
  // boundary, waits for the lane, then releases every row.
  absl::Status AfterAdvance(const std::vector<int32_t>& index, Lane& lane);
  // Folds rows[i] (busy, owned by the caller) whose cursor is past `max_pos`: queued on the
  // lane and booked at once (cursor 0, `counter`; waiting drafts discarded); the caller waits
  // for the lane and on an error calls MarkBroken(*folded). A fold that cannot be queued marks
  // its rows broken.
  absl::Status FoldRows(const std::vector<int32_t>& rows, int32_t max_pos,
                        int64_t CacheStats::*counter, Lane& lane, std::vector<int32_t>* folded);
  // Forgets the waiting drafts of busy rows (a verify's first layer is about to overwrite
  // their records; index -1 = padding).
  void DiscardDrafts(const std::vector<int32_t>& index) ABSL_LOCKS_EXCLUDED(mu_);
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
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The refusal of any change to a slot that is being moved out.
  absl::Status MovingLocked(SlotId id, int32_t index, const std::string& field) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks a live slot busy for an operation; refuses a slot that is busy, being moved out or
  // has drafts.
  absl::StatusOr<int32_t> AcquireLocked(SlotId id, const std::string& field, bool allow_pending)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A free slot, evicting the least recently used unreferenced snapshot when none is free:
  // with the host tier, one whose state the host holds first (no loss), then any (dropped:
  // this path never waits for a spill; MakeRoom is the one that spills).
  absl::StatusOr<int32_t> TakeFreeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // How many TakeFreeLocked calls would succeed now, counted up to `need` (free slots, then
  // snapshots it may evict); evicts nothing.
  size_t TakableLocked(size_t need) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // TakeFreeLocked's refusal.
  absl::Status NoFreeSlotLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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
  void DropBackendLocked(int32_t victim) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The least recently used snapshot nothing uses that `which` accepts, or -1.
  int32_t LruVictimLocked(const std::function<bool(const Slot&)>& which) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Books host entries that HostTier::Reserve evicted: reported removed from kHost, unlinked
  // from a backend snapshot holding the same state.
  void HostEvictedLocked(const std::vector<HostTier::Entry>& evicted)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new backend snapshot at `index` whose key the host tier holds shares that entry (its
  // eviction then costs no copy).
  void LinkHostLocked(int32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Spills the least recently used snapshots to the host tier until `n` slots are free (or
  // none can be spilled: everything live or in use, the host tier full of entries in use).
  // Each copy runs on a lane of its own without the lock; the snapshot stays findable in
  // backend memory until its state is on the host. Nothing without the host tier.
  void MakeRoom(size_t n) ABSL_LOCKS_EXCLUDED(mu_);
  // The same until namespace `ns` is under its bound (max_snapshots_per_namespace), spilling
  // its own snapshots: Donate's, so that the bound's eviction moves a snapshot to the host
  // instead of dropping it.
  void MakeNamespaceRoom(PrefixNamespace ns) ABSL_LOCKS_EXCLUDED(mu_);
  // Both: spills the least recently used unused snapshots `which` accepts until `done()`
  // (called under the lock) or none can be spilled.
  void SpillUntil(const std::function<bool()>& done, const std::function<bool(const Slot&)>& which)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Spilling `victim` (an unused snapshot without a host copy): a host entry reserved and the
  // snapshot marked busy, or -1 (every host entry in use). *displaced (when given): the
  // reservation evicted a host entry that backed a backend snapshot.
  int32_t StartSpillLocked(int32_t victim, bool* displaced = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After Spill: the entry holds the snapshot's state (true), or is given back.
  bool EndSpillLocked(int32_t victim, int32_t e, const absl::Status& st)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The spiller's thread (host_spill_ahead > 0): woken when a slot is taken, it copies the
  // least recently used snapshots to the host until host_spill_ahead slots are obtainable
  // without loss. A forward never waits for it.
  void SpillAhead() ABSL_LOCKS_EXCLUDED(mu_);
  // The snapshot the spiller copies next, or -1 when enough slots are obtainable already.
  int32_t SpillAheadVictimLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the host tier holds snapshot s's state.
  bool HostBackedLocked(const Slot& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return s.host >= 0 || host_->Find(s.ns, s.tokens) >= 0;
  }
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

  // Whether namespace `ns` holds max_snapshots_per_namespace backend snapshots (or more).
  bool NamespaceFullLocked(PrefixNamespace ns) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Room for one more snapshot in namespace `ns` (CacheOptions::max_snapshots_per_namespace):
  // true when it is under its bound, or once its own least recently used snapshot is evicted
  // (one the host tier holds first: nothing lost).
  // A true answer counts the new snapshot; SnapshotDroppedLocked takes it back.
  bool ReserveSnapshotLocked(PrefixNamespace ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SnapshotDroppedLocked(PrefixNamespace ns) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    --ns_snapshots_[ns];
  }

  void StartLiveLocked(int32_t index, std::vector<int32_t> tokens)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // Returns a live slot to the free list; its id stops working.
  void ReleaseLocked(int32_t index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    slots_[index] = Slot{Kind::kFree, slots_[index].generation + 1};
    free_.push_back(index);
  }

  // Reports a snapshot stored in or removed from the prefix cache (CacheOptions::event_sink).
  void EmitLocked(CacheEvent::Type type, PrefixNamespace ns, const std::vector<int32_t>& tokens,
                  Medium medium) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void TouchLocked(int32_t snapshot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    lru_.splice(lru_.begin(), lru_, slots_[snapshot].lru);
  }

  // Opens a forward over rows.index's slots `ids` (one per row): takes a lane, marks every
  // non-padding slot busy (field(r) names row r's slot in errors; nothing is taken if any row
  // fails), takes a prefill's spare slots when `spares`, and starts the forward.
  absl::StatusOr<std::unique_ptr<Forward>> Open(ForwardRows rows, absl::Span<const SlotId> ids,
                                                absl::FunctionRef<std::string(size_t)> field,
                                                bool spares, bool layer_waits);
  // Releases the rows `index` names (busy no more) and sets every entry to -1.
  void ReleaseRowsLocked(std::vector<int32_t>& index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Marks rows busy as Open does; on an error releases what it took.
  absl::Status AcquireRowsLocked(absl::Span<const SlotId> ids,
                                 absl::FunctionRef<std::string(size_t)> field, bool allow_pending,
                                 std::vector<int32_t>* index) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED naming the first row of `index` (-1: none) no spare slot is left for,
  // counting the free slots, the snapshots a take may evict and `coming` more (snapshots whose
  // spill to the host is in flight); nothing is taken.
  absl::Status SparesRefusalLocked(const std::vector<int32_t>& index, size_t coming) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
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
  // Acquires `id` (busy), folds it and checks that its state is finite (CheckShareable): its
  // index, still busy; on a refusal the slot is left as it was (not busy) and the status given.
  absl::StatusOr<int32_t> AcquireShareable(SlotId id, const char* purpose);
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
  uint64_t slots_taken_ ABSL_GUARDED_BY(mu_) = 0;  // wakes the spiller
  int32_t spills_in_flight_ ABSL_GUARDED_BY(mu_) = 0;  // their snapshots busy: MakeRoom waits
  int64_t spills_ended_ ABSL_GUARDED_BY(mu_) = 0;      // SpillUntil's wait: one more ended
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread spiller_;  // last: started once everything else is

  friend class ForwardImpl;
};

}  // namespace replayssm::cache::internal

#endif  // REPLAYSSM_CACHE_STATE_CACHE_IMPL_H_
