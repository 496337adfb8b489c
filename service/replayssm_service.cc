#include "service/replayssm_service.h"

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "service/caller.h"
#include "service/forward_session.h"
#include "service/status_map.h"
#include "service/watch_cache.h"

namespace replayssm::service {

namespace {

// One forward stream: reads a message, lets the session handle it, writes the answer, reads
// the next. A closed or cancelled stream, an error before a commit, or a forward that waited
// for layer messages past --stream-idle-timeout (OpenStreams' sweep) abandons the open forward
// (End). The callbacks and the sweep's ClaimIfIdle take mu_, so that the sweep never ends a
// stream in the middle of a message; Finish is called outside it, since a finished stream
// may be deleted at once.
//
// A message that comes while a planned forward is open (its commit, or the begin that closes
// it) waits for that forward's layers, and so for the engine's doorbells, up to
// --forward-timeout: it is answered from the stream's own thread (answerer_), not from the
// gRPC callback thread that read it. gRPC's callback threads are shared by every call of the
// server; a few engines whose commits waited on them used to hold them all, and every other
// client's calls waited meanwhile (an outside review: GetInfo answered after 9.5 s behind four
// such streams). Other messages (inline layers, the first begin) run kernels whose time the
// server bounds, and stay on the callback thread (no thread hop).
class DecodeStreamReactor final
    : public grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse>,
      public IdleWatched {
 public:
  DecodeStreamReactor(const ServiceContext* ctx, const grpc::CallbackServerContext& c,
                      OpenStreams* streams)
      : c_(&c), call_(*ctx), ctx_(&call_), session_(&call_), streams_(streams) {
    const absl::Status admitted = Admit(c, *ctx);
    if (!admitted.ok()) {
      grpc::Status end;
      {
        absl::MutexLock lock(&mu_);
        end = End(admitted);
      }
      Finish(end);
      return;
    }
    streams_->Add(this);
    Read();
  }

  void OnReadDone(bool ok) override {
    std::optional<grpc::Status> end;
    {
      absl::MutexLock lock(&mu_);
      ++reads_done_;
      if (finished_) return;  // the idle sweep ended the stream while this read waited
      if (!ok) {
        end = End(Ended());
      } else if (session_.PlannedOpen()) {
        // Answered (written or finished) by the job; no read is outstanding meanwhile, so
        // nothing else ends the stream before it.
        if (answerer_ == nullptr) answerer_ = std::make_unique<QueueWorker>();
        answerer_->WaitIdle();  // the last answer's job has returned from its write
        answerer_->Post([this] { Answer(); });
        return;
      } else {
        end = HandleMessage();
      }
    }
    Reply(end);
  }
  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> end;
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return;
      if (!ok) end = End(absl::CancelledError("decode stream: write failed"));
    }
    if (end.has_value()) return Finish(*end);
    Read();
  }
  // The client cancelled or went away: a commit or begin waiting on a planned forward's
  // doorbells ends now (the forward is expired: rung and abandoned), not at --forward-timeout;
  // its reply's write then fails and ends the stream. Without mu_, which that wait holds.
  void OnCancel() override { session_.CancelWaits(); }
  void OnDone() override {
    streams_->Remove(this);  // first: the sweep holds no pointer to this after it
    if (counted_) ctx_->streams->Close(call_.tenant());
    delete this;
  }

  bool ClaimIfIdle(absl::Time now, absl::Duration limit) override {
    if (!mu_.TryLock()) return false;  // handling a message: not idle
    bool claimed = false;
    // Idle only while a read is outstanding: not while a message is handled or its reply is
    // written (Finish must not land on a pending write), and from when that read was started,
    // not from when the last message came (a layer that ran long is no silence).
    const bool waiting = reads_started_ == reads_done_ + 1;
    if (!finished_ && waiting && session_.AwaitsMessage(now) && now - waiting_since_ > limit) {
      claimed_end_ = End(absl::DeadlineExceededError(absl::StrCat(
          "decode stream: the open forward had no message for ",
          absl::FormatDuration(now - waiting_since_), ", longer than --stream-idle-timeout (",
          absl::FormatDuration(limit), "): it was abandoned, nothing of it committed")));
      claimed = true;
    }
    mu_.Unlock();
    return claimed;
  }
  void FinishClaimed() override { Finish(claimed_end_); }

 private:
  // The answerer's job: the message read last, handled and answered off gRPC's threads.
  void Answer() {
    std::optional<grpc::Status> end;
    {
      absl::MutexLock lock(&mu_);
      end = HandleMessage();
    }
    Reply(end);
  }
  // Handles the message read last into response_; the stream's end if it failed.
  std::optional<grpc::Status> HandleMessage() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    response_.Clear();
    const absl::Status s = Handle();
    if (!s.ok()) return End(s);
    return std::nullopt;
  }
  // Outside mu_: the stream may be deleted once finished.
  void Reply(const std::optional<grpc::Status>& end) {
    if (end.has_value()) return Finish(*end);
    StartWrite(&response_);
  }
  absl::Status Handle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
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
  // Starts the next read, then counts it. The count follows the start, so that the sweep sees
  // a read outstanding only once it is (and never finishes a stream before its read starts);
  // a read done before the count (OnReadDone on another thread) leaves started == done.
  void Read() {
    StartRead(&request_);
    absl::MutexLock lock(&mu_);
    ++reads_started_;
    waiting_since_ = absl::Now();
  }
  // The caller's tenant and its room under --max-streams (and the tenant's bound).
  absl::Status Admit(const grpc::CallbackServerContext& c, const ServiceContext& ctx) {
    absl::StatusOr<ServiceContext> caller = CallerContext(c, ctx);
    if (!caller.ok()) return caller.status();
    call_ = *std::move(caller);
    absl::Status admitted = ctx_->streams->Open(call_.tenant());
    counted_ = admitted.ok();
    return admitted;
  }
  // The stream's end: its open forward abandoned, the RPC counted. Finish (the returned status)
  // follows, outside mu_; finished_ keeps anything else from finishing it again.
  grpc::Status End(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    finished_ = true;
    session_.Abandon();
    const grpc::Status g = ToGrpcStatus(status);
    ctx_->metrics->CountRpc("DecodeStream", g.error_code());
    return g;
  }

  const grpc::CallbackServerContext* c_;
  ServiceContext call_;  // the server's, as the caller's tenant sees it
  const ServiceContext* ctx_;
  bool counted_ = false;  // holds one of --max-streams
  uint64_t tokens_checked_ = 0;  // CheckStillAuthorized's
  ForwardSession session_;
  OpenStreams* const streams_;
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // End called: a late read is ignored
  // Reads started and done (ClaimIfIdle: one outstanding), and when the last one started.
  int64_t reads_started_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t reads_done_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time waiting_since_ ABSL_GUARDED_BY(mu_);
  grpc::Status claimed_end_;  // set by ClaimIfIdle, before FinishClaimed
  v1::DecodeStreamRequest request_;
  v1::DecodeStreamResponse response_;
  // Answers the messages that wait for a planned forward (made at the first); declared last so
  // that it is joined first, before the session its job used goes. OnDone, which deletes the
  // stream, never runs on it: gRPC runs OnDone on its own threads after Finish returns.
  std::unique_ptr<QueueWorker> answerer_;
};

}  // namespace

OpenStreams::OpenStreams(absl::Duration limit)
    : limit_(limit),
      sweep_(PeriodicSweep::LeasePeriod(limit), [this](absl::Time now) { Sweep(now); }) {}

void OpenStreams::Add(IdleWatched* s) {
  absl::MutexLock lock(&mu_);
  streams_.insert(s);
}

void OpenStreams::Remove(IdleWatched* s) {
  absl::MutexLock lock(&mu_);
  streams_.erase(s);
}

void OpenStreams::Sweep(absl::Time now) {
  std::vector<IdleWatched*> claimed;
  {
    absl::MutexLock lock(&mu_);  // a stream's OnDone waits here before it is deleted
    for (IdleWatched* s : streams_) {
      if (s->ClaimIfIdle(now, limit_)) claimed.push_back(s);
    }
  }
  // A claimed stream is not finished by anything else, so it lives until its Finish.
  for (IdleWatched* s : claimed) s->FinishClaimed();
}

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
  return new DecodeStreamReactor(ctx_, *c, &streams_);
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
