#include "replayssm/cache/tp.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace replayssm::cache {

absl::Status CheckTpSize(const ModelSpec& full, int32_t tp_size, const char* field) {
  const int32_t h = full.shape.num_qk_heads, hv = full.shape.num_v_heads;
  if (tp_size < 1 || tp_size > kMaxTpSize) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected 1 to ", kMaxTpSize, " ranks, got ", tp_size));
  }
  if (h % tp_size != 0 || hv % tp_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ": expected a divisor of both num_qk_heads (", h, ") and num_v_heads (", hv,
        ") of model ", full.name, " (each rank holds whole heads), got ", tp_size));
  }
  return absl::OkStatus();
}

bool RanksOnDistinctDevices(const std::vector<int32_t>& devices) {
  std::vector<int32_t> d = devices;
  std::sort(d.begin(), d.end());
  return d.size() > 1 && std::adjacent_find(d.begin(), d.end()) == d.end();
}

TpShard ShardOf(const ModelSpec& full, int32_t tp_size, int32_t rank) {
  TpShard s;
  s.rank = rank;
  s.size = tp_size;
  s.qk_heads = full.shape.num_qk_heads / tp_size;
  s.v_heads = full.shape.num_v_heads / tp_size;
  s.qk_head_begin = rank * s.qk_heads;
  s.v_head_begin = rank * s.v_heads;
  return s;
}

std::vector<SliceRun> QkvColumns(const ModelSpec& full, const TpShard& s) {
  const int64_t k = full.shape.head_k, v = full.shape.head_v;
  const int64_t h = full.shape.num_qk_heads;
  const int64_t qk = s.qk_heads * k;
  return {{s.qk_head_begin * k, 0, qk},
          {h * k + s.qk_head_begin * k, qk, qk},
          {2 * h * k + s.v_head_begin * v, 2 * qk, s.v_heads * v}};
}

SliceRun AColumns(const ModelSpec& full, const TpShard& s) {
  const int64_t per = full.shape.gate == RSSM_GATE_KDA ? full.shape.head_k : 1;
  return {s.v_head_begin * per, 0, s.v_heads * per};
}
SliceRun BColumns(const ModelSpec&, const TpShard& s) { return {s.v_head_begin, 0, s.v_heads}; }
SliceRun OutColumns(const ModelSpec& full, const TpShard& s) {
  return {int64_t{s.v_head_begin} * full.shape.head_v, 0, int64_t{s.v_heads} * full.shape.head_v};
}

ModelSpec ShardModel(const ModelSpec& full, const TpShard& s) {
  ModelSpec m = full;
  m.tp_size = 1;
  m.shape.num_qk_heads = s.qk_heads;
  m.shape.num_v_heads = s.v_heads;
  const SliceRun heads{s.v_head_begin, 0, s.v_heads};
  const SliceRun a = AColumns(full, s);
  const std::vector<SliceRun> qkv = QkvColumns(full, s);
  const int64_t width = full.QkvWidth(), shard_width = m.QkvWidth();
  const int64_t w = full.conv_width;
  for (int32_t l = 0; l < full.num_layers; ++l) {
    const LayerParams& p = full.layers[l];
    LayerParams& q = m.layers[l];
    q.a_log.assign(p.a_log.begin() + heads.full, p.a_log.begin() + heads.full + heads.count);
    q.dt_bias.assign(p.dt_bias.begin() + a.full, p.dt_bias.begin() + a.full + a.count);
    if (!p.conv_weight.empty()) {  // [C, W]: whole rows per channel
      q.conv_weight.assign(shard_width * w, 0.f);
      std::vector<SliceRun> rows;
      for (const SliceRun& r : qkv) rows.push_back({r.full * w, r.shard * w, r.count * w});
      CopyToShard(p.conv_weight.data(), width * w, q.conv_weight.data(), shard_width * w, 1, rows,
                  sizeof(float));
    }
    if (!p.conv_bias.empty()) {
      q.conv_bias.assign(shard_width, 0.f);
      CopyToShard(p.conv_bias.data(), width, q.conv_bias.data(), shard_width, 1, qkv,
                  sizeof(float));
    }
  }
  return m;
}

std::vector<SliceRun> LayerStateRuns(const ModelSpec& full, const TpShard& s) {
  const int64_t es = rssm_dtype_size(full.shape.state_dtype);
  const int64_t head = int64_t{full.shape.head_v} * full.shape.head_k * es;
  std::vector<SliceRun> runs = {{s.v_head_begin * head, 0, s.v_heads * head}};
  if (full.ConvWindowBytes() == 0) return runs;
  const int64_t ckpt_full = full.shape.num_v_heads * head, ckpt_shard = s.v_heads * head;
  const int64_t ea = rssm_dtype_size(full.shape.act_dtype);
  const int64_t width = full.QkvWidth();
  const int64_t shard_width =
      2LL * s.qk_heads * full.shape.head_k + int64_t{s.v_heads} * full.shape.head_v;
  const std::vector<SliceRun> qkv = QkvColumns(full, s);
  for (int64_t t = 0; t < full.conv_width - 1; ++t) {
    for (const SliceRun& r : qkv) {
      runs.push_back({ckpt_full + (t * width + r.full) * ea, ckpt_shard + (t * shard_width + r.shard) * ea,
                      r.count * ea});
    }
  }
  return runs;
}

void CopyToShard(const void* full, int64_t full_row, void* shard, int64_t shard_row, int64_t rows,
                 const std::vector<SliceRun>& runs, int64_t elem_bytes) {
  const auto* src = static_cast<const uint8_t*>(full);
  auto* dst = static_cast<uint8_t*>(shard);
  for (int64_t i = 0; i < rows; ++i) {
    for (const SliceRun& r : runs) {
      std::memcpy(dst + (i * shard_row + r.shard) * elem_bytes,
                  src + (i * full_row + r.full) * elem_bytes, r.count * elem_bytes);
    }
  }
}

void CopyFromShard(const void* shard, int64_t shard_row, void* full, int64_t full_row,
                   int64_t rows, const std::vector<SliceRun>& runs, int64_t elem_bytes) {
  const auto* src = static_cast<const uint8_t*>(shard);
  auto* dst = static_cast<uint8_t*>(full);
  for (int64_t i = 0; i < rows; ++i) {
    for (const SliceRun& r : runs) {
      std::memcpy(dst + (i * full_row + r.full) * elem_bytes,
                  src + (i * shard_row + r.shard) * elem_bytes, r.count * elem_bytes);
    }
  }
}

}  // namespace replayssm::cache
