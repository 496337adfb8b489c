// The gRPC face of replayssm.v1.ReplaySsm (callback API). Handlers are thin: they call
// Operations (unary) or drive a ForwardSession (the DecodeStream reactor), count the RPC in
// the metrics and map the status through ToGrpcStatus. No domain logic lives here.
#ifndef REPLAYSSM_SERVICE_REPLAYSSM_SERVICE_H_
#define REPLAYSSM_SERVICE_REPLAYSSM_SERVICE_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/v1/replayssm.grpc.pb.h"
#include "service/operations.h"
#include "service/service_context.h"

namespace replayssm::service {

class ReplaySsmService final : public v1::ReplaySsm::CallbackService {
 public:
  explicit ReplaySsmService(const ServiceContext* ctx) : ctx_(ctx) {}

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
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_REPLAYSSM_SERVICE_H_
