#include "service/decode_session.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "service/status_map.h"
#include "service/tensors.h"

namespace replayssm::service {

absl::Status CheckRows(const google::protobuf::RepeatedPtrField<v1::DecodeRow>& rows,
                       const ServiceLimits& limits) {
  if (rows.empty() || rows.size() > limits.max_batch) {
    return FieldError("rows", absl::StrCat("1..", limits.max_batch, " rows"),
                      absl::StrCat(rows.size()));
  }
  absl::flat_hash_set<uint64_t> seen;
  for (int i = 0; i < rows.size(); ++i) {
    if (rows[i].slot() != 0 && !seen.insert(rows[i].slot()).second) {
      return FieldError(absl::StrCat("rows[", i, "].slot"), "a slot not already in this forward",
                        absl::StrCat("duplicate ", rows[i].slot()));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeSession::Begin(const v1::DecodeBegin& begin, v1::DecodeBegun* begun) {
  if (open_) return absl::FailedPreconditionError("begin: a forward is already open");
  if (begin.request_id().empty()) return FieldError("request_id", "a non-empty id", "\"\"");
  absl::Status s = CheckRows(begin.rows(), ctx_->limits);
  if (s.ok()) s = Claim(begin);
  if (!s.ok()) return s;
  if (!replay_) {
    s = Open(begin.rows());
    if (!s.ok()) {
      ctx_->requests->Release("Decode", begin.request_id());
      return s;
    }
  }
  request_id_ = begin.request_id();
  open_ = true;
  layer_done_.assign(ctx_->cache->model().num_layers, false);
  start_ = absl::Now();
  begun->set_batch(begin.rows_size());
  begun->set_replayed(replay_.has_value());
  return absl::OkStatus();
}

absl::Status DecodeSession::Claim(const v1::DecodeBegin& begin) {
  v1::DecodeBegin key;  // the rows identify the request; the activations do not
  *key.mutable_rows() = begin.rows();
  RequestLog::Claim claim =
      ctx_->requests->Begin("Decode", begin.request_id(), Fingerprint(key.SerializeAsString()));
  switch (claim.outcome) {
    case RequestLog::Outcome::kNew:
      return absl::OkStatus();
    case RequestLog::Outcome::kReplay:
      replay_.emplace();
      replay_->ParseFromString(claim.reply);
      ctx_->metrics->CountDedupReplay();
      return absl::OkStatus();
    case RequestLog::Outcome::kInFlight:
      return absl::AbortedError("request_id: the same forward is still in flight");
    case RequestLog::Outcome::kMismatch:
      return FieldError("request_id", "a new id or a retry of the same rows",
                        "an id already used for different rows");
    case RequestLog::Outcome::kNotRetained:
      break;
  }
  return absl::AlreadyExistsError("request_id: applied; its outputs were too large to keep");
}

absl::Status DecodeSession::Open(const google::protobuf::RepeatedPtrField<v1::DecodeRow>& rows) {
  ForwardGate::Ticket ticket;
  absl::Status s = ctx_->gate->Enter(&ticket);
  if (!s.ok()) return s;
  std::vector<cache::DecodeRow> cache_rows;
  for (const v1::DecodeRow& r : rows) {
    cache_rows.push_back({ctx_->slots.FromWire(r.slot()), r.token_id()});
  }
  absl::StatusOr<std::unique_ptr<cache::Forward>> forward = ctx_->cache->BeginForward(cache_rows);
  if (!forward.ok()) return forward.status();
  forward_ = *std::move(forward);
  ticket_ = std::move(ticket);
  rows_ = std::move(cache_rows);
  const cache::ModelSpec& m = ctx_->cache->model();
  const int64_t output_bytes = m.num_layers * static_cast<int64_t>(rows_.size()) * m.OutWidth() *
                               static_cast<int64_t>(rssm_dtype_size(m.shape.act_dtype));
  retain_ = output_bytes <= ctx_->requests->max_bytes();  // else: do not copy the outputs
  record_.Clear();
  for (int l = 0; retain_ && l < m.num_layers; ++l) record_.add_layers();
  return absl::OkStatus();
}

absl::Status DecodeSession::CheckOpenLayer(const v1::LayerInput& input) const {
  if (!open_) return absl::FailedPreconditionError("layer: no open forward (send begin first)");
  const int64_t batch = static_cast<int64_t>(replay_ ? replay_->rows_size() : rows_.size());
  absl::Status s = CheckLayerInput(input, "layer", ctx_->cache->model(), batch);
  if (!s.ok()) return s;
  if (layer_done_[input.layer()]) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer.layer: layer ", input.layer(), " already ran in this forward"));
  }
  return absl::OkStatus();
}

absl::Status DecodeSession::RunLayer(const v1::LayerInput& input, v1::LayerOutput* output) {
  absl::Status s = CheckOpenLayer(input);
  if (!s.ok()) return s;
  if (replay_) {
    *output = replay_->layers(input.layer());
  } else {
    const cache::ModelSpec& model = ctx_->cache->model();
    const absl::Time t0 = absl::Now();
    s = forward_->RunLayer(input.layer(), LayerView(input, model, rows_.size(), output));
    ctx_->metrics->ObserveKernel("run_layer", absl::ToDoubleSeconds(absl::Now() - t0));
    if (!s.ok()) return s;
    if (retain_) *record_.mutable_layers(input.layer()) = *output;
  }
  layer_done_[input.layer()] = true;
  ctx_->metrics->AddBytes(
      input.mixed_qkv().data().size() + input.a().data().size() + input.b().data().size(),
      output->out().data().size());
  return absl::OkStatus();
}

absl::StatusOr<v1::SlotState> DecodeSession::RowState(const cache::DecodeRow& row) const {
  v1::SlotState state;
  if (row.slot == cache::kPaddingSlot) return state;
  absl::StatusOr<cache::SlotInfo> info = ctx_->cache->Info(row.slot);
  if (!info.ok()) return info.status();
  state.set_slot(ctx_->slots.ToWire(row.slot));
  state.set_seq_len(info->seq_len);
  state.set_write_pos(info->write_pos);
  state.set_pending_drafts(info->pending_drafts);
  return state;
}

absl::Status DecodeSession::Commit(v1::DecodeCommitted* committed) {
  if (!open_) return absl::FailedPreconditionError("commit: no open forward");
  for (size_t l = 0; l < layer_done_.size(); ++l) {
    if (!layer_done_[l]) {
      return absl::FailedPreconditionError(
          absl::StrCat("commit: layer ", l, " has not run in this forward"));
    }
  }
  if (replay_) {
    *committed->mutable_rows() = replay_->rows();
    Abandon();
    return absl::OkStatus();
  }
  const absl::Time t0 = absl::Now();
  absl::Status s = forward_->Commit();
  ctx_->metrics->ObserveKernel("commit", absl::ToDoubleSeconds(absl::Now() - t0));
  if (!s.ok()) return s;  // the forward stays open until abandoned: nothing committed
  forward_.reset();
  for (const cache::DecodeRow& row : rows_) {
    absl::StatusOr<v1::SlotState> state = RowState(row);
    if (!state.ok()) return state.status();
    *committed->add_rows() = *std::move(state);
  }
  if (retain_) {
    *record_.mutable_rows() = committed->rows();
    ctx_->requests->Complete("Decode", request_id_, record_.SerializeAsString());
  } else {
    ctx_->requests->CompleteWithoutReply("Decode", request_id_);
  }
  ctx_->metrics->ObserveForward(absl::ToDoubleSeconds(absl::Now() - start_),
                                static_cast<int32_t>(rows_.size()));
  request_id_.clear();
  Abandon();
  return absl::OkStatus();
}

void DecodeSession::Abandon() {
  forward_.reset();
  if (open_ && !replay_ && !request_id_.empty()) {
    ctx_->requests->Release("Decode", request_id_);
  }
  open_ = false;
  replay_.reset();
  request_id_.clear();
  rows_.clear();
  record_.Clear();
  ticket_.Reset();
}

}  // namespace replayssm::service
