// The WatchCache stream (replayssm.v1.ReplaySsm.WatchCache): a caller's cache events
// (cache_events.h) as CacheEventBatch messages, written one at a time as the client takes
// them. A client that falls 4096 batches behind is cut off with
// RESOURCE_EXHAUSTED and reconnects from its next sequence number.
#ifndef REPLAYSSM_SERVICE_WATCH_CACHE_H_
#define REPLAYSSM_SERVICE_WATCH_CACHE_H_

#include "grpcpp/grpcpp.h"
#include "replayssm/v1/replayssm.grpc.pb.h"
#include "service/cache_events.h"
#include "service/service_context.h"

namespace replayssm::service {

// The batch as the wire carries it.
void ToProto(const KvEventBatch& b, uint64_t epoch, int32_t block_size, v1::CacheEventBatch* out);

// A reactor for one WatchCache call; it deletes itself when the call is done.
grpc::ServerWriteReactor<v1::CacheEventBatch>* NewWatchCacheReactor(
    const ServiceContext* ctx, grpc::CallbackServerContext* c, const v1::WatchCacheRequest& req);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_WATCH_CACHE_H_
