#include "service/forward_session.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "service/status_map.h"
#include "service/tensors.h"

namespace replayssm::service {

namespace {

// What every begin checks first: no forward open but a planned one (the begin closes it), a
// request id.
absl::Status CheckBegin(bool open, bool planned, const std::string& request_id) {
  if (open && !planned) {
    return absl::FailedPreconditionError(
        "begin: a forward is already open (layer messages pending): send commit first");
  }
  if (request_id.empty()) return FieldError("request_id", "a non-empty id", "\"\"");
  return absl::OkStatus();
}

}  // namespace

absl::Status ForwardSession::Begin(const v1::DecodeBegin& begin, v1::DecodeBegun* begun) {
  absl::Status s = CheckBegin(open_, planned_ != nullptr, begin.request_id());
  if (s.ok()) s = CheckRows(begin.rows(), ctx_->limits);
  if (!s.ok()) return Refuse(begin.has_plan() ? &begin.plan() : nullptr, s);
  v1::DecodeBegin key;  // the rows identify the request; the activations do not
  *key.mutable_rows() = begin.rows();
  std::vector<cache::DecodeRow> rows;
  for (const v1::DecodeRow& r : begin.rows()) {
    rows.push_back({ctx_->slots.FromWire(r.slot()), r.token_id()});
  }
  Opening o{&kDecode, begin.request_id(), key.SerializeAsString(), begin.rows_size()};
  for (const cache::DecodeRow& r : rows) o.slots.push_back(r.slot);
  o.decode_rows = rows;
  o.open = [this, rows = std::move(rows)] { return ctx_->cache->BeginForward(rows); };
  if (begin.has_plan()) o.plan = &begin.plan();
  return Start(std::move(o), begun);
}

absl::Status ForwardSession::BeginPrefill(const v1::PrefillBegin& begin, v1::DecodeBegun* begun) {
  absl::Status s = CheckBegin(open_, planned_ != nullptr, begin.request_id());
  if (s.ok()) s = CheckPrefillRows(begin.rows(), ctx_->limits);
  if (!s.ok()) return Refuse(begin.has_plan() ? &begin.plan() : nullptr, s);
  v1::PrefillBegin key = begin;
  key.clear_request_id();
  Opening o{&kPrefill, begin.request_id(), key.SerializeAsString()};
  for (const v1::PrefillRow& r : begin.rows()) {
    o.slots.push_back(ctx_->slots.FromWire(r.slot()));
    o.tokens += r.tokens_size();
  }
  o.open = [this, &begin, slots = o.slots] {
    std::vector<cache::PrefillRow> rows;
    for (int i = 0; i < begin.rows_size(); ++i) {
      const auto& t = begin.rows(i).tokens();
      rows.push_back({slots[i], absl::MakeConstSpan(t.data(), t.size())});
    }
    return ctx_->cache->BeginPrefill(rows);
  };
  if (begin.has_plan()) o.plan = &begin.plan();
  return Start(std::move(o), begun);
}

absl::Status ForwardSession::BeginVerify(const v1::VerifyBegin& begin, v1::DecodeBegun* begun) {
  const cache::ModelSpec& m = ctx_->cache->model();
  absl::Status s = CheckBegin(open_, planned_ != nullptr, begin.request_id());
  if (s.ok()) {
    s = CheckVerifyRows(begin.slots(), begin.num_draft(), begin.draft_tokens_size(), m,
                        ctx_->limits);
  }
  if (!s.ok()) return Refuse(begin.has_plan() ? &begin.plan() : nullptr, s);
  v1::VerifyBegin key = begin;
  key.clear_request_id();
  Opening o{&kVerify, begin.request_id(), key.SerializeAsString(), begin.draft_tokens_size()};
  for (uint64_t h : begin.slots()) o.slots.push_back(ctx_->slots.FromWire(h));
  o.open = [this, &begin, slots = o.slots] {
    const auto& d = begin.draft_tokens();
    return ctx_->cache->BeginVerify(slots, begin.num_draft(),
                                    absl::MakeConstSpan(d.data(), d.size()));
  };
  if (begin.has_plan()) o.plan = &begin.plan();
  return Start(std::move(o), begun);
}

absl::Status ForwardSession::Refuse(const v1::ForwardPlan* plan, absl::Status status) {
  if (planned_ != nullptr) {
    // Refused before this begin closed the planned forward open before it. A begin closes
    // that forward whatever the begin turns out to be: its layers ran on the engine's
    // doorbells, and the engine may have used its outputs, so it is committed here as a
    // valid begin would commit it (it used to be abandoned, or committed, by which check
    // refused). Its commit waits for its last layer, so this refusal's ring comes after it.
    v1::DecodeCommitted closed;  // a refusal carries no reply: the rows are lost
    const absl::Status c = Commit(&closed);
    status = absl::Status(
        status.code(),
        absl::StrCat(status.message(),
                     c.ok() ? " (the planned forward open before this begin was committed)"
                            : absl::StrCat(" (the planned forward open before this begin "
                                           "could not be committed: ",
                                           c.message(), ")")));
  }
  if (plan != nullptr) {
    RingRefused(*plan, *ctx_->regions, ctx_->cache->model().num_layers);
  }
  return status;
}

absl::Status ForwardSession::Start(Opening opening, v1::DecodeBegun* begun) {
  const absl::Time t0 = absl::Now();
  absl::Status s = StartTimed(std::move(opening), begun);
  ctx_->metrics->ObserveKernel("begin", absl::ToDoubleSeconds(absl::Now() - t0));
  return s;
}

absl::Status ForwardSession::TryContinue(Opening& opening, v1::DecodeBegun* begun, bool* chained) {
  *chained = false;
  if (!decode() || opening.plan == nullptr || opening.decode_rows.empty() || replay_) {
    return absl::OkStatus();
  }
  // Everything that can refuse the new begin first: on any refusal the general path commits
  // the open forward, then refuses the same way.
  if (!opening.resolved->ok()) return absl::OkStatus();
  // A continued forward is a new one: not once the server drains or its device failed (the
  // general path commits the open forward, then Open's gate refuses the begin). Else an engine
  // that keeps sending begins would keep a drain waiting its whole --drain-timeout.
  if (!ctx_->gate->Refuse("no new forwards").ok()) return absl::OkStatus();
  absl::Status s = Claim(opening);
  if (!s.ok() || replay_) {
    replay_.reset();
    return absl::OkStatus();
  }
  absl::StatusOr<std::unique_ptr<cache::Forward>> next =
      planned_->Continue(*ctx_->cache, opening.decode_rows);
  if (next.ok() && *next == nullptr) {  // not continuable: the general path
    ctx_->requests->Release(ctx_->RequestScope(opening.kind->method), opening.request_id);
    return absl::OkStatus();
  }
  *chained = true;
  // The open forward is committed (in the cache) either way from here.
  s = Committed(begun->mutable_closed());
  if (!next.ok() || !s.ok()) {
    ctx_->requests->Release(ctx_->RequestScope(opening.kind->method), opening.request_id);
    Abandon();
    const absl::Status e = next.ok() ? s : next.status();
    return Refuse(opening.plan,
                  absl::Status(e.code(), absl::StrCat(e.message(),
                                                      " (the planned forward open before this "
                                                      "begin was committed)")));
  }
  SetPlanned(std::make_unique<PlannedForward>(*std::move(next), **std::move(opening.resolved),
                                              ctx_->forward_timeout, worker_.get(),
                                              PlanWatch::Default(), std::move(planned_)));
  retain_ = false;  // the outputs are in the client's region: the log keeps the rows only
  Opened(opening, begun);
  return absl::OkStatus();
}

absl::Status ForwardSession::StartTimed(Opening opening, v1::DecodeBegun* begun) {
  if (opening.plan != nullptr) {
    opening.resolved = ResolvePlan(*opening.plan, "begin.plan", *ctx_->regions,
                                   ctx_->cache->model(), opening.tokens);
  }
  const bool closing = open_;  // a planned forward (CheckBegin): this begin commits it first
  if (closing) {
    bool chained = false;
    absl::Status s = TryContinue(opening, begun, &chained);
    if (chained) return s;
  }
  if (closing) {
    absl::Status s = Commit(begun->mutable_closed());
    if (!s.ok()) {
      return Refuse(opening.plan,
                    absl::Status(s.code(), absl::StrCat(s.message(),
                                                        " (while this begin closed the planned "
                                                        "forward open before it: not committed)")));
    }
  }
  // An error from here on comes after that commit: say so, the reply with its rows is lost.
  const auto refuse = [&](const absl::Status& s) {
    if (!closing) return Refuse(opening.plan, s);
    return Refuse(opening.plan,
                  absl::Status(s.code(), absl::StrCat(s.message(),
                                                      " (the planned forward open before this "
                                                      "begin was committed)")));
  };
  absl::Status s = Claim(opening);
  if (!s.ok()) return refuse(s);
  if (!replay_) {
    s = Open(opening);
    if (!s.ok()) {
      ctx_->requests->Release(ctx_->RequestScope(opening.kind->method), opening.request_id);
      return refuse(s);
    }
  }
  Opened(opening, begun);
  return absl::OkStatus();
}

void ForwardSession::Opened(Opening& opening, v1::DecodeBegun* begun) {
  method_ = ctx_->RequestScope(opening.kind->method);
  kind_ = opening.kind;
  request_id_ = std::move(opening.request_id);
  tokens_ = opening.tokens;
  slots_ = std::move(opening.slots);
  open_ = true;
  layer_done_.assign(ctx_->cache->model().num_layers, false);
  start_ = absl::Now();
  begun->set_batch(static_cast<int32_t>(slots_.size()));
  begun->set_replayed(replay_.has_value());
  begun->set_tokens(tokens_);
}

absl::Status ForwardSession::Claim(const Opening& opening) {
  RequestLog::Claim claim = ctx_->requests->Begin(ctx_->RequestScope(opening.kind->method),
                                                  opening.request_id, Fingerprint(opening.key));
  switch (claim.outcome) {
    case RequestLog::Outcome::kNew:
      return absl::OkStatus();
    case RequestLog::Outcome::kReplay:
      if (opening.plan != nullptr) {
        // Applied before (inline or planned): a planned begin's layers would run from the
        // regions and nothing would write them; the engine's retry must know it was applied.
        return absl::AlreadyExistsError(
            "request_id: applied; a planned begin is not replayed (its outputs went to the "
            "client's region): use a new id");
      }
      replay_.emplace();
      replay_->ParseFromString(claim.reply);
      ctx_->metrics->CountDedupReplay();
      return absl::OkStatus();
    case RequestLog::Outcome::kInFlight:
      return absl::AbortedError("request_id: the same forward is still in flight");
    case RequestLog::Outcome::kMismatch:
      return FieldError("request_id", "a new id or a retry of the same begin",
                        "an id already used for a different begin");
    case RequestLog::Outcome::kNotRetained:
      break;
  }
  // Applied and its outputs not kept: a planned forward's went to the client's region (never
  // kept), an inline one's were past the request log's bound.
  return absl::AlreadyExistsError(
      "request_id: applied; its outputs were not kept (a planned forward's went to the "
      "client's region, an inline forward's were too large to keep)");
}

absl::Status ForwardSession::Open(Opening& opening) {
  const cache::ModelSpec& m = ctx_->cache->model();
  std::optional<ResolvedPlan> plan;
  if (opening.resolved.has_value()) {  // checked whole before anything opens
    if (!opening.resolved->ok()) return opening.resolved->status();
    plan = **std::move(opening.resolved);
  }
  ForwardGate::Ticket ticket;
  absl::Status s = ctx_->gate->Enter(&ticket, plan.has_value());
  if (!s.ok()) return s;
  absl::StatusOr<std::unique_ptr<cache::Forward>> forward = opening.open();
  if (!forward.ok()) return forward.status();
  ticket_ = std::move(ticket);
  if (plan) {
    // The outputs are in the client's region: the request log keeps the rows only.
    if (!worker_) worker_ = std::make_unique<QueueWorker>();  // the stream's, from now on
    SetPlanned(std::make_unique<PlannedForward>(*std::move(forward), *std::move(plan),
                                                ctx_->forward_timeout, worker_.get()));
    retain_ = false;
    return absl::OkStatus();
  }
  forward_ = *std::move(forward);
  const int64_t output_bytes = m.num_layers * opening.tokens * m.OutWidth() *
                               static_cast<int64_t>(rssm_dtype_size(m.shape.act_dtype));
  retain_ = output_bytes <= ctx_->requests->max_bytes();  // else: do not copy the outputs
  record_.Clear();
  for (int l = 0; retain_ && l < m.num_layers; ++l) record_.add_layers();
  return absl::OkStatus();
}

absl::Status ForwardSession::CheckOpenLayer(const v1::LayerInput& input) const {
  if (!open_) return absl::FailedPreconditionError("layer: no open forward (send begin first)");
  if (planned_) {
    return absl::FailedPreconditionError(
        "layer: this forward is planned (begin.plan): its layers run from the regions as their "
        "doorbells ring; send commit");
  }
  absl::Status s = CheckLayerInput(input, "layer", ctx_->cache->model(), tokens_);
  if (!s.ok()) return s;
  if (layer_done_[input.layer()]) {
    return absl::FailedPreconditionError(
        absl::StrCat("layer.layer: layer ", input.layer(), " already ran in this forward"));
  }
  return absl::OkStatus();
}

absl::Status ForwardSession::RunLayer(const v1::LayerInput& input, v1::LayerOutput* output) {
  absl::Status s = CheckOpenLayer(input);
  if (!s.ok()) return s;
  if (replay_) {
    *output = replay_->layers(input.layer());
  } else {
    const cache::ModelSpec& model = ctx_->cache->model();
    const absl::Time t0 = absl::Now();
    if (input.mixed_qkv().has_region()) {
      s = RunRegionLayer(input, output);
    } else {
      s = forward_->RunLayer(input.layer(), LayerView(input, model, tokens_, output));
    }
    ctx_->metrics->ObserveKernel(kind_->layer_op, absl::ToDoubleSeconds(absl::Now() - t0));
    if (!s.ok()) return s;
    if (retain_) *record_.mutable_layers(input.layer()) = *output;
  }
  layer_done_[input.layer()] = true;
  ctx_->metrics->AddBytes(
      input.mixed_qkv().data().size() + input.a().data().size() + input.b().data().size(),
      output->out().data().size());
  return absl::OkStatus();
}

absl::Status ForwardSession::RunRegionLayer(const v1::LayerInput& input,
                                            v1::LayerOutput* output) {
  const cache::ModelSpec& m = ctx_->cache->model();
  std::map<std::string, cache::RegionLease> leases;  // held until the layer's work is done
  absl::StatusOr<cache::LayerIo> io =
      ResolveLayerRegions(input, "layer", *ctx_->regions, m, tokens_, &leases);
  if (!io.ok()) return io.status();
  absl::Status s = forward_->RunLayer(input.layer(), *io);
  // The reply says the output is in place: wait for it (host-memory layers already have).
  if (s.ok() && io->memory == cache::IoMemory::kBackend) s = forward_->Synchronize();
  if (!s.ok()) return s;
  output->set_layer(input.layer());
  v1::Tensor* out = output->mutable_out();
  out->set_dtype(ToWireDtype(m.shape.act_dtype));
  for (int64_t d : OutShape(m, tokens_)) out->add_shape(d);
  *out->mutable_region() = input.out();
  // The reply names the region (a few bytes): a retry gets it back and the region is not
  // written again, as for the unary calls with regions (it used to keep the rows only, and a
  // retried Decode was told its outputs were too large to keep).
  return absl::OkStatus();
}

absl::StatusOr<v1::SlotState> ForwardSession::RowState(cache::SlotId slot) const {
  v1::SlotState state;
  if (slot == cache::kPaddingSlot) return state;
  absl::StatusOr<cache::SlotInfo> info = ctx_->cache->Info(slot);
  if (!info.ok()) return info.status();
  state.set_slot(ctx_->slots.ToWire(slot));
  state.set_seq_len(info->seq_len);
  state.set_write_pos(info->write_pos);
  state.set_pending_drafts(info->pending_drafts);
  return state;
}

absl::Status ForwardSession::Commit(v1::DecodeCommitted* committed) {
  if (!open_) return absl::FailedPreconditionError("commit: no open forward");
  for (size_t l = 0; !planned_ && l < layer_done_.size(); ++l) {
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
  absl::Status s = planned_ ? planned_->Commit() : forward_->Commit();
  ctx_->metrics->ObserveKernel(kind_->commit_op, absl::ToDoubleSeconds(absl::Now() - t0));
  if (!s.ok() && planned_) {
    Abandon();  // a planned forward that failed has been abandoned: so is the session's
    return s;
  }
  // The forward stays open until abandoned: nothing committed, or (a track fold that failed
  // after the cursors moved) the rows are broken, and a retry is refused, never applied twice.
  if (!s.ok()) return s;
  forward_.reset();
  SetPlanned(nullptr);
  s = Committed(committed);
  Abandon();
  return s;
}

absl::Status ForwardSession::Committed(v1::DecodeCommitted* committed) {
  // Applied whatever comes next: the request id is completed either way, so that a retry is
  // never applied again. A row's state can be gone by now (the rows were released at the
  // commit, and a Free may have come in between): then no reply is kept, and the error says
  // the forward committed.
  absl::Status read = absl::OkStatus();
  for (cache::SlotId slot : slots_) {
    absl::StatusOr<v1::SlotState> state = RowState(slot);
    if (!state.ok()) {
      read = absl::Status(state.status().code(),
                          absl::StrCat("the forward committed, but a row's state could not be "
                                       "read after it: ",
                                       state.status().message()));
      break;
    }
    *committed->add_rows() = *std::move(state);
  }
  if (!read.ok()) {
    ctx_->requests->CompleteWithoutReply(method_, request_id_);
    request_id_.clear();
    return read;
  }
  if (retain_) {
    *record_.mutable_rows() = committed->rows();
    ctx_->requests->Complete(method_, request_id_, record_.SerializeAsString());
  } else {
    ctx_->requests->CompleteWithoutReply(method_, request_id_);
  }
  if (decode()) {
    ctx_->metrics->ObserveForward(absl::ToDoubleSeconds(absl::Now() - start_),
                                  static_cast<int32_t>(slots_.size()));
  }
  request_id_.clear();  // applied: Abandon must not release it
  return absl::OkStatus();
}

void ForwardSession::CancelWaits() const {
  if (const uint64_t id = planned_id_.load(); id != 0) PlanWatch::Default().ExpireNow(id);
}

void ForwardSession::Abandon() {
  SetPlanned(nullptr);  // rings its doorbells if they are still awaited, then abandons
  forward_.reset();
  if (open_ && !replay_ && !request_id_.empty()) {
    ctx_->requests->Release(method_, request_id_);
  }
  open_ = false;
  replay_.reset();
  request_id_.clear();
  slots_.clear();
  record_.Clear();
  ticket_.Reset();
}

}  // namespace replayssm::service
