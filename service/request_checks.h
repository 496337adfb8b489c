// The checks every request passes before the service touches the cache: each field against
// the model and the limits (counts, distinct slots, dtypes, shapes, byte counts, finiteness of
// inline activations and checkpoints). Pure functions of the message — no server, no cache —
// so that a fuzz target (fuzz/) runs exactly what the handlers run. Checks that need the
// server's state (request ids in the request log, registered regions, slot handles) stay in
// the handlers.
//
// Thread safety: pure functions.
#ifndef REPLAYSSM_SERVICE_REQUEST_CHECKS_H_
#define REPLAYSSM_SERVICE_REQUEST_CHECKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "replayssm/cache/model.h"
#include "replayssm/v1/replayssm.pb.h"
#include "service/service_context.h"

namespace replayssm::service {

// Rows of a decode forward: 1..max_batch of them, non-padding slots distinct.
absl::Status CheckRows(const google::protobuf::RepeatedPtrField<v1::DecodeRow>& rows,
                       const ServiceLimits& limits);
// Rows of a prefill forward: 1..max_batch distinct non-zero slots, each with >= 1 token, at
// most max_prefill_tokens in all.
absl::Status CheckPrefillRows(const google::protobuf::RepeatedPtrField<v1::PrefillRow>& rows,
                              const ServiceLimits& limits);
// A verify's slots (1..max_batch, distinct, non-zero), num_draft (1..L) and draft count (B*T).
absl::Status CheckVerifyRows(const google::protobuf::RepeatedField<uint64_t>& slots,
                             int32_t num_draft, int64_t draft_tokens, const cache::ModelSpec& model,
                             const ServiceLimits& limits);

// The unary requests' fields (the request id and any regions are checked by the handler).
absl::Status CheckAllocateRequest(const v1::AllocateRequest& req);
absl::Status CheckImportRequest(const v1::ImportRequest& req, const cache::ModelSpec& model,
                                const ServiceLimits& limits);
absl::Status CheckPrefillRequest(const v1::PrefillRequest& req, const cache::ModelSpec& model,
                                 const ServiceLimits& limits);
absl::Status CheckDecodeRequest(const v1::DecodeRequest& req, const cache::ModelSpec& model,
                                const ServiceLimits& limits);
absl::Status CheckVerifyRequest(const v1::VerifyRequest& req, const cache::ModelSpec& model,
                                const ServiceLimits& limits);
absl::Status CheckAcceptRequest(const v1::AcceptRequest& req, const cache::ModelSpec& model);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_REQUEST_CHECKS_H_
