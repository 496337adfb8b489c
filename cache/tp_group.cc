#include "tp_group.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "replayssm/cache/tp.h"
#include "state_cache_impl.h"
#include "tp_slot_io.h"

namespace replayssm::cache {
namespace {

class TpGroup;

const void* Advance(const void* p, int64_t bytes) {
  return p == nullptr ? nullptr : static_cast<const uint8_t*>(p) + bytes;
}
void* Advance(void* p, int64_t bytes) {
  return p == nullptr ? nullptr : static_cast<uint8_t*>(p) + bytes;
}

// Rank r's view of a rank-major io of n tokens.
LayerIo ShardIo(const ModelSpec& shard, const LayerIo& io, int64_t n, int32_t rank) {
  const int64_t at = rank * n * rssm_dtype_size(shard.shape.act_dtype);
  return LayerIo{Advance(io.mixed_qkv, at * shard.QkvWidth()), Advance(io.a, at * shard.AWidth()),
                 Advance(io.b, at * shard.BWidth()), Advance(io.out, at * shard.OutWidth()),
                 io.memory};
}

// A forward of the group: one forward per shard, driven together.
class TpForward final : public Forward {
 public:
  TpForward(TpGroup* group, std::vector<std::unique_ptr<Forward>> shards)
      : group_(group), shards_(std::move(shards)) {}
  ~TpForward() override;

  int32_t batch() const override { return shards_[0]->batch(); }
  int64_t tokens() const override { return shards_[0]->tokens(); }
  absl::Status RunLayer(int32_t layer, const LayerIo& io) override;
  absl::Status RunLayers(absl::Span<const LayerIo> layers, absl::Span<const LayerDoorbells> bells,
                         uint32_t value) override;
  absl::Status Synchronize() override {
    return Each([](Forward& f) { return f.Synchronize(); });
  }
  void* stream() const override { return shards_[0]->stream(); }
  absl::Status QueueWait(const uint32_t* addr, uint32_t value) override {
    return Each([&](Forward& f) { return f.QueueWait(addr, value); });
  }
  // The word means "every rank's work before it is done": the other ranks' streams are
  // waited for on the host, then the last rank's stream writes it.
  absl::Status QueueSignal(uint32_t* addr, uint32_t value) override;
  // The earliest unrung wait of any rank (each rank counts its predecessor's waits first, so
  // a predecessor's on any rank comes before every rank's own), not rank 0's: a wait rank 0
  // had rung would otherwise hide another rank's earlier unrung one.
  int32_t ReleaseWaits() override {
    int32_t first = -1;
    Each([&](Forward& f) {
      const int32_t i = f.ReleaseWaits();
      if (i >= 0 && (first < 0 || i < first)) first = i;
      return absl::OkStatus();
    }).IgnoreError();
    return first;
  }
  absl::Status Commit() override;

  std::vector<std::unique_ptr<Forward>>& shards() { return shards_; }
  // Abandons what is left of every rank's part, each on its device; the caller holds ops_mu.
  void DropLocked();

 private:
  // Runs `op` on every rank's forward in order, each on its rank's device; the first error.
  template <typename Op>
  absl::Status Each(Op op);

  TpGroup* group_;
  std::vector<std::unique_ptr<Forward>> shards_;
};

class TpGroup final : public StateCache, public TpSlotIoHost {
 public:
  TpGroup(ModelSpec full, CacheOptions options) : full_(std::move(full)), options_(options) {
    full_.tp_size = options_.tp_size;
  }

  ~TpGroup() override {
    for (size_t r = 0; r < shards_.size(); ++r) {
      Use(r);  // a shard frees its memory on its own device
      shards_[r].reset();
    }
  }

  absl::Status Init() {
    if (!options_.devices.empty() &&
        static_cast<int32_t>(options_.devices.size()) != options_.tp_size) {
      return absl::InvalidArgumentError(absl::StrCat("options.devices: expected ", options_.tp_size,
                                                     " devices (one per rank), got ",
                                                     options_.devices.size()));
    }
    for (int32_t r = 0; r < options_.tp_size; ++r) {
      layouts_.push_back(ShardOf(full_, options_.tp_size, r));
      models_.push_back(ShardModel(full_, layouts_.back()));
      state_runs_.push_back(LayerStateRuns(full_, layouts_.back()));
    }
    map_ = TpLayerMap::Of(full_, models_, state_runs_);
    if (options_.event_sink) {
      events_ = std::make_unique<TpEventMerger>(options_.tp_size, options_.event_sink);
    }
    for (int32_t r = 0; r < options_.tp_size; ++r) {
      CacheOptions o = options_;
      o.tp_size = 1;
      o.slot_name = [this, r](SlotId id) { return ShardSlotName(r, id); };
      o.devices.clear();
      if (options_.event_sink) {
        o.event_sink = [this, r](const CacheEvent& e) { events_->OnShardEvent(r, e); };
      }
      if (!options_.devices.empty()) {
        if (rssm_status st = rssm_set_device(options_.backend, options_.devices[r]); st != RSSM_OK) {
          return absl::InvalidArgumentError(
              absl::StrCat("options.devices[", r, "]: ", rssm_last_error()));
        }
      }
      absl::StatusOr<std::unique_ptr<StateCache>> c = StateCache::Create(models_[r], o);
      if (!c.ok()) {
        return absl::Status(c.status().code(),
                            absl::StrCat("tp rank ", r, ": ", c.status().message()));
      }
      shards_.push_back(*std::move(c));
    }
    return absl::OkStatus();
  }

  const ModelSpec& model() const override { return full_; }
  const CacheOptions& options() const override { return options_; }
  int64_t capacity() const override { return shards_[0]->capacity(); }
  CacheStats stats() const override {
    // The shards' counters and the group's corrections are read together: between a rank's
    // count and the group's correction a scrape saw a counter that then went down (read as a
    // reset by Prometheus).
    absl::MutexLock counting(&counting_mu_);
    CacheStats s = shards_[0]->stats();
    for (size_t r = 1; r < shards_.size(); ++r) {  // the counters agree; bytes and lanes add
      const CacheStats t = shards_[r]->stats();
      s.lanes += t.lanes;
      // A donation is refused by one rank: the first to find its shard not finite (Fan stops
      // there); a move out by every rank that does (they check together: the repeats are
      // taken off below); a track snapshot skipped once per rank skipping it.
      s.nonfinite_refusals += t.nonfinite_refusals;
      s.backend_snapshot_bytes += t.backend_snapshot_bytes;
      s.host_bytes += t.host_bytes;
      s.host_capacity_bytes += t.host_capacity_bytes;
      // Each shard spills ahead on its own thread: the group's lossless evictions are those
      // every shard's are.
      s.host_backed_snapshots = std::min(s.host_backed_snapshots, t.host_backed_snapshots);
    }
    s.nonfinite_refusals -= repeated_refusals_;
    s.snapshot_hits -= uncounted_.snapshot_hits;
    s.snapshot_misses -= uncounted_.snapshot_misses;
    s.host_hits -= uncounted_.host_hits;
    s.host_misses -= uncounted_.host_misses;
    return s;
  }

  absl::StatusOr<SlotId> Allocate() override {
    absl::MutexLock ops(&ops_mu_);
    std::vector<SlotId> ids;
    for (size_t r = 0; r < shards_.size(); ++r) {
      Use(r);
      absl::StatusOr<SlotId> id = shards_[r]->Allocate();
      if (!id.ok()) return FreeAll(ids, id.status());
      ids.push_back(*id);
    }
    return Bind(std::move(ids));
  }
  absl::StatusOr<PrefixAllocation> AllocateFromPrefix(absl::Span<const int32_t> tokens) override {
    return AllocateFromPrefixIn(kDefaultNamespace, tokens);
  }
  absl::StatusOr<PrefixAllocation> AllocateFromPrefixIn(PrefixNamespace ns,
                                                        absl::Span<const int32_t> tokens) override;
  absl::Status SetPrefixNamespace(SlotId id, PrefixNamespace ns) override {
    return Fan(id, [&](size_t, StateCache& c, SlotId s) { return c.SetPrefixNamespace(s, ns); });
  }
  absl::Status Free(SlotId id) override {
    absl::Status st = Fan(id, [](size_t, StateCache& c, SlotId s) { return c.Free(s); });
    if (st.ok()) Unbind(id);
    return st;
  }
  absl::StatusOr<SlotInfo> Info(SlotId id) const override {
    Use(0);
    return shards_[0]->Info(Members(id)[0]);
  }

  absl::Status Prefill(SlotId id, absl::Span<const int32_t> tokens,
                       absl::Span<const LayerIo> layers) override {
    if (tokens.empty()) {  // a no-op, on a slot that could take a prefill
      return Fan(id, [&](size_t r, StateCache& c, SlotId s) {
        return c.Prefill(s, tokens, ShardLayers(r, layers, 0));
      });
    }
    if (absl::Status st = full_.CheckLayerCount(layers.size(), "layers"); !st.ok()) return st;
    // Opened on every rank at once under the group's lock, as every forward: no other call
    // (a Free, an export) can land on one rank between the ranks' prefills.
    absl::StatusOr<std::unique_ptr<Forward>> f = BeginPrefillInPlace(id, tokens);
    if (!f.ok()) return f.status();
    return (*f)->RunEveryLayer(layers);
  }
  absl::StatusOr<std::unique_ptr<Forward>> BeginPrefillInPlace(
      SlotId id, absl::Span<const int32_t> tokens) override {
    const std::vector<SlotId> ids = Members(id);
    return Open([&](size_t r, StateCache& c) { return c.BeginPrefillInPlace(ids[r], tokens); });
  }

  absl::Status ImportFrom(SlotId id, absl::Span<const int32_t> tokens,
                          absl::Span<const void* const> checkpoints, IoMemory memory) override;
  absl::StatusOr<ExportedState> ExportInto(SlotId id, absl::Span<void* const> checkpoints,
                                           IoMemory memory) override;
  absl::StatusOr<std::unique_ptr<SlotReader>> OpenExport(SlotId id, absl::string_view move_id,
                                                         const SlotIoOptions& options) override;
  absl::StatusOr<std::unique_ptr<SlotWriter>> OpenImport(int64_t seq_len,
                                                         const SlotIoOptions& options) override;
  absl::StatusOr<std::unique_ptr<BackendBuffer>> AllocateBackendBuffer(size_t bytes) override {
    Use(0);
    return shards_[0]->AllocateBackendBuffer(bytes);
  }

  absl::StatusOr<std::unique_ptr<Forward>> BeginForward(
      absl::Span<const DecodeRow> rows) override {
    const std::vector<std::vector<DecodeRow>> mine = RankRows(rows);
    return Open([&](size_t r, StateCache& c) { return c.BeginForward(mine[r]); });
  }
  absl::StatusOr<std::unique_ptr<Forward>> ContinueForward(
      std::unique_ptr<Forward>& previous, absl::Span<const DecodeRow> rows) override;
  bool CanContinueForward(Forward& previous, absl::Span<const DecodeRow> rows) override;
  absl::StatusOr<std::unique_ptr<Forward>> BeginPrefill(
      absl::Span<const PrefillRow> rows) override {
    const std::vector<std::vector<PrefillRow>> mine = RankRows(rows);
    return Open([&](size_t r, StateCache& c) { return c.BeginPrefill(mine[r]); });
  }
  absl::StatusOr<std::unique_ptr<Forward>> BeginVerify(
      absl::Span<const SlotId> slots, int32_t num_draft,
      absl::Span<const int32_t> draft_tokens) override {
    const std::vector<std::vector<SlotId>> mine = RankRows(slots);
    return Open([&](size_t r, StateCache& c) {
      return c.BeginVerify(mine[r], num_draft, draft_tokens);
    });
  }
  absl::Status Verify(absl::Span<const SlotId> slots, int32_t num_draft,
                      absl::Span<const int32_t> draft_tokens,
                      absl::Span<const LayerIo> layers) override {
    if (absl::Status st = full_.CheckLayerCount(layers.size(), "layers"); !st.ok()) return st;
    absl::StatusOr<std::unique_ptr<Forward>> f = BeginVerify(slots, num_draft, draft_tokens);
    if (!f.ok()) return f.status();
    return (*f)->RunEveryLayer(layers);
  }
  absl::Status Accept(SlotId id, int32_t n) override {
    return Fan(id, [&](size_t, StateCache& c, SlotId s) { return c.Accept(s, n); });
  }

  int64_t MatchPrefix(absl::Span<const int32_t> tokens) const override {
    return MatchPrefixIn(kDefaultNamespace, tokens);
  }
  int64_t MatchPrefixIn(PrefixNamespace ns, absl::Span<const int32_t> tokens) const override {
    int64_t m = static_cast<int64_t>(tokens.size());
    for (;;) {  // the longest prefix every shard holds: m only shrinks
      int64_t lo = m, hi = 0;
      for (size_t r = 0; r < shards_.size(); ++r) {
        Use(r);
        const int64_t got = shards_[r]->MatchPrefixIn(ns, tokens.subspan(0, m));
        lo = std::min(lo, got);
        hi = std::max(hi, got);
      }
      if (lo == hi) return lo;
      m = lo;
    }
  }
  // Every rank's state is checked before any rank donates: a refusal of rank r > 0 after
  // rank 0 had donated left rank 0's slot a snapshot (the handle dead) and rank r's live with
  // no handle to free it (an outside review).
  // Both under one hold of ops_mu_: no forward begins on the slot in between.
  absl::Status Donate(SlotId id) override {
    absl::MutexLock ops(&ops_mu_);
    absl::Status st =
        FanLocked(id, [](size_t, StateCache& c, SlotId s) { return c.CheckFinite(s, "donate"); });
    if (st.ok()) st = FanLocked(id, [](size_t, StateCache& c, SlotId s) { return c.Donate(s); });
    if (st.ok()) Unbind(id);
    return st;
  }
  absl::Status CheckFinite(SlotId id, const char* purpose) override {
    return Fan(id,
               [purpose](size_t, StateCache& c, SlotId s) { return c.CheckFinite(s, purpose); });
  }

  // Makes rank r's device the calling thread's current one (before every call into shard r:
  // what it allocates and the streams it makes belong there). No-op without devices.
  void Use(size_t r) const override {
    if (!options_.devices.empty()) rssm_set_device(options_.backend, options_.devices[r]);
  }
  bool ranks_at_once() const override {
    if (options_.tp_ranks_at_once == CacheOptions::TpRanksAtOnce::kAlways) return true;
    return options_.backend != RSSM_BACKEND_CPU && RanksOnDistinctDevices(options_.devices);
  }

  // --- for TpForward, the readers and writers ---
  absl::Mutex& ops_mu() override { return ops_mu_; }
  int32_t backend() const override { return options_.backend; }
  const ModelSpec& shard_model(size_t r) const { return models_[r]; }
  std::vector<LayerIo> ShardLayers(size_t r, absl::Span<const LayerIo> layers, int64_t n) const {
    std::vector<LayerIo> io;
    for (const LayerIo& l : layers) io.push_back(ShardIo(models_[r], l, n, static_cast<int32_t>(r)));
    return io;
  }
  SlotId Bind(std::vector<SlotId> ids) override {
    absl::MutexLock lock(&map_mu_);
    const SlotId group = ids[0];
    for (size_t r = 1; r < ids.size(); ++r) group_of_[r][ids[r]] = group;
    members_[group] = std::move(ids);
    return group;
  }
  void Unbind(SlotId group) override {
    absl::MutexLock lock(&map_mu_);
    auto it = members_.find(group);
    if (it == members_.end()) return;
    for (size_t r = 1; r < it->second.size(); ++r) group_of_[r].erase(it->second[r]);
    members_.erase(it);
  }
  // A failure of rank r > 0 after rank 0 accepted the same call names the rank.
  static absl::Status RankStatus(size_t r, const absl::Status& st) {
    if (r == 0 || st.ok()) return st;
    return absl::Status(st.code(), absl::StrCat("tp rank ", r, ": ", st.message()));
  }
  std::unique_ptr<uint8_t[]> TakePayloadBuffer() override {
    absl::MutexLock lock(&buffers_mu_);
    if (spare_buffers_.empty()) return std::make_unique_for_overwrite<uint8_t[]>(payload_bytes_);
    std::unique_ptr<uint8_t[]> b = std::move(spare_buffers_.back());
    spare_buffers_.pop_back();
    return b;
  }
  void ReturnPayloadBuffer(std::unique_ptr<uint8_t[]> buffer) override {
    absl::MutexLock lock(&buffers_mu_);
    if (buffer != nullptr && spare_buffers_.size() < kSpareBuffers) {
      spare_buffers_.push_back(std::move(buffer));
    }
  }
  // Frees `ids` (one per shard, in order) and returns `why`.
  absl::Status FreeAll(const std::vector<SlotId>& ids, absl::Status why) override {
    for (size_t r = 0; r < ids.size(); ++r) {
      if (ids[r] == kPaddingSlot) continue;  // that rank has none
      Use(r);
      shards_[r]->Free(ids[r]).IgnoreError();
    }
    return why;
  }

 private:
  // Every shard's id of a group id. An id the group does not know maps to itself on every
  // shard: rank 0 then refuses it with its own message (NOT_FOUND), before any other rank.
  std::vector<SlotId> Members(SlotId id) const {
    absl::MutexLock lock(&map_mu_);
    auto it = members_.find(id);
    if (it != members_.end()) return it->second;
    std::vector<SlotId> ids(shards_.size(), NoSlot(id));
    ids[0] = id;  // rank 0 refuses it, naming it
    return ids;
  }
  // What ranks r > 0 get for an id that is no group's: an index no pool has, so no rank
  // touches another group's slot that happens to have that id there (ranks run at once).
  static SlotId NoSlot(SlotId id) { return id == kPaddingSlot ? id : id | 0xffffffffULL; }
  // Each rank's copy of `rows` (slot ids, or rows with a `slot`), its ids in place of the
  // group's: one lookup per row for all ranks. Padding stays; unknown ids as Members.
  template <typename Row>
  std::vector<std::vector<Row>> RankRows(absl::Span<const Row> rows) const {
    std::vector<std::vector<Row>> out(shards_.size(), std::vector<Row>(rows.begin(), rows.end()));
    absl::MutexLock lock(&map_mu_);
    for (size_t i = 0; i < rows.size(); ++i) {
      auto it = members_.find(SlotOf(rows[i]));
      for (size_t r = 1; r < out.size(); ++r) {
        SlotOf(out[r][i]) = it != members_.end() ? it->second[r] : NoSlot(SlotOf(rows[i]));
      }
    }
    return out;
  }
  static SlotId& SlotOf(SlotId& id) { return id; }
  static SlotId SlotOf(const SlotId& id) { return id; }
  template <typename Row>
  static SlotId& SlotOf(Row& row) { return row.slot; }
  template <typename Row>
  static SlotId SlotOf(const Row& row) { return row.slot; }
  std::string ShardSlotName(int32_t r, SlotId id) const {
    SlotId group = id;
    if (r > 0) {
      absl::MutexLock lock(&map_mu_);
      auto it = group_of_[r].find(id);
      if (it != group_of_[r].end()) group = it->second;
    }
    return options_.slot_name ? options_.slot_name(group) : absl::StrCat("0x", absl::Hex(group));
  }
  // Runs `op` on every shard, rank 0 first (it decides refusals), in order under ops_mu_.
  template <typename Op>
  absl::Status Fan(SlotId id, Op op) {
    absl::MutexLock ops(&ops_mu_);
    return FanLocked(id, op);
  }
  template <typename Op>
  absl::Status FanLocked(SlotId id, Op op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(ops_mu_) {
    const std::vector<SlotId> ids = Members(id);
    for (size_t r = 0; r < shards_.size(); ++r) {
      Use(r);
      if (absl::Status st = op(r, *shards_[r], ids[r]); !st.ok()) return RankStatus(r, st);
    }
    return absl::OkStatus();
  }
  template <typename Begin>
  absl::StatusOr<std::unique_ptr<Forward>> Open(Begin begin) {
    absl::MutexLock ops(&ops_mu_);
    std::vector<std::unique_ptr<Forward>> fs;
    for (size_t r = 0; r < shards_.size(); ++r) {
      Use(r);
      absl::StatusOr<std::unique_ptr<Forward>> f = begin(r, *shards_[r]);
      if (!f.ok()) return RankStatus(r, f.status());  // the opened ones are abandoned
      fs.push_back(*std::move(f));
    }
    return std::unique_ptr<Forward>(std::make_unique<TpForward>(this, std::move(fs)));
  }

  ModelSpec full_;  // the unsharded model, tp_size = the group's
  const CacheOptions options_;
  std::vector<TpShard> layouts_;
  std::vector<ModelSpec> models_;
  std::vector<std::vector<SliceRun>> state_runs_;
  TpLayerMap map_;  // the ranks' bytes in an unsharded layer state (slot I/O)
  // Payload buffers of finished moves out, kept for the next ones (a few moves at once; more
  // allocate their own).
  static constexpr size_t kSpareBuffers = 4;
  const size_t payload_bytes_ = SlotPayloadBytes(full_);
  absl::Mutex buffers_mu_;
  std::vector<std::unique_ptr<uint8_t[]>> spare_buffers_ ABSL_GUARDED_BY(buffers_mu_);
  // The shards' events merged (called under a shard's lock; its own lock after it, never
  // before one). Created before the shards, gone after them.
  std::unique_ptr<TpEventMerger> events_;
  std::vector<std::unique_ptr<StateCache>> shards_;
  absl::Mutex ops_mu_;  // orders the shards' slot decisions the same way on every shard
  // Held by stats() and around every operation whose shard counts the group corrects (a
  // lookup asked again, a move out refused by several ranks): a scrape never sees a count
  // before its correction. After ops_mu_; before a shard's lock.
  mutable absl::Mutex counting_mu_;
  // Refusals of a move out counted by more than one rank, beyond the first (stats()).
  int64_t repeated_refusals_ ABSL_GUARDED_BY(counting_mu_) = 0;
  // Rank 0's lookups asked again shorter (the ranks held different prefixes): taken off the
  // lookup counters it reports for the group.
  CacheStats uncounted_ ABSL_GUARDED_BY(counting_mu_);
  mutable absl::Mutex map_mu_;  // after a shard's lock (slot names), never before one
  absl::flat_hash_map<SlotId, std::vector<SlotId>> members_ ABSL_GUARDED_BY(map_mu_);
  absl::flat_hash_map<SlotId, SlotId> group_of_[kMaxTpSize] ABSL_GUARDED_BY(map_mu_);
};

// ---- forwards ----

TpForward::~TpForward() {
  // Parts taken over by a continuation leave nothing to abandon: no lock then (a continuation
  // must never wait for it: TpGroup::ContinueForward).
  if (std::all_of(shards_.begin(), shards_.end(), [](const auto& f) { return f == nullptr; })) {
    return;
  }
  absl::MutexLock ops(&group_->ops_mu());  // abandonment returns spares: in order
  DropLocked();
}

void TpForward::DropLocked() {
  for (size_t r = 0; r < shards_.size(); ++r) {
    group_->Use(r);
    shards_[r].reset();
  }
}

template <typename Op>
absl::Status TpForward::Each(Op op) {
  for (size_t r = 0; r < shards_.size(); ++r) {
    group_->Use(r);
    if (absl::Status st = op(*shards_[r]); !st.ok()) return TpGroup::RankStatus(r, st);
  }
  return absl::OkStatus();
}

// The word means "every rank's work before it is done": the other ranks' streams are waited
// for on the host, then the last rank's stream writes it.
absl::Status TpForward::QueueSignal(uint32_t* addr, uint32_t value) {
  const size_t last = shards_.size() - 1;
  for (size_t r = 0; r < last; ++r) {
    group_->Use(r);
    if (absl::Status st = shards_[r]->Synchronize(); !st.ok()) return TpGroup::RankStatus(r, st);
  }
  group_->Use(last);
  return TpGroup::RankStatus(last, shards_[last]->QueueSignal(addr, value));
}

absl::Status TpForward::RunLayer(int32_t layer, const LayerIo& io) {
  for (size_t r = 0; r < shards_.size(); ++r) {
    const LayerIo mine = ShardIo(group_->shard_model(r), io, tokens(), static_cast<int32_t>(r));
    group_->Use(r);
    if (absl::Status st = shards_[r]->RunLayer(layer, mine); !st.ok()) {
      return TpGroup::RankStatus(r, st);
    }
  }
  return absl::OkStatus();
}

// Layer by layer, each rank's wait, layer and signal in turn (on the CPU backend a wait blocks
// the caller, so every rank must reach layer l before any waits for layer l + 1). The io is
// either num_layers rank-major ios (ShardIo) or num_layers per rank, each the rank's own
// tensors (its engine's memory, on its GPU), rank-major. Bells are
// either each rank's own (num_layers per rank, rank-major: its engine rank rings and watches
// them) or one pair per layer for the whole group: every rank waits for its ready, and its done
// is written once every rank's layer is done (QueueSignal).
absl::Status TpForward::RunLayers(absl::Span<const LayerIo> layers,
                                  absl::Span<const LayerDoorbells> bells, uint32_t value) {
  const size_t num_layers = static_cast<size_t>(group_->model().num_layers);
  const size_t ranks = shards_.size();
  const bool per_rank = layers.size() == num_layers * ranks && ranks > 1;
  if (layers.size() != num_layers && !per_rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers: expected ", num_layers, " (each io rank-major) or ", num_layers * ranks,
        " (each rank's own io, rank-major), got ", layers.size()));
  }
  const bool shared = bells.size() == num_layers;
  if (!bells.empty() && !shared && bells.size() != num_layers * ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bells: expected none, ", num_layers, " (one pair per layer for the group) or ",
        num_layers * ranks, " (", num_layers, " layers for each of ", ranks,
        " ranks, rank-major), got ", bells.size()));
  }
  for (size_t i = 0; i < bells.size(); ++i) {
    if (bells[i].ready == nullptr || bells[i].done == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("bells[", i, "]: expected two words, got null"));
    }
  }
  for (size_t l = 0; l < num_layers; ++l) {
    for (size_t r = 0; r < ranks; ++r) {
      Forward& f = *shards_[r];
      group_->Use(r);
      const LayerDoorbells* b = nullptr;
      if (!bells.empty()) b = shared ? &bells[l] : &bells[r * num_layers + l];
      absl::Status st = b != nullptr ? f.QueueWait(b->ready, value) : absl::OkStatus();
      if (st.ok()) {
        st = f.RunLayer(static_cast<int32_t>(l),
                        per_rank ? layers[r * num_layers + l]
                                 : ShardIo(group_->shard_model(r), layers[l], tokens(),
                                           static_cast<int32_t>(r)));
      }
      if (st.ok() && b != nullptr && !shared) st = f.QueueSignal(b->done, value);
      if (!st.ok()) return TpGroup::RankStatus(r, st);
    }
    if (shared) {
      if (absl::Status st = QueueSignal(bells[l].done, value); !st.ok()) return st;
    }
  }
  return absl::OkStatus();
}

absl::Status TpForward::Commit() {
  // Every rank's device work is confirmed (outside the group's lock: it waits for the device)
  // and every rank's part checked before any rank's cursors move: a refusal on rank r used to
  // come after the ranks before it had committed, and one after the move (a fold that failed
  // on rank r) kept the ranks after it from committing, so a row could stand a token further
  // on some ranks than on others, usable and wrong.
  if (absl::Status st = Synchronize(); !st.ok()) return st;
  absl::MutexLock ops(&group_->ops_mu());
  std::vector<internal::ForwardImpl*> parts;
  for (std::unique_ptr<Forward>& f : shards_) {
    parts.push_back(dynamic_cast<internal::ForwardImpl*>(f.get()));
    if (parts.back() == nullptr) {
      return absl::InternalError("forward: a rank's part is not a rank cache's forward");
    }
  }
  for (size_t r = 0; r < parts.size(); ++r) {
    group_->Use(r);
    if (absl::Status st = parts[r]->CheckCommit(); !st.ok()) return TpGroup::RankStatus(r, st);
  }
  // Every rank applies, whatever another's apply said: it cannot refuse any more.
  absl::Status first = absl::OkStatus();
  for (size_t r = 0; r < parts.size(); ++r) {
    group_->Use(r);
    if (absl::Status st = parts[r]->ApplyCommit(); !st.ok() && first.ok()) {
      first = TpGroup::RankStatus(r, st);
    }
  }
  return first;
}

bool TpGroup::CanContinueForward(Forward& previous, absl::Span<const DecodeRow> rows) {
  auto* prev = dynamic_cast<TpForward*>(&previous);
  if (prev == nullptr) return false;
  const std::vector<std::vector<DecodeRow>> rank_rows = RankRows(rows);
  for (size_t r = 0; r < shards_.size(); ++r) {
    Use(r);
    if (!shards_[r]->CanContinueForward(*prev->shards()[r], rank_rows[r])) return false;
  }
  return true;
}

absl::StatusOr<std::unique_ptr<Forward>> TpGroup::ContinueForward(
    std::unique_ptr<Forward>& previous, absl::Span<const DecodeRow> rows) {
  auto* prev = dynamic_cast<TpForward*>(previous.get());
  if (prev == nullptr) {
    return absl::InvalidArgumentError("previous: expected a forward of this cache");
  }
  const std::vector<std::vector<DecodeRow>> rank_rows = RankRows(rows);
  // ops_mu_ is tried, never waited for: the caller holds its planned forward's lock, which
  // that forward's deadline needs to ring its doorbells, and a holder of ops_mu_ may wait for
  // the device (a begin that made a lane or grew a scratch buffer freed memory then, and
  // freeing device memory waits for every stream; neither frees now, but a holder may still
  // synchronize), so for those very doorbells -- a cycle that hung every planned forward of
  // the server (an outside review). Busy: not continued; the caller commits
  // previous the usual way, outside its lock.
  if (!ops_mu_.TryLock()) return std::unique_ptr<Forward>();
  struct Unlocks {  // at every return, once its value is made
    absl::Mutex* mu;
    ~Unlocks() { mu->Unlock(); }
  } held{&ops_mu_};
  // Every rank or none: a rank that cannot continue (its part of the forward before previous
  // not done on its GPU yet, ranks run at their own pace) leaves every rank's part as it was,
  // and the caller commits previous the usual way -- waiting, with its deadline, outside any
  // lock. (Rank 0 used to continue alone and the others' parts were committed here, waiting
  // on the engine's doorbells under the caller's locks: an engine gone then hung them.)
  if (!CanContinueForward(*prev, rows)) return std::unique_ptr<Forward>();
  std::vector<std::unique_ptr<Forward>> next;
  for (size_t r = 0; r < shards_.size(); ++r) {
    Use(r);
    absl::StatusOr<std::unique_ptr<Forward>> f =
        shards_[r]->ContinueForward(prev->shards()[r], rank_rows[r]);
    if (f.ok() && *f != nullptr) {
      next.push_back(*std::move(f));
      continue;
    }
    if (r == 0 && f.ok()) return std::unique_ptr<Forward>();  // nothing consumed
    // Checked above, so only a device error comes here, after some ranks took their part
    // over: previous counts as consumed (as a single cache's failed continuation). What is
    // left of it is abandoned and the continued parts with it: each rings its doorbells
    // first, so none waits for the engine. The ranks' rows may then disagree; a device error
    // refuses the device anyway.
    prev->DropLocked();  // under the lock held here, which is never waited for
    TpForward(this, std::move(next)).DropLocked();  // the continued parts, on their devices
    previous.reset();  // nothing left in it: takes no lock
    return RankStatus(r, f.ok() ? absl::InternalError("forward: could not continue after its "
                                                      "check (a device error)")
                                : f.status());
  }
  previous.reset();  // every rank's part is owned by the new forward now: takes no lock
  return std::unique_ptr<Forward>(std::make_unique<TpForward>(this, std::move(next)));
}

absl::StatusOr<StateCache::PrefixAllocation> TpGroup::AllocateFromPrefixIn(
    PrefixNamespace ns, absl::Span<const int32_t> tokens) {
  absl::MutexLock ops(&ops_mu_);
  absl::MutexLock counting(&counting_mu_);  // rank 0's count and its correction together
  int64_t m = static_cast<int64_t>(tokens.size());
  for (;;) {  // the longest prefix every shard holds: m only shrinks
    std::vector<SlotId> ids;
    int64_t lo = m, hi = 0;
    PrefixAllocation::Source source = PrefixAllocation::Source::kNone;  // rank 0's
    for (size_t r = 0; r < shards_.size(); ++r) {
      Use(r);
      absl::StatusOr<PrefixAllocation> a = shards_[r]->AllocateFromPrefixIn(ns, tokens.subspan(0, m));
      if (!a.ok()) return FreeAll(ids, RankStatus(ids.size(), a.status()));
      ids.push_back(a->slot);
      lo = std::min(lo, a->matched);
      hi = std::max(hi, a->matched);
      if (r == 0) source = a->source;
    }
    if (lo == hi) return PrefixAllocation{Bind(std::move(ids)), lo, source};
    FreeAll(ids, absl::OkStatus()).IgnoreError();
    // The group reports rank 0's lookup counters: this attempt is asked again shorter, and
    // the group's lookup is counted once, by the last attempt.
    CountLookup(source, options_.host_snapshot_bytes != 0, uncounted_);
    m = lo;
  }
}

// ---- states in and out: unsharded bytes ----

absl::Status TpGroup::ImportFrom(SlotId id, absl::Span<const int32_t> tokens,
                                 absl::Span<const void* const> checkpoints, IoMemory memory) {
  if (absl::Status st = full_.CheckLayerCount(checkpoints.size(), "checkpoints"); !st.ok()) {
    return st;
  }
  if (memory == IoMemory::kBackend && options_.backend != RSSM_BACKEND_CPU) {
    return absl::InvalidArgumentError(
        "checkpoints: a tensor-parallel group imports unsharded states from host memory only");
  }
  std::vector<std::vector<std::vector<uint8_t>>> parts(shards_.size());
  for (size_t r = 0; r < shards_.size(); ++r) {
    for (int32_t l = 0; l < full_.num_layers; ++l) {
      std::vector<uint8_t> b(models_[r].LayerStateBytes());
      CopyToShard(checkpoints[l], 0, b.data(), 0, 1, state_runs_[r], 1);
      parts[r].push_back(std::move(b));
    }
  }
  return Fan(id, [&](size_t r, StateCache& c, SlotId s) {
    std::vector<const void*> ptrs;
    for (const std::vector<uint8_t>& b : parts[r]) ptrs.push_back(b.data());
    return c.ImportFrom(s, tokens, ptrs, IoMemory::kHost);
  });
}

absl::StatusOr<ExportedState> TpGroup::ExportInto(SlotId id, absl::Span<void* const> checkpoints,
                                                  IoMemory memory) {
  if (absl::Status st = full_.CheckLayerCount(checkpoints.size(), "checkpoints"); !st.ok()) {
    return st;
  }
  if (memory == IoMemory::kBackend && options_.backend != RSSM_BACKEND_CPU) {
    return absl::InvalidArgumentError(
        "checkpoints: a tensor-parallel group exports unsharded states to host memory only");
  }
  ExportedState out;
  absl::Status st = Fan(id, [&](size_t r, StateCache& c, SlotId s) {
    absl::StatusOr<ExportedState> e = c.Export(s);
    if (!e.ok()) return e.status();
    for (int32_t l = 0; l < full_.num_layers; ++l) {
      CopyFromShard(e->checkpoints[l].data(), 0, checkpoints[l], 0, 1, state_runs_[r], 1);
    }
    if (r == 0) {
      out.seq_len = e->seq_len;
      out.tokens = std::move(e->tokens);
    }
    return absl::OkStatus();
  });
  if (!st.ok()) return st;
  return out;
}

absl::StatusOr<std::unique_ptr<SlotReader>> TpGroup::OpenExport(SlotId id,
                                                                absl::string_view move_id,
                                                                const SlotIoOptions& options) {
  SlotIoOptions mine = options;  // the ranks' chunks are copied on the host (tp_slot_io.h)
  // Host memory (or a test's choice of path): the group re-lays the bytes out on the host.
  mine.path = options.path.has_value() && *options.path != SlotIoPath::kDeviceDirect
                  ? *options.path
                  : SelectCacheSlotIoPath(options_.backend, options_.tp_size, false);
  mine.checksum = false;  // the group hashes the unsharded payload as it assembles it
  // Staged: enough chunks in flight per rank for the group's copier threads to share.
  mine.staging_buffers = std::max(options.staging_buffers, 8);
  absl::MutexLock ops(&ops_mu_);
  absl::MutexLock counting(&counting_mu_);  // the ranks' refusals and the group's correction
  // After the lock: on a refusal the ranks that opened are released (their MOVING ended)
  // before it is let go, so no Free comes between and frees the other ranks alone (an outside
  // review: a rank's slot left live with no handle, the group's capacity one short for good).
  std::vector<std::unique_ptr<SlotReader>> readers(shards_.size());
  const std::vector<SlotId> ids = Members(id);
  // The ranks fold and open together; if one refuses, the opened ones are released (a fold
  // keeps the logical state) and the first refusal by rank is returned.
  const std::vector<absl::Status> st = OnEachRank(*this, shards_.size(), [&](size_t r) {
    absl::StatusOr<std::unique_ptr<SlotReader>> rd = shards_[r]->OpenExport(ids[r], move_id, mine);
    if (!rd.ok()) return rd.status();
    readers[r] = *std::move(rd);
    return absl::OkStatus();
  });
  for (size_t r = 0; r < st.size(); ++r) {
    if (!st[r].ok()) {
      for (size_t k = 0; k < readers.size(); ++k) {
        Use(k);
        readers[k].reset();
      }
      // The ranks check together: each that found its shard not finite counted a refusal of
      // this one move. The group's count is of moves (stats() takes the extra ones off).
      const auto nonfinite = std::count_if(st.begin(), st.end(), IsNonfiniteRefusal);
      if (nonfinite > 1) repeated_refusals_ += nonfinite - 1;
      return RankStatus(r, st[r]);
    }
  }
  return NewTpReader(this, id, std::move(readers), &map_, options.chunk_bytes);
}

absl::StatusOr<std::unique_ptr<SlotWriter>> TpGroup::OpenImport(int64_t seq_len,
                                                                const SlotIoOptions& options) {
  SlotIoOptions mine = options;
  // Host memory (or a test's choice of path), as OpenExport.
  mine.path = options.path.has_value() && *options.path != SlotIoPath::kDeviceDirect
                  ? *options.path
                  : SelectCacheSlotIoPath(options_.backend, options_.tp_size, false);
  mine.checksum = false;  // the group checks the unsharded payload it receives
  absl::MutexLock ops(&ops_mu_);
  std::vector<std::unique_ptr<ShardSlotWriter>> writers(shards_.size());
  // The ranks reserve together; if one refuses, the opened ones free their slots.
  const std::vector<absl::Status> st = OnEachRank(*this, shards_.size(), [&](size_t r) {
    absl::StatusOr<std::unique_ptr<SlotWriter>> w = shards_[r]->OpenImport(seq_len, mine);
    if (!w.ok()) return w.status();
    // A shard is a StateCache of this library: its writers are NewSlotWriter's.
    auto* shard_writer = dynamic_cast<ShardSlotWriter*>(w->get());
    if (shard_writer == nullptr) {
      return absl::InternalError("the shard's slot writer cannot hash for a group");
    }
    w->release();
    writers[r].reset(shard_writer);
    return absl::OkStatus();
  });
  for (size_t r = 0; r < st.size(); ++r) {
    if (!st[r].ok()) return RankStatus(r, st[r]);
  }
  return NewTpWriter(this, std::move(writers), &map_);
}

}  // namespace

void TpEventMerger::OnShardEvent(int32_t rank, const CacheEvent& e) {
  absl::MutexLock lock(&mu_);
  const uint32_t all = (uint32_t{1} << ranks_) - 1, bit = uint32_t{1} << rank;
  auto it = held_.try_emplace({e.ns, e.tokens}).first;
  Held& h = it->second;
  uint32_t& mask = e.medium == Medium::kHost ? h.host : h.backend;
  mask = e.type == CacheEvent::Type::kStored ? (mask | bit) : (mask & ~bit);
  const bool backend = h.backend == all;
  const bool host = h.host == all || (!backend && (h.backend | h.host) == all);
  auto tell = [&](CacheEvent::Type type, Medium medium) {
    CacheEvent out = e;
    out.type = type;
    out.medium = medium;
    sink_(out);
  };
  if (backend && !h.told_backend) tell(CacheEvent::Type::kStored, Medium::kBackend);
  if (host && !h.told_host) tell(CacheEvent::Type::kStored, Medium::kHost);
  if (!backend && h.told_backend) tell(CacheEvent::Type::kRemoved, Medium::kBackend);
  if (!host && h.told_host) tell(CacheEvent::Type::kRemoved, Medium::kHost);
  h.told_backend = backend;
  h.told_host = host;
  if (h.backend == 0 && h.host == 0) held_.erase(it);
}

absl::StatusOr<std::unique_ptr<StateCache>> CreateTpGroup(ModelSpec full, CacheOptions options) {
  if (absl::Status st = CheckTpSize(full, options.tp_size, "options.tp_size"); !st.ok()) {
    return st;
  }
  auto group = std::make_unique<TpGroup>(std::move(full), options);
  if (absl::Status st = group->Init(); !st.ok()) return st;
  return std::unique_ptr<StateCache>(std::move(group));
}

}  // namespace replayssm::cache
