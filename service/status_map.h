// The one place where a domain status (absl::Status from the cache, the transfer layer and
// the service's own validation) becomes a gRPC status, and where a peer's gRPC status becomes
// an absl::Status again. Handlers never build a grpc::Status themselves.
#ifndef REPLAYSSM_SERVICE_STATUS_MAP_H_
#define REPLAYSSM_SERVICE_STATUS_MAP_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"

namespace replayssm::service {

// absl code -> grpc::StatusCode (the numeric values agree by design; the switch makes the
// mapping explicit and total). The message is kept as is.
grpc::Status ToGrpcStatus(const absl::Status& status);

// The inverse, for calls to peers: the same code, the message prefixed with `context` (e.g.
// "peer CommitTransfer: ...").
absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view context);

// "<field>: expected <expected>, got <got>" as INVALID_ARGUMENT: the format every validation
// error uses, so clients and tests can rely on it.
absl::Status FieldError(absl::string_view field, absl::string_view expected, absl::string_view got);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_STATUS_MAP_H_
