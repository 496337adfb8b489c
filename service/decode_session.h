// DecodeSession: one client's decode forwards, in the order Begin -> RunLayer (each layer
// once, any order) -> Commit. The streaming RPC keeps one session per stream (several
// forwards one after another); the unary Decode runs one forward through the same code.
//
// A session that is destroyed, or fails, before Commit abandons its forward: the cache moves
// no cursor, the request id is released (a retry runs again) and the forward's ticket is
// returned to the drain gate. A Begin whose request id was already applied replays the
// original outputs instead of running the kernels again.
//
// Not thread-safe: one driver at a time (a stream's reactor serializes its messages).
#ifndef REPLAYSSM_SERVICE_DECODE_SESSION_H_
#define REPLAYSSM_SERVICE_DECODE_SESSION_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/v1/replayssm.pb.h"
#include "service/service_context.h"

namespace replayssm::service {

// Rows of a forward: 1..max_batch of them, non-padding slots distinct.
absl::Status CheckRows(const google::protobuf::RepeatedPtrField<v1::DecodeRow>& rows,
                       const ServiceLimits& limits);

class DecodeSession {
 public:
  explicit DecodeSession(const ServiceContext* ctx) : ctx_(ctx) {}
  ~DecodeSession() { Abandon(); }
  DecodeSession(const DecodeSession&) = delete;
  DecodeSession& operator=(const DecodeSession&) = delete;

  absl::Status Begin(const v1::DecodeBegin& begin, v1::DecodeBegun* begun);
  absl::Status RunLayer(const v1::LayerInput& input, v1::LayerOutput* output);
  absl::Status Commit(v1::DecodeCommitted* committed);
  // Drops an open forward (no state changes). Idempotent.
  void Abandon();

 private:
  // Claims begin.request_id in the request log, or sets replay_ for an applied one.
  absl::Status Claim(const v1::DecodeBegin& begin);
  // Enters the drain gate and opens the cache forward for `rows`.
  absl::Status Open(const google::protobuf::RepeatedPtrField<v1::DecodeRow>& rows);
  absl::Status CheckOpenLayer(const v1::LayerInput& input) const;
  absl::StatusOr<v1::SlotState> RowState(const cache::DecodeRow& row) const;

  const ServiceContext* ctx_;
  bool open_ = false;
  std::string request_id_;
  std::vector<cache::DecodeRow> rows_;
  std::vector<bool> layer_done_;
  std::unique_ptr<cache::Forward> forward_;
  ForwardGate::Ticket ticket_;
  std::optional<v1::DecodeResponse> replay_;  // set when replaying an applied request
  v1::DecodeResponse record_;                 // what the request log keeps on commit ...
  bool retain_ = false;                       // ... unless its outputs would not fit the log anyway
  absl::Time start_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_DECODE_SESSION_H_
