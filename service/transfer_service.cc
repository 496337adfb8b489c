#include "service/transfer_service.h"

#include <unistd.h>

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "prometheus/gauge.h"
#include "service/status_map.h"

namespace replayssm::service {
namespace {

v1::StateFormat ToProto(const transfer::StateFormat& f) {
  v1::StateFormat p;
  p.set_num_layers(f.num_layers);
  p.set_gate(f.gate);
  p.set_num_qk_heads(f.num_qk_heads);
  p.set_num_v_heads(f.num_v_heads);
  p.set_head_k(f.head_k);
  p.set_head_v(f.head_v);
  p.set_state_dtype(f.state_dtype);
  p.set_params_hash(f.params_hash);
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
  f.params_hash = p.params_hash();
  return f;
}

absl::Status FromGrpc(const grpc::Status& s, const std::string& what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("peer ", what, ": ", s.error_message()));
}

// The sender's view of the receiving server, over its SlotTransfer service.
class GrpcPeer final : public transfer::Peer {
 public:
  GrpcPeer(const std::string& address, absl::Duration timeout)
      : stub_(v1::SlotTransfer::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))),
        timeout_(timeout) {}

  absl::StatusOr<transfer::Reservation> Reserve(const std::string& id,
                                                const transfer::StateFormat& format,
                                                int64_t seq_len, uint32_t checksum_version) override {
    v1::ReserveTransferRequest req;
    req.set_transfer_id(id);
    *req.mutable_format() = ToProto(format);
    req.set_seq_len(seq_len);
    req.set_checksum_version(checksum_version);
    v1::ReserveTransferResponse resp;
    grpc::ClientContext c;
    Deadline(c);
    absl::Status st = FromGrpc(stub_->ReserveTransfer(&c, req, &resp), "ReserveTransfer");
    if (!st.ok()) return st;
    return transfer::Reservation{resp.worker_address(), resp.remote_addr(), resp.rkey(),
                                 resp.bytes(), resp.doorbell_addr()};
  }
  absl::StatusOr<cache::SlotId> Commit(const std::string& id, const std::vector<int32_t>& tokens,
                                       uint64_t checksum) override {
    v1::CommitTransferRequest req;
    req.set_transfer_id(id);
    req.mutable_tokens()->Add(tokens.begin(), tokens.end());
    req.set_checksum(checksum);
    v1::CommitTransferResponse resp;
    grpc::ClientContext c;
    Deadline(c);
    absl::Status st = FromGrpc(stub_->CommitTransfer(&c, req, &resp), "CommitTransfer");
    if (!st.ok()) return st;
    return resp.slot();  // the peer's wire handle
  }
  absl::Status Abort(const std::string& id) override {
    v1::AbortTransferRequest req;
    req.set_transfer_id(id);
    v1::AbortTransferResponse resp;
    grpc::ClientContext c;
    Deadline(c);
    return FromGrpc(stub_->AbortTransfer(&c, req, &resp), "AbortTransfer");
  }

 private:
  void Deadline(grpc::ClientContext& c) const { c.set_deadline(absl::ToChronoTime(absl::Now() + timeout_)); }
  std::unique_ptr<v1::SlotTransfer::Stub> stub_;
  absl::Duration timeout_;
};

// The fields both transfer forms need: INVALID_ARGUMENT naming the first one missing.
absl::Status RequireSet(const std::string& request_id, uint64_t slot, const std::string& peer) {
  const char* missing = request_id.empty() ? "request_id"
                        : slot == 0        ? "slot"
                        : peer.empty()     ? "peer_address"
                                           : nullptr;
  if (missing == nullptr) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(missing, ": expected it set (request_id, slot and peer_address all are), got ",
                   slot == 0 && missing[0] == 's' ? "0" : "\"\""));
}

// Ends the process as a crash would (no cleanup): fault injection for the tests.
[[noreturn]] void Die() { _exit(86); }

}  // namespace

TransferService::TransferService(const ServiceContext* ctx, TransferOptions options)
    : ctx_(ctx), options_(std::move(options)) {}

absl::StatusOr<std::unique_ptr<TransferService>> TransferService::Create(const ServiceContext* ctx,
                                                                         TransferOptions options) {
  if (options.lanes < 1 || options.lanes > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer-lanes: expected 1..16, got ", options.lanes));
  }
  if (options.import_threads < 1 || options.import_threads > 32) {
    return absl::InvalidArgumentError(
        absl::StrCat("transfer-import-threads: expected 1..32, got ", options.import_threads));
  }
  std::unique_ptr<TransferService> s(new TransferService(ctx, std::move(options)));
  absl::StatusOr<std::unique_ptr<transfer::UcxTransport>> ucx = transfer::UcxTransport::Create();
  if (!ucx.ok()) return ucx.status();
  s->ucx_ = std::move(*ucx);
  std::vector<transfer::UcxTransport*> lanes = {s->ucx_.get()};
  for (int32_t k = 1; k < s->options_.lanes; ++k) {
    absl::StatusOr<std::unique_ptr<transfer::UcxTransport>> lane =
        transfer::UcxTransport::Create(/*progress_thread=*/false);
    if (!lane.ok()) return lane.status();
    lanes.push_back(lane->get());
    s->lanes_.push_back(std::move(*lane));
  }
  s->receiver_ = std::make_unique<transfer::Receiver>(
      ctx->cache, s->ucx_.get(),
      transfer::ReceiverOptions{s->options_.lease, s->options_.max_open, s->options_.chunk_bytes,
                                s->options_.import_threads});
  if (s->options_.fault == "corrupt") s->receiver_->CorruptNextPayloadForTest();
  s->sender_ = std::make_unique<transfer::Sender>(ctx->cache, std::move(lanes));
  prometheus::Registry& r = *ctx->metrics->registry();
  s->failures_ = &prometheus::BuildCounter()
                      .Name("replayssm_transfer_failures_total")
                      .Help("Slot transfers that failed, by reason (the gRPC code name).")
                      .Register(r);
  s->bytes_ = &prometheus::BuildCounter()
                   .Name("replayssm_transfer_bytes_total")
                   .Help("State bytes sent to peers by completed slot transfers.")
                   .Register(r)
                   .Add({});
  s->seconds_ = &prometheus::BuildHistogram()
                     .Name("replayssm_transfer_duration_seconds")
                     .Help("Wall time of completed outgoing slot transfers.")
                     .Register(r)
                     .Add({}, prometheus::Histogram::BucketBoundaries{
                                  0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10});
  s->open_ = &prometheus::BuildGauge()
                  .Name("replayssm_transfer_reservations")
                  .Help("Incoming transfers reserved and not yet committed, aborted or expired.")
                  .Register(r)
                  .Add({});
  TransferService* self = s.get();
  s->janitor_ = std::thread([self] {
    while (!self->stop_.WaitForNotificationWithTimeout(absl::Milliseconds(200))) {
      self->receiver_->ExpireLeases();
      self->open_->Set(self->receiver_->open());
    }
  });
  return s;
}

TransferService::~TransferService() {
  while (pulls_.load() > 0) absl::SleepFor(absl::Milliseconds(5));  // detached PullSlot waits
  stop_.Notify();
  if (janitor_.joinable()) janitor_.join();
}

grpc::ServerUnaryReactor* TransferService::Reply(grpc::CallbackServerContext* c,
                                                 absl::string_view method,
                                                 const absl::Status& status) {
  const grpc::Status g = ToGrpcStatus(status);
  ctx_->metrics->CountRpc(method, g.error_code());
  open_->Set(receiver_->open());
  grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
  reactor->Finish(g);
  return reactor;
}

void TransferService::CountFailure(const absl::Status& status) {
  failures_->Add({{"reason", std::string(absl::StatusCodeToString(status.code()))}}).Increment();
}

grpc::ServerUnaryReactor* TransferService::TransferSlot(grpc::CallbackServerContext* c,
                                                        const v1::TransferSlotRequest* req,
                                                        v1::TransferSlotResponse* resp) {
  if (absl::Status st = RequireSet(req->request_id(), req->slot(), req->peer_address());
      !st.ok()) {
    return Reply(c, "TransferSlot", st);
  }
  GrpcPeer grpc_peer(req->peer_address(), options_.timeout);
  // Fault injection: the sender "dies" between the put and the commit.
  struct DyingPeer final : transfer::Peer {
    transfer::Peer* inner;
    absl::StatusOr<transfer::Reservation> Reserve(const std::string& id,
                                                  const transfer::StateFormat& f, int64_t n,
                                                  uint32_t version) override {
      return inner->Reserve(id, f, n, version);
    }
    absl::StatusOr<cache::SlotId> Commit(const std::string&, const std::vector<int32_t>&,
                                         uint64_t) override {
      Die();
    }
    absl::Status Abort(const std::string& id) override { return inner->Abort(id); }
  } dying;
  dying.inner = &grpc_peer;
  transfer::Peer& peer = options_.fault == "exit-after-put" ? static_cast<transfer::Peer&>(dying)
                                                            : grpc_peer;
  absl::StatusOr<transfer::SendResult> r = sender_->Send(
      peer, ctx_->slots.FromWire(req->slot()), req->request_id(),
      transfer::SendOptions{req->keep_source(), options_.chunk_bytes, options_.timeout});
  if (!r.ok()) {
    CountFailure(r.status());
    return Reply(c, "TransferSlot", r.status());
  }
  bytes_->Increment(static_cast<double>(r->bytes));
  seconds_->Observe(r->seconds);
  resp->set_remote_slot(r->remote_slot);
  resp->set_seq_len(r->seq_len);
  resp->set_bytes(r->bytes);
  resp->set_seconds(r->seconds);
  return Reply(c, "TransferSlot", absl::OkStatus());
}

void TransferService::set_self_address(const std::string& address) {
  absl::MutexLock lock(&mu_);
  self_address_ = address;
}

namespace {

bool WildcardHost(absl::string_view address) {
  return absl::StartsWith(address, "0.0.0.0:") || absl::StartsWith(address, "[::]:") ||
         absl::StartsWith(address, ":");
}

}  // namespace

grpc::ServerUnaryReactor* TransferService::PullSlot(grpc::CallbackServerContext* c,
                                                    const v1::PullSlotRequest* req,
                                                    v1::PullSlotResponse* resp) {
  if (absl::Status st = RequireSet(req->request_id(), req->slot(), req->peer_address());
      !st.ok()) {
    return Reply(c, "PullSlot", st);
  }
  std::string self = req->self_address();
  if (self.empty()) {
    absl::MutexLock lock(&mu_);
    self = self_address_;
  }
  if (self.empty() || WildcardHost(self)) {
    return Reply(c, "PullSlot",
                 absl::InvalidArgumentError(absl::StrCat(
                     "self_address: expected this server's address as the peer reaches it "
                     "(host:port), got \"", req->self_address(), "\" and this server listens on \"",
                     self, "\"")));
  }
  // The peer calls back into this server (Reserve, Commit) while this call waits: the wait
  // runs on a thread of its own, not on one of gRPC's callback threads.
  grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
  v1::TransferSlotRequest push;
  push.set_request_id(req->request_id());
  push.set_slot(req->slot());
  push.set_peer_address(self);
  push.set_keep_source(req->keep_source());
  pulls_.fetch_add(1);
  std::thread([this, reactor, resp, push, peer = req->peer_address()] {
    auto stub = v1::SlotTransfer::NewStub(
        grpc::CreateChannel(peer, grpc::InsecureChannelCredentials()));
    grpc::ClientContext cc;
    cc.set_deadline(absl::ToChronoTime(absl::Now() + 2 * options_.timeout));
    v1::TransferSlotResponse r;
    absl::Status st = FromGrpc(stub->TransferSlot(&cc, push, &r), "TransferSlot");
    if (st.ok()) {
      resp->set_slot(r.remote_slot());  // the sender's reply names the slot on this server
      resp->set_seq_len(r.seq_len());
      resp->set_bytes(r.bytes());
      resp->set_seconds(r.seconds());
    } else {
      CountFailure(st);
    }
    const grpc::Status g = ToGrpcStatus(st);
    ctx_->metrics->CountRpc("PullSlot", g.error_code());
    reactor->Finish(g);
    pulls_.fetch_sub(1);
  }).detach();
  return reactor;
}

grpc::ServerUnaryReactor* TransferService::ReserveTransfer(grpc::CallbackServerContext* c,
                                                           const v1::ReserveTransferRequest* req,
                                                           v1::ReserveTransferResponse* resp) {
  absl::StatusOr<transfer::Reservation> r =
      receiver_->Reserve(req->transfer_id(), FromProto(req->format()), req->seq_len(),
                         req->checksum_version());
  if (!r.ok()) {
    CountFailure(r.status());
    return Reply(c, "ReserveTransfer", r.status());
  }
  resp->set_worker_address(r->worker_address);
  resp->set_remote_addr(r->remote_addr);
  resp->set_rkey(r->rkey);
  resp->set_bytes(r->bytes);
  resp->set_doorbell_addr(r->doorbell_addr);
  return Reply(c, "ReserveTransfer", absl::OkStatus());
}

grpc::ServerUnaryReactor* TransferService::CommitTransfer(grpc::CallbackServerContext* c,
                                                          const v1::CommitTransferRequest* req,
                                                          v1::CommitTransferResponse* resp) {
  if (options_.fault == "exit-before-commit") Die();
  const std::vector<int32_t> tokens(req->tokens().begin(), req->tokens().end());
  absl::StatusOr<cache::SlotId> slot = receiver_->Commit(req->transfer_id(), tokens, req->checksum());
  if (!slot.ok()) {
    CountFailure(slot.status());
    return Reply(c, "CommitTransfer", slot.status());
  }
  resp->set_slot(ctx_->slots.ToWire(*slot));
  return Reply(c, "CommitTransfer", absl::OkStatus());
}

grpc::ServerUnaryReactor* TransferService::AbortTransfer(grpc::CallbackServerContext* c,
                                                         const v1::AbortTransferRequest* req,
                                                         v1::AbortTransferResponse*) {
  return Reply(c, "AbortTransfer", receiver_->Abort(req->transfer_id()));
}

}  // namespace replayssm::service
