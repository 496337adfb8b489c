#include "service/request_checks.h"

#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "service/finite.h"
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

absl::Status CheckPrefillRows(const google::protobuf::RepeatedPtrField<v1::PrefillRow>& rows,
                              const ServiceLimits& limits) {
  if (rows.empty() || rows.size() > limits.max_batch) {
    return FieldError("rows", absl::StrCat("1..", limits.max_batch, " rows"),
                      absl::StrCat(rows.size()));
  }
  absl::flat_hash_set<uint64_t> seen;
  int64_t total = 0;
  for (int i = 0; i < rows.size(); ++i) {
    if (rows[i].slot() == 0 || !seen.insert(rows[i].slot()).second) {
      return FieldError(absl::StrCat("rows[", i, "].slot"), "a distinct non-zero slot",
                        absl::StrCat(rows[i].slot()));
    }
    total += rows[i].tokens_size();
    if (rows[i].tokens().empty() || total > limits.max_prefill_tokens) {
      return FieldError(
          absl::StrCat("rows[", i, "].tokens"),
          absl::StrCat("1 or more tokens, ", limits.max_prefill_tokens, " in all rows at most"),
          absl::StrCat(rows[i].tokens_size(), " (", total, " in rows 0..", i, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckVerifyRows(const google::protobuf::RepeatedField<uint64_t>& slots,
                             int32_t num_draft, int64_t draft_tokens, const cache::ModelSpec& model,
                             const ServiceLimits& limits) {
  const int64_t b = slots.size();
  if (b < 1 || b > limits.max_batch) {
    return FieldError("slots", absl::StrCat("1..", limits.max_batch, " slots"), absl::StrCat(b));
  }
  absl::flat_hash_set<uint64_t> seen;
  for (int i = 0; i < slots.size(); ++i) {
    if (slots[i] == 0 || !seen.insert(slots[i]).second) {
      return FieldError(absl::StrCat("slots[", i, "]"), "a distinct non-zero slot",
                        absl::StrCat(slots[i]));
    }
  }
  if (num_draft < 1 || num_draft > model.shape.ring_len) {
    return FieldError("num_draft", absl::StrCat("1..", model.shape.ring_len),
                      absl::StrCat(num_draft));
  }
  if (draft_tokens != b * num_draft) {
    return FieldError("draft_tokens", absl::StrCat(b * num_draft, " tokens (slots x num_draft)"),
                      absl::StrCat(draft_tokens));
  }
  return absl::OkStatus();
}

absl::Status CheckAllocateRequest(const v1::AllocateRequest& req) {
  if (!req.from_prefix() && req.prefix_tokens_size() > 0) {
    return FieldError("prefix_tokens", "empty unless from_prefix",
                      absl::StrCat(req.prefix_tokens_size(), " tokens"));
  }
  return absl::OkStatus();
}

absl::Status CheckImportRequest(const v1::ImportRequest& req, const cache::ModelSpec& model,
                                const ServiceLimits& limits) {
  if (absl::Status s = CheckImportTokens(req.tokens_size(), limits); !s.ok()) return s;
  if (req.checkpoints_size() != model.num_layers) {
    return FieldError("checkpoints", absl::StrCat(model.num_layers, " layers"),
                      absl::StrCat(req.checkpoints_size()));
  }
  const bool regions = req.checkpoints(0).has_region();
  for (int l = 0; l < req.checkpoints_size(); ++l) {
    const v1::Tensor& t = req.checkpoints(l);
    const std::string field = absl::StrCat("checkpoints[", l, "]");
    absl::Status s = CheckTensor(t, field, model.shape.state_dtype, CheckpointShape(model));
    if (s.ok() && t.has_region() != regions) {
      s = FieldError(
          field + ".region",
          regions ? "a region, as checkpoints[0]" : "unset, as checkpoints[0] (inline bytes)",
          t.has_region() ? "a region" : "inline bytes");
    }
    if (s.ok()) s = CheckFinite(t, field, model.shape.state_dtype, RowDim::kNone);
    if (!s.ok()) return s;
  }
  // The short convolution's windows: inline beside inline checkpoints (a region range holds
  // the checkpoint followed by its window), none without a convolution.
  const bool conv = model.conv_width > 0;
  if ((!conv || regions) && req.conv_windows_size() > 0) {
    return FieldError("conv_windows",
                      conv ? "none (region checkpoints hold their windows)"
                           : "none (the model has no short convolution)",
                      absl::StrCat(req.conv_windows_size(), " tensors"));
  }
  if (!conv || regions) return absl::OkStatus();
  if (req.conv_windows_size() != model.num_layers) {
    return FieldError("conv_windows",
                      absl::StrCat(model.num_layers, " layers ([", model.conv_width - 1, ", ",
                                   model.QkvWidth(), "] each)"),
                      absl::StrCat(req.conv_windows_size()));
  }
  for (int l = 0; l < req.conv_windows_size(); ++l) {
    const std::string field = absl::StrCat("conv_windows[", l, "]");
    const v1::Tensor& w = req.conv_windows(l);
    absl::Status s = CheckTensor(w, field, model.shape.act_dtype, ConvWindowShape(model));
    if (s.ok()) s = CheckFinite(w, field, model.shape.act_dtype, RowDim::kNone);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status CheckPrefillRequest(const v1::PrefillRequest& req, const cache::ModelSpec& model,
                                 const ServiceLimits& limits) {
  const int64_t n = req.tokens_size();
  if (n < 1 || n > limits.max_prefill_tokens) {
    return FieldError("tokens", absl::StrCat("1..", limits.max_prefill_tokens, " tokens"),
                      absl::StrCat(n));
  }
  return CheckAllLayers(req.layers(), model, n);
}

absl::Status CheckDecodeRequest(const v1::DecodeRequest& req, const cache::ModelSpec& model,
                                const ServiceLimits& limits) {
  absl::Status s = CheckRows(req.rows(), limits);
  if (!s.ok()) return s;
  return CheckAllLayers(req.layers(), model, req.rows_size());
}

absl::Status CheckVerifyRequest(const v1::VerifyRequest& req, const cache::ModelSpec& model,
                                const ServiceLimits& limits) {
  absl::Status s =
      CheckVerifyRows(req.slots(), req.num_draft(), req.draft_tokens_size(), model, limits);
  if (!s.ok()) return s;
  return CheckAllLayers(req.layers(), model, int64_t{req.slots_size()} * req.num_draft());
}

absl::Status CheckAcceptRequest(const v1::AcceptRequest& req, const cache::ModelSpec& model) {
  const int32_t l = model.shape.ring_len;
  if (req.num_accepted() < 0 || req.num_accepted() > l) {
    return FieldError("num_accepted", absl::StrCat("0..", l), absl::StrCat(req.num_accepted()));
  }
  return absl::OkStatus();
}

}  // namespace replayssm::service
