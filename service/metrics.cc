#include "service/metrics.h"

#include <limits>
#include <string>
#include <utility>

#include "prometheus/metric_family.h"

namespace replayssm::service {

namespace {

// Latency buckets from 50 us to ~3 s: the low end for a decode forward of a tiny model (the
// demo's tiny-gdn) on the CPU backend, the high end for a large prefill.
prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {5e-5,   1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
          2.5e-2, 5e-2, 0.1,    0.25, 0.5,  1.0,    2.5};
}

// Powers of two up to the first at or past --max-batch: every batch the server takes falls
// below a bucket's bound, not into +Inf.
prometheus::Histogram::BucketBoundaries BatchBuckets(int32_t max_batch) {
  prometheus::Histogram::BucketBoundaries b{1};
  while (b.back() < max_batch) b.push_back(2 * b.back());
  return b;
}

std::string CodeName(grpc::StatusCode code) {
  static const char* const kNames[] = {"OK",
                                       "CANCELLED",
                                       "UNKNOWN",
                                       "INVALID_ARGUMENT",
                                       "DEADLINE_EXCEEDED",
                                       "NOT_FOUND",
                                       "ALREADY_EXISTS",
                                       "PERMISSION_DENIED",
                                       "RESOURCE_EXHAUSTED",
                                       "FAILED_PRECONDITION",
                                       "ABORTED",
                                       "OUT_OF_RANGE",
                                       "UNIMPLEMENTED",
                                       "INTERNAL",
                                       "UNAVAILABLE",
                                       "DATA_LOSS",
                                       "UNAUTHENTICATED"};
  const int i = static_cast<int>(code);
  return (i >= 0 && i <= 16) ? kNames[i] : "UNKNOWN";
}

prometheus::MetricFamily Family(std::string name, std::string help, prometheus::MetricType type) {
  prometheus::MetricFamily f;
  f.name = std::move(name);
  f.help = std::move(help);
  f.type = type;
  return f;
}

void AddSample(prometheus::MetricFamily& f, double value,
               std::vector<prometheus::ClientMetric::Label> labels = {}) {
  prometheus::ClientMetric m;
  m.label = std::move(labels);
  if (f.type == prometheus::MetricType::Counter) {
    m.counter.value = value;
  } else {
    m.gauge.value = value;
  }
  f.metric.push_back(std::move(m));
}

// A family of one unlabelled sample, appended to `out`.
void AddSingle(std::vector<prometheus::MetricFamily>& out, std::string name, std::string help,
               prometheus::MetricType type, double value) {
  out.push_back(Family(std::move(name), std::move(help), type));
  AddSample(out.back(), value);
}

// The snapshot tiers (docs/operations.md, "Host tier"): lookups, moves and bytes per tier, and
// the promotion latency histogram (CacheStats counts per bucket; Prometheus wants them
// cumulative).
void AddTierFamilies(const cache::CacheStats& s, std::vector<prometheus::MetricFamily>& out) {
  using prometheus::MetricType;
  auto lookups = Family("replayssm_snapshot_lookups_total",
                        "Prefix lookups by tier asked and result: gpu first, a gpu miss asks host",
                        MetricType::Counter);
  AddSample(lookups, s.snapshot_hits, {{"tier", "gpu"}, {"result", "hit"}});
  AddSample(lookups, s.snapshot_misses, {{"tier", "gpu"}, {"result", "miss"}});
  AddSample(lookups, s.host_hits, {{"tier", "host"}, {"result", "hit"}});
  AddSample(lookups, s.host_misses, {{"tier", "host"}, {"result", "miss"}});
  out.push_back(std::move(lookups));
  // result: kept (another tier holds the snapshot: a spill to the host, or a host copy dropped
  // while the GPU holds it) or lost (no tier does: its prefix hits are gone).
  auto evictions = Family("replayssm_snapshot_tier_evictions_total",
                          "Snapshots that left a tier, by result: kept (another tier holds it) or "
                          "lost (none does)",
                          MetricType::Counter);
  AddSample(evictions, s.snapshot_spills, {{"tier", "gpu"}, {"result", "kept"}});
  AddSample(evictions, s.snapshot_evictions - s.snapshot_spills,
            {{"tier", "gpu"}, {"result", "lost"}});
  AddSample(evictions, s.host_evictions_kept, {{"tier", "host"}, {"result", "kept"}});
  AddSample(evictions, s.host_evictions - s.host_evictions_kept,
            {{"tier", "host"}, {"result", "lost"}});
  out.push_back(std::move(evictions));
  auto bytes = Family("replayssm_snapshot_bytes", "Bytes of snapshots held, by tier",
                      MetricType::Gauge);
  AddSample(bytes, s.backend_snapshot_bytes, {{"tier", "gpu"}});
  AddSample(bytes, s.host_bytes, {{"tier", "host"}});
  out.push_back(std::move(bytes));
  AddSingle(out, "replayssm_host_snapshot_capacity_bytes",
            "--host-snapshot-bytes usable (whole snapshots), all ranks", MetricType::Gauge,
            s.host_capacity_bytes);
  AddSingle(out, "replayssm_host_backed_snapshots",
            "GPU snapshots whose state the host tier holds too (evicted at no loss)",
            MetricType::Gauge, s.host_backed_snapshots);
  auto latency = Family("replayssm_snapshot_promotion_seconds",
                        "Host hits: the copy of the state back to the GPU, seconds",
                        MetricType::Histogram);
  prometheus::ClientMetric m;
  uint64_t cumulative = 0;
  for (size_t i = 0; i < s.promotion_latency_counts.size(); ++i) {
    cumulative += static_cast<uint64_t>(s.promotion_latency_counts[i]);
    const double bound = i < cache::kPromotionLatencyBounds.size()
                             ? cache::kPromotionLatencyBounds[i]
                             : std::numeric_limits<double>::infinity();
    m.histogram.bucket.push_back({cumulative, bound});
  }
  m.histogram.sample_count = cumulative;
  m.histogram.sample_sum = s.promotion_seconds;
  latency.metric.push_back(std::move(m));
  out.push_back(std::move(latency));
}

}  // namespace

Metrics::Metrics(int32_t max_batch)
    : registry_(std::make_shared<prometheus::Registry>()),
      rpcs_(prometheus::BuildCounter()
                .Name("replayssm_rpcs_total")
                .Help("RPCs finished, by method and gRPC status code")
                .Register(*registry_)),
      forward_seconds_(prometheus::BuildHistogram()
                           .Name("replayssm_forward_duration_seconds")
                           .Help("Decode forward latency, begin to commit")
                           .Register(*registry_)
                           .Add({}, LatencyBuckets())),
      forward_batch_(prometheus::BuildHistogram()
                         .Name("replayssm_forward_batch_size")
                         .Help("Rows per committed decode forward")
                         .Register(*registry_)
                         .Add({}, BatchBuckets(max_batch))),
      kernel_seconds_(prometheus::BuildHistogram()
                          .Name("replayssm_kernel_duration_seconds")
                          .Help("Time in cache calls that run kernels (kernel + staging)")
                          .Register(*registry_)),
      received_bytes_(prometheus::BuildCounter()
                          .Name("replayssm_tensor_received_bytes_total")
                          .Help("Tensor payload bytes received in requests")
                          .Register(*registry_)
                          .Add({})),
      sent_bytes_(prometheus::BuildCounter()
                      .Name("replayssm_tensor_sent_bytes_total")
                      .Help("Tensor payload bytes sent in replies")
                      .Register(*registry_)
                      .Add({})),
      dedup_replays_(prometheus::BuildCounter()
                         .Name("replayssm_dedup_replays_total")
                         .Help("Retried requests answered from the request-id log")
                         .Register(*registry_)
                         .Add({})),
      slot_expiries_(prometheus::BuildCounter()
                         .Name("replayssm_slot_expiries_total")
                         .Help("Live slots freed because no call used them for --slot-ttl")
                         .Register(*registry_)
                         .Add({})),
      auth_failures_(prometheus::BuildCounter()
                         .Name("replayssm_auth_failures_total")
                         .Help("Calls refused UNAUTHENTICATED, by reason: a client's token "
                               "missing, malformed, unknown or revoked (--auth-tokens), a peer's "
                               "proof missing or unknown (--peer-token)")
                         .Register(*registry_)) {}

void Metrics::CountRpc(absl::string_view method, grpc::StatusCode code) {
  rpcs_.Add({{"method", std::string(method)}, {"code", CodeName(code)}}).Increment();
}

void Metrics::CountSlotExpiry() { slot_expiries_.Increment(); }

void Metrics::CountAuthFailure(absl::string_view reason) {
  auth_failures_.Add({{"reason", std::string(reason)}}).Increment();
}

void Metrics::ObserveForward(double seconds, int32_t batch) {
  forward_seconds_.Observe(seconds);
  forward_batch_.Observe(batch);
}

void Metrics::ObserveKernel(absl::string_view op, double seconds) {
  kernel_seconds_.Add({{"op", std::string(op)}}, LatencyBuckets()).Observe(seconds);
}

void Metrics::AddBytes(int64_t received, int64_t sent) {
  received_bytes_.Increment(static_cast<double>(received));
  sent_bytes_.Increment(static_cast<double>(sent));
}

void Metrics::CountDedupReplay() { dedup_replays_.Increment(); }

CacheCollector::CacheCollector(const cache::StateCache* cache,
                               std::function<ServiceGauges()> gauges)
    : cache_(cache), gauges_(std::move(gauges)) {}

std::vector<prometheus::MetricFamily> CacheCollector::Collect() const {
  using prometheus::MetricType;
  const cache::CacheStats s = cache_->stats();
  const ServiceGauges g = gauges_();
  std::vector<prometheus::MetricFamily> out;

  auto slots = Family("replayssm_slots", "Slots by state", MetricType::Gauge);
  AddSample(slots, s.slots_live, {{"state", "live"}});
  AddSample(slots, s.slots_snapshot, {{"state", "snapshot"}});
  AddSample(slots, s.slots_free, {{"state", "free"}});
  out.push_back(std::move(slots));
  AddSingle(out, "replayssm_slots_capacity", "Slots the budget holds", MetricType::Gauge,
            s.slots_total);

  auto folds = Family("replayssm_folds_total", "Checkpoint folds by reason", MetricType::Counter);
  AddSample(folds, s.folds_ring_full, {{"reason", "ring_full"}});
  AddSample(folds, s.folds_track, {{"reason", "track"}});
  AddSample(folds, s.folds_materialize, {{"reason", "materialize"}});
  out.push_back(std::move(folds));

  struct Counter {
    const char* name;
    const char* help;
    int64_t value;
  };
  const Counter counters[] = {
      {"replayssm_snapshot_hits_total", "Prefix lookups that found a GPU snapshot",
       s.snapshot_hits},
      {"replayssm_snapshot_misses_total", "Prefix lookups that found no GPU snapshot",
       s.snapshot_misses},
      {"replayssm_snapshot_evictions_total", "GPU snapshots evicted (spilled or dropped)",
       s.snapshot_evictions},
      {"replayssm_snapshots_taken_total", "Snapshots taken at track-interval boundaries",
       s.snapshots_taken},
      {"replayssm_donations_total", "Finished slots donated to the prefix cache", s.donations},
      {"replayssm_guarded_exits_total", "Calls of the materialize guard (a state leaving a slot)",
       s.guard_calls},
      {"replayssm_invariant_refusals_total", "The materialize guard's refusals",
       s.invariant_refusals},
      {"replayssm_nonfinite_refusals_total",
       "States with a NaN or Inf kept from a snapshot, a donation or a move out",
       s.nonfinite_refusals},
      {"replayssm_forwards_graphed_total", "Planned decode forwards run as one CUDA graph",
       s.forwards_graphed},
      {"replayssm_forward_recordings_total", "CUDA graphs recorded for planned forwards",
       s.forward_recordings},
      {"replayssm_forward_recording_failures_total",
       "Recordings that failed: those streams run call by call", s.forward_recording_failures},
      {"replayssm_snapshot_spills_total", "GPU snapshots evicted into the host tier",
       s.snapshot_spills},
      {"replayssm_snapshot_promotions_total", "Host-tier hits copied back to the GPU",
       s.host_promotions},
      {"replayssm_snapshot_spills_ahead_total", "Snapshots copied to the host ahead of need",
       s.spills_ahead},
  };
  for (const Counter& c : counters) {
    AddSingle(out, c.name, c.help, MetricType::Counter, c.value);
  }
  AddTierFamilies(s, out);
  auto forwards =
      Family("replayssm_forwards_total", "Decode forwards by outcome", MetricType::Counter);
  AddSample(forwards, s.forwards_committed, {{"outcome", "committed"}});
  AddSample(forwards, s.forwards_abandoned, {{"outcome", "abandoned"}});
  out.push_back(std::move(forwards));

  AddSingle(out, "replayssm_open_forwards", "Forwards in progress", MetricType::Gauge,
            g.open_forwards);
  AddSingle(out, "replayssm_draining", "1 while the server drains", MetricType::Gauge,
            g.draining ? 1 : 0);
  AddSingle(out, "replayssm_drain_overdue",
            "1 once a drain has run past --drain-timeout + --transfer-timeout + 1 s: stuck",
            MetricType::Gauge, g.drain_overdue ? 1 : 0);
  auto streams = Family("replayssm_open_streams",
                        "Open streams by method, against --max-streams (DecodeStream) and "
                        "--max-watchers (WatchCache)",
                        MetricType::Gauge);
  AddSample(streams, g.open_decode_streams, {{"method", "DecodeStream"}});
  AddSample(streams, g.open_watch_streams, {{"method", "WatchCache"}});
  out.push_back(std::move(streams));
  AddSingle(out, "replayssm_region_unmaps_held",
            "Unregistered CUDA IPC regions whose unmapping waits for no planned forward to be "
            "open (on CUDA an unmapping waits for the running doorbell waits, with every CUDA "
            "call of the server)",
            MetricType::Gauge, g.region_unmaps_held);
  AddSingle(out, "replayssm_region_unmaps_forced_total",
            "CUDA IPC regions unmapped while planned forwards were open, past 16 held: each "
            "such unmapping held every CUDA call of the server until the running doorbell "
            "waits ended",
            MetricType::Counter, g.region_unmaps_forced);
  AddSingle(out, "replayssm_device_failed",
            "1 once a device failed its check (--device-check-interval): all new work refused",
            MetricType::Gauge, g.device_failed ? 1 : 0);
  AddSingle(out, "replayssm_cache_event_batches_total",
            "Cache event batches numbered (all tenants)", MetricType::Counter,
            g.cache_event_batches);
  AddSingle(out, "replayssm_cache_event_watchers",
            "Listeners of cache events: WatchCache streams and the ZMQ publisher",
            MetricType::Gauge, g.cache_event_watchers);
  AddSingle(out, "replayssm_kv_events_published_total",
            "Cache event batches sent on the ZMQ PUB socket", MetricType::Counter,
            g.kv_events_published);
  return out;
}

}  // namespace replayssm::service
