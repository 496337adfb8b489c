// The gRPC face of replayssm.v1.Regions: register / unregister / status of the memory regions
// co-located clients share with this server (cache::RegionTable does the work).
#ifndef REPLAYSSM_SERVICE_REGIONS_SERVICE_H_
#define REPLAYSSM_SERVICE_REGIONS_SERVICE_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/v1/regions.grpc.pb.h"
#include "service/service_context.h"

namespace replayssm::service {

class RegionsService final : public v1::Regions::CallbackService {
 public:
  explicit RegionsService(const ServiceContext* ctx) : ctx_(ctx) {}

  grpc::ServerUnaryReactor* RegisterSystemRegion(grpc::CallbackServerContext* c,
                                                 const v1::RegisterSystemRegionRequest* req,
                                                 v1::RegisterRegionResponse*) override;
  grpc::ServerUnaryReactor* RegisterCudaRegion(grpc::CallbackServerContext* c,
                                               const v1::RegisterCudaRegionRequest* req,
                                               v1::RegisterRegionResponse*) override;
  grpc::ServerUnaryReactor* UnregisterRegion(grpc::CallbackServerContext* c,
                                             const v1::UnregisterRegionRequest* req,
                                             v1::UnregisterRegionResponse*) override;
  grpc::ServerUnaryReactor* GetRegionStatus(grpc::CallbackServerContext* c,
                                            const v1::RegionStatusRequest* req,
                                            v1::RegionStatusResponse* resp) override;

 private:
  grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* c, absl::string_view method,
                                  const absl::Status& status);
  // The caller's tenant's regions (caller.h); UNAUTHENTICATED as every client-facing call.
  absl::StatusOr<cache::RegionTable*> Regions(const grpc::CallbackServerContext& c) const;
  const ServiceContext* ctx_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_REGIONS_SERVICE_H_
