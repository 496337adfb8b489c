// Server: wires options -> StateCache -> the gRPC service (+ grpc.health.v1, reflection) ->
// the Prometheus /metrics endpoint, and stops gracefully: Drain() refuses new forwards with
// UNAVAILABLE and reports NOT_SERVING, waits for the open ones, then shuts the server down.
//
// Thread safety: Drain() and Wait() may be called from any thread, once each.
#ifndef REPLAYSSM_SERVICE_SERVER_H_
#define REPLAYSSM_SERVICE_SERVER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace replayssm::service {

struct ServerOptions {
  std::string grpc_address = "127.0.0.1:50051";    // port 0 picks a free port
  std::string metrics_address = "127.0.0.1:9400";  // "" = no /metrics endpoint
  std::string model = "tiny-gdn";                  // a preset name (ModelPresetNames())
  std::string device = "auto";                     // auto | cpu | cuda | cuda:N
  int64_t memory_budget_bytes = int64_t{1} << 30;  // slots + snapshots, per TP rank
  int32_t tp_size = 1;  // ranks of the tensor-parallel engine served (cache/tp.h)
  std::string devices;  // CUDA devices of the ranks, "0,1,..."; "" = all on --device's
  int32_t ring_length = 0;                         // L; 0 = the preset's
  int32_t track_interval = 64;  // snapshot every this many decoded tokens; 0 = never
  std::string state_dtype;      // f32 | bf16 | f16; "" = the preset's
  std::string ring_dtype;       // ring d, k: f32 | bf16 | f16; "" = the state dtype
  std::string beta_rounding;    // act | f32; "" = the model's (cache::DefaultRoundBeta)
  int32_t max_batch = 256;      // rows per decode / verify
  bool forward_graphs = true;   // cache::CacheOptions::forward_graphs
  int32_t max_prefill_tokens = 1 << 16;
  int64_t max_message_bytes = int64_t{64} << 20;     // larger requests: RESOURCE_EXHAUSTED
  int64_t dedup_entries = 4096;                      // request ids remembered ...
  int64_t dedup_bytes = int64_t{256} << 20;          // ... and their replies' bytes at most
  int32_t max_request_id_bytes = 128;                // longer request ids: INVALID_ARGUMENT
  int64_t max_import_tokens = int64_t{1} << 20;      // tokens an Import or a transfer brings
  int32_t max_streams = 1024;                        // open DecodeStream streams at once
  // Planned forwards open at once (docs/data-plane.md); 0: chosen by the device — on CUDA
  // three quarters of the GPU's work queues (24 of the 32 the server asks for) over the most
  // TP ranks sharing one GPU, no bound on the CPU.
  int32_t max_planned_forwards = 0;
  int64_t tenant_max_slots = 0;  // live slots one tenant may hold (with --auth-tokens); 0: any
  int32_t tenant_max_streams = 0;    // DecodeStream streams one tenant may hold open; 0: any
  int32_t tenant_max_watchers = 0;   // WatchCache streams one tenant may hold open; 0: any
  int64_t tenant_max_snapshots = 0;  // snapshots one tenant's prefix namespace may hold; 0: any
  // The host tier (cache::CacheOptions::host_snapshot_bytes, host_policy), per TP rank.
  int64_t host_snapshot_bytes = 0;              // pinned host bytes for evicted snapshots; 0: off
  std::string host_snapshot_policy = "lru";     // lru | value
  int32_t host_spill_ahead = 4;                 // slots kept obtainable without loss; 0: off
  bool host_pin_at_start = true;                // pin the whole host tier at start
  // Cache events (cache_events.h, zmq_events.h).
  int64_t cache_events_retain = 4096;  // batches kept per tenant for replay
  int32_t max_watchers = 64;           // WatchCache streams open at once
  std::string kv_events_endpoint;      // ZMQ PUB; empty: no ZMQ publisher
  std::string kv_events_replay_endpoint;
  std::string kv_events_topic = "kv-events";
  std::string kv_events_tenant;        // the tenant whose events ZMQ carries ("": implicit)
  std::string kv_events_curve_secret_file;  // CURVE: the server's secret key (Z85)
  std::string kv_events_clients_file;       // CURVE: the routers' public keys admitted
  int32_t max_regions = 64;                          // registered memory regions at once
  absl::Duration slot_ttl = absl::ZeroDuration();    // idle live slots expire; 0 = never
  absl::Duration region_ttl = absl::ZeroDuration();  // idle registered regions go; 0 = never
  int64_t max_region_bytes = int64_t{64} << 30;      // their bytes together (mapped, not owned)
  absl::Duration forward_timeout = absl::Seconds(10);  // a doorbell forward, begin to commit
  // A streamed forward's wait for its next layer message (the stream's idle sweep).
  absl::Duration stream_idle_timeout = absl::Seconds(60);
  absl::Duration drain_timeout = absl::Seconds(30);  // wait for open forwards at most this
  // The drain also waits (within drain_timeout) until no live slot is left: time for the
  // schedulers to move their requests off (TransferSlot) or free them.
  bool drain_wait_slots = false;
  // How often the server checks that its devices still take work (rssm_device_check); on the
  // first failure it reports NOT_SERVING and refuses all new work. 0 = never.
  absl::Duration device_check_interval = absl::Seconds(5);
  // Slot transfers to and from peers (replayssm.v1.SlotTransfer over UCX; docs/transfer.md).
  int64_t transfer_chunk_bytes = int64_t{4} << 20;    // UCX put granularity
  int32_t transfer_lanes = 4;                          // sender threads putting at once, 1..16
  int32_t transfer_import_threads = 8;                 // receiver copier threads, 1..32
  absl::Duration transfer_timeout = absl::Seconds(30);  // one outgoing transfer, all of it
  absl::Duration transfer_lease = absl::Seconds(30);    // an uncommitted reservation at most
  int32_t transfer_max_concurrent = 8;                 // outgoing transfers at once, 1..64
  int32_t transfer_reservations_per_peer = 4;  // incoming reservations one peer may hold, 1..64
  // TLS on the gRPC port and for transfer dials (service/tls.h): off when both are empty.
  std::string tls_cert_file, tls_key_file;
  std::string tls_client_ca_file;           // mTLS: clients and peers must present a cert it signed
  std::vector<std::string> transfer_peers;  // host:port this server may dial; empty: any
  // Bearer tokens of tenants (service/tenants.h): every client-facing call needs one; "": off,
  // one implicit tenant (localhost and trusted networks).
  std::string auth_tokens_file;
  // The cluster's peer token (service/secrets.h): SlotTransfer's peer methods need a proof of
  // it, and this server proves it to its peers. "": with --auth-tokens or --tls-client-ca incoming
  // transfers are refused; without either, peers are anyone who can connect (trusted network).
  std::string peer_token_file;
  // The network interface UCX uses and listens on for transfers (UCX_NET_DEVICES); "": all.
  std::string transfer_interface;
};

class Server {
 public:
  static absl::StatusOr<std::unique_ptr<Server>> Start(const ServerOptions& options);
  virtual ~Server() = default;

  virtual std::string grpc_address() const = 0;     // host:port actually bound
  virtual std::string metrics_address() const = 0;  // host:port, "" when disabled
  virtual std::string backend_name() const = 0;     // "cpu", "cuda:0"
  virtual std::string model_name() const = 0;
  // CUDA backend: whether this process's GPU work goes through MPS (co-located engines need
  // it: docs/data-plane.md). Always false on the CPU backend.
  virtual bool mps_active() const = 0;
  // What the operator should hear about at start: settings that work but are unsafe (secret
  // files others may read, ...). main prints each as a warning.
  virtual std::vector<std::string> warnings() const = 0;
  // The CURVE public key (Z85) routers use for the ZMQ cache events; "" without CURVE.
  virtual std::string kv_events_public_key() const = 0;

  // Refuse new forwards and incoming transfers, report NOT_SERVING, wait for open forwards
  // (and with drain_wait_slots for the live slots to be moved off or freed; all within the
  // drain timeout), then stop serving. Returns when the gRPC server is shut down.
  virtual void Drain() = 0;
};

// The longest a drain of `options` runs: its waits (drain_timeout), then the outgoing transfers
// it lets finish (each within transfer_timeout) and gRPC's half second of shutdown, and a
// second to spare. Past it the drain is stuck: /metrics says replayssm_drain_overdue 1 (the
// alert ReplaySSMDrainStuck).
absl::Duration DrainBound(const ServerOptions& options);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SERVER_H_
