// The cache events of one tenant on ZMQ, in vLLM's KV-events wire format, for routers that
// already consume vLLM's (llm-d, Dynamo, vLLM's own examples):
//  - a PUB socket (--kv-events-endpoint) sends each batch as three frames: the topic
//    (--kv-events-topic), the batch's sequence number (8 bytes, big-endian) and the batch
//    as msgpack: [ts, [event, ...]] where an event is ["BlockStored", [hash], parent | nil,
//    [token ids], block_size, nil (lora_id), medium], ["BlockRemoved", [hash], medium] or
//    ["AllBlocksCleared"] (msgspec's array_like tagged structs);
//  - a ROUTER socket (--kv-events-replay-endpoint) answers a request of one frame, the first
//    sequence number wanted (8 bytes, big-endian), with a message [seq, batch] per kept batch
//    from there and an end marker [-1 (8 bytes), empty] (REQ or DEALER clients). A replay is
//    sent at the pace the router reads it (ZMQ_ROUTER_MANDATORY: a full queue is retried,
//    never dropped), at most kMaxReplays at once; a request beyond that, or one from a router
//    already being answered, replaces the oldest / its earlier answer (whose messages queued
//    for that router already still arrive first: a router asking again reads up to its
//    earlier answer's end marker or the sequence number it asked from).
// The endpoint carries one tenant's events (--kv-events-tenant). Authentication
// (--kv-events-curve-secret-file, --kv-events-clients-file): both sockets are CURVE servers
// (ZMQ's encryption and key authentication) and a ZAP handler admits only the client public
// keys of the clients file, so only the routers holding those keys subscribe or replay; the
// routers need the server's public key (logged at start). Without them the sockets are open
// (as vLLM's) and belong on an interface only the routers reach. WatchCache is the other
// authenticated path (tokens, multi-tenant). The publisher announces its start with
// AllBlocksCleared.
#ifndef REPLAYSSM_SERVICE_ZMQ_EVENTS_H_
#define REPLAYSSM_SERVICE_ZMQ_EVENTS_H_

#include <atomic>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "service/cache_events.h"

namespace replayssm::service {

// The msgpack payload of a batch (above).
std::string EncodeKvEventBatch(const KvEventBatch& batch, int32_t block_size);

struct ZmqEventsOptions {
  std::string endpoint;         // PUB, e.g. tcp://127.0.0.1:5557
  std::string replay_endpoint;  // ROUTER; empty: no replay
  std::string topic = "kv-events";
  TenantId tenant = kImplicitTenant;
  // CURVE (both set, or neither): the server's secret key file (Z85, 40 characters) and the
  // file of the client public keys admitted (Z85, one per line; lines starting with `#` are
  // comments: Z85 itself uses '#', so never after a key).
  std::string curve_secret_file;
  std::string clients_file;
};

// The server's public key (Z85) for the secret key in `secret_file`, for the routers;
// INVALID_ARGUMENT naming the flag when the file holds no CURVE secret key.
absl::StatusOr<std::string> CurvePublicKey(const std::string& secret_file);

class ZmqEventPublisher final : public KvEventListener {
 public:
  // A reply whose router's queue took nothing for this long is dropped: a REQ router reads one
  // message per request, and its reply would wait (holding batches the log let go) till the
  // router asked again or eight newer requests pushed it out.
  static constexpr absl::Duration kReplayIdle = absl::Seconds(30);
  // Replays sent at once (each holds the log's batches it still has to send, shared: a batch
  // the log has let go of lives on until every reply holding it has sent it).
  static constexpr size_t kMaxReplays = 8;
  // Binds both sockets; UNAVAILABLE naming the flag when one cannot bind.
  static absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> Start(CacheEventLog* log,
                                                                  ZmqEventsOptions options);
  ~ZmqEventPublisher() override;

  void OnBatch(TenantId tenant, const KvEventBatch& batch) override;
  int64_t published() const { return published_.load(); }

 private:
  ZmqEventPublisher(CacheEventLog* log, ZmqEventsOptions options)
      : log_(log), options_(std::move(options)) {}
  // A replay being sent: the router's identity, whether it sent a REQ's empty delimiter, the
  // batches still to send, then the end marker.
  struct PendingReplay {
    std::string id;
    bool delimited = false;
    std::vector<std::shared_ptr<const KvEventBatch>> batches;  // the log's own
    size_t next = 0;  // batches.size(): the end marker is next
    // The next message's frames, kept while the router's queue is full (encoded once).
    std::vector<std::string> frames;
    absl::Time progressed;  // the request, or the last message the router's queue took
  };

  void Run();
  void Replay(void* socket);  // takes one request and queues its answer
  // Sends what each pending replay's router takes now; drops the routers gone.
  void SendReplays();
  void Authenticate(void* zap);  // one ZAP request: admits the clients file's keys only

  CacheEventLog* const log_;
  const ZmqEventsOptions options_;
  void* context_ = nullptr;
  void* pub_ = nullptr;     // used by the thread only (ZMQ sockets are single-threaded)
  void* replay_ = nullptr;
  void* zap_ = nullptr;                  // the ZAP handler (CURVE only)
  std::vector<std::string> clients_;     // admitted client public keys, 32 bytes each
  std::deque<PendingReplay> replays_;    // the thread's
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, std::string>> outbox_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> published_{0};
  std::thread thread_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_ZMQ_EVENTS_H_
