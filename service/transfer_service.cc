#include "service/transfer_service.h"

#include <openssl/evp.h>

#include <functional>
#include <optional>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "prometheus/gauge.h"
#include "service/caller.h"
#include "service/status_map.h"

namespace replayssm::service {
namespace {

// Metadata of the TransferSlot a PullSlot asks its source for (any value): the source counts
// a failure of that push under role "peer", since the puller counts it as the initiator.
constexpr char kPullKey[] = "replayssm-pull";

// replayssm_transfer_failures_total's `role` label.
const char* RoleName(TransferRole role) {
  return role == TransferRole::kInitiator ? "initiator" : "peer";
}

v1::StateFormat ToProto(const transfer::StateFormat& f) {
  v1::StateFormat p;
  p.set_num_layers(f.num_layers);
  p.set_gate(f.gate);
  p.set_num_qk_heads(f.num_qk_heads);
  p.set_num_v_heads(f.num_v_heads);
  p.set_head_k(f.head_k);
  p.set_head_v(f.head_v);
  p.set_state_dtype(f.state_dtype);
  p.set_conv_width(f.conv_width);
  p.set_conv_dtype(f.conv_dtype);
  p.set_ring_dtype(f.ring_dtype);
  p.set_round_beta(f.round_beta);
  p.set_params_hash(f.params_hash);
  p.set_head_layout(static_cast<v1::HeadLayout>(f.head_layout));
  p.set_tp_size(f.tp_size);
  return p;
}

transfer::StateFormat FromProto(const v1::StateFormat& p) {
  transfer::StateFormat f;
  f.num_layers = p.num_layers();
  f.gate = p.gate();
  f.num_qk_heads = p.num_qk_heads();
  f.num_v_heads = p.num_v_heads();
  f.head_k = p.head_k();
  f.head_v = p.head_v();
  f.state_dtype = p.state_dtype();
  f.conv_width = p.conv_width();
  f.conv_dtype = p.conv_dtype();
  f.ring_dtype = p.ring_dtype();
  f.round_beta = p.round_beta();
  f.params_hash = p.params_hash();
  f.head_layout = p.head_layout();
  f.tp_size = p.tp_size();
  return f;
}

// ---- What each peer message's proof covers (docs/transfer.md, "Peer proofs") ----------------
// Each a sequence of PeerProofField()s; numbers in decimal, booleans 0 or 1.

template <typename... V>
std::string Fields(const V&... v) {
  return absl::StrCat(PeerProofField(absl::StrCat(v))...);
}

// The request: the format's fields in their proto order, then seq_len, checksum_version,
// budget_ms, nonce.
std::string ReserveContent(const v1::ReserveTransferRequest& r) {
  const v1::StateFormat& f = r.format();
  return Fields(f.num_layers(), f.gate(), f.num_qk_heads(), f.num_v_heads(), f.head_k(), f.head_v(),
                f.state_dtype(), f.params_hash(), f.conv_width(), f.conv_dtype(), f.ring_dtype(),
                f.round_beta() ? 1 : 0, static_cast<int32_t>(f.head_layout()), f.tp_size(),
                r.seq_len(), r.checksum_version(), r.budget_ms(), r.nonce());
}

// The reply: the request's nonce, then every field the sender acts on.
std::string ReserveReplyContent(absl::string_view nonce, const v1::ReserveTransferResponse& r) {
  return Fields(nonce, r.worker_address(), r.remote_addr(), r.rkey(), r.bytes(), r.doorbell_addr());
}

// The tokens as SHA-256 (hex) of their little-endian int32 bytes, their count, the checksum
// and the nonce.
std::string CommitContent(const v1::CommitTransferRequest& r) {
  std::string le;
  le.reserve(static_cast<size_t>(r.tokens_size()) * 4);
  for (int32_t t : r.tokens()) {
    const uint32_t u = static_cast<uint32_t>(t);
    for (int b = 0; b < 4; ++b) le.push_back(static_cast<char>((u >> (8 * b)) & 0xff));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(le.data(), le.size(), md, &n, EVP_sha256(), nullptr);
  return Fields(r.tokens_size(),
                absl::BytesToHexString(absl::string_view(reinterpret_cast<char*>(md), n)),
                r.checksum(), r.nonce());
}

std::string CommitReplyContent(absl::string_view nonce, const v1::CommitTransferResponse& r) {
  return Fields(nonce, r.slot());
}

std::string AbortReplyContent(absl::string_view nonce, const v1::AbortTransferResponse& r) {
  return Fields(nonce, r.committed() ? 1 : 0, r.slot(), r.seq_len());
}

// A peer call's outcome, as the sender's caller hears it. INVALID_ARGUMENT from the peer is a
// bound of the peer's (--max-import-tokens, --max-request-id-bytes) that this move does not
// meet, not a field of the caller's: FAILED_PRECONDITION (the message names the field).
absl::Status FromPeer(const grpc::Status& g, absl::string_view what) {
  absl::Status st = FromGrpcStatus(g, what);
  if (st.code() == absl::StatusCode::kInvalidArgument) {
    st = absl::FailedPreconditionError(st.message());
  }
  return st;
}

// A reply the sender cannot act on: its proof is missing or is not the receiver's over it.
absl::Status UnprovenReply(absl::string_view method, absl::string_view proof) {
  return absl::UnauthenticatedError(absl::StrCat(
      "peer ", method,
      ": expected its reply to carry the receiver's proof of the cluster's "
      "peer token (--peer-token) over the reply, got ",
      proof.empty() ? "none (a server without the peer token, an older replayssm, or no "
                      "replayssm at all)"
                    : "one that does not match it (another token, or a reply changed on its "
                      "way)"));
}

// The sender's view of the receiving server, over its SlotTransfer service.
class GrpcPeer final : public transfer::Peer {
 public:
  // `tenant_of` names the tenant that owns a transfer id's slot ("" without tenants);
  // every call carries a proof of `peer_tokens`' own token (none without them).
  GrpcPeer(std::shared_ptr<grpc::Channel> channel,
           std::function<std::string(const std::string&)> tenant_of,
           std::shared_ptr<const PeerTokens> peer_tokens)
      : stub_(v1::SlotTransfer::NewStub(std::move(channel))),
        tenant_of_(std::move(tenant_of)),
        peer_tokens_(std::move(peer_tokens)) {}

  absl::StatusOr<transfer::Reservation> Reserve(const std::string& id,
                                                const transfer::StateFormat& format,
                                                int64_t seq_len, uint32_t checksum_version,
                                                absl::Duration budget,
                                                absl::Time deadline) override {
    v1::ReserveTransferRequest req;
    req.set_transfer_id(id);
    *req.mutable_format() = ToProto(format);
    req.set_seq_len(seq_len);
    req.set_checksum_version(checksum_version);
    req.set_budget_ms(absl::ToInt64Milliseconds(budget));
    req.set_tenant(tenant_of_(id));
    req.set_nonce(PeerNonce());
    v1::ReserveTransferResponse resp;
    grpc::ClientContext c;
    Prepare(c, deadline, "ReserveTransfer", id, req.tenant(),
            peer_tokens_ != nullptr ? ReserveContent(req) : "");
    absl::Status st = FromPeer(stub_->ReserveTransfer(&c, req, &resp), "peer ReserveTransfer");
    if (!st.ok()) return st;
    // Its addresses are where this process writes: only the receiver's own (an outside
    // review: a fake peer's shifted remote_addr made the put a write into this server).
    if (peer_tokens_ != nullptr &&
        !peer_tokens_->Accepts(resp.proof(), "ReserveTransfer/reply", id, req.tenant(),
                               ReserveReplyContent(req.nonce(), resp))) {
      return UnprovenReply("ReserveTransfer", resp.proof());
    }
    return transfer::Reservation{resp.worker_address(), resp.remote_addr(), resp.rkey(),
                                 resp.bytes(), resp.doorbell_addr()};
  }

  absl::StatusOr<uint64_t> Commit(const std::string& id, const std::vector<int32_t>& tokens,
                                  uint64_t checksum, absl::Time deadline) override {
    v1::CommitTransferRequest req;
    req.set_transfer_id(id);
    req.mutable_tokens()->Add(tokens.begin(), tokens.end());
    req.set_checksum(checksum);
    req.set_nonce(PeerNonce());
    v1::CommitTransferResponse resp;
    grpc::ClientContext c;
    Prepare(c, deadline, "CommitTransfer", id, "",
            peer_tokens_ != nullptr ? CommitContent(req) : "");
    absl::Status st = FromPeer(stub_->CommitTransfer(&c, req, &resp), "peer CommitTransfer");
    if (!st.ok()) return st;
    // An unproven "committed" would free the source of a state nobody holds: the outcome is
    // then unknown, and the sender asks AbortTransfer.
    if (peer_tokens_ != nullptr &&
        !peer_tokens_->Accepts(resp.proof(), "CommitTransfer/reply", id, "",
                               CommitReplyContent(req.nonce(), resp))) {
      return UnprovenReply("CommitTransfer", resp.proof());
    }
    return resp.slot();  // the peer's wire handle
  }

  absl::StatusOr<transfer::Decision> Abort(const std::string& id, absl::Time deadline) override {
    v1::AbortTransferRequest req;
    req.set_transfer_id(id);
    req.set_nonce(PeerNonce());
    v1::AbortTransferResponse resp;
    grpc::ClientContext c;
    Prepare(c, deadline, "AbortTransfer", id, "", Fields(req.nonce()));
    absl::Status st = FromGrpcStatus(stub_->AbortTransfer(&c, req, &resp), "peer AbortTransfer");
    if (!st.ok()) return st;
    // An unproven decision is none: either way it would lose or duplicate the state.
    if (peer_tokens_ != nullptr &&
        !peer_tokens_->Accepts(resp.proof(), "AbortTransfer/reply", id, "",
                               AbortReplyContent(req.nonce(), resp))) {
      return UnprovenReply("AbortTransfer", resp.proof());
    }
    return transfer::Decision{resp.committed(), resp.slot(), resp.seq_len()};
  }

  // Asynchronous: the move's reply does not wait for it (a lost one only keeps the peer's
  // decision until its horizon).
  void Acknowledge(const std::string& id) override {
    struct Call {
      grpc::ClientContext context;
      v1::AcknowledgeTransferRequest req;
      v1::AcknowledgeTransferResponse resp;
    };
    auto* call = new Call;
    call->req.set_transfer_id(id);
    Prepare(call->context, absl::Now() + absl::Seconds(10), "AcknowledgeTransfer", id, "", "");
    stub_->async()->AcknowledgeTransfer(&call->context, &call->req, &call->resp,
                                         [call](grpc::Status) { delete call; });
  }

 private:
  void Prepare(grpc::ClientContext& c, absl::Time deadline, absl::string_view method,
               const std::string& id, absl::string_view tenant, absl::string_view content) const {
    c.set_deadline(absl::ToChronoTime(deadline));
    if (peer_tokens_ != nullptr) {
      c.AddMetadata(kPeerProofKey, peer_tokens_->Prove(method, id, tenant, content));
    }
  }

  std::unique_ptr<v1::SlotTransfer::Stub> stub_;
  std::function<std::string(const std::string&)> tenant_of_;
  const std::shared_ptr<const PeerTokens> peer_tokens_;
};

// The fields both transfer forms need: INVALID_ARGUMENT naming the first one missing.
absl::Status RequireSet(const std::string& request_id, uint64_t slot, const std::string& peer) {
  const char* missing = request_id.empty() ? "request_id"
                        : slot == 0        ? "slot"
                        : peer.empty()     ? "peer_address"
                                           : nullptr;
  if (missing == nullptr) return absl::OkStatus();
  return FieldError(missing, "it set (request_id, slot and peer_address all are)",
                    slot == 0 && missing[0] == 's' ? "0" : "\"\"");
}

// A draining server takes no state in: it is about to exit, and the state would go with it.
constexpr char kNoIncoming[] =
    "no incoming transfers (a state moved here would be lost when it exits)";

// Reconnect backoff of the channels to peers (issue 31 §7): a second at most between
// attempts, so a restarted peer is reachable again at once; a dead one costs a failed
// connect per second.
constexpr int kPeerReconnectInitialMs = 100;
constexpr int kPeerReconnectMaxMs = 1000;
// The least time one connection attempt gets for TCP, TLS and the peer's HTTP/2 SETTINGS.
// gRPC reads GRPC_ARG_MIN_RECONNECT_BACKOFF_MS as this, not as a backoff. It was once set to
// the 100 ms above, and a peer ~50 ms of round trip away (or an mTLS handshake on a loaded
// machine) was never reached. A move to a peer that drops connections (a dead node) waits for
// the attempt to fail, so it is not gRPC's 20 s: 5 s is many round trips on any network a
// cluster spans, and a refused connect fails at once whatever it is.
constexpr int kPeerConnectAttemptMs = 5000;

bool WildcardHost(absl::string_view address) {
  return absl::StartsWith(address, "0.0.0.0:") || absl::StartsWith(address, "[::]:") ||
         absl::StartsWith(address, ":");
}

}  // namespace

TransferService::TransferService(const ServiceContext* ctx, TransferOptions options)
    : ctx_(ctx), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<TransferService>> TransferService::Create(const ServiceContext* ctx,
                                                                         TransferOptions options) {
  std::unique_ptr<TransferService> s(new TransferService(ctx, std::move(options)));
  const TransferOptions& o = s->options_;
  absl::StatusOr<std::unique_ptr<transfer::UcxTransport>> ucx = transfer::UcxTransport::Create();
  if (!ucx.ok()) return ucx.status();
  s->ucx_ = std::move(*ucx);
  std::vector<transfer::PutLane*> lanes = {s->ucx_.get()};
  for (int32_t k = 1; k < o.lanes; ++k) {
    absl::StatusOr<std::unique_ptr<transfer::UcxTransport>> lane =
        transfer::UcxTransport::Create(/*progress_thread=*/false);
    if (!lane.ok()) return lane.status();
    lanes.push_back(lane->get());
    s->lanes_.push_back(std::move(*lane));
  }
  s->receiver_ = std::make_unique<transfer::Receiver>(
      ctx->cache, s->ucx_.get(),
      transfer::ReceiverOptions{
          .lease = o.lease,
          .max_open = o.max_open,
          .max_open_per_peer = o.max_open_per_peer,
          .chunk_bytes = o.chunk_bytes,
          .import_threads = o.import_threads,
          // A reservation counts against its tenant's --tenant-max-slots from the moment it is
          // made, and its committed slot's handle is issued as it ends: the bound holds across
          // concurrent reservations, allocations and commits.
          .admit =
              [ctx](uint64_t owner) {
                return ctx->ReserveIncomingSlot(static_cast<TenantId>(owner));
              },
          .settle =
              [ctx](uint64_t owner, cache::SlotId slot) {
                ctx->slots.handles()->Settle(static_cast<TenantId>(owner), slot);
              },
          // A commit is decided against the drain under the receiver's lock: one that ends
          // after the drain began is aborted (its check at the commit's start is not enough:
          // a commit takes ~1 s for a large state; an outside review lost states that way).
          .accepting = [ctx] { return ctx->gate->Refuse(kNoIncoming).ok(); },
          // On CUDA a free waits for the running doorbell waits, and every other CUDA call of
          // the process with it: a dropped device-direct buffer waits for a moment with no
          // planned forward open (docs/transfer.md).
          .device_quiet =
              ctx->cache->options().backend == RSSM_BACKEND_CUDA
                  ? std::function<bool()>([ctx] { return ctx->gate->open_planned() == 0; })
                  : nullptr});
  s->sender_ = std::make_unique<transfer::Sender>(ctx->cache, std::move(lanes));
  prometheus::Registry& r = *ctx->metrics->registry();
  s->failures_ = &prometheus::BuildCounter()
                      .Name("replayssm_transfer_failures_total")
                      .Help(
                          "Slot transfers that failed, by reason (the gRPC code name) and "
                          "role (initiator: a move this server was asked for; peer: a "
                          "peer's reserve or commit it refused).")
                      .Register(r);
  // Every series exists from the start at 0: a series born at its first failure (already at
  // 3 after a burst) has no earlier sample, and Prometheus's increase() counts nothing of it
  // (an outside review: the transfer alert missed a peer outage's first failures).
  for (int code = 1; code <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++code) {
    for (TransferRole role : {TransferRole::kInitiator, TransferRole::kPeer}) {
      s->failures_->Add(
          {{"reason", std::string(absl::StatusCodeToString(static_cast<absl::StatusCode>(code)))},
           {"role", RoleName(role)}});
    }
  }
  s->bytes_ = &prometheus::BuildCounter()
                   .Name("replayssm_transfer_bytes_total")
                   .Help("State bytes sent to peers by completed slot transfers.")
                   .Register(r)
                   .Add({});
  s->seconds_ = &prometheus::BuildHistogram()
                     .Name("replayssm_transfer_duration_seconds")
                     .Help("Wall time of completed outgoing slot transfers.")
                     .Register(r)
                     .Add({}, prometheus::Histogram::BucketBoundaries{0.001, 0.0025, 0.005, 0.01,
                                                                      0.025, 0.05, 0.1, 0.25, 0.5,
                                                                      1, 2.5, 5, 10, 20, 30, 60});
  s->open_ = &prometheus::BuildGauge()
                  .Name("replayssm_transfer_reservations")
                  .Help("Incoming transfers reserved and not yet committed, aborted or expired.")
                  .Register(r)
                  .Add({});
  s->channels_gauge_ = &prometheus::BuildGauge()
                            .Name("replayssm_transfer_peer_channels")
                            .Help(
                                "gRPC channels to transfer peers kept open (at most 64: the "
                                "least recently used goes).")
                            .Register(r)
                            .Add({});
  s->in_doubt_ = &prometheus::BuildGauge()
                      .Name("replayssm_transfer_in_doubt")
                      .Help(
                          "Outgoing transfers whose outcome the peer has not told yet (their "
                          "source slots stay locked).")
                      .Register(r)
                      .Add({});
  s->held_buffers_ = &prometheus::BuildGauge()
                          .Name("replayssm_transfer_dropped_buffers_held")
                          .Help(
                              "Device-direct receive buffers of aborted or expired transfers "
                              "held until no planned forward is open (a free on CUDA waits for "
                              "the running doorbell waits, with every CUDA call of the server).")
                          .Register(r)
                          .Add({});
  s->forced_frees_ = &prometheus::BuildCounter()
                          .Name("replayssm_transfer_dropped_buffers_forced_total")
                          .Help(
                              "Dropped device-direct receive buffers freed while planned "
                              "forwards were open, past 16 held: each such free held every CUDA "
                              "call of the server until the running doorbell waits ended.")
                          .Register(r)
                          .Add({});
  TransferService* self = s.get();
  transfer::ManagerOptions m;
  m.timeout = o.timeout;
  m.chunk_bytes = o.chunk_bytes;
  m.max_concurrent = o.max_concurrent;
  m.on_moved = [self](const transfer::TransferRequest& request, const transfer::SendResult& moved) {
    // Here, not in TransferSlot's answer: a move in doubt that the resolver learns was
    // committed frees its source with no caller waiting, and its handle counted as a live slot
    // (slots_live, --tenant-max-slots) until a retry came. Forget keys on the slot's
    // generation, so an index reused since the free keeps its new handle.
    if (!request.keep_source) self->ctx_->slots.Forget(request.slot);
    self->bytes_->Increment(static_cast<double>(moved.bytes));
    self->seconds_->Observe(moved.seconds);
  };
  s->manager_ = std::make_unique<transfer::TransferManager>(
      s->sender_.get(),
      [self](const std::string& address) -> std::unique_ptr<transfer::Peer> {
        return std::make_unique<GrpcPeer>(
            self->Channel(address), [self](const std::string& id) { return self->TenantOf(id); },
            self->options_.peer_tokens);
      },
      m);
  s->janitor_ = std::thread([self] {
    while (!self->stop_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      self->receiver_->ExpireLeases();
      self->open_->Set(self->receiver_->open());
      self->in_doubt_->Set(self->manager_->in_doubt());
      self->channels_gauge_->Set(static_cast<double>(self->cached_channels()));
      self->held_buffers_->Set(self->receiver_->held_device_buffers());
      const double forced = static_cast<double>(self->receiver_->forced_device_frees());
      self->forced_frees_->Increment(forced - self->forced_frees_->Value());
    }
  });
  return s;
}

TransferService::~TransferService() {
  Stop();
  while (pulls_.load() > 0) absl::SleepFor(absl::Milliseconds(5));  // their peers answer
  stop_.Notify();
  if (janitor_.joinable()) janitor_.join();
}

void TransferService::Stop() { manager_->Stop(); }

size_t TransferService::cached_channels() {
  absl::MutexLock lock(&mu_);
  return channels_.size();
}

std::shared_ptr<grpc::Channel> TransferService::Channel(const std::string& address) {
  absl::MutexLock lock(&mu_);
  if (!channels_.contains(address) && channels_.size() >= kMaxChannels) {
    auto lru = channels_.begin();
    for (auto it = channels_.begin(); it != channels_.end(); ++it) {
      if (it->second.used < lru->second.used) lru = it;
    }
    channels_.erase(lru);  // a call running on it holds it still
  }
  PeerChannel& entry = channels_[address];
  entry.used = ++channel_clock_;
  std::shared_ptr<grpc::Channel>& c = entry.channel;
  if (c == nullptr) {
    // A peer that was down is dialled again within a second of coming back (gRPC's default
    // backoff grows to 120 s, and every transfer to it fails fast meanwhile).
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, kPeerReconnectInitialMs);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, kPeerConnectAttemptMs);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kPeerReconnectMaxMs);
    c = grpc::CreateCustomChannel(address,
                                  options_.peer_credentials != nullptr
                                      ? options_.peer_credentials
                                      : grpc::InsecureChannelCredentials(),
                                  args);
  }
  return c;
}

void TransferService::Finish(grpc::ServerUnaryReactor* reactor, absl::string_view method,
                             const absl::Status& status) {
  const grpc::Status g = ToGrpcStatus(status);
  ctx_->metrics->CountRpc(method, g.error_code());
  open_->Set(receiver_->open());
  reactor->Finish(g);
}

grpc::ServerUnaryReactor* TransferService::Reply(grpc::CallbackServerContext* c,
                                                 absl::string_view method,
                                                 const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
  Finish(reactor, method, status);
  return reactor;
}

void TransferService::CountFailure(TransferRole role, const absl::Status& status) {
  failures_
      ->Add({{"reason", std::string(absl::StatusCodeToString(status.code()))},
             {"role", RoleName(role)}})
      .Increment();
}

std::string TransferService::PeerIdentity(const grpc::CallbackServerContext& c) {
  // Under mTLS the certificate's identity (its subject alternative names or common name);
  // else the host the call came from (ipv4:HOST:PORT -> HOST: one per machine, not per port).
  std::shared_ptr<const grpc::AuthContext> auth = c.auth_context();
  if (auth != nullptr && auth->IsPeerAuthenticated()) {
    std::vector<grpc::string_ref> names = auth->GetPeerIdentity();
    if (!names.empty()) return std::string(names.front().data(), names.front().size());
  }
  std::string peer = c.peer();
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

absl::Status TransferService::AuthenticatePeer(const grpc::CallbackServerContext& c,
                                               absl::string_view method,
                                               const std::string& transfer_id,
                                               absl::string_view tenant, absl::string_view content,
                                               const std::string* nonce) const {
  if (options_.peer_tokens == nullptr) {
    if (!options_.clients_authenticated) return absl::OkStatus();  // a trusted network
    return absl::PermissionDeniedError(absl::StrCat(
        method, ": this server takes no incoming transfers: it authenticates its clients "
        "(--auth-tokens, --tls-client-ca) but has no --peer-token to authenticate peers, and a "
        "client's credentials are never a peer's"));
  }
  const auto& md = c.client_metadata();
  auto it = md.find(kPeerProofKey);
  if (it == md.end()) {
    ctx_->metrics->CountAuthFailure("peer_missing");
    return absl::UnauthenticatedError(
        absl::StrCat(kPeerProofKey,
                     ": expected a proof of the cluster's peer token (--peer-token) in the "
                     "metadata of ",
                     method, ", got none"));
  }
  const absl::string_view proof(it->second.data(), it->second.size());
  if (!options_.peer_tokens->Accepts(proof, method, transfer_id, tenant, content)) {
    ctx_->metrics->CountAuthFailure("peer_unknown");
    return absl::UnauthenticatedError(absl::StrCat(
        kPeerProofKey, ": expected a proof of the cluster's peer token (--peer-token) for ", method,
        " of this transfer_id, tenant and content (v2), got ",
        absl::StartsWith(proof, "v1:")
            ? "a v1 proof (a peer running an older replayssm: a cluster upgrades its peers "
              "together)"
            : "another"));
  }
  // Proven: the nonce is the sender's (its reply's proof covers it, so that a recorded reply
  // never passes for a new one).
  if (nonce != nullptr && (nonce->size() < 16 || nonce->size() > 128)) {
    return FieldError("nonce", "16..128 bytes drawn at random by the sender",
                      absl::StrCat(nonce->size(), " bytes"));
  }
  return absl::OkStatus();
}

std::string TransferService::MoveId(TenantId tenant, const std::string& request_id) const {
  if (ctx_->tokens == nullptr) return request_id;
  return absl::StrCat(tenant, "/", request_id);
}

std::string TransferService::TenantOf(const std::string& transfer_id) const {
  if (ctx_->tokens == nullptr) return "";
  TenantId tenant = kImplicitTenant;
  const size_t slash = transfer_id.find('/');
  if (slash == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(transfer_id).substr(0, slash), &tenant)) {
    return "";
  }
  return ctx_->tokens->Name(tenant);
}

absl::StatusOr<TenantId> TransferService::ReceivingTenant(const std::string& name) const {
  if (ctx_->tokens == nullptr) return kImplicitTenant;  // one tenant here: it takes every slot
  if (std::optional<TenantId> t = ctx_->tokens->Find(name); t.has_value()) return *t;
  return absl::PermissionDeniedError(absl::StrCat(
      "tenant: expected a tenant of this server's token file (--auth-tokens) to own the slot, "
      "got ",
      name.empty() ? "none (the sending server has no tenants)" : absl::StrCat("\"", name, "\"")));
}

absl::Status TransferService::CheckPeer(const std::string& address) const {
  if (options_.allowed_peers.empty()) {
    // Any address a client names: only where its replies are proven, or its clients trusted.
    // A client-named fake peer's reservation was a write wherever it said, in this process.
    if (options_.peer_tokens != nullptr || !options_.clients_authenticated) {
      return absl::OkStatus();
    }
    return absl::PermissionDeniedError(absl::StrCat(
        "peer_address: this server dials no peer a client names (got \"", address,
        "\"): it authenticates its clients (--auth-tokens, --tls-client-ca) but has neither "
        "--peer-token (peers prove their replies) nor --transfer-peers (the peers it trusts)"));
  }
  for (const std::string& p : options_.allowed_peers) {
    if (p == address) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "peer_address: expected one of the peers this server may dial (--transfer-peers: ",
      absl::StrJoin(options_.allowed_peers, ", "), "), got \"", address, "\""));
}

grpc::ServerUnaryReactor* TransferService::TransferSlot(grpc::CallbackServerContext* c,
                                                        const v1::TransferSlotRequest* req,
                                                        v1::TransferSlotResponse* resp) {
  absl::StatusOr<ServiceContext> caller = CallerContext(*c, *ctx_);
  if (!caller.ok()) return Reply(c, "TransferSlot", caller.status());
  absl::Status st = RequireSet(req->request_id(), req->slot(), req->peer_address());
  if (st.ok()) st = CheckPeer(req->peer_address());
  if (st.ok()) st = ctx_->requests->CheckId(req->request_id());
  if (st.ok()) st = ctx_->gate->RefuseIfFailed(kNoDeviceWork);
  if (!st.ok()) return Reply(c, "TransferSlot", st);
  grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
  const cache::SlotId slot = caller->slots.FromWire(req->slot());
  // A peer's PullSlot asks for this push: the puller counts the move as its initiator.
  const TransferRole role =
      c->client_metadata().count(kPullKey) > 0 ? TransferRole::kPeer : TransferRole::kInitiator;
  manager_->Transfer(
      {MoveId(caller->tenant(), req->request_id()), slot, req->peer_address(), req->keep_source()},
      [this, reactor, resp, role](const absl::StatusOr<transfer::SendResult>& r) {
        if (r.ok()) {
          resp->set_remote_slot(r->remote_slot);
          resp->set_seq_len(r->seq_len);
          resp->set_bytes(r->bytes);
          resp->set_seconds(r->seconds);
        } else {
          CountFailure(role, r.status());
        }
        Finish(reactor, "TransferSlot", r.status());
      });
  return reactor;
}

void TransferService::set_self_address(const std::string& address) {
  absl::MutexLock lock(&mu_);
  self_address_ = address;
}

grpc::ServerUnaryReactor* TransferService::PullSlot(grpc::CallbackServerContext* c,
                                                    const v1::PullSlotRequest* req,
                                                    v1::PullSlotResponse* resp) {
  absl::StatusOr<ServiceContext> caller = CallerContext(*c, *ctx_);
  if (!caller.ok()) return Reply(c, "PullSlot", caller.status());
  absl::Status st = RequireSet(req->request_id(), req->slot(), req->peer_address());
  if (st.ok()) st = CheckPeer(req->peer_address());
  if (st.ok()) st = ctx_->requests->CheckId(req->request_id());
  if (st.ok()) st = ctx_->gate->RefuseIfFailed(kNoDeviceWork);
  // A pull brings a state in: a draining server refuses it here, before the source is asked
  // to push (its reservation here would be refused, each side counting a failed move).
  if (st.ok()) st = ctx_->gate->Refuse(kNoIncoming);
  if (!st.ok()) return Reply(c, "PullSlot", st);
  std::string self = req->self_address();
  if (self.empty()) {
    absl::MutexLock lock(&mu_);
    self = self_address_;
  }
  if (self.empty() || WildcardHost(self)) {
    return Reply(
        c, "PullSlot",
        FieldError("self_address", "this server's address as the peer reaches it (host:port)",
                   req->self_address().empty()
                       ? absl::StrCat("none, and this server listens on \"", self,
                                      "\" (no address a peer can dial)")
                       : absl::StrCat("\"", req->self_address(),
                                      "\" (a wildcard host: no address a peer can dial)")));
  }
  // The peer calls back into this server (Reserve, Commit) while this call waits: the call to
  // it is asynchronous, so no gRPC thread waits.
  struct Pull {
    grpc::ClientContext context;
    v1::TransferSlotRequest push;
    v1::TransferSlotResponse pushed;
    std::unique_ptr<v1::SlotTransfer::Stub> stub;
  };
  auto pull = std::make_shared<Pull>();
  pull->push.set_request_id(req->request_id());
  pull->push.set_slot(req->slot());
  pull->push.set_peer_address(self);
  pull->push.set_keep_source(req->keep_source());
  pull->stub = v1::SlotTransfer::NewStub(Channel(req->peer_address()));
  // The peer's own --transfer-timeout bounds its move; this one bounds a peer that hangs.
  pull->context.set_deadline(absl::ToChronoTime(absl::Now() + 2 * options_.timeout));
  // The peer's TransferSlot acts for the same tenant: the caller's token goes with it (one
  // token file for the cluster).
  const auto& md = c->client_metadata();
  if (auto it = md.find(kAuthorizationKey); it != md.end()) {
    pull->context.AddMetadata(kAuthorizationKey, std::string(it->second.data(), it->second.size()));
  }
  pull->context.AddMetadata(kPullKey, "1");  // the failure metric's role there
  grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
  pulls_.fetch_add(1);
  pull->stub->async()->TransferSlot(
      &pull->context, &pull->push, &pull->pushed, [this, pull, reactor, resp](grpc::Status g) {
        const absl::Status st = FromGrpcStatus(g, "peer TransferSlot");
        if (st.ok()) {
          resp->set_slot(pull->pushed.remote_slot());  // the sender names the slot here
          resp->set_seq_len(pull->pushed.seq_len());
          resp->set_bytes(pull->pushed.bytes());
          resp->set_seconds(pull->pushed.seconds());
        } else {
          CountFailure(TransferRole::kInitiator, st);
        }
        Finish(reactor, "PullSlot", st);
        pulls_.fetch_sub(1);
      });
  return reactor;
}

grpc::ServerUnaryReactor* TransferService::ReserveTransfer(grpc::CallbackServerContext* c,
                                                           const v1::ReserveTransferRequest* req,
                                                           v1::ReserveTransferResponse* resp) {
  // An unauthenticated call is no transfer: counted in replayssm_auth_failures_total alone.
  const bool proven = options_.peer_tokens != nullptr;  // contents hashed only to prove them
  if (absl::Status st = AuthenticatePeer(*c, "ReserveTransfer", req->transfer_id(), req->tenant(),
                                         proven ? ReserveContent(*req) : "", &req->nonce());
      !st.ok()) {
    return Reply(c, "ReserveTransfer", st);
  }
  if (absl::Status st = ctx_->gate->Refuse(kNoIncoming); !st.ok()) {
    CountFailure(TransferRole::kPeer, st);
    return Reply(c, "ReserveTransfer", st);
  }
  absl::Status checked = ctx_->requests->CheckTransferId(req->transfer_id());
  // The history its commit will bring: refused now, not after every byte moved.
  if (checked.ok()) checked = CheckImportTokens(req->seq_len(), ctx_->limits, "seq_len");
  if (!checked.ok()) {
    CountFailure(TransferRole::kPeer, checked);  // a move the sender counts failed too
    return Reply(c, "ReserveTransfer", checked);
  }
  absl::StatusOr<TenantId> tenant = ReceivingTenant(req->tenant());
  if (!tenant.ok()) {
    CountFailure(TransferRole::kPeer, tenant.status());
    return Reply(c, "ReserveTransfer", tenant.status());
  }
  // The tenant travels with the reservation (its owner) into the decision; the receiver
  // counts the reservation against its slot bound (ReceiverOptions::admit, above).
  absl::StatusOr<transfer::Reservation> r = receiver_->Reserve(
      req->transfer_id(), FromProto(req->format()), req->seq_len(), req->checksum_version(),
      absl::Milliseconds(req->budget_ms()), PeerIdentity(*c), *tenant);
  if (!r.ok()) {
    CountFailure(TransferRole::kPeer, r.status());
    return Reply(c, "ReserveTransfer", r.status());
  }
  // A drain that began after the check above may have looked for open reservations before
  // this one was made: it would shut down under it, the sender left in doubt. Now made, the
  // reservation is visible to the drain's wait; seen draining here, it is given back.
  if (absl::Status d = ctx_->gate->Refuse(kNoIncoming); !d.ok()) {
    receiver_->Abort(req->transfer_id(), PeerIdentity(*c)).IgnoreError();  // its own: decided
    CountFailure(TransferRole::kPeer, d);
    return Reply(c, "ReserveTransfer", d);
  }
  resp->set_worker_address(r->worker_address);
  resp->set_remote_addr(r->remote_addr);
  resp->set_rkey(r->rkey);
  resp->set_bytes(r->bytes);
  resp->set_doorbell_addr(r->doorbell_addr);
  if (options_.peer_tokens != nullptr) {
    resp->set_proof(options_.peer_tokens->Prove("ReserveTransfer/reply", req->transfer_id(),
                                                req->tenant(),
                                                ReserveReplyContent(req->nonce(), *resp)));
  }
  return Reply(c, "ReserveTransfer", absl::OkStatus());
}

grpc::ServerUnaryReactor* TransferService::CommitTransfer(grpc::CallbackServerContext* c,
                                                          const v1::CommitTransferRequest* req,
                                                          v1::CommitTransferResponse* resp) {
  absl::Status st =
      AuthenticatePeer(*c, "CommitTransfer", req->transfer_id(), "",
                       options_.peer_tokens != nullptr ? CommitContent(*req) : "", &req->nonce());
  if (!st.ok()) return Reply(c, "CommitTransfer", st);  // no peer's: no transfer failure
  st = ctx_->requests->CheckTransferId(req->transfer_id());
  if (st.ok()) st = CheckImportTokens(req->tokens_size(), ctx_->limits);
  if (!st.ok()) {
    CountFailure(TransferRole::kPeer, st);
    return Reply(c, "CommitTransfer", st);
  }
  // Reserved before the drain began: refused all the same. The sender's abort then learns that
  // nothing was committed and keeps its source; the reservation goes with that abort (or its
  // lease).
  if (absl::Status d = ctx_->gate->Refuse(kNoIncoming); !d.ok()) {
    CountFailure(TransferRole::kPeer, d);
    return Reply(c, "CommitTransfer", d);
  }
  const std::vector<int32_t> tokens(req->tokens().begin(), req->tokens().end());
  absl::StatusOr<transfer::Decision> d =
      receiver_->Commit(req->transfer_id(), tokens, req->checksum(), PeerIdentity(*c));
  if (!d.ok()) {
    CountFailure(TransferRole::kPeer, d.status());
    return Reply(c, "CommitTransfer", d.status());
  }
  // Nobody has its handle yet: the slot joins its reservation's tenant's prefix cache and
  // handles.
  const ServiceContext owner = ctx_->ForTenant(static_cast<TenantId>(d->owner));
  if (owner.prefix_namespace() != cache::kDefaultNamespace) {
    ctx_->cache->SetPrefixNamespace(d->slot, owner.prefix_namespace()).IgnoreError();
  }
  resp->set_slot(owner.slots.ToWire(d->slot));
  if (options_.peer_tokens != nullptr) {
    resp->set_proof(options_.peer_tokens->Prove("CommitTransfer/reply", req->transfer_id(), "",
                                                CommitReplyContent(req->nonce(), *resp)));
  }
  return Reply(c, "CommitTransfer", absl::OkStatus());
}

grpc::ServerUnaryReactor* TransferService::AbortTransfer(grpc::CallbackServerContext* c,
                                                         const v1::AbortTransferRequest* req,
                                                         v1::AbortTransferResponse* resp) {
  absl::Status st = AuthenticatePeer(*c, "AbortTransfer", req->transfer_id(), "",
                                     Fields(req->nonce()), &req->nonce());
  if (st.ok()) st = ctx_->requests->CheckTransferId(req->transfer_id());
  if (!st.ok()) return Reply(c, "AbortTransfer", st);
  absl::StatusOr<transfer::Decision> decided =
      receiver_->Abort(req->transfer_id(), PeerIdentity(*c));
  if (!decided.ok()) return Reply(c, "AbortTransfer", decided.status());
  const transfer::Decision& d = *decided;
  resp->set_committed(d.committed);
  if (d.committed) {  // its handle was issued at the commit, to the reservation's tenant
    resp->set_slot(ctx_->ForTenant(static_cast<TenantId>(d.owner)).slots.ToWire(d.slot));
    resp->set_seq_len(d.seq_len);
  }
  if (options_.peer_tokens != nullptr) {
    resp->set_proof(options_.peer_tokens->Prove("AbortTransfer/reply", req->transfer_id(), "",
                                                AbortReplyContent(req->nonce(), *resp)));
  }
  return Reply(c, "AbortTransfer", absl::OkStatus());
}

grpc::ServerUnaryReactor* TransferService::AcknowledgeTransfer(
    grpc::CallbackServerContext* c, const v1::AcknowledgeTransferRequest* req,
    v1::AcknowledgeTransferResponse*) {
  absl::Status st = AuthenticatePeer(*c, "AcknowledgeTransfer", req->transfer_id(), "", "");
  if (st.ok()) st = ctx_->requests->CheckTransferId(req->transfer_id());
  if (!st.ok()) return Reply(c, "AcknowledgeTransfer", st);
  receiver_->Acknowledge(req->transfer_id(), PeerIdentity(*c));  // only the reserving peer's
  return Reply(c, "AcknowledgeTransfer", absl::OkStatus());
}

}  // namespace replayssm::service
