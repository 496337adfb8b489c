#include "service/replayssm_service.h"

#include <chrono>
#include <optional>
#include <string>

#include "service/caller.h"
#include "service/forward_session.h"
#include "service/status_map.h"
#include "service/watch_cache.h"

namespace replayssm::service {

namespace {

// One forward stream: reads a message, lets the session handle it, writes the answer, reads
// the next. A closed or cancelled stream or an error before a commit abandons the open
// forward (Done).
class DecodeStreamReactor final
    : public grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse> {
 public:
  DecodeStreamReactor(const ServiceContext* ctx, const grpc::CallbackServerContext& c)
      : c_(&c), call_(*ctx), ctx_(&call_), session_(&call_) {
    absl::StatusOr<ServiceContext> caller = CallerContext(c, *ctx);
    if (!caller.ok()) {
      Done(caller.status());
      return;
    }
    call_ = *std::move(caller);
    const absl::Status admitted = ctx_->streams->Open(call_.tenant());
    if (!admitted.ok()) {
      Done(admitted);
      return;
    }
    counted_ = true;
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) return Done(Ended());
    response_.Clear();
    absl::Status s = Handle();
    if (!s.ok()) return Done(s);
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return Done(absl::CancelledError("decode stream: write failed"));
    StartRead(&request_);
  }
  void OnDone() override {
    if (counted_) ctx_->streams->Close(call_.tenant());
    delete this;
  }

 private:
  absl::Status Handle() {
    const std::optional<const v1::ForwardPlan*> begin = BeginPlan();
    absl::Status s = CheckRequestId();
    // Each forward's begin: a token removed from the file (or moved to another tenant) since
    // the stream opened starts nothing more on it.
    if (s.ok() && begin.has_value()) s = CheckStillAuthorized(*c_, call_, &tokens_checked_);
    // A begin refused here is refused as the session refuses one: its plan's done doorbells
    // ring (an engine that queued the forward does not hang), after an open one's.
    if (!s.ok()) return session_.Refuse(begin.value_or(nullptr), s);
    switch (request_.msg_case()) {
      case v1::DecodeStreamRequest::kBegin:
        return session_.Begin(request_.begin(), response_.mutable_begun());
      case v1::DecodeStreamRequest::kPrefillBegin:
        return session_.BeginPrefill(request_.prefill_begin(), response_.mutable_begun());
      case v1::DecodeStreamRequest::kVerifyBegin:
        return session_.BeginVerify(request_.verify_begin(), response_.mutable_begun());
      case v1::DecodeStreamRequest::kLayer:
        return session_.RunLayer(request_.layer(), response_.mutable_layer());
      case v1::DecodeStreamRequest::kCommit:
        return session_.Commit(response_.mutable_committed());
      default:
        return absl::InvalidArgumentError(
            "msg: expected begin, prefill_begin, verify_begin, layer or commit, got none");
    }
  }
  // For a begin: its plan (null: none); nullopt for other messages.
  std::optional<const v1::ForwardPlan*> BeginPlan() const {
    switch (request_.msg_case()) {
      case v1::DecodeStreamRequest::kBegin:
        return request_.begin().has_plan() ? &request_.begin().plan() : nullptr;
      case v1::DecodeStreamRequest::kPrefillBegin:
        return request_.prefill_begin().has_plan() ? &request_.prefill_begin().plan() : nullptr;
      case v1::DecodeStreamRequest::kVerifyBegin:
        return request_.verify_begin().has_plan() ? &request_.verify_begin().plan() : nullptr;
      default: return std::nullopt;
    }
  }
  // A begin's request id, checked for length before the session keeps it
  // (--max-request-id-bytes); the session refuses an empty one after checking the order.
  absl::Status CheckRequestId() const {
    switch (request_.msg_case()) {
      case v1::DecodeStreamRequest::kBegin:
        return CheckId(request_.begin().request_id(), "begin.request_id");
      case v1::DecodeStreamRequest::kPrefillBegin:
        return CheckId(request_.prefill_begin().request_id(), "prefill_begin.request_id");
      case v1::DecodeStreamRequest::kVerifyBegin:
        return CheckId(request_.verify_begin().request_id(), "verify_begin.request_id");
      default: return absl::OkStatus();
    }
  }
  absl::Status CheckId(const std::string& id, absl::string_view field) const {
    return id.empty() ? absl::OkStatus() : ctx_->requests->CheckId(id, field);
  }
  // Why reading stopped: the client closed its side (OK), or the call was cancelled or ran
  // past its deadline, which the client sees as that code and the metrics count as such.
  absl::Status Ended() const {
    if (!c_->IsCancelled()) return absl::OkStatus();
    if (std::chrono::system_clock::now() >= c_->deadline()) {
      return absl::DeadlineExceededError("decode stream: past its deadline");
    }
    return absl::CancelledError("decode stream: cancelled");
  }
  void Done(const absl::Status& status) {
    session_.Abandon();
    ctx_->metrics->CountRpc("DecodeStream", ToGrpcStatus(status).error_code());
    Finish(ToGrpcStatus(status));
  }

  const grpc::CallbackServerContext* c_;
  ServiceContext call_;  // the server's, as the caller's tenant sees it
  const ServiceContext* ctx_;
  bool counted_ = false;  // holds one of --max-streams
  uint64_t tokens_checked_ = 0;  // CheckStillAuthorized's
  ForwardSession session_;
  v1::DecodeStreamRequest request_;
  v1::DecodeStreamResponse response_;
};

}  // namespace

grpc::ServerUnaryReactor* ReplaySsmService::Reply(grpc::CallbackServerContext* c,
                                                  absl::string_view method,
                                                  const absl::Status& status) {
  const grpc::Status g = ToGrpcStatus(status);
  ctx_->metrics->CountRpc(method, g.error_code());
  grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
  reactor->Finish(g);
  return reactor;
}

template <typename F>
grpc::ServerUnaryReactor* ReplaySsmService::Run(grpc::CallbackServerContext* c,
                                                absl::string_view method, F&& op) {
  absl::StatusOr<ServiceContext> caller = CallerContext(*c, *ctx_);
  if (!caller.ok()) return Reply(c, method, caller.status());
  Operations ops(&*caller);
  return Reply(c, method, op(ops));
}

grpc::ServerUnaryReactor* ReplaySsmService::GetInfo(grpc::CallbackServerContext* c,
                                                    const v1::GetInfoRequest*,
                                                    v1::GetInfoResponse* resp) {
  return Run(c, "GetInfo", [&](Operations& ops) { return ops.GetInfo(resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::GetStats(grpc::CallbackServerContext* c,
                                                     const v1::GetStatsRequest*,
                                                     v1::GetStatsResponse* resp) {
  return Run(c, "GetStats", [&](Operations& ops) { return ops.GetStats(resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Allocate(grpc::CallbackServerContext* c,
                                                     const v1::AllocateRequest* req,
                                                     v1::AllocateResponse* resp) {
  return Run(c, "Allocate", [&](Operations& ops) { return ops.Allocate(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Free(grpc::CallbackServerContext* c,
                                                 const v1::FreeRequest* req,
                                                 v1::FreeResponse* resp) {
  return Run(c, "Free", [&](Operations& ops) { return ops.Free(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::GetSlot(grpc::CallbackServerContext* c,
                                                    const v1::GetSlotRequest* req,
                                                    v1::GetSlotResponse* resp) {
  return Run(c, "GetSlot", [&](Operations& ops) { return ops.GetSlot(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::ListSlots(grpc::CallbackServerContext* c,
                                                      const v1::ListSlotsRequest*,
                                                      v1::ListSlotsResponse* resp) {
  return Run(c, "ListSlots", [&](Operations& ops) { return ops.ListSlots(resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Import(grpc::CallbackServerContext* c,
                                                   const v1::ImportRequest* req,
                                                   v1::ImportResponse* resp) {
  return Run(c, "Import", [&](Operations& ops) { return ops.Import(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Export(grpc::CallbackServerContext* c,
                                                   const v1::ExportRequest* req,
                                                   v1::ExportResponse* resp) {
  return Run(c, "Export", [&](Operations& ops) { return ops.Export(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Prefill(grpc::CallbackServerContext* c,
                                                    const v1::PrefillRequest* req,
                                                    v1::PrefillResponse* resp) {
  return Run(c, "Prefill", [&](Operations& ops) { return ops.Prefill(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Decode(grpc::CallbackServerContext* c,
                                                   const v1::DecodeRequest* req,
                                                   v1::DecodeResponse* resp) {
  return Run(c, "Decode", [&](Operations& ops) { return ops.Decode(*req, resp); });
}

grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse>*
ReplaySsmService::DecodeStream(grpc::CallbackServerContext* c) {
  return new DecodeStreamReactor(ctx_, *c);
}

grpc::ServerUnaryReactor* ReplaySsmService::Verify(grpc::CallbackServerContext* c,
                                                   const v1::VerifyRequest* req,
                                                   v1::VerifyResponse* resp) {
  return Run(c, "Verify", [&](Operations& ops) { return ops.Verify(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Accept(grpc::CallbackServerContext* c,
                                                   const v1::AcceptRequest* req,
                                                   v1::AcceptResponse* resp) {
  return Run(c, "Accept", [&](Operations& ops) { return ops.Accept(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::MatchPrefix(grpc::CallbackServerContext* c,
                                                        const v1::MatchPrefixRequest* req,
                                                        v1::MatchPrefixResponse* resp) {
  return Run(c, "MatchPrefix", [&](Operations& ops) { return ops.MatchPrefix(*req, resp); });
}

grpc::ServerUnaryReactor* ReplaySsmService::Donate(grpc::CallbackServerContext* c,
                                                   const v1::DonateRequest* req,
                                                   v1::DonateResponse* resp) {
  return Run(c, "Donate", [&](Operations& ops) { return ops.Donate(*req, resp); });
}

grpc::ServerWriteReactor<v1::CacheEventBatch>* ReplaySsmService::WatchCache(
    grpc::CallbackServerContext* c, const v1::WatchCacheRequest* req) {
  return NewWatchCacheReactor(ctx_, c, *req);
}

}  // namespace replayssm::service
