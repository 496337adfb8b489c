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
  // The short convolution in front of the recurrence (ModelSpec::conv_width > 0): weight
  // [C, W] (Hugging Face's conv1d weight [C, 1, W]; KDA's q, k, v convolutions concatenated
  // in mixed_qkv's channel order) and bias [C] or empty (none), C = QkvWidth().
  std::vector<float> conv_weight;
  std::vector<float> conv_bias;
};

struct ModelSpec {
  std::string name;
  int32_t num_layers = 0;   // linear-attention layers only
  rssm_layer_shape shape{};  // shared by every layer
  std::vector<LayerParams> layers;  // [num_layers]
  bool params_from_seed = true;     // true when the parameters are not a checkpoint's
  // Width W of the causal depthwise convolution + SiLU applied to mixed_qkv before the
  // recurrence (docs/math-and-abi.md); 0 = none (the inputs are post-convolution). Its state
  // (the W-1 inputs before the checkpoint, in the act dtype) is stored right after each
  // layer's checkpoint in the slot, and the inputs of ring records in a ring of its own.
  int32_t conv_width = 0;
  // beta = sigmoid(b) rounded to the act dtype before the rule (rssm_layer_params.round_beta);
  // the presets and Hugging Face configs start from DefaultRoundBeta(gate).
  bool round_beta = false;
  // The TP degree of the group serving this model (CacheOptions::tp_size; tp.h): its
  // activations arrive as tp_size ranks' tensors, rank-major ([tp_size, N, width / tp_size]).
  // A rank's own model (ShardModel) has 1. States leave a slot unsharded whatever it is.
  int32_t tp_size = 1;

  // Bytes per token of one layer's inputs (mixed_qkv, a, b) and output, in the act dtype.
  int64_t QkvWidth() const;  // 2*H*K + HV*V elements
  int64_t AWidth() const;    // HV (GDN) or HV*K (KDA) elements
  int64_t BWidth() const;    // HV elements
  int64_t OutWidth() const;  // HV*V elements
  // The rssm_dtype ring d and k are stored in (shape.ring_dtype resolved).
  int32_t RingDtype() const;
  // The convolution's shape (channels = QkvWidth(), width, ring_len, act dtype).
  rssm_conv_shape ConvShape() const;
  // One layer's folded state as it leaves a slot (export, import, transfer, snapshots):
  // checkpoint [HV,V,K] (state dtype) followed by the conv window [W-1, C] (act dtype).
  int64_t ConvWindowBytes() const;  // 0 without a convolution
  int64_t ConvRingBytes() const;    // ring_x [L, C], 0 without a convolution
  int64_t LayerStateBytes() const;
  // What one slot costs across all layers: checkpoint + conv window + ring (d, k, g, x).
  int64_t SlotBytes() const;
  // OK, or INVALID_ARGUMENT naming `field` when `got` layer states are given for num_layers.
  absl::Status CheckLayerCount(size_t got, const char* field) const;
};

// Built-in presets: "qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "tiny-gdn", "tiny-kda",
// "tiny-gdn-tp" (4 qk and 8 v heads: splits over 1, 2 or 4 ranks).
// Parameters come from a fixed seed (params_from_seed = true). `state_dtype`, `ring_len`
// override the preset's defaults when > -1 / > 0.
absl::StatusOr<ModelSpec> ModelPreset(std::string_view name, int32_t state_dtype = -1,
                                      int32_t ring_len = 0);
std::vector<std::string> ModelPresetNames();

// Deterministic parameters for a shape: A_log in [-0.25, 0.5] style values, dt_bias small;
// with conv_width > 0, convolution weights of about a unit's gain per channel and no bias.
std::vector<LayerParams> SeededParams(const rssm_layer_shape& shape, int32_t num_layers,
                                      uint64_t seed, int32_t conv_width = 0);

// How the reference model of each gate rounds beta = sigmoid(b) with bf16 activations: Hugging
// Face's Qwen3-Next (Gated DeltaNet) takes the sigmoid of its bf16 tensor (beta in bf16);
// Kimi-Linear (KDA) takes it in fp32 (`.float().sigmoid()`).
inline bool DefaultRoundBeta(int32_t gate) { return gate == RSSM_GATE_GDN; }

// The service's model options on top of a preset or config (flags --ring-dtype and
// --beta-rounding): ring_dtype is an rssm_ring_dtype code (0 = the state dtype; the pair must
// be one the kernels build, else INVALID_ARGUMENT naming `flag`); round_beta -1 keeps the
// model's default, 0/1 set it.
absl::Status ApplyModelOptions(ModelSpec& m, int32_t ring_dtype, int32_t round_beta);

// The convolution width of the presets (Qwen3-Next linear_conv_kernel_dim, Kimi-Linear
// short_conv_kernel_size).
inline constexpr int32_t kPresetConvWidth = 4;

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_MODEL_H_
