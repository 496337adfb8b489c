// Cache events for routers: where each prefix's state lives on this server. The cache reports
// every snapshot stored and removed (cache/events.h); CacheEventLog turns them into numbered
// batches per tenant, keeps the last ones for a router that reconnects, and hands them to the
// WatchCache stream (gRPC, authenticated per tenant) and the ZMQ publisher (vLLM's KV-events
// wire format). docs/api.md, "Cache events", is the contract; in short:
//
//  - A snapshot keyed by the tokens t[0..P) is one "block" of the vLLM format. Block hashes
//    chain over blocks of `block_size` tokens (the track interval): h(0) = 0 and
//    h(j) = H(h(j-1), t[(j-1)B..jB)); a key that ends inside a block (a donation, P = jB + r)
//    hashes as H(h(j), t[jB..P)). H(parent, tokens) is the first 8 bytes, big-endian, of
//    SHA-256 over the parent as 8 bytes little-endian followed by the tokens as int32
//    little-endian. A stored event names the key's hash, its parent h(floor((P-1)/B)) (absent
//    for P <= B) and the tokens between them, so a router can index keys of any length.
//  - Each tenant's batches are numbered 1, 2, ... from the server's start (`epoch`, random per
//    start, tells a restart). The last `retain` batches are kept: a router asks for what it
//    missed from its next sequence number; one that asks for more than is kept, or another
//    epoch, gets a resync: AllBlocksCleared and every snapshot stored now, then live batches.
//
// Thread safety: thread-safe. The sink (Sink()) only queues; a thread of the log numbers,
// hashes and hands out batches every `flush_interval`.
#ifndef REPLAYSSM_SERVICE_CACHE_EVENTS_H_
#define REPLAYSSM_SERVICE_CACHE_EVENTS_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "replayssm/cache/events.h"
#include "service/tenants.h"

namespace replayssm::service {

// H(parent, tokens) of the header comment.
uint64_t BlockHash(uint64_t parent, absl::Span<const int32_t> tokens);

// The vLLM medium name of a tier: "GPU" (the backend's memory, whatever the backend), "CPU"
// (the host tier), "DISK".
const char* MediumName(cache::Medium medium);

// One event of a batch, in the vLLM format's terms.
struct KvEvent {
  enum class Type { kStored, kRemoved, kAllCleared };
  Type type = Type::kStored;
  uint64_t block_hash = 0;                 // stored, removed: the key's hash
  std::optional<uint64_t> parent_hash;     // stored: absent for a key of one block or less
  std::vector<int32_t> token_ids;          // stored: the key's tokens after the parent's
  int64_t num_tokens = 0;                  // stored: the key's length P
  cache::Medium medium = cache::Medium::kBackend;  // stored, removed
};

struct KvEventBatch {
  uint64_t seq = 0;  // per tenant, from 1
  double ts = 0;     // seconds since the Unix epoch
  bool resync = false;  // a resync: AllBlocksCleared, then every snapshot stored now
  std::vector<KvEvent> events;
};

// Receives each tenant's batches in order, on the log's thread (it must not block long).
class KvEventListener {
 public:
  virtual ~KvEventListener() = default;
  virtual void OnBatch(TenantId tenant, const KvEventBatch& batch) = 0;
  // The token file changed (--auth-tokens): a listener that acts for a tenant's token checks
  // it is still there (on the reloading thread, under the log's lock).
  virtual void OnTokensChanged() {}
};

struct CacheEventLogOptions {
  int32_t block_size = 64;      // tokens per hashed block (the track interval)
  int64_t retain = 4096;        // batches kept per tenant for replay
  int32_t max_batch_events = 1024;
  absl::Duration flush_interval = absl::Milliseconds(10);
};

class CacheEventLog {
 public:
  explicit CacheEventLog(CacheEventLogOptions options);
  ~CacheEventLog();  // stops the thread; listeners must be removed before

  // The cache's sink (CacheOptions::event_sink): queues the event.
  cache::CacheEventSink Sink();

  uint64_t epoch() const { return epoch_; }
  int32_t block_size() const { return options_.block_size; }

  // What a router that saw batches up to `from_seq - 1` of `epoch` needs, and from then on
  // every new batch of `tenant` through `listener` (registered atomically with the answer,
  // so nothing is lost or repeated). from_seq 0, another epoch, a sequence number older than
  // the kept batches or ahead of the last one, or more than `max_batches` to catch up on (what
  // the caller can queue): a resync batch (numbered the last one).
  std::vector<KvEventBatch> Watch(TenantId tenant, uint64_t epoch, uint64_t from_seq,
                                  KvEventListener* listener, size_t max_batches = SIZE_MAX)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The kept batches of `tenant` from `from_seq` on (the ZMQ replay), or, when `from_seq` is
  // older than the kept batches or ahead of the last one, a resync batch (numbered the last).
  // The batches are the log's own, shared (never changed once numbered).
  std::vector<std::shared_ptr<const KvEventBatch>> Replay(TenantId tenant, uint64_t from_seq)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Unwatch(KvEventListener* listener) ABSL_LOCKS_EXCLUDED(mu_);
  // Tells every listener that the token file changed (KvEventListener::OnTokensChanged).
  void TokensChanged() ABSL_LOCKS_EXCLUDED(mu_);

  // Numbers and hands out a batch of one AllBlocksCleared for `tenant` (after what is queued):
  // a publisher's start, which tells routers to drop what they knew of this server.
  void Clear(TenantId tenant) ABSL_LOCKS_EXCLUDED(mu_);

  // Numbers and hands out what is queued now (the thread does it every flush_interval).
  void Flush() ABSL_LOCKS_EXCLUDED(mu_);

  int64_t batches() const ABSL_LOCKS_EXCLUDED(mu_);  // numbered so far, all tenants
  int64_t watchers() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Tenant {
    uint64_t last_seq = 0;
    std::deque<std::shared_ptr<const KvEventBatch>> kept;  // consecutive sequence numbers
    // Every snapshot stored now, by (key hash, medium): the resync.
    absl::flat_hash_map<std::pair<uint64_t, int32_t>, KvEvent> stored;
  };
  KvEvent Convert(const cache::CacheEvent& e) const;
  KvEventBatch ResyncLocked(const Tenant& t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Numbers `b`, keeps it and hands it to the tenant's listeners.
  void PublishLocked(TenantId tenant, KvEventBatch b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Run();
  // Flush's work, flush_mu_ held by the caller (Flush, Clear).
  void FlushHeld() ABSL_EXCLUSIVE_LOCKS_REQUIRED(flush_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  const CacheEventLogOptions options_;
  const uint64_t epoch_;
  mutable absl::Mutex queue_mu_;  // the sink's: taken under the cache's lock
  std::vector<cache::CacheEvent> queue_ ABSL_GUARDED_BY(queue_mu_);
  mutable absl::Mutex mu_;  // never taken under queue_mu_
  absl::flat_hash_map<TenantId, Tenant> tenants_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<KvEventListener*, TenantId> listeners_ ABSL_GUARDED_BY(mu_);
  int64_t batches_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex flush_mu_;  // one Flush at a time: batches leave in order
  absl::Mutex stop_mu_;
  bool stop_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread thread_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_CACHE_EVENTS_H_
