// The cache events of one tenant on ZMQ, in vLLM's KV-events wire format, for routers that
// already consume vLLM's (llm-d, Dynamo, vLLM's own examples):
//  - a PUB socket (--kv-events-endpoint) sends each batch as three frames: the topic
//    (--kv-events-topic), the batch's sequence number (8 bytes, big-endian) and the batch
//    as msgpack: [ts, [event, ...]] where an event is ["BlockStored", [hash], parent | nil,
//    [token ids], block_size, nil (lora_id), medium], ["BlockRemoved", [hash], medium] or
//    ["AllBlocksCleared"] (msgspec's array_like tagged structs);
//  - a ROUTER socket (--kv-events-replay-endpoint) answers a request of one frame, the first
//    sequence number wanted (8 bytes, big-endian), with a message [seq, batch] per kept batch
//    from there and an end marker [-1 (8 bytes), empty] (REQ or DEALER clients).
// ZMQ has no authentication here: the endpoint carries one tenant's events (--kv-events-tenant)
// and belongs on an interface only the routers reach (loopback by default). WatchCache is the
// authenticated, multi-tenant path. The publisher announces its start with AllBlocksCleared.
#ifndef REPLAYSSM_SERVICE_ZMQ_EVENTS_H_
#define REPLAYSSM_SERVICE_ZMQ_EVENTS_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "service/cache_events.h"

namespace replayssm::service {

// The msgpack payload of a batch (above).
std::string EncodeKvEventBatch(const KvEventBatch& batch, int32_t block_size);

struct ZmqEventsOptions {
  std::string endpoint;         // PUB, e.g. tcp://127.0.0.1:5557
  std::string replay_endpoint;  // ROUTER; empty: no replay
  std::string topic = "kv-events";
  TenantId tenant = kImplicitTenant;
};

class ZmqEventPublisher final : public KvEventListener {
 public:
  // Binds both sockets; UNAVAILABLE naming the flag when one cannot bind.
  static absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> Start(CacheEventLog* log,
                                                                  ZmqEventsOptions options);
  ~ZmqEventPublisher() override;

  void OnBatch(TenantId tenant, const KvEventBatch& batch) override;
  int64_t published() const { return published_.load(); }

 private:
  ZmqEventPublisher(CacheEventLog* log, ZmqEventsOptions options)
      : log_(log), options_(std::move(options)) {}
  void Run();
  void Replay(void* socket);

  CacheEventLog* const log_;
  const ZmqEventsOptions options_;
  void* context_ = nullptr;
  void* pub_ = nullptr;     // used by the thread only (ZMQ sockets are single-threaded)
  void* replay_ = nullptr;
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, std::string>> outbox_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> published_{0};
  std::thread thread_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_ZMQ_EVENTS_H_
