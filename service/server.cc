#include "service/server.h"

#include <net/if.h>
#include <stdlib.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "prometheus/exposer.h"
#include "replayssm/cache/model.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/cache/tp.h"
#include "service/cache_events.h"
#include "service/caller.h"
#include "service/config.h"
#include "service/hf_config.h"
#include "service/interfaces.h"
#include "service/malformed_requests.h"
#include "service/metrics.h"
#include "service/periodic_sweep.h"
#include "service/region_leases.h"
#include "service/regions_service.h"
#include "service/replayssm_service.h"
#include "service/request_log.h"
#include "service/secrets.h"
#include "service/service_context.h"
#include "service/slot_handles.h"
#include "service/slot_leases.h"
#include "service/tenants.h"
#include "service/tls.h"
#include "service/transfer_service.h"
#include "service/zmq_events.h"

namespace replayssm::service {

namespace {

constexpr char kServiceName[] = "replayssm.v1.ReplaySsm";
// The server's keepalive pings (Listen): after this long without traffic on a connection, and
// how long the ack may take before the connection, and every stream on it, is dropped.
constexpr int kKeepaliveTimeMs = 30'000;
constexpr int kKeepaliveTimeoutMs = 10'000;
// The end of a drain: idle streams and calls in flight get kShutdownGrace once the open
// forwards are done (Drain); with kDrainSlack, a drain may run a second past its waits and
// transfers before it is stuck (DrainBound).
constexpr absl::Duration kShutdownGrace = absl::Milliseconds(500);
constexpr absl::Duration kDrainSlack = absl::Milliseconds(500);

struct Device {
  int32_t backend = RSSM_BACKEND_CPU;
  std::string name = "cpu";
};

// A word flag's value read through `parse` (config.h), the error naming the flag. Checked by
// CheckServerBounds already (Start's first step).
absl::StatusOr<int32_t> ReadWord(const char* flag,
                                 absl::StatusOr<int32_t> (*parse)(absl::string_view),
                                 const std::string& value) {
  absl::StatusOr<int32_t> word = parse(value);
  if (!word.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", word.status().message()));
  }
  return word;
}

// auto: CUDA when a device is visible, else the CPU backend. cuda:N selects device N by
// restricting CUDA_VISIBLE_DEVICES before the backend initializes (the kernel ABI has no
// device argument; the service knows nothing of CUDA).
absl::StatusOr<Device> ResolveDevice(const std::string& device) {
  const absl::StatusOr<int32_t> word = ReadWord("device", DeviceWord, device);
  if (!word.ok()) return word.status();
  if (*word == kDeviceCpu) return Device{};
  if (*word == kDeviceAuto) {
    if (rssm_backend_available(RSSM_BACKEND_CUDA)) return Device{RSSM_BACKEND_CUDA, "cuda:0"};
    return Device{};
  }
  const int32_t index = *word;
  // cuda:N is the N-th device this process sees: of CUDA_VISIBLE_DEVICES when it is set (a
  // container's GPUs), as for N = 0. It was the N-th of the machine for N > 0 and the first
  // visible one for 0 (an outside review).
  if (index != 0) {
    std::string chosen = absl::StrCat(index);
    if (const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
        visible != nullptr && *visible != '\0') {
      const std::vector<std::string> listed = absl::StrSplit(visible, ',');
      if (static_cast<size_t>(index) >= listed.size()) {
        return absl::FailedPreconditionError(
            absl::StrCat("--device ", device, ": CUDA_VISIBLE_DEVICES=", visible, " shows ",
                         listed.size(), " device(s): expected cuda:0..cuda:", listed.size() - 1));
      }
      chosen = listed[index];
    }
    setenv("CUDA_VISIBLE_DEVICES", chosen.c_str(), 1);
  }
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--device ", device, ": the CUDA backend is not built or no GPU"));
  }
  return Device{RSSM_BACKEND_CUDA, absl::StrCat("cuda:", index)};
}

// --tp-size and --devices into the cache's options: one device per rank, and --tp-size taken
// from --devices when it was left at 1.
absl::Status ResolveRanks(const ServerOptions& o, const Device& device, cache::CacheOptions& c) {
  c.tp_size = o.tp_size;
  if (o.devices.empty()) return absl::OkStatus();
  for (absl::string_view d : absl::StrSplit(o.devices, ',')) {
    int32_t index = -1;
    if (!absl::SimpleAtoi(d, &index) || index < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--devices: expected device indices like 0,1,2,3, got ", o.devices));
    }
    c.devices.push_back(index);
  }
  // One device would be a cache of one rank, which takes no device from --devices: it ran on
  // the GPU --device chose whatever this flag said (while the device check watched this one).
  if (c.devices.size() == 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--devices: expected 2 or more devices (one per rank of a TP group), got 1 (",
                     o.devices, "); a one-GPU server takes its GPU from --device (cuda:N)"));
  }
  if (device.backend != RSSM_BACKEND_CUDA) {
    return absl::InvalidArgumentError(
        absl::StrCat("--devices: expected a CUDA backend (--device auto or cuda), got ", device.name));
  }
  const int32_t n = static_cast<int32_t>(c.devices.size());
  if (c.tp_size == 1) c.tp_size = n;
  if (c.tp_size != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--devices: expected ", c.tp_size, " devices (one per --tp-size rank), got ", n));
  }
  const int count = rssm_device_count(RSSM_BACKEND_CUDA);
  for (int32_t d : c.devices) {
    if (d >= count) {
      return absl::InvalidArgumentError(absl::StrCat("--devices: expected indices below ", count,
                                                     " (the GPUs visible), got ", d));
    }
  }
  return absl::OkStatus();
}

// --max-planned-forwards, 0 resolved. On CUDA each open planned forward holds a lane (a
// stream) per rank whose doorbell wait, a running one-thread kernel, lasts until its engine
// rings or its deadline releases it, and the CUDA runtime making a stream while such kernels
// run can wait until they end (the process's 36th, made after 33 waits, on an H100 on
// 2026-12-06; rssm_stream_create now hands out streams made at the device's first): the lanes
// for the bound are made at start (Start) — 24 per GPU, over the most ranks sharing one. The
// CPU backend waits on host threads: no bound.
int32_t PlannedForwardBound(const ServerOptions& o, int32_t backend, const cache::CacheOptions& c) {
  if (o.max_planned_forwards > 0 || backend != RSSM_BACKEND_CUDA) return o.max_planned_forwards;
  constexpr int32_t kPerGpu = 24;
  // Without --devices every rank is on --device's GPU.
  int32_t per_gpu = c.devices.empty() ? std::max<int32_t>(c.tp_size, 1) : 1;
  for (int32_t d : c.devices) {
    per_gpu = std::max<int32_t>(
        per_gpu, static_cast<int32_t>(std::count(c.devices.begin(), c.devices.end(), d)));
  }
  return std::max<int32_t>(1, kPerGpu / per_gpu);
}

absl::StatusOr<cache::ModelSpec> LoadModel(const ServerOptions& o) {
  const absl::StatusOr<int32_t> dtype = ReadWord("state-dtype", DtypeWord, o.state_dtype);
  if (!dtype.ok()) return dtype.status();
  const absl::StatusOr<int32_t> ring = ReadWord("ring-dtype", DtypeWord, o.ring_dtype);
  if (!ring.ok()) return ring.status();
  const absl::StatusOr<int32_t> round_beta =
      ReadWord("beta-rounding", BetaRoundingWord, o.beta_rounding);
  if (!round_beta.ok()) return round_beta.status();
  absl::StatusOr<cache::ModelSpec> m = absl::EndsWith(o.model, ".json")
                                           ? ModelFromHfConfigFile(o.model, *dtype, o.ring_length)
                                           : cache::ModelPreset(o.model, *dtype, o.ring_length);
  if (!m.ok()) return m;
  absl::Status st = cache::ApplyModelOptions(
      *m, *ring < 0 ? RSSM_RING_DTYPE_STATE : RSSM_RING_DTYPE_F32 + *ring, *round_beta);
  if (!st.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--ring-dtype ", o.ring_dtype, " with a ",
                                                   rssm_dtype_name(m->shape.state_dtype),
                                                   " state: ", st.message()));
  }
  return m;
}

bool IsUnixAddress(absl::string_view address) {
  return absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
}

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// A listen address is a host and a port 0..65535 (0: any free one). gRPC took anything:
// 127.0.0.1:99999 listened on 34463, a missing port on 443 (an outside review).
absl::Status CheckListenAddress(absl::string_view flag, const std::string& address) {
  // gRPC's Unix-domain forms name no port.
  if (flag == "grpc-address" && IsUnixAddress(address)) return absl::OkStatus();
  // The metrics server (civetweb) also takes a bare port and comma-separated lists.
  if (flag == "metrics-address" && address.find(',') != std::string::npos) {
    for (absl::string_view part : absl::StrSplit(address, ',')) {
      if (absl::Status s = CheckListenAddress(flag, std::string(part)); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  int bare = -1;
  if (flag == "metrics-address" && address.size() <= 5 &&
      address.find_first_not_of("0123456789") == std::string::npos &&
      absl::SimpleAtoi(address, &bare) && bare <= 65535) {
    return absl::OkStatus();
  }
  const size_t colon = address.rfind(':');
  int port = -1;
  const bool ok = colon != std::string::npos && colon > 0 && colon + 1 < address.size() &&
                  address.size() - colon - 1 <= 5 &&
                  address.find_first_not_of("0123456789", colon + 1) == std::string::npos &&
                  absl::SimpleAtoi(address.substr(colon + 1), &port) && port <= 65535;
  if (ok) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "--", flag, ": expected host:port with a port in 0..65535 (0: any free one), got \"", address,
      "\""));
}

// The memory this process may use: the container's bound (cgroup v2 memory.max, v1
// memory.limit_in_bytes) when it has one, else the machine's (MemTotal); 0 when unknown.
int64_t UsableMemoryBytes() {
  int64_t bytes = 0;
  if (std::ifstream meminfo("/proc/meminfo"); meminfo) {
    std::string key;
    int64_t kb = 0;
    while (meminfo >> key >> kb) {
      if (key == "MemTotal:") {
        bytes = kb * 1024;
        break;
      }
      meminfo.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
    }
  }
  for (const char* path :
       {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    std::string text;
    int64_t limit = 0;
    if (f >> text && absl::SimpleAtoi(text, &limit) && limit > 0 && (bytes == 0 || limit < bytes)) {
      bytes = limit;
    }
  }
  return bytes;
}

class ServerImpl final : public Server {
 public:
  ServerImpl(const ServerOptions& options, Device device, std::unique_ptr<SlotHandles> handles,
             std::unique_ptr<CacheEventLog> events, std::unique_ptr<cache::StateCache> cache)
      : options_(options),
        device_(std::move(device)),
        handles_(std::move(handles)),
        events_(std::move(events)),
        cache_(std::move(cache)),
        requests_(options.dedup_entries, options.dedup_bytes, options.max_request_id_bytes),
        // The tenants' bounds count with --auth-tokens only (else every call is one tenant).
        streams_(options.max_streams,
                 options.auth_tokens_file.empty() ? 0 : options.tenant_max_streams, "DecodeStream",
                 "--max-streams", "--tenant-max-streams"),
        watchers_(options.max_watchers,
                  options.auth_tokens_file.empty() ? 0 : options.tenant_max_watchers, "WatchCache",
                  "--max-watchers", "--tenant-max-watchers"),
        regions_(device_.backend,
                 cache::RegionLimits{options.max_regions,
                                     static_cast<uint64_t>(options.max_region_bytes)},
                 DeviceQuiet()),
        metrics_(options.max_batch) {
    ctx_.cache = cache_.get();
    ctx_.regions = &regions_;
    ctx_.requests = &requests_;
    ctx_.metrics = &metrics_;
    ctx_.gate = &gate_;
    ctx_.streams = &streams_;
    ctx_.events = events_.get();
    ctx_.watchers = &watchers_;
    ctx_.slots = SlotCodec(handles_.get());
    ctx_.limits = {options.max_batch, options.max_prefill_tokens, options.max_message_bytes,
                   options.max_import_tokens, options.tenant_max_slots};
    ctx_.backend_name = device_.name;
    ctx_.forward_timeout = options.forward_timeout;
    ctx_.stream_idle_timeout = options.stream_idle_timeout;
    ctx_.slot_ttl = options.slot_ttl;
    ctx_.mps = device_.backend == RSSM_BACKEND_CUDA && rssm_mps_active() != 0;
    service_ = std::make_unique<ReplaySsmService>(&ctx_);
    regions_service_ = std::make_unique<RegionsService>(&ctx_);
  }

  // --device-check-interval: after Listen (the health service). On the first failed check the
  // gate refuses all new work for good, health turns NOT_SERVING (readiness drops, and the
  // liveness probe restarts the pod: a failed CUDA context never recovers) and the
  // replayssm_device_failed gauge turns 1.
  void BoundPlannedForwards(int32_t n) { gate_.set_max_planned(n); }

  // `devices`: the ranks' (--devices), or empty for device 0.
  void StartDeviceCheck(std::vector<int32_t> devices) {
    if (options_.device_check_interval <= absl::ZeroDuration()) return;
    if (devices.empty()) devices.push_back(0);
    device_check_ = std::make_unique<PeriodicSweep>(
        options_.device_check_interval, [this, devices](absl::Time) {
          if (gate_.failed()) return;
          for (int32_t d : devices) {
            if (rssm_device_check(device_.backend, d) == RSSM_OK) continue;
            const std::string reason =
                absl::StrCat(device_.name, " device ", d, ": ", rssm_last_error());
            gate_.Fail(reason);
            server_->GetHealthCheckService()->SetServingStatus(false);
            server_->GetHealthCheckService()->SetServingStatus(kServiceName, false);
            std::fprintf(stderr,
                         "replayssm-server: device failed, refusing all new work and reporting "
                         "NOT_SERVING: %s\n",
                         reason.c_str());
            return;
          }
        });
  }

  // --slot-ttl: after the transfer service, whose receiver frees an idle slot that a
  // sender's unacknowledged commit names (transfer/receiver.h, FreeSlot).
  void StartSlotLeases() {
    if (options_.slot_ttl <= absl::ZeroDuration()) return;
    std::function<absl::Status(cache::SlotId)> free;
    if (transfers_ != nullptr) {
      free = [t = transfers_.get()](cache::SlotId slot) { return t->FreeIdleSlot(slot); };
    }
    leases_ = std::make_unique<SlotLeases>(
        cache_.get(), handles_.get(), options_.slot_ttl, [this] { metrics_.CountSlotExpiry(); },
        free);
  }

  // --auth-tokens: every client-facing call names its tenant (tenants.h), and each tenant
  // gets regions of its own.
  // --region-ttl: after the tables exist (LoadTokens makes the tenants').
  void StartRegionLeases() {
    if (options_.region_ttl <= absl::ZeroDuration()) return;
    region_leases_ =
        std::make_unique<RegionLeases>(&regions_, tenant_regions_.get(), options_.region_ttl);
  }

  absl::Status LoadTokens() {
    // Without tokens a tenant's bound is refused before (config.cc, Companions).
    if (options_.auth_tokens_file.empty()) return absl::OkStatus();
    absl::StatusOr<std::unique_ptr<TokenStore>> tokens =
        TokenStore::Load(options_.auth_tokens_file);
    if (!tokens.ok()) return tokens.status();
    tokens_ = *std::move(tokens);
    if (auto w = ExposureWarning("auth-tokens", options_.auth_tokens_file)) warnings_.push_back(*w);
    tenant_regions_ = std::make_unique<TenantRegions>(
        device_.backend,
        cache::RegionLimits{options_.max_regions, static_cast<uint64_t>(options_.max_region_bytes)},
        DeviceQuiet());
    ctx_.tokens = tokens_.get();
    ctx_.tenant_regions = tenant_regions_.get();
    // Calls look at the file at most once a second when they come; streams already open
    // check the loaded tokens (CheckStillAuthorized), so the server looks for them.
    // WatchCache streams wait for events: they are told when the file changed.
    // Against the generation last told, not the one before this sweep's own reload: a call
    // with a token the server does not know reloads the file too, and a rotation whose new
    // token came first left the old token's watchers untold (an outside review).
    token_reload_ = std::make_unique<PeriodicSweep>(
        absl::Seconds(1), [t = tokens_.get(), events = events_.get(),
                           told = tokens_->generation()](absl::Time) mutable {
          t->Reload(false).IgnoreError();
          if (const uint64_t now = t->generation(); now != told) {
            told = now;
            events->TokensChanged();
          }
        });
    return absl::OkStatus();
  }

  // --kv-events-endpoint: the ZMQ publisher of one tenant's cache events (after LoadTokens,
  // which knows the tenants). Its flags without it were refused before (config.cc, Companions).
  absl::Status StartEventPublisher() {
    if (options_.kv_events_endpoint.empty()) return absl::OkStatus();
    std::optional<TenantId> tenant;
    if (!options_.kv_events_tenant.empty()) {
      tenant = tokens_ ? tokens_->Find(options_.kv_events_tenant) : std::nullopt;
      if (!tenant.has_value()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--kv-events-tenant: expected a tenant of the --auth-tokens file, got \"",
                         options_.kv_events_tenant, "\""));
      }
    }
    if (tokens_ != nullptr && !tenant.has_value()) {
      // With tokens every caller is a named tenant: the implicit one has no events, and the
      // publisher sent routers nothing after its start (an outside review).
      return absl::InvalidArgumentError(
          "--kv-events-tenant: expected a tenant of the --auth-tokens file with "
          "--kv-events-endpoint (with tokens every caller is a named tenant, and ZMQ carries "
          "one tenant's events), got none");
    }
    ZmqEventsOptions z;
    z.endpoint = options_.kv_events_endpoint;
    z.replay_endpoint = options_.kv_events_replay_endpoint;
    z.topic = options_.kv_events_topic;
    z.curve_secret_file = options_.kv_events_curve_secret_file;
    z.clients_file = options_.kv_events_clients_file;
    if (tenant.has_value()) z.tenant = *tenant;
    absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> p =
        ZmqEventPublisher::Start(events_.get(), std::move(z));
    if (!p.ok()) return p.status();
    publisher_ = *std::move(p);
    const std::string& secret_file = options_.kv_events_curve_secret_file;
    if (!secret_file.empty()) {
      if (auto w = ExposureWarning("kv-events-curve-secret-file", secret_file)) {
        warnings_.push_back(*w);
      }
      absl::StatusOr<std::string> key = CurvePublicKey(secret_file);
      if (key.ok()) kv_events_public_key_ = *key;
    } else {
      warnings_.push_back(
          "--kv-events-endpoint without --kv-events-curve-secret-file: the ZMQ cache events are "
          "open to whoever reaches the endpoint; keep it on a private interface");
    }
    return absl::OkStatus();
  }

  // The SlotTransfer service (UCX worker, receiver, sender); fails when UCX cannot start.
  absl::Status StartTransfers() {
    if (!options_.transfer_interface.empty()) {
      // UCX reads its configuration from the environment when each context starts: every
      // transfer context of this process then uses (and listens on) this interface only.
      if (if_nametoindex(options_.transfer_interface.c_str()) == 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("--transfer-interface: expected a network interface of this host, got \"",
                         options_.transfer_interface, "\""));
      }
      setenv("UCX_NET_DEVICES", options_.transfer_interface.c_str(), /*overwrite=*/1);
    } else if (getenv("UCX_NET_DEVICES") == nullptr) {
      DefaultTransferInterface();
    }
    TransferOptions t;
    t.chunk_bytes = static_cast<size_t>(options_.transfer_chunk_bytes);
    t.lanes = options_.transfer_lanes;
    t.import_threads = options_.transfer_import_threads;
    t.timeout = options_.transfer_timeout;
    t.lease = options_.transfer_lease;
    t.max_concurrent = options_.transfer_max_concurrent;
    t.max_open_per_peer = options_.transfer_reservations_per_peer;
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> peers = PeerCredentialsFor(Tls());
    if (!peers.ok()) return peers.status();
    t.peer_credentials = *std::move(peers);
    t.allowed_peers = options_.transfer_peers;
    if (absl::Status st = LoadPeerTokens(t); !st.ok()) return st;
    absl::StatusOr<std::unique_ptr<TransferService>> ts = TransferService::Create(&ctx_, t);
    if (!ts.ok()) return ts.status();
    transfers_ = std::move(*ts);
    return absl::OkStatus();
  }

  // Without --transfer-interface (or UCX_NET_DEVICES set by the operator) UCX listens where
  // gRPC does: on the interface of --grpc-address (loopback by default), on every one for a
  // wildcard address.
  void DefaultTransferInterface() {
    // A Unix-domain gRPC socket is reached from this host only: so is UCX then (loopback).
    const std::string host = IsUnixAddress(options_.grpc_address)
                                 ? std::string("127.0.0.1")
                                 : HostOfAddress(options_.grpc_address);
    if (std::optional<std::string> i = InterfaceHolding(host); i.has_value()) {
      setenv("UCX_NET_DEVICES", i->c_str(), /*overwrite=*/1);
      return;
    }
    if (host.empty() || host == "0.0.0.0" || host == "::") return;  // gRPC is everywhere too
    warnings_.push_back(absl::StrCat(
        "UCX transfers listen on every interface: no interface of this host holds the "
        "--grpc-address host \"", host, "\"; name one with --transfer-interface"));
  }

  // Settings that run but expose more than the operator may think.
  void SecurityWarnings() {
    // A config.json without weights beside it serves seeded parameters: fine for a test, not
    // what a deployment that mounted the config and forgot the weights means (GetInfo says
    // params_from_seed; the start says it too).
    if (cache_->model().params_from_seed && absl::EndsWith(options_.model, ".json")) {
      warnings_.push_back(absl::StrCat(
          "--model ", options_.model,
          ": no safetensors weights beside it: serving seeded parameters, not the model's "
          "(GetInfo's params_from_seed)"));
    }
    const bool tls = !options_.tls_cert_file.empty();
    if (!options_.auth_tokens_file.empty() && !tls) {
      warnings_.push_back(
          "--auth-tokens without TLS (--tls-cert, --tls-key): bearer tokens and request states "
          "cross the network in plaintext; anyone on the path can read and replay them");
    }
    if (tls && options_.tls_client_ca_file.empty()) {
      warnings_.push_back(
          "TLS without client certificates (--tls-client-ca): any host that reaches the port "
          "can call it; with neither --tls-client-ca nor --auth-tokens, it can use any slot "
          "handle it learns");
    }
  }

  // --peer-token: peers authenticate with it; without it a server that authenticates its
  // clients takes no incoming transfers (a client's credentials are never a peer's).
  absl::Status LoadPeerTokens(TransferOptions& t) {
    t.clients_authenticated =
        !options_.auth_tokens_file.empty() || !options_.tls_client_ca_file.empty();
    if (options_.peer_token_file.empty()) {
      if (t.clients_authenticated) {
        warnings_.push_back(absl::StrCat(
            "incoming slot transfers are refused, and ",
            t.allowed_peers.empty() ? "outgoing ones too (no --transfer-peers)"
                                    : "outgoing ones go to --transfer-peers only",
            ": clients are authenticated (--auth-tokens, --tls-client-ca) and peers cannot be "
            "without --peer-token"));
      }
      return absl::OkStatus();
    }
    absl::StatusOr<std::unique_ptr<PeerTokens>> tokens = PeerTokens::Load(options_.peer_token_file);
    if (!tokens.ok()) return tokens.status();
    t.peer_tokens = *std::move(tokens);
    if (auto w = ExposureWarning("peer-token", options_.peer_token_file)) warnings_.push_back(*w);
    return absl::OkStatus();
  }

  ~ServerImpl() override {
    leases_.reset();  // its sweep calls into the transfer service and the cache
    if (transfers_ != nullptr) transfers_->Stop();  // its reactors end before the server
    if (server_ != nullptr) server_->Shutdown(std::chrono::system_clock::now());
  }

  TlsOptions Tls() const {
    return {options_.tls_cert_file, options_.tls_key_file, options_.tls_client_ca_file};
  }

  absl::Status Listen() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();
    grpc::ServerBuilder builder;
    int port = 0;
    absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> creds = ServerCredentialsFor(Tls());
    if (!creds.ok()) return creds.status();
    builder.AddListeningPort(options_.grpc_address, *creds, &port);
    // A port another process listens on is refused, not shared: gRPC sets SO_REUSEPORT, and
    // two servers given one port both started, the kernel splitting clients between their
    // caches (an outside review).
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    builder.SetMaxReceiveMessageSize(static_cast<int>(
        std::min<int64_t>(options_.max_message_bytes, std::numeric_limits<int>::max())));
    builder.SetMaxSendMessageSize(-1);
    // Keepalive: a client host gone without closing its connection (power, partition) would
    // keep its streams, and the forwards and slots they hold, open until TCP gave up (hours).
    // The server pings every connection after 30 s without traffic and drops it when 10 s
    // pass without the ack; gRPC clients answer pings without any setting of theirs. Clients
    // may ping too (their own keepalive), as often as every 10 s, with or without calls.
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10'000);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> hooks;
    hooks.push_back(MalformedRequestsFactory(&metrics_));
    builder.experimental().SetInterceptorCreators(std::move(hooks));
    builder.RegisterService(service_.get());
    builder.RegisterService(transfers_.get());
    builder.RegisterService(regions_service_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr || port == 0) {
      return absl::UnavailableError(
          absl::StrCat("--grpc-address ", options_.grpc_address, ": cannot listen"));
    }
    // A Unix-domain socket has no port (gRPC reports 1): its address is the flag's own.
    grpc_address_ = IsUnixAddress(options_.grpc_address)
                        ? options_.grpc_address
                        : absl::StrCat(HostOf(options_.grpc_address), ":", port);
    transfers_->set_self_address(grpc_address_);  // PullSlot's default self_address
    server_->GetHealthCheckService()->SetServingStatus(true);
    server_->GetHealthCheckService()->SetServingStatus(kServiceName, true);
    return options_.metrics_address.empty() ? absl::OkStatus() : ExposeMetrics();
  }

  std::string grpc_address() const override { return grpc_address_; }
  std::string metrics_address() const override { return metrics_address_; }
  std::string kv_events_public_key() const override { return kv_events_public_key_; }
  std::string backend_name() const override { return device_.name; }
  std::string model_name() const override { return cache_->model().name; }
  bool mps_active() const override { return ctx_.mps; }
  std::vector<std::string> warnings() const override { return warnings_; }

  void Drain() override {
    gate_.Drain();
    server_->GetHealthCheckService()->SetServingStatus(false);
    server_->GetHealthCheckService()->SetServingStatus(kServiceName, false);
    const absl::Time deadline = absl::Now() + options_.drain_timeout;
    gate_.WaitIdle(options_.drain_timeout);
    // Incoming transfers reserved before the drain: their commits are refused, and each sender
    // then asks AbortTransfer to learn that nothing was committed. A server gone before that
    // answer left the sender in doubt, its source locked for good (an outside review): the
    // drain waits (within --drain-timeout) until every reservation is decided.
    while (transfers_->incoming_open() > 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    // Outgoing moves and Free still work while draining; incoming states are refused.
    // Slots on a failed device cannot be moved off: no wait for them then.
    while (options_.drain_wait_slots && !gate_.failed() && cache_->stats().slots_live > 0 &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(50));
    }
    transfers_->Stop();  // waiting transfers are refused, running ones end
    // Open forwards are done; idle streams and calls in flight get a short grace period.
    server_->Shutdown(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(kShutdownGrace));
    server_->Wait();
  }

 private:
  absl::Status ExposeMetrics() {
    try {
      exposer_ = std::make_unique<prometheus::Exposer>(options_.metrics_address);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("--metrics-address ", options_.metrics_address,
                                                 ": cannot listen: ", e.what()));
    }
    collector_ = std::make_shared<CacheCollector>(cache_.get(), [this] {
      return ServiceGauges{gate_.open(),
                           gate_.draining(),
                           gate_.draining_for(absl::Now()) > DrainBound(options_),
                           events_->batches(),
                           events_->watchers(),
                           publisher_ ? publisher_->published() : 0,
                           gate_.failed(),
                           streams_.open(),
                           watchers_.open(),
                           regions_.held_unmaps() +
                               (tenant_regions_ ? tenant_regions_->held_unmaps() : 0),
                           regions_.forced_unmaps() +
                               (tenant_regions_ ? tenant_regions_->forced_unmaps() : 0)};
    });
    exposer_->RegisterCollectable(metrics_.registry());
    exposer_->RegisterCollectable(collector_);
    const std::vector<int> ports = exposer_->GetListeningPorts();
    metrics_address_ =
        absl::StrCat(HostOf(options_.metrics_address), ":", ports.empty() ? 0 : ports.front());
    return absl::OkStatus();
  }

  // On CUDA, whether no planned forward is open, so that no doorbell wait runs: a CUDA region's
  // unmapping waits for that (cache/regions.h). Null on the CPU.
  std::function<bool()> DeviceQuiet() {
    if (device_.backend != RSSM_BACKEND_CUDA) return nullptr;
    return [this] { return gate_.open_planned() == 0; };
  }

  const ServerOptions options_;
  const Device device_;
  std::unique_ptr<SlotHandles> handles_;  // before cache_: the cache names slots through it
  std::unique_ptr<CacheEventLog> events_;  // before cache_: the cache reports to it
  std::unique_ptr<cache::StateCache> cache_;
  RequestLog requests_;
  StreamLimit streams_;
  StreamLimit watchers_;
  ForwardGate gate_;  // before the region tables: their unmaps ask it until they stop
  cache::RegionTable regions_;  // leases held by open forwards keep their mappings alive
  Metrics metrics_;
  ServiceContext ctx_;
  std::unique_ptr<SlotLeases> leases_;  // --slot-ttl; stopped before the cache goes
  std::unique_ptr<TokenStore> tokens_;  // --auth-tokens; null: one tenant
  std::unique_ptr<TenantRegions> tenant_regions_;  // with tokens_: each tenant's regions
  std::unique_ptr<RegionLeases> region_leases_;    // --region-ttl; stopped before the tables
  std::unique_ptr<ReplaySsmService> service_;
  std::unique_ptr<RegionsService> regions_service_;
  std::unique_ptr<TransferService> transfers_;  // after cache_: destroyed before it
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<ZmqEventPublisher> publisher_;  // after server_: gone before the log
  std::string kv_events_public_key_;  // the routers' CURVE server key ("" without CURVE)
  std::shared_ptr<CacheCollector> collector_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<PeriodicSweep> device_check_;  // after server_ and gate_: stops before them
  std::unique_ptr<PeriodicSweep> token_reload_;  // after tokens_: stops before it
  std::string grpc_address_;
  std::string metrics_address_;
  std::vector<std::string> warnings_;  // for main to print
};

}  // namespace

absl::Duration DrainBound(const ServerOptions& options) {
  return options.drain_timeout + options.transfer_timeout + kShutdownGrace + kDrainSlack;
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(const ServerOptions& options) {
  // The resource bounds (docs/operations.md, "Security and resource bounds"), one table
  // with the flags' (config.cc): options made in code are held to them too.
  if (absl::Status s = CheckServerBounds(options); !s.ok()) return s;
  if (absl::Status s = CheckListenAddress("grpc-address", options.grpc_address); !s.ok()) return s;
  if (!options.metrics_address.empty()) {
    if (absl::Status s = CheckListenAddress("metrics-address", options.metrics_address); !s.ok()) {
      return s;
    }
  }
  absl::StatusOr<Device> device = ResolveDevice(options.device);
  if (!device.ok()) return device.status();
  absl::StatusOr<cache::ModelSpec> model = LoadModel(options);
  if (!model.ok()) return model.status();
  cache::CacheOptions cache_options;
  cache_options.backend = device->backend;
  absl::Status s = ResolveRanks(options, *device, cache_options);
  if (s.ok()) s = cache::CheckTpSize(*model, cache_options.tp_size, "--tp-size");
  if (!s.ok()) return s;
  if (!cache_options.devices.empty()) {
    device->name = absl::StrCat("cuda:", absl::StrJoin(cache_options.devices, ","));
  }
  cache_options.memory_budget_bytes = options.memory_budget_bytes;
  cache_options.track_interval = options.track_interval;
  cache_options.max_batch = options.max_batch;
  cache_options.forward_graphs = options.forward_graphs;
  cache_options.max_prefill_tokens = options.max_prefill_tokens;
  cache_options.max_snapshots_per_namespace = options.tenant_max_snapshots;
  CacheEventLogOptions event_options;
  event_options.block_size = options.track_interval > 0 ? options.track_interval : 64;
  event_options.retain = options.cache_events_retain;
  auto events = std::make_unique<CacheEventLog>(event_options);
  cache_options.event_sink = events->Sink();
  cache_options.host_snapshot_bytes = options.host_snapshot_bytes;
  // Host memory past what the process may use gets it killed, with no word, after minutes of
  // pinning (an outside review: 300G on a 128 GiB host, SIGKILL): the host tier, and on the
  // CPU backend the pool itself, are refused past it (per rank, over the TP ranks).
  const int64_t usable = UsableMemoryBytes();
  const int64_t ranks = std::max<int64_t>(cache_options.tp_size, 1);
  for (const auto& [flag, bytes, where] :
       {std::tuple<const char*, int64_t, const char*>{"host-snapshot-bytes",
                                                      options.host_snapshot_bytes, ""},
        {"memory-budget", device->backend == RSSM_BACKEND_CPU ? options.memory_budget_bytes : 0,
         " on the CPU backend"}}) {
    if (usable > 0 && bytes > usable / ranks) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": expected at most the memory this process may use", where,
                       " (", usable >> 20, " MiB: the container's limit or MemTotal) over ", ranks,
                       " TP rank(s), got ", bytes >> 20, " MiB per rank"));
    }
  }
  // On the CPU backend both are host memory: bounded together (each alone passed at 3/4 of
  // the machine, and with --host-pin-at-start both were taken at start: killed without a word).
  if (const int64_t pool = device->backend == RSSM_BACKEND_CPU ? options.memory_budget_bytes : 0;
      usable > 0 && pool > 0 && options.host_snapshot_bytes > 0 &&
      pool + options.host_snapshot_bytes > usable / ranks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--host-snapshot-bytes + --memory-budget: expected at most the memory this process may "
        "use on the CPU backend (",
        usable >> 20, " MiB: the container's limit or MemTotal) over ", ranks, " TP rank(s), got ",
        options.host_snapshot_bytes >> 20, " + ", pool >> 20, " MiB per rank"));
  }
  cache_options.host_spill_ahead = options.host_spill_ahead;
  cache_options.host_pin_at_start = options.host_pin_at_start;
  cache_options.host_policy = options.host_snapshot_policy == "value" ? cache::HostPolicy::kValue
                                                                      : cache::HostPolicy::kLru;
  // On CUDA every planned forward the server admits holds a lane (a stream) while its engine
  // has not rung; their lanes are made now, before any doorbell wait runs, with a few for the
  // other calls beside them (past 64 planned forwards, the rest on demand). Their streams come
  // from rssm_stream_create's reserve, and a lane pins its staging only at its first operation
  // (docs/data-plane.md).
  const int32_t planned_bound = PlannedForwardBound(options, device->backend, cache_options);
  if (device->backend == RSSM_BACKEND_CUDA) {
    cache_options.lanes_at_start = std::min(planned_bound, 64) + 4;
  }
  auto handles = std::make_unique<SlotHandles>();
  cache_options.slot_name = [h = handles.get()](cache::SlotId id) { return h->Describe(id); };
  absl::StatusOr<std::unique_ptr<cache::StateCache>> cache =
      cache::StateCache::Create(*std::move(model), cache_options);
  if (!cache.ok() && absl::StrContains(cache.status().message(), "host_snapshot_bytes: ")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--host-snapshot-bytes (per TP rank): ", cache.status().message()));
  }
  // The cache's fields name the flags that set them (an outside review: "ring_len: expected
  // >= 2", "memory_budget: ..." named no flag).
  for (const auto& [field, flag] : {std::pair<absl::string_view, absl::string_view>{
                                        "memory_budget: ", "--memory-budget (per TP rank): "},
                                    {"ring_len: ", "--ring-length: "}}) {
    if (!cache.ok() && absl::StartsWith(cache.status().message(), field)) {
      return absl::Status(cache.status().code(),
                          absl::StrCat(flag, cache.status().message().substr(field.size())));
    }
  }
  // The pool's allocation failed: more than the device (or the host, on the CPU) has.
  if (!cache.ok() && cache.status().code() == absl::StatusCode::kInternal &&
      absl::StrContains(cache.status().message(), "out of")) {
    return absl::ResourceExhaustedError(
        absl::StrCat("--memory-budget (per TP rank): ", options.memory_budget_bytes >> 20,
                     " MiB cannot be allocated: ", cache.status().message()));
  }
  if (!cache.ok()) return cache.status();
  auto server = std::make_unique<ServerImpl>(options, *std::move(device), std::move(handles),
                                             std::move(events), *std::move(cache));
  server->BoundPlannedForwards(planned_bound);
  server->SecurityWarnings();
  s = server->LoadTokens();
  if (s.ok()) server->StartRegionLeases();
  if (s.ok()) s = server->StartEventPublisher();
  if (s.ok()) s = server->StartTransfers();
  if (s.ok()) server->StartSlotLeases();
  if (s.ok()) s = server->Listen();
  if (s.ok()) server->StartDeviceCheck(cache_options.devices);
  if (!s.ok()) return s;
  return std::unique_ptr<Server>(std::move(server));
}

}  // namespace replayssm::service
