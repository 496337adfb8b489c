#include "service/regions_service.h"

#include "service/caller.h"
#include "service/status_map.h"

namespace replayssm::service {

absl::StatusOr<cache::RegionTable*> RegionsService::Regions(
    const grpc::CallbackServerContext& c) const {
  absl::StatusOr<ServiceContext> caller = CallerContext(c, *ctx_);
  if (!caller.ok()) return caller.status();
  return caller->regions;
}

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
  absl::StatusOr<cache::RegionTable*> regions = Regions(*c);
  return Reply(c, "RegisterSystemRegion",
               regions.ok() ? (*regions)->Register(spec) : regions.status());
}

grpc::ServerUnaryReactor* RegionsService::RegisterCudaRegion(
    grpc::CallbackServerContext* c, const v1::RegisterCudaRegionRequest* req,
    v1::RegisterRegionResponse*) {
  if (absl::Status d = ctx_->gate->RefuseIfFailed(kNoDeviceWork); !d.ok()) {
    return Reply(c, "RegisterCudaRegion", d);
  }
  cache::RegionSpec spec;
  spec.name = req->name();
  spec.kind = cache::RegionKind::kCuda;
  spec.cuda_handle = req->raw_handle();
  spec.device = req->device_id();
  spec.offset = req->offset();
  spec.bytes = req->byte_size();
  absl::StatusOr<cache::RegionTable*> regions = Regions(*c);
  return Reply(c, "RegisterCudaRegion",
               regions.ok() ? (*regions)->Register(spec) : regions.status());
}

grpc::ServerUnaryReactor* RegionsService::UnregisterRegion(grpc::CallbackServerContext* c,
                                                           const v1::UnregisterRegionRequest* req,
                                                           v1::UnregisterRegionResponse*) {
  absl::StatusOr<cache::RegionTable*> regions = Regions(*c);
  return Reply(c, "UnregisterRegion",
               regions.ok() ? (*regions)->Unregister(req->name()) : regions.status());
}

grpc::ServerUnaryReactor* RegionsService::GetRegionStatus(grpc::CallbackServerContext* c,
                                                          const v1::RegionStatusRequest* req,
                                                          v1::RegionStatusResponse* resp) {
  absl::StatusOr<cache::RegionTable*> regions = Regions(*c);
  if (!regions.ok()) return Reply(c, "GetRegionStatus", regions.status());
  absl::StatusOr<std::vector<cache::RegionInfo>> infos = (*regions)->Status(req->name());
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
