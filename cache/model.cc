#include "replayssm/cache/model.h"

#include <cmath>
#include <random>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace replayssm::cache {
namespace {

struct Preset {
  const char* name;
  int32_t num_layers;
  rssm_layer_shape shape;
};

// Linear-attention layers only. Qwen3-Next-80B-A3B: 48 layers, 3 of every 4 Gated DeltaNet
// (36), 16 qk-heads and 32 v-heads of dim 128. Kimi-Linear-48B-A3B: 27 layers, KDA in 3 of
// every 4 (20 here, the rest full attention), 32 heads of dim 128 for q, k and v.
constexpr Preset kPresets[] = {
    {"qwen3-next-80b-a3b", 36,
     {RSSM_GATE_GDN, 16, 32, 128, 128, 16, RSSM_DTYPE_F32, RSSM_DTYPE_BF16}},
    {"kimi-linear-48b-a3b", 20,
     {RSSM_GATE_KDA, 32, 32, 128, 128, 16, RSSM_DTYPE_F32, RSSM_DTYPE_BF16}},
    {"tiny-gdn", 4, {RSSM_GATE_GDN, 2, 4, 32, 32, 8, RSSM_DTYPE_F32, RSSM_DTYPE_F32}},
    {"tiny-kda", 4, {RSSM_GATE_KDA, 2, 4, 32, 32, 8, RSSM_DTYPE_F32, RSSM_DTYPE_F32}},
    // Heads that split 1, 2 and 4 ways (--tp-size), for tensor-parallel demos and tests.
    {"tiny-gdn-tp", 4, {RSSM_GATE_GDN, 4, 8, 32, 32, 8, RSSM_DTYPE_F32, RSSM_DTYPE_BF16}},
};

}  // namespace

int64_t ModelSpec::QkvWidth() const {
  return 2LL * shape.num_qk_heads * shape.head_k + int64_t{shape.num_v_heads} * shape.head_v;
}
int64_t ModelSpec::AWidth() const {
  return shape.gate == RSSM_GATE_KDA ? int64_t{shape.num_v_heads} * shape.head_k
                                     : shape.num_v_heads;
}
int64_t ModelSpec::BWidth() const { return shape.num_v_heads; }
int32_t ModelSpec::RingDtype() const { return rssm_ring_storage_dtype(&shape); }
int64_t ModelSpec::OutWidth() const { return int64_t{shape.num_v_heads} * shape.head_v; }
rssm_conv_shape ModelSpec::ConvShape() const {
  return rssm_conv_shape{static_cast<int32_t>(QkvWidth()), conv_width, shape.ring_len,
                         shape.act_dtype};
}
int64_t ModelSpec::ConvWindowBytes() const {
  if (conv_width < 2) return 0;
  const rssm_conv_shape c = ConvShape();
  return rssm_conv_window_elems(&c) * static_cast<int64_t>(rssm_dtype_size(shape.act_dtype));
}
int64_t ModelSpec::ConvRingBytes() const {
  if (conv_width < 2) return 0;
  const rssm_conv_shape c = ConvShape();
  return rssm_conv_ring_elems(&c) * static_cast<int64_t>(rssm_dtype_size(shape.act_dtype));
}
absl::Status ModelSpec::CheckLayerCount(size_t got, const char* field) const {
  if (got == static_cast<size_t>(num_layers)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": expected ", num_layers, " layers, got ", got));
}

int64_t ModelSpec::LayerStateBytes() const {
  return rssm_checkpoint_elems(&shape) * static_cast<int64_t>(rssm_dtype_size(shape.state_dtype)) +
         ConvWindowBytes();
}
int64_t ModelSpec::SlotBytes() const {
  return num_layers * (rssm_slot_layer_bytes(&shape) + ConvWindowBytes() + ConvRingBytes());
}

std::vector<LayerParams> SeededParams(const rssm_layer_shape& shape, int32_t num_layers,
                                      uint64_t seed, int32_t conv_width) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const int per = shape.gate == RSSM_GATE_KDA ? shape.head_k : 1;
  std::vector<LayerParams> layers(num_layers);
  for (LayerParams& p : layers) {
    for (int h = 0; h < shape.num_v_heads; ++h) p.a_log.push_back(0.125f + 0.375f * u(rng));
    for (int i = 0; i < shape.num_v_heads * per; ++i) p.dt_bias.push_back(0.5f * u(rng));
    p.scale = 1.f / std::sqrt(static_cast<float>(shape.head_k));
    p.use_qk_l2norm = true;
  }
  if (conv_width > 0) {
    // After the recurrence's parameters, so that they do not depend on the convolution.
    const int64_t channels =
        2LL * shape.num_qk_heads * shape.head_k + int64_t{shape.num_v_heads} * shape.head_v;
    std::uniform_real_distribution<float> uw(0.f, 1.f);
    for (LayerParams& p : layers) {
      p.conv_weight.resize(channels * conv_width);
      for (float& w : p.conv_weight) w = (0.25f + 0.5f * uw(rng)) * 2.f / conv_width;
    }
  }
  return layers;
}

absl::Status ApplyModelOptions(ModelSpec& m, int32_t ring_dtype, int32_t round_beta) {
  rssm_layer_shape s = m.shape;
  s.ring_dtype = ring_dtype;
  if (rssm_check_shape(&s) != RSSM_OK) return absl::InvalidArgumentError(rssm_last_error());
  m.shape = s;
  if (round_beta >= 0) m.round_beta = round_beta != 0;
  return absl::OkStatus();
}

std::vector<std::string> ModelPresetNames() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

absl::StatusOr<ModelSpec> ModelPreset(std::string_view name, int32_t state_dtype,
                                      int32_t ring_len) {
  for (const Preset& p : kPresets) {
    if (name != p.name) continue;
    ModelSpec m;
    m.name = p.name;
    m.num_layers = p.num_layers;
    m.shape = p.shape;
    if (state_dtype > -1) m.shape.state_dtype = state_dtype;
    if (ring_len > 0) m.shape.ring_len = ring_len;
    if (rssm_check_shape(&m.shape) != RSSM_OK) {
      return absl::InvalidArgumentError(rssm_last_error());
    }
    m.conv_width = kPresetConvWidth;
    m.round_beta = DefaultRoundBeta(m.shape.gate);
    m.layers = SeededParams(m.shape, m.num_layers, 0x9e3779b97f4a7c15ULL, m.conv_width);
    m.params_from_seed = true;
    return m;
  }
  return absl::NotFoundError(absl::StrCat("model: expected one of [",
                                          absl::StrJoin(ModelPresetNames(), ", "),
                                          "], got \"", std::string(name), "\""));
}

}  // namespace replayssm::cache
