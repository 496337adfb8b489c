#include "service/regions_service.h"

#include "service/status_map.h"

namespace replayssm::service {

grpc::ServerUnaryReactor* RegionsService::Reply(grpc::CallbackServerContext* c,
                                                absl::string_view method,
                                                const absl::Status& status) {
  const grpc::Status g = ToGrpcStatus(status);
  ctx_->metrics->CountRpc(method, g.error_code());
  grpc::ServerUnaryReactor* reactor = c->DefaultReactor();
  reactor->Finish(g);
  return reactor;
}

grpc::ServerUnaryReactor* RegionsService::RegisterSystemRegion(
    grpc::CallbackServerContext* c, const v1::RegisterSystemRegionRequest* req,
    v1::RegisterRegionResponse*) {
  cache::RegionSpec spec;
  spec.name = req->name();
  spec.kind = cache::RegionKind::kSystem;
  spec.shm_key = req->key();
  spec.offset = req->offset();
  spec.bytes = req->byte_size();
  return Reply(c, "RegisterSystemRegion", ctx_->regions->Register(spec));
}

grpc::ServerUnaryReactor* RegionsService::RegisterCudaRegion(
    grpc::CallbackServerContext* c, const v1::RegisterCudaRegionRequest* req,
    v1::RegisterRegionResponse*) {
  cache::RegionSpec spec;
  spec.name = req->name();
  spec.kind = cache::RegionKind::kCuda;
  spec.cuda_handle = req->raw_handle();
  spec.device = req->device_id();
  spec.offset = req->offset();
  spec.bytes = req->byte_size();
  return Reply(c, "RegisterCudaRegion", ctx_->regions->Register(spec));
}

grpc::ServerUnaryReactor* RegionsService::UnregisterRegion(grpc::CallbackServerContext* c,
                                                           const v1::UnregisterRegionRequest* req,
                                                           v1::UnregisterRegionResponse*) {
  return Reply(c, "UnregisterRegion", ctx_->regions->Unregister(req->name()));
}

grpc::ServerUnaryReactor* RegionsService::GetRegionStatus(grpc::CallbackServerContext* c,
                                                          const v1::RegionStatusRequest* req,
                                                          v1::RegionStatusResponse* resp) {
  absl::StatusOr<std::vector<cache::RegionInfo>> infos = ctx_->regions->Status(req->name());
  if (infos.ok()) {
    for (const cache::RegionInfo& i : *infos) {
      v1::RegionStatus* s = resp->add_regions();
      s->set_name(i.name);
      s->set_kind(i.kind == cache::RegionKind::kCuda ? v1::RegionStatus::KIND_CUDA
                                                     : v1::RegionStatus::KIND_SYSTEM);
      s->set_byte_size(i.bytes);
      s->set_device_id(i.device);
      s->set_in_use(i.leases);
    }
  }
  return Reply(c, "GetRegionStatus", infos.status());
}

}  // namespace replayssm::service
