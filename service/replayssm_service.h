// The gRPC face of replayssm.v1.ReplaySsm (callback API). Handlers are thin: they call
// Operations (unary) or drive a ForwardSession (the DecodeStream reactor), count the RPC in
// the metrics and map the status through ToGrpcStatus. No domain logic lives here.
#ifndef REPLAYSSM_SERVICE_REPLAYSSM_SERVICE_H_
#define REPLAYSSM_SERVICE_REPLAYSSM_SERVICE_H_

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/v1/replayssm.grpc.pb.h"
#include "service/operations.h"
#include "service/periodic_sweep.h"
#include "service/service_context.h"

namespace replayssm::service {

// A DecodeStream as the idle sweep sees it (replayssm_service.cc).
class IdleWatched {
 public:
  virtual ~IdleWatched() = default;
  // True when a forward waiting for layer messages has had none for longer than `limit`: the
  // forward is then abandoned and the stream claimed for FinishClaimed, which must follow,
  // outside the sweep's lock (finishing may end the stream at once). A stream busy handling a
  // message is left alone.
  virtual bool ClaimIfIdle(absl::Time now, absl::Duration limit) = 0;
  // Ends a claimed stream with DEADLINE_EXCEEDED.
  virtual void FinishClaimed() = 0;
};

// The open DecodeStreams, swept for forwards whose client went quiet: such a forward holds its
// slots from every other call, Free and drain included, for as long as the stream stays open,
// and a client host gone without closing its connection keeps it open until the transport
// notices (the server's keepalive pings, server.cc).
class OpenStreams {
 public:
  explicit OpenStreams(absl::Duration limit);
  void Add(IdleWatched* s) ABSL_LOCKS_EXCLUDED(mu_);
  void Remove(IdleWatched* s) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Sweep(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_);

  const absl::Duration limit_;
  absl::Mutex mu_;
  absl::flat_hash_set<IdleWatched*> streams_ ABSL_GUARDED_BY(mu_);
  PeriodicSweep sweep_;  // last: stops before the set goes
};

class ReplaySsmService final : public v1::ReplaySsm::CallbackService {
 public:
  explicit ReplaySsmService(const ServiceContext* ctx)
      : ctx_(ctx), streams_(ctx->stream_idle_timeout) {}

  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* c, const v1::GetInfoRequest*,
                                    v1::GetInfoResponse* resp) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* c, const v1::GetStatsRequest*,
                                     v1::GetStatsResponse* resp) override;
  grpc::ServerUnaryReactor* Allocate(grpc::CallbackServerContext* c, const v1::AllocateRequest* req,
                                     v1::AllocateResponse* resp) override;
  grpc::ServerUnaryReactor* Free(grpc::CallbackServerContext* c, const v1::FreeRequest* req,
                                 v1::FreeResponse* resp) override;
  grpc::ServerUnaryReactor* GetSlot(grpc::CallbackServerContext* c, const v1::GetSlotRequest* req,
                                    v1::GetSlotResponse* resp) override;
  grpc::ServerUnaryReactor* ListSlots(grpc::CallbackServerContext* c,
                                      const v1::ListSlotsRequest* req,
                                      v1::ListSlotsResponse* resp) override;
  grpc::ServerUnaryReactor* Import(grpc::CallbackServerContext* c, const v1::ImportRequest* req,
                                   v1::ImportResponse* resp) override;
  grpc::ServerUnaryReactor* Export(grpc::CallbackServerContext* c, const v1::ExportRequest* req,
                                   v1::ExportResponse* resp) override;
  grpc::ServerUnaryReactor* Prefill(grpc::CallbackServerContext* c, const v1::PrefillRequest* req,
                                    v1::PrefillResponse* resp) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* c, const v1::DecodeRequest* req,
                                   v1::DecodeResponse* resp) override;
  grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse>* DecodeStream(
      grpc::CallbackServerContext* c) override;
  grpc::ServerUnaryReactor* Verify(grpc::CallbackServerContext* c, const v1::VerifyRequest* req,
                                   v1::VerifyResponse* resp) override;
  grpc::ServerUnaryReactor* Accept(grpc::CallbackServerContext* c, const v1::AcceptRequest* req,
                                   v1::AcceptResponse* resp) override;
  grpc::ServerUnaryReactor* MatchPrefix(grpc::CallbackServerContext* c,
                                        const v1::MatchPrefixRequest* req,
                                        v1::MatchPrefixResponse* resp) override;
  grpc::ServerUnaryReactor* Donate(grpc::CallbackServerContext* c, const v1::DonateRequest* req,
                                   v1::DonateResponse* resp) override;
  grpc::ServerWriteReactor<v1::CacheEventBatch>* WatchCache(
      grpc::CallbackServerContext* c, const v1::WatchCacheRequest* req) override;

 private:
  // Counts the RPC and finishes it with the mapped status.
  grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* c, absl::string_view method,
                                  const absl::Status& status);
  // Authenticates the caller (caller.h), runs `op` on Operations bound to its tenant, replies.
  template <typename F>
  grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* c, absl::string_view method, F&& op);

  const ServiceContext* ctx_;
  OpenStreams streams_;  // every stream ends before the service goes (server shutdown)
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_REPLAYSSM_SERVICE_H_
