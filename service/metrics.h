// Prometheus metrics of the service (prometheus-cpp). Two sources:
//  - events the service sees (RPCs by method and code, forward latency and batch size, time
//    in cache/kernel calls, tensor bytes in and out): counters and histograms in `registry()`;
//  - the cache's own counters and gauges (folds by reason, slots by state, snapshot hits /
//    misses / evictions, invariant refusals, forwards committed / abandoned), read from
//    StateCache::stats() at scrape time by CacheCollector, so they never drift.
// Names: `replayssm_` prefix, base units (seconds, bytes), `_total` on counters.
//
// Thread safety: every method is thread-safe.
#ifndef REPLAYSSM_SERVICE_METRICS_H_
#define REPLAYSSM_SERVICE_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/strings/string_view.h"
#include "grpcpp/support/status_code_enum.h"
#include "prometheus/collectable.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "replayssm/cache/state_cache.h"

namespace replayssm::service {

class Metrics {
 public:
  // max_batch: --max-batch, the top of the batch-size histogram's buckets.
  explicit Metrics(int32_t max_batch);

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  void CountRpc(absl::string_view method, grpc::StatusCode code);
  // One committed decode forward (Begin to Commit) of `batch` rows.
  void ObserveForward(double seconds, int32_t batch);
  // Time spent in one cache call that runs kernels: op = run_layer, commit, prefill, verify.
  void ObserveKernel(absl::string_view op, double seconds);
  void AddBytes(int64_t received, int64_t sent);
  void CountDedupReplay();
  void CountSlotExpiry();  // a slot freed by its lease (--slot-ttl)
  // A call refused UNAUTHENTICATED (--auth-tokens): reason = missing, malformed, unknown.
  void CountAuthFailure(absl::string_view reason);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Histogram& forward_seconds_;
  prometheus::Histogram& forward_batch_;
  prometheus::Family<prometheus::Histogram>& kernel_seconds_;
  prometheus::Counter& received_bytes_;
  prometheus::Counter& sent_bytes_;
  prometheus::Counter& dedup_replays_;
  prometheus::Counter& slot_expiries_;
  prometheus::Family<prometheus::Counter>& auth_failures_;
};

// Gauges owned by the service, sampled at scrape time.
struct ServiceGauges {
  int64_t open_forwards = 0;
  bool draining = false;
  bool drain_overdue = false;       // draining past DrainBound (server.h): stuck
  int64_t cache_event_batches = 0;  // numbered so far (cache_events.h), all tenants
  int64_t cache_event_watchers = 0;  // open WatchCache streams and ZMQ publishers
  int64_t kv_events_published = 0;   // batches sent on the ZMQ PUB socket
  bool device_failed = false;        // the device check found a device that takes no work
  int64_t open_decode_streams = 0;   // against --max-streams
  int64_t open_watch_streams = 0;    // against --max-watchers
  // CUDA regions whose unmapping waits for no planned forward to be open, and those unmapped
  // all the same past 16 held (cache/regions.h), every table.
  int64_t region_unmaps_held = 0;
  int64_t region_unmaps_forced = 0;
};

// Exposes StateCache::stats() and the service gauges on every scrape.
class CacheCollector : public prometheus::Collectable {
 public:
  CacheCollector(const cache::StateCache* cache, std::function<ServiceGauges()> gauges);
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  const cache::StateCache* cache_;
  std::function<ServiceGauges()> gauges_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_METRICS_H_
