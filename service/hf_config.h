// The linear-attention shape of a Hugging Face model from its config.json: Qwen3-Next style
// Gated DeltaNet (`linear_num_key_heads`, `linear_num_value_heads`, `linear_key_head_dim`,
// `linear_value_head_dim`, and `layer_types` or `full_attention_interval`) and Kimi-Linear
// style KDA (`linear_attn_config`: `num_heads`, `head_dim`, `kda_layers`), optionally under
// `text_config`. Activation dtype from `torch_dtype`/`dtype` (bf16 when absent); state dtype
// fp32 and ring length 16 unless overridden. Layer parameters: ModelFromHfConfigFile reads
// A_log/dt_bias from the *.safetensors beside config.json (safetensors.h) when there are
// any; otherwise (and always for ModelFromHfConfigJson) from a fixed seed (params_from_seed).
#ifndef REPLAYSSM_SERVICE_HF_CONFIG_H_
#define REPLAYSSM_SERVICE_HF_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "replayssm/cache/model.h"

namespace replayssm::service {

// `state_dtype` (-1 = fp32) and `ring_len` (0 = 16) as for cache::ModelPreset.
absl::StatusOr<cache::ModelSpec> ModelFromHfConfigJson(const std::string& json,
                                                       const std::string& name, int32_t state_dtype,
                                                       int32_t ring_len);
absl::StatusOr<cache::ModelSpec> ModelFromHfConfigFile(const std::string& path, int32_t state_dtype,
                                                       int32_t ring_len);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_HF_CONFIG_H_
