// ForwardSession: one client's forwards of any kind — decode, prefill, verify — in the order
// Begin -> RunLayer (each layer once, any order) -> Commit. The DecodeStream RPC keeps one
// session per stream (several forwards one after another); the unary Decode runs one decode
// forward through the same code.
//
// A session that is destroyed, or fails, before Commit abandons its forward: the cache changes
// no state, the request id is released (a retry runs again) and the forward's ticket is
// returned to the drain gate. A begin whose request id was already applied replays the
// original outputs instead of running the kernels again.
//
// Not thread-safe: one driver at a time (a stream's reactor serializes its messages).
#ifndef REPLAYSSM_SERVICE_FORWARD_SESSION_H_
#define REPLAYSSM_SERVICE_FORWARD_SESSION_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/v1/replayssm.pb.h"
#include "service/planned_forward.h"
#include "service/request_checks.h"
#include "service/service_context.h"

namespace replayssm::service {

class ForwardSession {
 public:
  explicit ForwardSession(const ServiceContext* ctx) : ctx_(ctx) {}
  ~ForwardSession() { Abandon(); }
  ForwardSession(const ForwardSession&) = delete;
  ForwardSession& operator=(const ForwardSession&) = delete;

  // Opens a forward of one kind; each answers with the batch and the tokens per layer. A begin
  // while a planned forward is open commits that forward first (begun->closed holds its
  // reply), so that a co-located engine sends one message per forward; with any other
  // forward open it is refused. A refused begin that carries a plan rings the plan's done
  // doorbells (RingRefused), so that an engine that did not wait for the reply does not hang.
  absl::Status Begin(const v1::DecodeBegin& begin, v1::DecodeBegun* begun);
  absl::Status BeginPrefill(const v1::PrefillBegin& begin, v1::DecodeBegun* begun);
  absl::Status BeginVerify(const v1::VerifyBegin& begin, v1::DecodeBegun* begun);
  absl::Status RunLayer(const v1::LayerInput& input, v1::LayerOutput* output);
  absl::Status Commit(v1::DecodeCommitted* committed);
  // Drops an open forward (no state changes). Idempotent.
  void Abandon();
  // A planned forward is open: the next message (its commit, or a begin that closes it) waits
  // for its layers, on the engine's doorbells (up to --forward-timeout).
  bool PlannedOpen() const { return planned_ != nullptr; }
  // The client went away (its call was cancelled): a planned forward open is expired now, as
  // its deadline would (its doorbells rung, abandoned), so that a commit or a begin waiting on
  // it ends at once instead of at --forward-timeout. Thread-safe, unlike everything else here:
  // for the stream's OnCancel while its answering thread runs a message.
  void CancelWaits() const;
  // A forward is open that the client owes a message to, so --stream-idle-timeout applies: one
  // that waits for layer messages, or a planned one past its --forward-timeout (abandoned
  // then, but it holds its rows and region leases until the commit, or the stream ends: a
  // client that never commits used to hold them for good; an outside review).
  bool AwaitsMessage(absl::Time now) const {
    return open_ && (planned_ == nullptr || planned_->PastDeadline(now));
  }
  // A refused begin (`plan`: its plan, or null): a planned forward still open is committed
  // first, as any begin commits it (its commit waits for its last layer), and then `plan`'s
  // done doorbells ring (RingRefused), so that neither overwrites the other's and an engine
  // that did not wait for the reply does not hang. Returns `status`, saying what became of
  // the open forward. The stream's own checks of a begin (its request id, its token) refuse
  // through it too.
  absl::Status Refuse(const v1::ForwardPlan* plan, absl::Status status);

 private:
  // A forward's kind: its request log's id space and the kernel metric's ops of its calls.
  struct Kind {
    const char* method;     // the request log's id space
    const char* layer_op;   // the kernel metric's op for its layers
    const char* commit_op;  // and for its commit
  };
  static constexpr Kind kDecode{"Decode", "run_layer", "commit"};
  static constexpr Kind kPrefill{"PrefillForward", "prefill_layer", "prefill_commit"};
  static constexpr Kind kVerify{"VerifyForward", "verify_layer", "verify_commit"};
  // What a begin of each kind hands to Start.
  struct Opening {
    const Kind* kind;
    std::string request_id;
    std::string key;                   // the identifying fields, serialized (not the activations)
    int64_t tokens = 0;                // per layer message
    std::vector<cache::SlotId> slots;  // [B], kPaddingSlot for a padding row
    std::function<absl::StatusOr<std::unique_ptr<cache::Forward>>()> open;
    const v1::ForwardPlan* plan = nullptr;  // set: a planned forward (docs/data-plane.md)
    // The plan checked against the regions and the model, once per begin (StartTimed): both
    // the continuation and the general path take it from here.
    std::optional<absl::StatusOr<ResolvedPlan>> resolved;
    std::vector<cache::DecodeRow> decode_rows;  // a decode forward's rows (to continue one)
  };
  // A planned decode begin while a planned decode forward over the same rows is open: that
  // forward is committed without waiting for its device work and the new one is queued
  // behind it (PlannedForward::Continue). *chained false: nothing was done.
  absl::Status TryContinue(Opening& opening, v1::DecodeBegun* begun, bool* chained);
  // The bookkeeping of a committed forward: its rows' states into `committed`, the request
  // log, the forward metrics.
  absl::Status Committed(v1::DecodeCommitted* committed);
  // Claims the request id (or finds its replay), enters the drain gate and opens the forward.
  absl::Status Start(Opening opening, v1::DecodeBegun* begun);  // timed: op "begin"
  absl::Status StartTimed(Opening opening, v1::DecodeBegun* begun);
  // The session's state for the forward `opening` opened (or replays), and begun's fields.
  void Opened(Opening& opening, v1::DecodeBegun* begun);
  // Claims opening.request_id in the request log, or sets replay_ for an applied one (a
  // planned begin of an applied id: ALREADY_EXISTS, its regions cannot be replayed into).
  absl::Status Claim(const Opening& opening);
  absl::Status Open(Opening& opening);
  absl::Status CheckOpenLayer(const v1::LayerInput& input) const;
  // A layer message whose tensors name registered regions; the output lands in input.out.
  absl::Status RunRegionLayer(const v1::LayerInput& input, v1::LayerOutput* output);
  absl::StatusOr<v1::SlotState> RowState(cache::SlotId slot) const;

  const ServiceContext* ctx_;
  bool open_ = false;
  RequestLog::Scope method_{""};  // the request log's id space (ServiceContext::RequestScope)
  const Kind* kind_ = nullptr;  // the last forward opened
  // A decode forward: its latency and batch go to the forward metrics.
  bool decode() const { return kind_ == &kDecode; }
  std::string request_id_;
  int64_t tokens_ = 0;
  std::vector<cache::SlotId> slots_;
  std::vector<bool> layer_done_;
  std::unique_ptr<cache::Forward> forward_;
  std::unique_ptr<QueueWorker> worker_;      // queues planned forwards' layers (lazily made)
  std::unique_ptr<PlannedForward> planned_;  // instead of forward_ for a planned forward
  std::atomic<uint64_t> planned_id_{0};      // planned_'s id, 0: none (CancelWaits)
  void SetPlanned(std::unique_ptr<PlannedForward> p) {
    planned_ = std::move(p);
    planned_id_.store(planned_ ? planned_->id() : 0);
  }
  ForwardGate::Ticket ticket_;
  std::optional<v1::DecodeResponse> replay_;  // set when replaying an applied request
  v1::DecodeResponse record_;                 // what the request log keeps on commit ...
  bool retain_ = false;                       // ... unless its outputs would not fit the log anyway
  absl::Time start_;
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_FORWARD_SESSION_H_
