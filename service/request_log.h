// RequestLog: at-most-once application of mutating calls. Each (method, request_id) that was
// applied keeps its serialized reply, so that a retry after a lost reply gets the original
// result instead of applying the call twice. Bounded: ids are forgotten beyond `max_entries`
// or `max_bytes` of stored replies (the dedup window).
//
// Owners (tenants) share the bounds fairly: each keeps its own ids, and when a bound is
// exceeded the owner holding the most (entries or bytes, whichever bound it is) forgets its
// least recently used one. An owner holding no more than its share (the bound over the owners
// holding ids) keeps every id whatever the others send; one owner alone has the whole window,
// least recently used first, as without owners.
//
// Protocol: Begin() an id before applying; then Complete() with the reply on success or
// Release() on failure (a failed call changed nothing, so its retry must run again).
//
// Memory: every id is at most max_id_bytes() long (CheckId, which every handler that takes a
// request id calls first), and the byte bound counts each kept entry's key (method + id, held
// twice: the map and the LRU list) and a fixed overhead besides its reply.
//
// Thread safety: all methods are thread-safe.
#ifndef REPLAYSSM_SERVICE_REQUEST_LOG_H_
#define REPLAYSSM_SERVICE_REQUEST_LOG_H_

#include <cstdint>
#include <list>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/node_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace replayssm::service {

// A fingerprint of the request's identifying fields (serialized), to detect a reused id.
uint64_t Fingerprint(absl::string_view bytes);

class RequestLog {
 public:
  enum class Outcome {
    kNew,          // claimed: the caller applies the call
    kReplay,       // applied before: `reply` holds the original reply
    kInFlight,     // the same id is being applied right now
    kMismatch,     // the id was used for a different request
    kNotRetained,  // applied before, but the reply was too large to keep
  };
  struct Claim {
    Outcome outcome = Outcome::kNew;
    std::string reply;
  };

  // The host bytes an entry costs besides its key and reply (map slot, list node, strings).
  static constexpr int64_t kEntryOverhead = 128;

  // An id space: one method's ids of one owner (a tenant; 0: the one owner without tenants).
  // A bare method name is its owner 0's.
  struct Scope {
    Scope(const char* m) : method(m) {}  // NOLINT: a method of owner 0
    Scope(absl::string_view m, uint32_t o = 0) : method(m), owner(o) {}  // NOLINT: likewise
    std::string method;
    uint32_t owner = 0;
  };

  RequestLog(int64_t max_entries, int64_t max_bytes, int64_t max_id_bytes = 128);

  // INVALID_ARGUMENT naming `field` unless `id` is 1..max_id_bytes() bytes long: the one check
  // of request-id length (--max-request-id-bytes); ids are kept here, in the transfer
  // manager and on slots being moved.
  absl::Status CheckId(absl::string_view id, absl::string_view field = "request_id") const;
  // A peer's transfer id: the sender's request id plus its attempt suffix ("#nonce.n").
  absl::Status CheckTransferId(absl::string_view id) const;
  static constexpr int64_t kTransferIdSuffix = 64;

  Claim Begin(const Scope& scope, absl::string_view request_id, uint64_t fingerprint);
  void Complete(const Scope& scope, absl::string_view request_id, std::string reply);
  // Applied, but the reply is not kept (the caller knew it would exceed max_bytes()): a
  // retry is answered kNotRetained instead of being applied again.
  void CompleteWithoutReply(const Scope& scope, absl::string_view request_id);
  void Release(const Scope& scope, absl::string_view request_id);

  int64_t max_entries() const { return max_entries_; }
  int64_t max_bytes() const { return max_bytes_; }
  int64_t max_id_bytes() const { return max_id_bytes_; }
  // Bytes the kept entries count against max_bytes() now.
  int64_t bytes() const {
    absl::MutexLock lock(&mutex_);
    return bytes_;
  }
  // The ids an owner's retries can replay now (applied ones, kept).
  int64_t entries_of(uint32_t owner) const;

 private:
  struct Entry {
    bool done = false;
    bool retained = true;
    uint32_t owner = 0;
    uint64_t fingerprint = 0;
    std::string reply;
    int64_t cost = 0;                      // what it counts in bytes_ (done entries)
    std::list<std::string>::iterator lru;  // position in its owner's lru (done entries only)
  };
  // An owner's done entries: their keys, most recent first, and what they count.
  struct Share {
    std::list<std::string> lru;
    int64_t bytes = 0;
  };
  void CompleteLocked(const std::string& key, std::string reply, bool retained)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);
  // While a bound is exceeded, the owner holding the most forgets its least recent id.
  void EvictLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mutex_);

  const int64_t max_entries_;
  const int64_t max_bytes_;
  const int64_t max_id_bytes_;
  mutable absl::Mutex mutex_;
  absl::flat_hash_map<std::string, Entry> entries_ ABSL_GUARDED_BY(mutex_);
  // Node-based: an entry's lru iterator stays valid as owners come and go.
  absl::node_hash_map<uint32_t, Share> shares_ ABSL_GUARDED_BY(mutex_);
  int64_t done_ ABSL_GUARDED_BY(mutex_) = 0;   // done entries, all owners
  int64_t bytes_ ABSL_GUARDED_BY(mutex_) = 0;  // what they count, all owners
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_REQUEST_LOG_H_
