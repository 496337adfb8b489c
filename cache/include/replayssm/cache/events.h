// Cache events: what a router needs to know about where each prefix's state lives. A cache
// reports every snapshot that becomes findable by a prefix match (stored) and every one that
// stops being findable (removed), per prefix namespace and per memory tier. The service turns
// them into its WatchCache stream and its ZMQ publisher (docs/api.md, "Cache events").
#ifndef REPLAYSSM_CACHE_EVENTS_H_
#define REPLAYSSM_CACHE_EVENTS_H_

#include <cstdint>
#include <functional>
#include <vector>

namespace replayssm::cache {

using PrefixNamespace = uint32_t;

// Where a snapshot's state lives. kBackend: the backend's own memory (GPU memory on CUDA);
// kHost: the pinned host tier; kDisk: the local-disk tier.
enum class Medium : int32_t { kBackend = 0, kHost = 1, kDisk = 2 };

struct CacheEvent {
  enum class Type : int32_t {
    kStored = 0,   // a snapshot keyed by `tokens` is findable in `medium`
    kRemoved = 1,  // it no longer is (evicted, moved to another tier, or dropped)
  };
  Type type = Type::kStored;
  PrefixNamespace ns = 0;
  Medium medium = Medium::kBackend;
  std::vector<int32_t> tokens;  // the snapshot's key: the whole token prefix it folds
};

// Called for each event in the order the cache's state changed, under the cache's lock: it
// must be quick (queue the event) and must not call back into the cache. A snapshot that moves
// between tiers is reported stored in the new medium, then removed from the old one (never a
// moment held nowhere). A consumer keeps each (key, medium) apart: one keyed by the key alone
// would take that removal for the snapshot's end.
using CacheEventSink = std::function<void(const CacheEvent&)>;

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_EVENTS_H_
