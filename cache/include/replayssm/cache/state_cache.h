// StateCache: the domain layer between the kernels and the service. It owns the recurrent
// state of every request on one backend (CPU or CUDA, through the kernel C ABI only; it
// never branches on which): a pool of slots (checkpoint + replay ring + cursors for every
// linear-attention layer), layer-by-layer forwards (decode, prefill, speculative verify) and
// their one-call forms, accept, import/export, and a radix prefix cache of folded snapshots
// that shares the same pool.
//
// Invariants
//  - A slot's cursor (write_pos) and seq_len advance once per forward, for all layers.
//  - A state leaves a slot (copy-on-write into another slot, donation, export, transfer)
//    only through one guarded function that folds it first (write_pos == 0), or refuses. A
//    fold keeps the logical state: it moves write_pos to 0, never seq_len.
//  - Slot bytes have one owner: a move in or out of the cache goes through slot I/O
//    (OpenExport, OpenImport; slot_io.h), on the cache's streams. A slot being moved out is
//    MOVING: every mutation of it is refused until the move ends.
//  - A failed or abandoned call leaves every slot as it was (a forward abandoned between two
//    layers included; the only exception is a device error, which marks a slot broken).
//  - Slot ids are generation-checked: a freed or reused slot is never reachable through an
//    old id.
//
// Thread safety: every method is thread-safe. Forwards and verifies on disjoint slots run
// concurrently (each operation on its own stream); a slot already in an open forward is
// refused (FAILED_PRECONDITION). Every operation but a Forward has finished its device work
// when it returns.
#ifndef REPLAYSSM_CACHE_STATE_CACHE_H_
#define REPLAYSSM_CACHE_STATE_CACHE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "replayssm/cache/events.h"
#include "replayssm/cache/io_memory.h"
#include "replayssm/cache/model.h"
#include "replayssm/cache/slot_io.h"

namespace replayssm::cache {

// Prefix-cache namespaces (a service's tenants): a snapshot is found only from the namespace
// of the slot it was taken from (its track snapshots and its donation). A slot is in
// kDefaultNamespace unless it was allocated from a prefix in another or moved there by
// SetPrefixNamespace.
inline constexpr PrefixNamespace kDefaultNamespace = 0;

// An opaque slot id (SlotId, slot_io.h): (generation << 32) | index. 0 is never a valid slot;
// in a forward's rows it marks a padding row.
inline constexpr SlotId kPaddingSlot = 0;

// Which host snapshot the host tier drops first when it is full (docs/cache.md, "Host tier").
enum class HostPolicy : int32_t {
  kLru = 0,    // the least recently used
  kValue = 1,  // the one worth least: tokens it saves per byte, by its hits, aged (GDSF)
};

// Upper bounds (seconds) of the promotion latency histogram's buckets (CacheStats), then +Inf:
// a Qwen3-Next snapshot's promotion lands in the millisecond buckets (bench/results/host_tier.md,
// "Promotion against a plain host → device copy"); the low end is the CPU backend.
inline constexpr std::array<double, 11> kPromotionLatencyBounds = {
    1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2, 6.4e-2, 0.25};

struct CacheOptions {
  int32_t backend = RSSM_BACKEND_CPU;     // where the state lives and kernels run
  int64_t memory_budget_bytes = 1LL << 30;  // slots (ring included) + snapshots
  int32_t track_interval = 64;  // snapshot every this many tokens in decode; 0 = never
  int32_t max_batch = 256;      // rows per forward / verify
  int32_t max_prefill_tokens = 1 << 16;  // tokens per prefill call
  // Snapshots one prefix namespace (a service's tenant) may hold at once; 0 = no bound. A new
  // snapshot or donation in a namespace at its bound evicts that namespace's own least recently
  // used snapshot (or is skipped when all of them are in use), never another namespace's.
  int64_t max_snapshots_per_namespace = 0;
  // A decode forward queued at once (Forward::RunLayers) on backend memory runs as one
  // recorded sequence (a CUDA graph) once it repeats; false: always call by call.
  bool forward_graphs = true;
  // How error messages name a slot (called under the cache's lock: it must not call back into
  // the cache). Unset: the id in hex. A service that hands out handles of its own names them
  // here, so that errors never reveal ids.
  std::function<std::string(SlotId)> slot_name;
  // Tensor parallelism (tp.h): > 1 makes the cache a group of this many shards, each holding
  // HV/tp_size v heads (and H/tp_size qk heads) of every slot, with memory_budget_bytes each.
  // Activations are then the ranks' tensors one after another, rank-major, and states that
  // enter or leave a slot are unsharded (docs/cache.md, "Tensor parallelism").
  int32_t tp_size = 1;
  // The device of each rank (rssm_set_device), [tp_size]; empty: every rank on the device
  // current when the cache is created (and the CPU backend's one).
  std::vector<int32_t> devices;
  // When a group's per-rank steps of a move (export opens with their folds, import
  // reservations, commits) run at once, a thread per rank: kWhenApart, when the ranks are on
  // distinct devices (ranks sharing one only contend for it: docs/transfer.md); kAlways, also
  // on one device or the CPU (tests and measurements of that path).
  enum class TpRanksAtOnce { kWhenApart, kAlways };
  TpRanksAtOnce tp_ranks_at_once = TpRanksAtOnce::kWhenApart;
  // Receives every snapshot stored and removed (events.h); unset: no events. A TP group
  // reports a snapshot once, when every shard holds it, and removed when the first shard drops
  // it.
  CacheEventSink event_sink;
  // The host tier: bytes of pinned host memory (per TP rank, as memory_budget_bytes) that keep
  // snapshots evicted from backend memory, their folded state (checkpoints and conv windows,
  // ModelSpec::LayerStateBytes per layer; no ring); 0 = off (an evicted snapshot is dropped).
  // A prefix hit on a host snapshot copies it back (docs/cache.md, "Host tier").
  int64_t host_snapshot_bytes = 0;
  HostPolicy host_policy = HostPolicy::kLru;  // which host snapshot goes first
  // With the host tier: backend slots kept obtainable without loss (free, or snapshots whose
  // state the host tier holds too). When fewer are, a thread of the cache copies the least
  // recently used snapshots to the host ahead of need (they stay in backend memory, still
  // hit there), so an eviction that no call waits for a spill before — a decode forward's
  // track snapshot at a full pool — moves a snapshot to the host instead of dropping it.
  // 0: spill only when a slot-taking call needs room (docs/cache.md, "Host tier"); the
  // server's --host-spill-ahead defaults to 4.
  int32_t host_spill_ahead = 0;
  // Pin every host entry's buffer at Create (seconds per tens of GiB) instead of at its first
  // use, where the allocation (cudaHostAlloc of a snapshot's bytes) falls inside that spill.
  bool host_pin_at_start = false;
  // Lanes (a stream, pinned staging and scratch each; one per operation in flight) made at
  // Create, so that the first that many operations at once make none. On CUDA a stream made
  // while doorbell waits run can wait until they end (docs/data-plane.md): a server makes one
  // lane per planned forward it admits, and a few more. 1 to kMaxLanesAtStart.
  int32_t lanes_at_start = 1;
};
inline constexpr int32_t kMaxLanesAtStart = 1024;

// One layer's activations and outputs for N tokens, dense, act dtype.
struct LayerIo {
  const void* mixed_qkv = nullptr;  // [N, 2*H*K + HV*V]
  const void* a = nullptr;          // [N, HV] (GDN) or [N, HV, K] (KDA)
  const void* b = nullptr;          // [N, HV]
  void* out = nullptr;              // [N, HV, V]; may be null for prefill
  IoMemory memory = IoMemory::kHost;  // where all four live
};

// A layer's doorbells in Forward::RunLayers: the layer waits for `ready`, then writes `done`.
struct LayerDoorbells {
  const uint32_t* ready = nullptr;
  uint32_t* done = nullptr;
};

struct SlotInfo {
  int64_t seq_len = 0;    // tokens applied to the state
  int32_t write_pos = 0;  // records in the ring since the checkpoint
  int32_t pending_drafts = 0;  // drafts verified and not yet accepted/rejected
};

// Whether `st` is a refusal to share a slot whose state holds a NaN or Inf (a donation, a move
// out), one that CacheStats::nonfinite_refusals counted.
bool IsNonfiniteRefusal(const absl::Status& st);

struct CacheStats {
  int64_t slots_total = 0, slots_live = 0, slots_snapshot = 0, slots_free = 0;
  int64_t folds_ring_full = 0, folds_track = 0, folds_materialize = 0;
  int64_t snapshot_hits = 0, snapshot_misses = 0, snapshot_evictions = 0;
  int64_t snapshots_taken = 0, donations = 0;
  int64_t guard_calls = 0, invariant_refusals = 0;
  // States refused from sharing because they hold a NaN or Inf: a donation or a move out
  // refused, a track-boundary snapshot skipped (the finiteness policy, docs/cache.md).
  int64_t nonfinite_refusals = 0;
  int64_t forwards_committed = 0, forwards_abandoned = 0;  // decode forwards
  // Decode forwards queued as one recorded sequence (RunLayers), and the recordings made.
  int64_t forwards_graphed = 0, forward_recordings = 0;
  // Recordings that failed (the lane's forwards then run call by call; CPU never records).
  int64_t forward_recording_failures = 0;
  int64_t lanes = 0;  // streams with pinned staging: the most operations that ever ran at once
  // Tiers (docs/cache.md, "Host tier"). A prefix lookup (AllocateFromPrefix) asks backend
  // memory first: snapshot_hits + snapshot_misses = lookups. With the host tier on, a backend
  // miss (no match, or a shorter one than the host holds) asks the host tier:
  // host_hits + host_misses = snapshot_misses. snapshot_evictions counts every snapshot that
  // left backend memory; snapshot_spills those of them that went on to the host tier.
  int64_t host_hits = 0, host_misses = 0;
  int64_t snapshot_spills = 0;
  int64_t host_promotions = 0;  // host hits copied back into a backend snapshot
  // Snapshots copied to the host tier ahead of need (host_spill_ahead), and the backend
  // snapshots whose state the host tier holds now (evicting one loses nothing).
  int64_t spills_ahead = 0, host_backed_snapshots = 0;
  int64_t host_evictions = 0;   // host snapshots dropped (policy, namespace bound)
  // Of host_evictions, those whose snapshot backend memory holds too: nothing was lost.
  // Snapshots lost (in no tier any more) = snapshot_evictions - snapshot_spills +
  // host_evictions - host_evictions_kept.
  int64_t host_evictions_kept = 0;
  int64_t backend_snapshot_bytes = 0;  // slots_snapshot x ModelSpec::SlotBytes()
  int64_t host_snapshots = 0, host_bytes = 0, host_capacity_bytes = 0;
  // The host -> backend copy of each host hit, seconds: counts per bucket of
  // kPromotionLatencyBounds (not cumulative), the last one past the largest bound; their sum.
  std::array<int64_t, kPromotionLatencyBounds.size() + 1> promotion_latency_counts{};
  double promotion_seconds = 0;
};

// A forward over a batch of rows, driven layer by layer: RunLayer once per layer (any order),
// then Commit. Three kinds share it (StateCache::BeginForward for decode, BeginPrefill,
// BeginVerify): they differ in the kernel a layer runs and in what Commit does. Every layer's
// io holds tokens() tokens: the rows' tokens packed in row order.
// Destroying it without Commit abandons it: no token is applied, seq_len stays and no state
// changes logically (decode and verify only append ring records past the cursors; a prefill
// puts back the checkpoints its layers overwrote; rows folded at its begin stay folded,
// write_pos -> 0, the same logical state), and the rows are free for other operations again.
// Each forward queues its work on a stream of its own (one of a pool the cache owns), so
// forwards on disjoint slots overlap on the device. It waits for that stream only where a
// caller must see results: a host-memory RunLayer (its outputs), Synchronize, Commit and
// abandonment (before its slots are released).
// Not thread-safe itself (one driver at a time); different forwards may run concurrently.
class Forward {
 public:
  virtual ~Forward() = default;
  virtual int32_t batch() const = 0;   // rows
  virtual int64_t tokens() const = 0;  // N per layer: B (decode), sum of lengths, B*T (verify)
  // Runs layer `layer` for every row: io holds N = tokens() tokens. With host memory it
  // returns once io.out is filled. With backend memory it only queues the layer: io.out is
  // written once Synchronize (or Commit) returns, and before any work the caller queues on
  // stream() after this call. A prefill's io.out may be null (no outputs).
  virtual absl::Status RunLayer(int32_t layer, const LayerIo& io) = 0;
  // RunLayer(l, layers[l]) for every l in order, then Commit: the one-call forms' body. An
  // error leaves the forward open (destroying it abandons it).
  absl::Status RunEveryLayer(absl::Span<const LayerIo> layers);
  // Queues every layer at once, in order: what QueueWait(bells[l].ready, value),
  // RunLayer(l, layers[l]), QueueSignal(bells[l].done, value) for each layer l would queue
  // (bells empty: no doorbells), except that every argument is checked before anything is
  // queued (an error then changes nothing). layers.size() and a non-empty bells.size() are
  // num_layers; no layer may have run. A decode forward whose io is all backend memory is
  // queued as one recorded sequence (CUDA: a graph, one host call instead of two to four per
  // layer) once the same forward — batch, addresses, doorbells; the value may differ —
  // repeats on this forward's stream (CacheOptions::forward_graphs); otherwise call by call.
  // CPU backend: call by call, so it blocks on each wait as QueueWait does.
  // A TP group's forward (CacheOptions::tp_size = T) also takes T * num_layers ios, each rank's
  // own tensors (rank r's layer l at r * num_layers + l), and bells of one pair per layer for
  // the group (num_layers) or per rank (T * num_layers, rank-major); docs/cache.md.
  virtual absl::Status RunLayers(absl::Span<const LayerIo> layers,
                                 absl::Span<const LayerDoorbells> bells, uint32_t value) = 0;
  // Waits for every layer queued so far.
  virtual absl::Status Synchronize() = 0;
  // The stream this forward's work is queued on (rssm_launch.stream: a cudaStream_t on CUDA,
  // NULL on CPU), valid until Commit or destruction.
  virtual void* stream() const = 0;
  // Doorbells for co-located clients (docs/data-plane.md): 32-bit words in backend memory
  // (a registered region). QueueWait makes the work queued after it wait until the word
  // reaches `value` (cyclic compare); on the CPU backend the call itself blocks until then,
  // so drive such a forward from a thread of its own. QueueSignal writes `value` once the
  // work queued before it is done and visible.
  virtual absl::Status QueueWait(const uint32_t* addr, uint32_t value) = 0;
  virtual absl::Status QueueSignal(uint32_t* addr, uint32_t value) = 0;
  // For a client that never rings: ends every wait of the forward (queued and to come) at
  // once, whatever its word does, so that the stream drains; the caller then abandons the
  // forward. Never waits for the device, and never writes the client's words. Returns the
  // queue index of the first wait that ended on the release with its word short of its value,
  // or -1; a wait decides when it runs (one still queued, or issued after the release, counts
  // as unrung unless its word was rung by then), so call it again once every layer was queued
  // and the stream has run (after Synchronize) for the whole answer. The one method that is
  // thread-safe: it may run while another thread is blocked in QueueWait.
  virtual int32_t ReleaseWaits() = 0;
  // Waits for the queued layers, then applies the forward at once for every row: decode
  // advances each cursor and seq_len by one, prefill by the row's tokens (write_pos -> 0), and
  // both fold and snapshot the rows that reach a track boundary; verify leaves the drafts
  // waiting for Accept. FAILED_PRECONDITION unless every layer ran exactly once; a device error
  // leaves the forward uncommitted (destroying it abandons it).
  virtual absl::Status Commit() = 0;
};

struct DecodeRow {
  SlotId slot = kPaddingSlot;  // kPaddingSlot = padding row
  int32_t token_id = 0;        // the token this step consumes (keys the prefix cache)
};

// One row of a layer-by-layer prefill.
struct PrefillRow {
  SlotId slot = kPaddingSlot;        // kPaddingSlot = padding row (tokens skipped, outputs 0)
  absl::Span<const int32_t> tokens;  // >= 1, continuing from the slot's current state
};

struct ExportedState {
  int64_t seq_len = 0;
  std::vector<int32_t> tokens;                   // [seq_len]
  std::vector<std::vector<uint8_t>> checkpoints;  // [layers][HV*V*K in the state dtype]
};

class StateCache {
 public:
  static absl::StatusOr<std::unique_ptr<StateCache>> Create(ModelSpec model,
                                                            CacheOptions options);
  virtual ~StateCache() = default;

  virtual const ModelSpec& model() const = 0;
  virtual const CacheOptions& options() const = 0;
  virtual int64_t capacity() const = 0;  // slots the budget holds
  virtual CacheStats stats() const = 0;

  // A fresh slot at seq_len 0 with a zero state. RESOURCE_EXHAUSTED when no slot is free
  // even after evicting every unreferenced snapshot.
  virtual absl::StatusOr<SlotId> Allocate() = 0;
  // A slot that starts from the longest snapshot whose key is a prefix of `tokens` (copy-on-
  // write; write_pos 0, seq_len = matched), or a fresh one when none matches. A snapshot in
  // the host tier is copied back first (and kept in backend memory again when a slot is free
  // for it): the caller waits for that copy, nothing else does (docs/cache.md, "Host tier").
  struct PrefixAllocation {
    SlotId slot = kPaddingSlot;
    int64_t matched = 0;
    // Where the prefix was found, as CacheStats counted the lookup: in backend memory (a
    // snapshot hit), on the host tier (a snapshot miss and a host hit), or nowhere (a snapshot
    // miss, and a host miss with the host tier on).
    enum class Source : int8_t { kNone, kBackend, kHost };
    Source source = Source::kNone;
  };
  virtual absl::StatusOr<PrefixAllocation> AllocateFromPrefix(
      absl::Span<const int32_t> tokens) = 0;
  // AllocateFromPrefix among the snapshots of namespace `ns`; the slot joins `ns`.
  virtual absl::StatusOr<PrefixAllocation> AllocateFromPrefixIn(
      PrefixNamespace ns, absl::Span<const int32_t> tokens) = 0;
  // Puts a live slot in namespace `ns`: the snapshots it makes from now on join ns's prefix
  // cache (a fresh Allocate, an import's commit). NOT_FOUND as Free.
  virtual absl::Status SetPrefixNamespace(SlotId slot, PrefixNamespace ns) = 0;
  virtual absl::Status Free(SlotId slot) = 0;
  virtual absl::StatusOr<SlotInfo> Info(SlotId slot) const = 0;

  // Runs `tokens.size()` tokens through every layer from the slot's current state, in one
  // call: the prefill forward of one row, without its spare slot (no layer can be abandoned).
  // layers.size() == num_layers; each io holds N = tokens.size() tokens (out may be null).
  virtual absl::Status Prefill(SlotId slot, absl::Span<const int32_t> tokens,
                               absl::Span<const LayerIo> layers) = 0;
  // The forward Prefill runs, for a caller that drives its layers itself (a tensor-parallel
  // group opens one on every rank under its lock, so that no other call lands between the
  // ranks): one row of >= 1 tokens, no spare slot. It keeps nothing to restore: abandoned
  // after a layer ran, it leaves the slot broken (Prefill runs every layer in one call).
  virtual absl::StatusOr<std::unique_ptr<Forward>> BeginPrefillInPlace(
      SlotId slot, absl::Span<const int32_t> tokens) = 0;

  // Replaces the slot's state: checkpoints[l] is layer l's [HV, V, K] in the state dtype
  // (then its conv window: ModelSpec::LayerStateBytes); the slot's seq_len becomes
  // tokens.size(). ImportFrom with host memory, after checking each layer's size.
  absl::Status Import(SlotId slot, absl::Span<const int32_t> tokens,
                      absl::Span<const absl::Span<const uint8_t>> checkpoints);
  // The slot's full state, folded first (the guarded path: write_pos -> 0, the logical state
  // and seq_len unchanged): ExportInto host buffers of its own.
  absl::StatusOr<ExportedState> Export(SlotId slot);
  // Import and Export with the checkpoints in the caller's memory (a co-located client's
  // registered regions): checkpoints[l] points at layer l's [HV, V, K] bytes, host memory
  // (staged) or backend memory (copied on the device) as `memory` says. Same rules and
  // errors as Import / Export; ExportInto leaves the returned checkpoints empty. Return once
  // the bytes are in place.
  virtual absl::Status ImportFrom(SlotId slot, absl::Span<const int32_t> tokens,
                                  absl::Span<const void* const> checkpoints, IoMemory memory) = 0;
  virtual absl::StatusOr<ExportedState> ExportInto(SlotId slot, absl::Span<void* const> checkpoints,
                                                   IoMemory memory) = 0;

  // Opens the move of `slot` out of this cache: the guarded path (folds it first, or refuses a
  // slot whose drafts await Accept), then the slot is MOVING under `move_id` (named in every
  // refusal) until the reader is finished (SlotReader::Finish, or its destruction).
  virtual absl::StatusOr<std::unique_ptr<SlotReader>> OpenExport(SlotId slot,
                                                                 absl::string_view move_id,
                                                                 const SlotIoOptions& options) = 0;
  // Opens a move into a fresh slot of `seq_len` tokens: not zeroed (the writer writes every
  // byte) and nobody's until the writer commits. RESOURCE_EXHAUSTED as Allocate.
  virtual absl::StatusOr<std::unique_ptr<SlotWriter>> OpenImport(int64_t seq_len,
                                                                 const SlotIoOptions& options) = 0;
  // Backend memory for a transport that moves slot bytes without staging (device-direct).
  virtual absl::StatusOr<std::unique_ptr<BackendBuffer>> AllocateBackendBuffer(size_t bytes) = 0;

  // A decode forward: one token per row.
  virtual absl::StatusOr<std::unique_ptr<Forward>> BeginForward(
      absl::Span<const DecodeRow> rows) = 0;
  // The next decode forward over the same rows, opened while `previous` (a decode forward of
  // this cache whose every layer has been queued, not committed) may still run on the device:
  // previous is committed at once (cursors, seq_len and tokens advance as by its Commit) and
  // the new forward queues its work on the same stream behind it, so the device never waits
  // for the host between the two. The rows stay held until the new forward ends; it confirms
  // previous's device work when it synchronizes. Should previous's work turn out incomplete
  // (its doorbells released unrung: ReleaseWaits counts previous's waits first) or fail, the
  // rows are marked broken and the new forward's Commit fails (DATA_LOSS).
  // Returns null, leaving `previous` untouched, when that cannot be done: other rows (the
  // same slots in the same order, padding in the same places), a row that reaches a track
  // boundary (its snapshot needs the state first), previous not a fully queued decode forward.
  // The caller then commits previous and begins as usual.
  virtual absl::StatusOr<std::unique_ptr<Forward>> ContinueForward(
      std::unique_ptr<Forward>& previous, absl::Span<const DecodeRow> rows) = 0;
  // Whether ContinueForward(previous, rows) would continue, answered without waiting for the
  // device and changing nothing (previous keeps its predecessor: its ReleaseWaits still counts
  // that one's waits first); a tensor-parallel group asks every rank before any continues.
  virtual bool CanContinueForward(Forward& previous, absl::Span<const DecodeRow> rows) = 0;
  // A layer-by-layer Prefill of several slots at once: N = the sum of the rows' lengths (at
  // most max_prefill_tokens). Until Commit every layer keeps a copy of each row's checkpoint
  // it overwrites in a spare slot per row, taken from the pool (snapshots are evicted for it;
  // RESOURCE_EXHAUSTED when none can be had), so that abandoning it restores them.
  virtual absl::StatusOr<std::unique_ptr<Forward>> BeginPrefill(
      absl::Span<const PrefillRow> rows) = 0;
  // A layer-by-layer Verify: T drafts per row, N = B*T in (row, draft) order. Rows without
  // room for T records are folded at begin (their logical state does not change; a row's
  // waiting drafts go with the fold). The rows' other waiting drafts stay until the first
  // layer runs (its records overwrite theirs): a verify refused or abandoned before that
  // leaves them to Accept. Commit leaves the new ones waiting for Accept.
  virtual absl::StatusOr<std::unique_ptr<Forward>> BeginVerify(
      absl::Span<const SlotId> slots, int32_t num_draft,
      absl::Span<const int32_t> draft_tokens) = 0;

  // Speculative decoding in one call: BeginVerify, every layer, Commit. Outputs only; the
  // drafts wait for Accept.
  virtual absl::Status Verify(absl::Span<const SlotId> slots, int32_t num_draft,
                              absl::Span<const int32_t> draft_tokens,
                              absl::Span<const LayerIo> layers) = 0;
  // Keeps the first n drafts of the last Verify (cursor += n, seq_len += n); 0 rejects all.
  // INVALID_ARGUMENT naming `num_accepted` (the wire's name of n) beyond the drafts verified.
  virtual absl::Status Accept(SlotId slot, int32_t n) = 0;

  // Length of the longest snapshot key that is a prefix of `tokens` (0 = none), in any tier:
  // what AllocateFromPrefix would start from.
  virtual int64_t MatchPrefix(absl::Span<const int32_t> tokens) const = 0;
  // MatchPrefix among the snapshots of namespace `ns`.
  virtual int64_t MatchPrefixIn(PrefixNamespace ns, absl::Span<const int32_t> tokens) const = 0;
  // A finished request: fold it and keep its state as a snapshot keyed by all its tokens
  // (in the slot's namespace).
  // The slot id is released (it is the caller's no more).
  virtual absl::Status Donate(SlotId slot) = 0;
  // Folds the slot (its logical state unchanged) and refuses a state holding a NaN or Inf:
  // FAILED_PRECONDITION "<purpose>: the slot's state is not finite ...", counted in
  // nonfinite_refusals; the slot stays as it was otherwise. The check Donate and OpenExport
  // make before a state is shared; a tensor-parallel group makes it on every rank before
  // any rank donates.
  virtual absl::Status CheckFinite(SlotId slot, const char* purpose) = 0;
};

// Books one prefix lookup answered from `source` in `s`'s lookup counters, the identities of
// CacheStats by construction: backend memory a snapshot hit; the host tier a snapshot miss and
// a host hit; nowhere a snapshot miss, and a host miss when the cache has a host tier.
void CountLookup(StateCache::PrefixAllocation::Source source, bool host_tier, CacheStats& s);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_STATE_CACHE_H_
