// EchoService: the transport baseline of replayssm-bench-service. It speaks replayssm.v1
// (GetInfo, Allocate, Free, Decode, DecodeStream) with replies of exactly the real server's
// sizes — a zero [B, HV, V] output per layer — but does no work, so the same client benchmark
// run against both measures the service's own overhead over gRPC moving the same bytes.
#ifndef REPLAYSSM_BENCH_ECHO_SERVICE_H_
#define REPLAYSSM_BENCH_ECHO_SERVICE_H_

#include <atomic>
#include <cstdint>

#include "replayssm/v1/replayssm.grpc.pb.h"

namespace replayssm::bench {

class EchoService final : public v1::ReplaySsm::CallbackService {
 public:
  explicit EchoService(v1::GetInfoResponse info) : info_(std::move(info)) {}

  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* c, const v1::GetInfoRequest*,
                                    v1::GetInfoResponse* resp) override;
  grpc::ServerUnaryReactor* Allocate(grpc::CallbackServerContext* c, const v1::AllocateRequest*,
                                     v1::AllocateResponse* resp) override;
  grpc::ServerUnaryReactor* Free(grpc::CallbackServerContext* c, const v1::FreeRequest*,
                                 v1::FreeResponse*) override;
  grpc::ServerUnaryReactor* Decode(grpc::CallbackServerContext* c, const v1::DecodeRequest* req,
                                   v1::DecodeResponse* resp) override;
  grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse>* DecodeStream(
      grpc::CallbackServerContext* c) override;

  // The output a layer of `batch` rows would have.
  v1::LayerOutput Output(int32_t layer, int64_t batch) const;

 private:
  const v1::GetInfoResponse info_;
  std::atomic<uint64_t> next_slot_{1};
};

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_ECHO_SERVICE_H_
