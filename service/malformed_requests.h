// A server interceptor that answers unparseable unary requests with INVALID_ARGUMENT and a
// text, and counts them in replayssm_rpcs_total. gRPC's callback API (1.51,
// grpcpp/impl/codegen/server_callback_handlers.h) answers a unary request whose bytes do not
// deserialize with UNIMPLEMENTED and no text, and never calls the handler; the interceptor
// sees the failed parse (POST_RECV_MESSAGE without a message) and rewrites that status
// (PRE_SEND_STATUS). Streams are not intercepted (docs/api.md, "Malformed messages").
//
// Thread safety: the factory is thread-safe; each interceptor serves one call.
#ifndef REPLAYSSM_SERVICE_MALFORMED_REQUESTS_H_
#define REPLAYSSM_SERVICE_MALFORMED_REQUESTS_H_

#include <memory>

#include "grpcpp/support/server_interceptor.h"
#include "service/metrics.h"

namespace replayssm::service {

// For ServerBuilder::experimental().SetInterceptorCreators; `metrics` outlives the server.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MalformedRequestsFactory(
    Metrics* metrics);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_MALFORMED_REQUESTS_H_
