// The model a cache serves: the shape every linear-attention layer shares, and each layer's
// parameters. Plain values; no device memory here.
#ifndef REPLAYSSM_CACHE_MODEL_H_
#define REPLAYSSM_CACHE_MODEL_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {

// One linear-attention layer's learned parameters (fp32, host memory).
struct LayerParams {
  std::vector<float> a_log;    // [HV]
  std::vector<float> dt_bias;  // GDN [HV], KDA [HV, K]
  float scale = 1.0f;          // q multiplier, usually K^-1/2
  bool use_qk_l2norm = true;
};

struct ModelSpec {
  std::string name;
  int32_t num_layers = 0;   // linear-attention layers only
  rssm_layer_shape shape{};  // shared by every layer
  std::vector<LayerParams> layers;  // [num_layers]
  bool params_from_seed = true;     // true when the parameters are not a checkpoint's

  // Bytes per token of one layer's inputs (mixed_qkv, a, b) and output, in the act dtype.
  int64_t QkvWidth() const;  // 2*H*K + HV*V elements
  int64_t AWidth() const;    // HV (GDN) or HV*K (KDA) elements
  int64_t BWidth() const;    // HV elements
  int64_t OutWidth() const;  // HV*V elements
  // What one slot costs across all layers: checkpoint + ring (d, k, g).
  int64_t SlotBytes() const;
};

// Built-in presets: "qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "tiny-gdn", "tiny-kda".
// Parameters come from a fixed seed (params_from_seed = true). `state_dtype`, `ring_len`
// override the preset's defaults when > -1 / > 0.
absl::StatusOr<ModelSpec> ModelPreset(std::string_view name, int32_t state_dtype = -1,
                                      int32_t ring_len = 0);
std::vector<std::string> ModelPresetNames();

// Deterministic parameters for a shape: A_log in [-0.25, 0.5] style values, dt_bias small.
std::vector<LayerParams> SeededParams(const rssm_layer_shape& shape, int32_t num_layers,
                                      uint64_t seed);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_MODEL_H_
