#include "service/status_map.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace replayssm::service {

namespace {

// The codes are numerically equal by design (both follow google.rpc.Code).
constexpr std::pair<absl::StatusCode, grpc::StatusCode> kCodes[] = {
    {absl::StatusCode::kOk, grpc::StatusCode::OK},
    {absl::StatusCode::kCancelled, grpc::StatusCode::CANCELLED},
    {absl::StatusCode::kUnknown, grpc::StatusCode::UNKNOWN},
    {absl::StatusCode::kInvalidArgument, grpc::StatusCode::INVALID_ARGUMENT},
    {absl::StatusCode::kDeadlineExceeded, grpc::StatusCode::DEADLINE_EXCEEDED},
    {absl::StatusCode::kNotFound, grpc::StatusCode::NOT_FOUND},
    {absl::StatusCode::kAlreadyExists, grpc::StatusCode::ALREADY_EXISTS},
    {absl::StatusCode::kPermissionDenied, grpc::StatusCode::PERMISSION_DENIED},
    {absl::StatusCode::kResourceExhausted, grpc::StatusCode::RESOURCE_EXHAUSTED},
    {absl::StatusCode::kFailedPrecondition, grpc::StatusCode::FAILED_PRECONDITION},
    {absl::StatusCode::kAborted, grpc::StatusCode::ABORTED},
    {absl::StatusCode::kOutOfRange, grpc::StatusCode::OUT_OF_RANGE},
    {absl::StatusCode::kUnimplemented, grpc::StatusCode::UNIMPLEMENTED},
    {absl::StatusCode::kInternal, grpc::StatusCode::INTERNAL},
    {absl::StatusCode::kUnavailable, grpc::StatusCode::UNAVAILABLE},
    {absl::StatusCode::kDataLoss, grpc::StatusCode::DATA_LOSS},
    {absl::StatusCode::kUnauthenticated, grpc::StatusCode::UNAUTHENTICATED},
};

grpc::StatusCode ToGrpcCode(absl::StatusCode code) {
  for (const auto& [a, g] : kCodes) {
    if (a == code) return g;
  }
  return grpc::StatusCode::UNKNOWN;
}

absl::StatusCode FromGrpcCode(grpc::StatusCode code) {
  for (const auto& [a, g] : kCodes) {
    if (g == code) return a;
  }
  return absl::StatusCode::kUnknown;
}

}  // namespace

absl::Status FromGrpcStatus(const grpc::Status& status, absl::string_view context) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(FromGrpcCode(status.error_code()),
                      absl::StrCat(context, ": ", status.error_message()));
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(ToGrpcCode(status.code()), std::string(status.message()));
}

absl::Status FieldError(absl::string_view field, absl::string_view expected,
                        absl::string_view got) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected ", expected, ", got ", got));
}

}  // namespace replayssm::service
