// Operations: the body of every unary RPC — validate every field, run it at most once per
// request id, call the cache, fill the reply. The gRPC handlers (replayssm_service.h) only
// call these and map the returned status; no gRPC types appear here besides the messages.
//
// Thread safety: thread-safe (the cache, request log, metrics and gate are).
#ifndef REPLAYSSM_SERVICE_OPERATIONS_H_
#define REPLAYSSM_SERVICE_OPERATIONS_H_

#include <map>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "replayssm/v1/replayssm.pb.h"
#include "service/service_context.h"

namespace replayssm::service {

class Operations {
 public:
  explicit Operations(const ServiceContext* ctx) : ctx_(ctx) {}

  absl::Status GetInfo(v1::GetInfoResponse* resp) const;
  absl::Status GetStats(v1::GetStatsResponse* resp) const;
  absl::Status Allocate(const v1::AllocateRequest& req, v1::AllocateResponse* resp);
  absl::Status Free(const v1::FreeRequest& req, v1::FreeResponse* resp);
  absl::Status GetSlot(const v1::GetSlotRequest& req, v1::GetSlotResponse* resp) const;
  absl::Status ListSlots(v1::ListSlotsResponse* resp) const;
  absl::Status Import(const v1::ImportRequest& req, v1::ImportResponse* resp);
  absl::Status Export(const v1::ExportRequest& req, v1::ExportResponse* resp);
  absl::Status Prefill(const v1::PrefillRequest& req, v1::PrefillResponse* resp);
  absl::Status Decode(const v1::DecodeRequest& req, v1::DecodeResponse* resp);
  absl::Status Verify(const v1::VerifyRequest& req, v1::VerifyResponse* resp);
  absl::Status Accept(const v1::AcceptRequest& req, v1::AcceptResponse* resp);
  absl::Status MatchPrefix(const v1::MatchPrefixRequest& req, v1::MatchPrefixResponse* resp) const;
  absl::Status Donate(const v1::DonateRequest& req, v1::DonateResponse* resp);

 private:
  // Runs `apply` unless (method, request_id) was applied before, in which case `resp` gets
  // the original reply. `key` holds the request's identifying fields (not its tensors).
  absl::Status Once(absl::string_view method, const std::string& request_id,
                    const google::protobuf::Message& key, google::protobuf::Message* resp,
                    absl::FunctionRef<absl::Status()> apply);
  absl::Status SlotStateOf(uint64_t handle, v1::SlotState* state) const;
  // Hands a new slot's handle to the caller unless that took its tenant past
  // --tenant-max-slots (then the slot is freed again: RESOURCE_EXHAUSTED).
  absl::Status IssueWithinQuota(cache::SlotId slot, v1::AllocateResponse* resp);
  // Export with checkpoints_out: into the named region ranges.
  absl::Status ExportToRegions(const v1::ExportRequest& req, v1::ExportResponse* resp);
  // Layer `layer`'s checkpoint range of `ref` (one [HV, V, K] in the state dtype, 16-byte
  // aligned), leased into `leases`; every layer's region of the memory kind of layer 0's.
  absl::StatusOr<void*> CheckpointRange(const v1::RegionRef& ref, const std::string& field,
                                        int layer, cache::IoMemory* memory,
                                        std::map<std::string, cache::RegionLease>* leases) const;

  const ServiceContext* ctx_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_OPERATIONS_H_
