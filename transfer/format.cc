// StateFormat and the protocol's shared timing rule (peer.h).
#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "replayssm/transfer/peer.h"

namespace replayssm::transfer {
namespace {

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v * 0x9E3779B97F4A7C15ULL;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 32);
}

// Four multiply-xorshift lanes over 32-byte blocks: the parameters' fingerprint.
uint64_t HashBytes(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t lane[4] = {1, 2, 3, 4};
  size_t i = 0;
  for (; i + 32 <= size; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * k, 8);
      lane[k] = Mix(lane[k], v);
    }
  }
  uint64_t h = Mix(Mix(lane[0], lane[1]), Mix(lane[2], lane[3]));
  for (; i < size; ++i) h = Mix(h, p[i]);
  return Mix(h, size);
}

uint64_t HashFloats(uint64_t h, const std::vector<float>& v) {
  return Mix(HashBytes(v.data(), v.size() * sizeof(float)), h);
}

}  // namespace

StateFormat StateFormat::Of(const cache::ModelSpec& m) {
  StateFormat f;
  f.num_layers = m.num_layers;
  f.gate = m.shape.gate;
  f.num_qk_heads = m.shape.num_qk_heads;
  f.num_v_heads = m.shape.num_v_heads;
  f.head_k = m.shape.head_k;
  f.head_v = m.shape.head_v;
  f.state_dtype = m.shape.state_dtype;
  f.conv_width = m.conv_width;
  f.conv_dtype = m.conv_width > 0 ? m.shape.act_dtype : 0;
  f.ring_dtype = m.RingDtype();
  f.round_beta = m.round_beta;
  f.tp_size = m.tp_size;
  uint64_t h = 0x5eed;
  for (const cache::LayerParams& p : m.layers) {
    h = HashFloats(HashFloats(h, p.a_log), p.dt_bias);
    h = Mix(h, static_cast<uint64_t>(p.scale * 1e6)) ^ p.use_qk_l2norm;
    if (m.conv_width > 0) h = HashFloats(HashFloats(h, p.conv_weight), p.conv_bias);
  }
  f.params_hash = h;
  return f;
}

absl::Status StateFormat::CheckCompatible(const StateFormat& s) const {
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"head_layout", {head_layout, s.head_layout}},
      {"num_layers", {num_layers, s.num_layers}},
      {"gate", {gate, s.gate}},
      {"num_qk_heads", {num_qk_heads, s.num_qk_heads}},
      {"num_v_heads", {num_v_heads, s.num_v_heads}},
      {"head_k", {head_k, s.head_k}},
      {"head_v", {head_v, s.head_v}},
      {"state_dtype", {state_dtype, s.state_dtype}},
      {"conv_width", {conv_width, s.conv_width}},
      {"conv_dtype", {conv_dtype, s.conv_dtype}},
      {"ring_dtype", {ring_dtype, s.ring_dtype}},
      {"round_beta", {round_beta, s.round_beta}},
  };
  // A value as an operator reads it: the number on the wire and, for a code, its name.
  const auto describe = [](absl::string_view name, int64_t v) -> std::string {
    if (absl::EndsWith(name, "_dtype")) {  // rssm_dtype's codes
      return absl::StrCat(v, v == RSSM_DTYPE_F32    ? " (f32)"
                             : v == RSSM_DTYPE_BF16 ? " (bf16)"
                             : v == RSSM_DTYPE_F16  ? " (f16)"
                                                    : " (unknown)");
    }
    if (name == "gate") {
      return absl::StrCat(v, v == RSSM_GATE_GDN   ? " (Gated DeltaNet)"
                             : v == RSSM_GATE_KDA ? " (Kimi Delta Attention)"
                                                  : " (unknown)");
    }
    if (name == "head_layout") {
      return absl::StrCat(v, v == kUnshardedHeads ? " (unsharded heads)" : " (unknown)");
    }
    if (name == "round_beta") return v != 0 ? "true" : "false";
    return absl::StrCat(v);
  };
  for (const auto& [name, v] : fields) {
    if (v.first != v.second) {
      return absl::FailedPreconditionError(
          absl::StrCat("format.", name, ": expected ", describe(name, v.first),
                       " (this server's model), got ", describe(name, v.second)));
    }
  }
  if (params_hash != s.params_hash) {
    return absl::FailedPreconditionError(
        "format.params_hash: the sender's layer parameters differ from this server's model");
  }
  return absl::OkStatus();
}

absl::Duration AbortReserve(absl::Duration budget) {
  return std::clamp(budget / 4, absl::ZeroDuration(), absl::Seconds(2));
}

}  // namespace replayssm::transfer
