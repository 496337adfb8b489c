#include "service/operations.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "replayssm/cache/tp.h"
#include "service/forward_session.h"
#include "service/planned_forward.h"
#include "service/request_checks.h"
#include "service/status_map.h"
#include "service/tensors.h"

namespace replayssm::service {

namespace {

constexpr char kVersion[] = "0.1.0";

v1::Gate ToWireGate(int32_t gate) { return gate == RSSM_GATE_KDA ? v1::GATE_KDA : v1::GATE_GDN; }

std::vector<int32_t> Tokens(const google::protobuf::RepeatedField<int32_t>& tokens) {
  return std::vector<int32_t>(tokens.begin(), tokens.end());
}

// The tokens a prefix match may cover: all but the last. The engine must run a prompt's last
// token through every layer for the logits of the first token it generates; a state that
// already folded it left nothing to prefill (a prefill of no tokens is refused, and decoding
// that token again would fold it twice) — an outside review. vLLM's and sglang's prefix
// caches leave the last token to compute the same way.
std::vector<int32_t> MatchableTokens(const google::protobuf::RepeatedField<int32_t>& tokens) {
  return std::vector<int32_t>(tokens.begin(), tokens.empty() ? tokens.end() : tokens.end() - 1);
}

// Times a cache call that runs kernels.
template <typename F>
absl::Status Timed(Metrics* metrics, absl::string_view op, F&& f) {
  const absl::Time t0 = absl::Now();
  absl::Status s = f();
  metrics->ObserveKernel(op, absl::ToDoubleSeconds(absl::Now() - t0));
  return s;
}

}  // namespace

absl::Status Operations::Once(absl::string_view method, const std::string& request_id,
                              const google::protobuf::Message& key, google::protobuf::Message* resp,
                              absl::FunctionRef<absl::Status()> apply) {
  if (absl::Status s = ctx_->requests->CheckId(request_id); !s.ok()) return s;
  const RequestLog::Scope scope = ctx_->RequestScope(method);
  RequestLog::Claim claim =
      ctx_->requests->Begin(scope, request_id, Fingerprint(key.SerializeAsString()));
  switch (claim.outcome) {
    case RequestLog::Outcome::kNew:
      break;
    case RequestLog::Outcome::kReplay:
      ctx_->metrics->CountDedupReplay();
      resp->ParseFromString(claim.reply);
      return absl::OkStatus();
    case RequestLog::Outcome::kInFlight:
      return absl::AbortedError("request_id: the same request is still in flight");
    case RequestLog::Outcome::kMismatch:
      return FieldError("request_id", "a new id or a retry of the same request",
                        "an id already used for a different request");
    case RequestLog::Outcome::kNotRetained:
      return absl::AlreadyExistsError("request_id: applied; its reply was too large to keep");
  }
  absl::Status s = apply();
  if (s.ok()) {
    ctx_->requests->Complete(scope, request_id, resp->SerializeAsString());
  } else {
    ctx_->requests->Release(scope, request_id);
  }
  return s;
}

absl::Status Operations::SlotStateOf(uint64_t handle, v1::SlotState* state) const {
  absl::StatusOr<cache::SlotInfo> info = ctx_->cache->Info(ctx_->slots.FromWire(handle));
  if (!info.ok()) return info.status();
  state->set_slot(handle);
  state->set_seq_len(info->seq_len);
  state->set_write_pos(info->write_pos);
  state->set_pending_drafts(info->pending_drafts);
  return absl::OkStatus();
}

absl::Status Operations::GetInfo(v1::GetInfoResponse* resp) const {
  const cache::ModelSpec& m = ctx_->cache->model();
  v1::ModelInfo* info = resp->mutable_model();
  info->set_name(m.name);
  info->set_num_layers(m.num_layers);
  info->set_gate(ToWireGate(m.shape.gate));
  info->set_num_qk_heads(m.shape.num_qk_heads);
  info->set_num_v_heads(m.shape.num_v_heads);
  info->set_head_k(m.shape.head_k);
  info->set_head_v(m.shape.head_v);
  info->set_ring_len(m.shape.ring_len);
  info->set_state_dtype(ToWireDtype(m.shape.state_dtype));
  info->set_act_dtype(ToWireDtype(m.shape.act_dtype));
  info->set_params_from_seed(m.params_from_seed);
  for (const cache::LayerParams& p : m.layers) {
    v1::LayerParams* w = info->add_layer_params();
    w->mutable_a_log()->Assign(p.a_log.begin(), p.a_log.end());
    w->mutable_dt_bias()->Assign(p.dt_bias.begin(), p.dt_bias.end());
    w->set_scale(p.scale);
    w->set_use_qk_l2norm(p.use_qk_l2norm);
    w->mutable_conv_weight()->Assign(p.conv_weight.begin(), p.conv_weight.end());
    w->mutable_conv_bias()->Assign(p.conv_bias.begin(), p.conv_bias.end());
  }
  info->set_conv_width(m.conv_width);
  info->set_ring_dtype(ToWireDtype(m.RingDtype()));
  info->set_round_beta(m.round_beta);
  info->set_tp_size(m.tp_size);
  for (int32_t r = 0; r < m.tp_size; ++r) {
    const cache::TpShard s = cache::ShardOf(m, m.tp_size, r);
    v1::TpShard* w = info->add_shards();
    w->set_rank(r);
    w->set_qk_head_begin(s.qk_head_begin);
    w->set_qk_heads(s.qk_heads);
    w->set_v_head_begin(s.v_head_begin);
    w->set_v_heads(s.v_heads);
  }
  const cache::CacheOptions& o = ctx_->cache->options();
  resp->set_backend(ctx_->backend_name);
  resp->set_mps(ctx_->mps);
  resp->set_capacity_slots(ctx_->cache->capacity());
  resp->set_slot_bytes(m.SlotBytes());
  resp->set_memory_budget_bytes(o.memory_budget_bytes);
  resp->set_track_interval(o.track_interval);
  resp->set_max_batch(ctx_->limits.max_batch);
  resp->set_max_prefill_tokens(ctx_->limits.max_prefill_tokens);
  resp->set_max_message_bytes(ctx_->limits.max_message_bytes);
  resp->set_dedup_window(ctx_->requests->max_entries());
  resp->set_max_request_id_bytes(static_cast<int32_t>(ctx_->requests->max_id_bytes()));
  resp->set_max_import_tokens(ctx_->limits.max_import_tokens);
  resp->set_slot_ttl_seconds(absl::ToDoubleSeconds(ctx_->slot_ttl));
  resp->set_version(kVersion);
  return absl::OkStatus();
}

absl::Status Operations::GetStats(v1::GetStatsResponse* resp) const {
  const cache::CacheStats s = ctx_->cache->stats();
  if (ctx_->tenant_view()) {  // other tenants' work is not the caller's to see (/metrics is)
    resp->set_tenant_view(true);
    resp->set_slots_total(s.slots_total);
    resp->set_slots_live(ctx_->slots.handles()->Count(ctx_->tenant()));
    resp->set_tenant_max_slots(ctx_->limits.tenant_max_slots);
    resp->set_draining(ctx_->gate->draining());
    return absl::OkStatus();
  }
  resp->set_slots_total(s.slots_total);
  resp->set_slots_live(s.slots_live);
  resp->set_slots_snapshot(s.slots_snapshot);
  resp->set_slots_free(s.slots_free);
  resp->set_folds_ring_full(s.folds_ring_full);
  resp->set_folds_track(s.folds_track);
  resp->set_folds_materialize(s.folds_materialize);
  resp->set_snapshot_hits(s.snapshot_hits);
  resp->set_snapshot_misses(s.snapshot_misses);
  resp->set_snapshot_evictions(s.snapshot_evictions);
  resp->set_snapshots_taken(s.snapshots_taken);
  resp->set_donations(s.donations);
  resp->set_invariant_refusals(s.invariant_refusals);
  resp->set_nonfinite_refusals(s.nonfinite_refusals);
  resp->set_forwards_committed(s.forwards_committed);
  resp->set_forwards_abandoned(s.forwards_abandoned);
  resp->set_forwards_graphed(s.forwards_graphed);
  resp->set_forward_recordings(s.forward_recordings);
  resp->set_forward_recording_failures(s.forward_recording_failures);
  resp->set_host_hits(s.host_hits);
  resp->set_host_misses(s.host_misses);
  resp->set_snapshot_spills(s.snapshot_spills);
  resp->set_host_promotions(s.host_promotions);
  resp->set_host_evictions(s.host_evictions);
  resp->set_host_snapshots(s.host_snapshots);
  resp->set_host_bytes(s.host_bytes);
  resp->set_host_capacity_bytes(s.host_capacity_bytes);
  resp->set_backend_snapshot_bytes(s.backend_snapshot_bytes);
  resp->set_spills_ahead(s.spills_ahead);
  resp->set_host_backed_snapshots(s.host_backed_snapshots);
  resp->set_open_forwards(ctx_->gate->open());
  resp->set_draining(ctx_->gate->draining());
  return absl::OkStatus();
}

absl::Status Operations::Allocate(const v1::AllocateRequest& req, v1::AllocateResponse* resp) {
  if (absl::Status d = ctx_->gate->Refuse("no new work"); !d.ok()) return d;
  if (absl::Status s = CheckAllocateRequest(req); !s.ok()) return s;
  return Once("Allocate", req.request_id(), req, resp, [&]() -> absl::Status {
    // Before the cache makes room (evicting snapshots) for a tenant at its bound.
    if (absl::Status q = ctx_->CheckSlotQuota(1); !q.ok()) return q;
    if (!req.from_prefix()) {
      absl::StatusOr<cache::SlotId> slot = ctx_->cache->Allocate();
      if (!slot.ok()) return slot.status();
      if (ctx_->prefix_namespace() != cache::kDefaultNamespace) {
        absl::Status s = ctx_->cache->SetPrefixNamespace(*slot, ctx_->prefix_namespace());
        if (!s.ok()) return s;  // nobody had its id: it cannot be gone
      }
      return IssueWithinQuota(*slot, resp);
    }
    absl::StatusOr<cache::StateCache::PrefixAllocation> a = ctx_->cache->AllocateFromPrefixIn(
        ctx_->prefix_namespace(), MatchableTokens(req.prefix_tokens()));
    if (!a.ok()) return a.status();
    resp->set_matched(a->matched);
    return IssueWithinQuota(a->slot, resp);
  });
}

absl::Status Operations::IssueWithinQuota(cache::SlotId slot, v1::AllocateResponse* resp) {
  resp->set_slot(ctx_->slots.ToWire(slot));
  absl::Status q = ctx_->CheckSlotQuota(0);  // concurrent allocations raced past the bound
  if (q.ok()) return q;
  ctx_->cache->Free(slot).IgnoreError();  // nobody else has its handle yet
  ctx_->slots.Forget(slot);
  resp->Clear();
  return q;
}

absl::Status Operations::Free(const v1::FreeRequest& req, v1::FreeResponse* resp) {
  return Once("Free", req.request_id(), req, resp, [&] {
    const cache::SlotId slot = ctx_->slots.FromWire(req.slot());
    absl::Status s = ctx_->cache->Free(slot);
    if (s.ok()) ctx_->slots.Forget(slot);
    return s;
  });
}

absl::Status Operations::GetSlot(const v1::GetSlotRequest& req, v1::GetSlotResponse* resp) const {
  return SlotStateOf(req.slot(), resp->mutable_state());
}

absl::Status Operations::ListSlots(v1::ListSlotsResponse* resp) const {
  std::vector<SlotHandles::Issued> issued = ctx_->slots.handles()->List();
  std::sort(issued.begin(), issued.end(),
            [](const auto& a, const auto& b) { return a.handle < b.handle; });
  const absl::Time now = absl::Now();
  for (const SlotHandles::Issued& e : issued) {
    // The caller's tenant's slots only.
    if (e.tenant != ctx_->tenant()) continue;
    absl::StatusOr<cache::SlotInfo> info = ctx_->cache->Info(e.slot);  // not a use
    if (!info.ok()) continue;  // freed since (its handle is replaced or forgotten soon)
    v1::SlotListing* l = resp->add_slots();
    l->mutable_state()->set_slot(e.handle);
    l->mutable_state()->set_seq_len(info->seq_len);
    l->mutable_state()->set_write_pos(info->write_pos);
    l->mutable_state()->set_pending_drafts(info->pending_drafts);
    l->set_idle_seconds(absl::ToDoubleSeconds(now - e.last_use));
  }
  return absl::OkStatus();
}

absl::Status Operations::Import(const v1::ImportRequest& req, v1::ImportResponse* resp) {
  if (absl::Status d = ctx_->gate->Refuse("no new work"); !d.ok()) return d;
  const cache::ModelSpec& m = ctx_->cache->model();
  if (absl::Status s = CheckImportRequest(req, m, ctx_->limits); !s.ok()) return s;
  std::vector<const void*> checkpoints;
  std::map<std::string, cache::RegionLease> leases;  // held until the call ends
  const bool regions = req.checkpoints(0).has_region();
  const bool conv = m.conv_width > 0;
  // Inline with a convolution: each layer's checkpoint and window joined, as the slot holds
  // them.
  std::vector<std::string> joined;  // (CheckImportRequest checked the windows)
  cache::IoMemory memory = cache::IoMemory::kHost;
  for (int l = 0; l < req.checkpoints_size(); ++l) {
    const v1::Tensor& t = req.checkpoints(l);
    const std::string field = absl::StrCat("checkpoints[", l, "]");
    if (!regions && conv) {
      joined.push_back(t.data() + req.conv_windows(l).data());
      continue;
    }
    if (!regions) {
      checkpoints.push_back(t.data().data());
      continue;
    }
    absl::StatusOr<void*> p = CheckpointRange(t.region(), field + ".region", l, &memory, &leases);
    if (!p.ok()) return p.status();
    checkpoints.push_back(*p);
  }
  for (const std::string& j : joined) checkpoints.push_back(j.data());
  v1::ImportRequest key;
  key.set_slot(req.slot());
  *key.mutable_tokens() = req.tokens();
  return Once("Import", req.request_id(), key, resp, [&]() -> absl::Status {
    absl::Status s = ctx_->cache->ImportFrom(ctx_->slots.FromWire(req.slot()), Tokens(req.tokens()),
                                             checkpoints, memory);
    if (!s.ok()) return s;
    return SlotStateOf(req.slot(), resp->mutable_state());
  });
}

absl::StatusOr<void*> Operations::CheckpointRange(
    const v1::RegionRef& ref, const std::string& field, int layer, cache::IoMemory* memory,
    std::map<std::string, cache::RegionLease>* leases) const {
  const cache::ModelSpec& m = ctx_->cache->model();
  const uint64_t bytes = static_cast<uint64_t>(m.LayerStateBytes());  // window included
  if (ref.region().empty()) {
    return FieldError(field, "a registered region's name", "\"\"");
  }
  absl::StatusOr<cache::RegionLease> lease =
      ctx_->regions->Acquire(ref.region(), ref.offset(), bytes, 16, field);
  if (!lease.ok()) return lease.status();
  if (layer > 0 && lease->memory() != *memory) {
    return FieldError(field, "a region of the same kind of memory as layer 0's", "another kind");
  }
  *memory = lease->memory();
  void* p = lease->data();
  leases->emplace(absl::StrCat(ref.region(), "@", layer), *std::move(lease));
  return p;
}

absl::Status Operations::Export(const v1::ExportRequest& req, v1::ExportResponse* resp) {
  if (absl::Status d = ctx_->gate->RefuseIfFailed(kNoDeviceWork); !d.ok()) return d;
  const cache::ModelSpec& m = ctx_->cache->model();
  if (req.checkpoints_out_size() > 0) return ExportToRegions(req, resp);
  absl::StatusOr<cache::ExportedState> state =
      ctx_->cache->Export(ctx_->slots.FromWire(req.slot()));
  if (!state.ok()) return state.status();
  resp->set_seq_len(state->seq_len);
  resp->mutable_tokens()->Assign(state->tokens.begin(), state->tokens.end());
  int64_t sent = 0;
  const size_t window = static_cast<size_t>(m.ConvWindowBytes());
  for (const std::vector<uint8_t>& c : state->checkpoints) {
    v1::Tensor* t = resp->add_checkpoints();
    t->set_dtype(ToWireDtype(m.shape.state_dtype));
    for (int64_t d : CheckpointShape(m)) t->add_shape(d);
    t->set_data(c.data(), c.size() - window);
    if (window > 0) {
      v1::Tensor* w = resp->add_conv_windows();
      w->set_dtype(ToWireDtype(m.shape.act_dtype));
      for (int64_t d : ConvWindowShape(m)) w->add_shape(d);
      w->set_data(c.data() + c.size() - window, window);
    }
    sent += static_cast<int64_t>(c.size());
  }
  ctx_->metrics->AddBytes(0, sent);
  return absl::OkStatus();
}

namespace {

// Layer `in`'s memory for a unary forward: its inline bytes (outputs into `output`, when
// given), or the registered regions it names (outputs written into in.out, which `output`
// then names); the regions stay leased in `leases` until the call ends.
absl::StatusOr<cache::LayerIo> UnaryLayerIo(const v1::LayerInput& in, const cache::ModelSpec& m,
                                            int64_t n, v1::LayerOutput* output,
                                            const cache::RegionTable& regions,
                                            std::map<std::string, cache::RegionLease>* leases) {
  if (!in.mixed_qkv().has_region()) return LayerView(in, m, n, output);
  absl::StatusOr<cache::LayerIo> io =
      ResolveLayerRegions(in, absl::StrCat("layers[", in.layer(), "]"), regions, m, n, leases);
  if (!io.ok() || output == nullptr) return io;
  output->set_layer(in.layer());
  v1::Tensor* out = output->mutable_out();
  out->set_dtype(ToWireDtype(m.shape.act_dtype));
  for (int64_t d : OutShape(m, n)) out->add_shape(d);
  *out->mutable_region() = in.out();
  return io;
}

}  // namespace

absl::Status Operations::ExportToRegions(const v1::ExportRequest& req, v1::ExportResponse* resp) {
  const cache::ModelSpec& m = ctx_->cache->model();
  if (req.checkpoints_out_size() != m.num_layers) {
    return FieldError("checkpoints_out", absl::StrCat(m.num_layers, " ranges (one per layer)"),
                      absl::StrCat(req.checkpoints_out_size()));
  }
  std::vector<void*> into;
  std::map<std::string, cache::RegionLease> leases;
  cache::IoMemory memory = cache::IoMemory::kHost;
  for (int l = 0; l < m.num_layers; ++l) {
    absl::StatusOr<void*> p = CheckpointRange(
        req.checkpoints_out(l), absl::StrCat("checkpoints_out[", l, "]"), l, &memory, &leases);
    if (!p.ok()) return p.status();
    into.push_back(*p);
  }
  absl::StatusOr<cache::ExportedState> state =
      ctx_->cache->ExportInto(ctx_->slots.FromWire(req.slot()), into, memory);
  if (!state.ok()) return state.status();
  resp->set_seq_len(state->seq_len);
  resp->mutable_tokens()->Assign(state->tokens.begin(), state->tokens.end());
  for (int l = 0; l < m.num_layers; ++l) {
    v1::Tensor* t = resp->add_checkpoints();
    t->set_dtype(ToWireDtype(m.shape.state_dtype));
    for (int64_t d : CheckpointShape(m)) t->add_shape(d);
    *t->mutable_region() = req.checkpoints_out(l);
  }
  return absl::OkStatus();
}

absl::Status Operations::Prefill(const v1::PrefillRequest& req, v1::PrefillResponse* resp) {
  const cache::ModelSpec& m = ctx_->cache->model();
  const int64_t n = req.tokens_size();
  absl::Status s = CheckPrefillRequest(req, m, ctx_->limits);
  if (!s.ok()) return s;
  ForwardGate::Ticket ticket;
  s = ctx_->gate->Enter(&ticket);
  if (!s.ok()) return s;
  v1::PrefillRequest key;
  key.set_slot(req.slot());
  *key.mutable_tokens() = req.tokens();
  key.set_return_outputs(req.return_outputs());
  return Once("Prefill", req.request_id(), key, resp, [&]() -> absl::Status {
    std::vector<cache::LayerIo> io;
    std::map<std::string, cache::RegionLease> leases;
    for (const v1::LayerInput& in : req.layers()) {
      absl::StatusOr<cache::LayerIo> l = UnaryLayerIo(
          in, m, n, req.return_outputs() ? resp->add_layers() : nullptr, *ctx_->regions, &leases);
      if (!l.ok()) return l.status();
      io.push_back(*l);
    }
    absl::Status st = Timed(ctx_->metrics, "prefill", [&] {
      return ctx_->cache->Prefill(ctx_->slots.FromWire(req.slot()), Tokens(req.tokens()), io);
    });
    if (!st.ok()) return st;
    int64_t sent = 0;
    for (const v1::LayerOutput& o : resp->layers()) sent += o.out().data().size();
    ctx_->metrics->AddBytes(PayloadBytes(req.layers()), sent);
    return SlotStateOf(req.slot(), resp->mutable_state());
  });
}

absl::Status Operations::Decode(const v1::DecodeRequest& req, v1::DecodeResponse* resp) {
  absl::Status s = ctx_->requests->CheckId(req.request_id());
  if (s.ok()) s = CheckDecodeRequest(req, ctx_->cache->model(), ctx_->limits);
  // Every region range checked before any layer runs (the session resolves them again).
  for (int l = 0; s.ok() && l < req.layers_size(); ++l) {
    std::map<std::string, cache::RegionLease> leases;
    if (req.layers(l).mixed_qkv().has_region()) {
      s = UnaryLayerIo(req.layers(l), ctx_->cache->model(), req.rows_size(), nullptr,
                       *ctx_->regions, &leases)
              .status();
    }
  }
  if (!s.ok()) return s;
  ForwardSession session(ctx_);
  v1::DecodeBegin begin;
  begin.set_request_id(req.request_id());
  *begin.mutable_rows() = req.rows();
  v1::DecodeBegun begun;
  s = session.Begin(begin, &begun);
  for (int l = 0; s.ok() && l < req.layers_size(); ++l) {
    s = session.RunLayer(req.layers(l), resp->add_layers());
  }
  v1::DecodeCommitted committed;
  if (s.ok()) s = session.Commit(&committed);
  if (!s.ok()) return s;
  resp->mutable_rows()->Swap(committed.mutable_rows());
  return absl::OkStatus();
}

absl::Status Operations::Verify(const v1::VerifyRequest& req, v1::VerifyResponse* resp) {
  const cache::ModelSpec& m = ctx_->cache->model();
  absl::Status s = CheckVerifyRequest(req, m, ctx_->limits);
  if (!s.ok()) return s;
  const int64_t n = int64_t{req.slots_size()} * req.num_draft();
  ForwardGate::Ticket ticket;
  s = ctx_->gate->Enter(&ticket);
  if (!s.ok()) return s;
  v1::VerifyRequest key;
  *key.mutable_slots() = req.slots();
  key.set_num_draft(req.num_draft());
  *key.mutable_draft_tokens() = req.draft_tokens();
  return Once("Verify", req.request_id(), key, resp, [&]() -> absl::Status {
    std::vector<cache::SlotId> slots;
    for (uint64_t h : req.slots()) slots.push_back(ctx_->slots.FromWire(h));
    std::vector<cache::LayerIo> io;
    std::map<std::string, cache::RegionLease> leases;
    for (const v1::LayerInput& in : req.layers()) {
      absl::StatusOr<cache::LayerIo> l =
          UnaryLayerIo(in, m, n, resp->add_layers(), *ctx_->regions, &leases);
      if (!l.ok()) return l.status();
      io.push_back(*l);
    }
    absl::Status st = Timed(ctx_->metrics, "verify", [&] {
      return ctx_->cache->Verify(slots, req.num_draft(), Tokens(req.draft_tokens()), io);
    });
    if (!st.ok()) return st;
    int64_t sent = 0;
    for (const v1::LayerOutput& o : resp->layers()) sent += o.out().data().size();
    ctx_->metrics->AddBytes(PayloadBytes(req.layers()), sent);
    return absl::OkStatus();
  });
}

absl::Status Operations::Accept(const v1::AcceptRequest& req, v1::AcceptResponse* resp) {
  if (absl::Status d = ctx_->gate->RefuseIfFailed(kNoDeviceWork); !d.ok()) return d;
  if (absl::Status s = CheckAcceptRequest(req, ctx_->cache->model()); !s.ok()) return s;
  return Once("Accept", req.request_id(), req, resp, [&]() -> absl::Status {
    absl::Status s = ctx_->cache->Accept(ctx_->slots.FromWire(req.slot()), req.num_accepted());
    if (!s.ok()) return s;
    return SlotStateOf(req.slot(), resp->mutable_state());
  });
}

absl::Status Operations::MatchPrefix(const v1::MatchPrefixRequest& req,
                                     v1::MatchPrefixResponse* resp) const {
  resp->set_matched(
      ctx_->cache->MatchPrefixIn(ctx_->prefix_namespace(), MatchableTokens(req.tokens())));
  return absl::OkStatus();
}

absl::Status Operations::Donate(const v1::DonateRequest& req, v1::DonateResponse* resp) {
  if (absl::Status d = ctx_->gate->RefuseIfFailed(kNoDeviceWork); !d.ok()) return d;
  return Once("Donate", req.request_id(), req, resp, [&] {
    const cache::SlotId slot = ctx_->slots.FromWire(req.slot());
    absl::Status s = ctx_->cache->Donate(slot);
    if (s.ok()) ctx_->slots.Forget(slot);  // the handle is released with the slot
    return s;
  });
}

}  // namespace replayssm::service
