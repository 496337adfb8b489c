#include "service/hf_config.h"

#include <cstring>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace replayssm::service {
namespace {

bool SameShape(const rssm_layer_shape& a, const rssm_layer_shape& b) {
  return std::memcmp(&a, &b, sizeof(a)) == 0;
}

TEST(HfConfig, Qwen3NextConfigGivesThePresetShape) {
  const std::string json = R"({"model_type": "qwen3_next", "num_hidden_layers": 48,
      "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
      "linear_key_head_dim": 128, "linear_value_head_dim": 128, "torch_dtype": "bfloat16"})";
  auto m = ModelFromHfConfigJson(json, "qwen3-next/config.json", -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  auto preset = cache::ModelPreset("qwen3-next-80b-a3b");
  ASSERT_TRUE(preset.ok());
  EXPECT_EQ(m->num_layers, preset->num_layers);
  EXPECT_TRUE(SameShape(m->shape, preset->shape));
  EXPECT_EQ(m->layers[3].a_log, preset->layers[3].a_log);
  EXPECT_TRUE(m->params_from_seed);
  // Hugging Face's Qwen3-Next takes beta = b.sigmoid() on its bf16 tensor.
  EXPECT_TRUE(m->round_beta);
  EXPECT_TRUE(preset->round_beta);
}

TEST(HfConfig, LayerTypesCountTheLinearAttentionLayers) {
  const std::string json = R"({"layer_types": ["linear_attention", "linear_attention",
      "full_attention", "linear_attention"], "linear_num_key_heads": 2,
      "linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 64,
      "dtype": "float32"})";
  auto m = ModelFromHfConfigJson(json, "c.json", RSSM_DTYPE_BF16, 8);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->num_layers, 3);
  EXPECT_EQ(m->shape.head_v, 64);
  EXPECT_EQ(m->shape.ring_len, 8);
  EXPECT_EQ(m->shape.state_dtype, RSSM_DTYPE_BF16);
  EXPECT_EQ(m->shape.act_dtype, RSSM_DTYPE_F32);
}

TEST(HfConfig, KimiLinearConfigGivesThePresetShape) {
  std::string kda = "[";
  for (int i = 0; i < 20; ++i) {
    if (i > 0) kda += ",";
    kda += std::to_string(i);
  }
  const std::string json = R"({"model_type": "kimi_linear", "num_hidden_layers": 27,
      "torch_dtype": "bfloat16", "linear_attn_config": {"num_heads": 32, "head_dim": 128,
      "short_conv_kernel_size": 4, "kda_layers": )" +
                           kda + "]}}";
  auto m = ModelFromHfConfigJson(json, "kimi/config.json", -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  auto preset = cache::ModelPreset("kimi-linear-48b-a3b");
  ASSERT_TRUE(preset.ok());
  EXPECT_EQ(m->num_layers, preset->num_layers);
  EXPECT_TRUE(SameShape(m->shape, preset->shape));
  // Kimi-Linear: b_proj(x).float().sigmoid(), fp32.
  EXPECT_FALSE(m->round_beta);
  EXPECT_FALSE(preset->round_beta);
}

TEST(HfConfig, ModelOptionsSetTheRingDtypeAndBetaRoundingOrNameTheField) {
  auto m = cache::ModelPreset("qwen3-next-80b-a3b");
  ASSERT_TRUE(m.ok());
  const int64_t fp32_ring = m->SlotBytes();
  ASSERT_TRUE(cache::ApplyModelOptions(*m, RSSM_RING_DTYPE_BF16, 0).ok());
  EXPECT_EQ(rssm_ring_storage_dtype(&m->shape), RSSM_DTYPE_BF16);
  EXPECT_FALSE(m->round_beta);
  // The ring's d and k take half the bytes; checkpoint, g and the conv state are unchanged.
  const rssm_layer_shape& s = m->shape;
  EXPECT_EQ(fp32_ring - m->SlotBytes(),
            m->num_layers * 2 * (rssm_ring_d_elems(&s) + rssm_ring_k_elems(&s)));
  ASSERT_TRUE(cache::ApplyModelOptions(*m, RSSM_RING_DTYPE_STATE, -1).ok());
  EXPECT_EQ(m->SlotBytes(), fp32_ring);
  EXPECT_FALSE(m->round_beta);  // -1 keeps what was set

  auto b = cache::ModelPreset("tiny-kda", RSSM_DTYPE_BF16);
  ASSERT_TRUE(b.ok());
  const absl::Status st = cache::ApplyModelOptions(*b, RSSM_RING_DTYPE_F32, 1);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("shape.ring_dtype"), std::string::npos) << st;
  EXPECT_EQ(b->shape.ring_dtype, RSSM_RING_DTYPE_STATE);  // nothing changed
  EXPECT_FALSE(b->round_beta);
}

TEST(HfConfig, TheShortConvolutionsWidthComesFromTheConfig) {
  const std::string gdn = R"({"linear_num_key_heads": 2, "linear_num_value_heads": 4,
      "linear_key_head_dim": 32, "linear_value_head_dim": 32, "num_hidden_layers": 4)";
  auto m = ModelFromHfConfigJson(gdn + "}", "c.json", -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->conv_width, 4);  // Qwen3NextConfig's default
  ASSERT_EQ(m->layers[0].conv_weight.size(), static_cast<size_t>(m->QkvWidth() * 4));
  m = ModelFromHfConfigJson(gdn + R"(, "linear_conv_kernel_dim": 3})", "c.json", -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->conv_width, 3);
  EXPECT_EQ(m->layers[2].conv_weight.size(), static_cast<size_t>(m->QkvWidth() * 3));
  for (const char* bad : {R"(, "linear_conv_kernel_dim": 1})", R"(, "linear_conv_kernel_dim": 9})",
                          R"(, "linear_conv_kernel_dim": "4"})"}) {
    m = ModelFromHfConfigJson(gdn + bad, "c.json", -1, 0);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(m.status().message().find("c.json"), std::string::npos) << m.status();
  }
  m = ModelFromHfConfigJson(R"({"linear_attn_config": {"num_heads": 2, "head_dim": 16,
      "kda_layers": [0, 1], "short_conv_kernel_size": 2}})",
                            "k.json", -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->conv_width, 2);
}

TEST(HfConfig, AConfigWithoutLinearAttentionOrWithAMissingKeyIsRefused) {
  auto dense = ModelFromHfConfigJson(R"({"num_hidden_layers": 32})", "llama.json", -1, 0);
  EXPECT_EQ(dense.status().code(), absl::StatusCode::kInvalidArgument);
  auto missing = ModelFromHfConfigJson(
      R"({"linear_num_value_heads": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
          "num_hidden_layers": 4})",
      "c.json", -1, 0);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find("linear_num_key_heads"), std::string::npos)
      << missing.status();
  EXPECT_FALSE(ModelFromHfConfigJson("not json", "c.json", -1, 0).ok());
  EXPECT_EQ(ModelFromHfConfigFile("/nonexistent/config.json", -1, 0).status().code(),
            absl::StatusCode::kNotFound);
}

// Every wrong type, range or missing key is an error naming the key's path, what was expected
// and what came (a string where a number belongs used to abort the server).
TEST(HfConfig, EveryWrongTypeIsAnErrorNamingTheKey) {
  const std::string gdn = R"("linear_num_key_heads": 2, "linear_num_value_heads": 4,
      "linear_key_head_dim": 32, "linear_value_head_dim": 32)";
  const struct {
    std::string json;
    std::string message;
  } cases[] = {
      {"{" + gdn + R"(, "num_hidden_layers": 8, "full_attention_interval": "4"})",
       "c.json: full_attention_interval: expected an integer in 0..2147483647, got a string "
       "\"4\""},
      {"{" + gdn + R"(, "num_hidden_layers": 8, "full_attention_interval": -4})",
       "full_attention_interval: expected an integer in 0..2147483647, got the number -4"},
      {"{" + gdn + R"(, "num_hidden_layers": 8.5})", "num_hidden_layers: expected an integer"},
      {"{" + gdn + R"(, "num_hidden_layers": 1e20})", "num_hidden_layers: expected an integer"},
      {"{" + gdn + "}", "num_hidden_layers: expected an integer in 1..2147483647, got nothing"},
      {"{" + gdn + R"(, "layer_types": "linear_attention"})",
       "layer_types: expected a list, got a string"},
      {"{" + gdn + R"(, "layer_types": ["linear_attention", 3]})",
       "layer_types[1]: expected a string, got the number 3"},
      {R"({"linear_num_value_heads": true})", "linear_num_key_heads: expected an integer"},
      {R"({"linear_attn_config": [1]})", "linear_attn_config: expected an object, got a list"},
      {R"({"linear_attn_config": {"num_heads": "32", "head_dim": 128, "kda_layers": [0]}})",
       "linear_attn_config.num_heads: expected an integer in 1..2147483647, got a string"},
      {R"({"linear_attn_config": {"num_heads": 2, "head_dim": 32, "kda_layers": 4}})",
       "linear_attn_config.kda_layers: expected a list, got the number 4"},
      {R"({"text_config": "x"})", "text_config: expected an object, got a string"},
      {R"({"text_config": {"linear_num_value_heads": 4, "linear_num_key_heads": {}}})",
       "text_config.linear_num_key_heads: expected an integer in 1..2147483647, got an object"},
      {"{" + gdn + R"(, "num_hidden_layers": 8, "torch_dtype": 16})",
       "torch_dtype: expected a string, got the number 16"},
      // An outside review: both became something else without a word (bf16; full attention).
      {"{" + gdn + R"(, "num_hidden_layers": 8, "torch_dtype": "float64"})",
       "c.json: torch_dtype: expected bfloat16, float16 or float32, got \"float64\""},
      {"{" + gdn + R"(, "layer_types": ["linear_attention", "linear_atention"]})",
       "layer_types[1]: expected \"linear_attention\" or \"full_attention\", got "
       "\"linear_atention\""},
  };
  for (const auto& c : cases) {
    auto m = ModelFromHfConfigJson(c.json, "c.json", -1, 0);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(m.status().message().find(c.message), std::string::npos)
        << c.json << "\nexpected: " << c.message << "\ngot: " << m.status();
  }
}

// Found by fuzz/ (hf_config target): a config.json asking for billions of layers or huge
// heads made the server allocate their parameters (out of memory) instead of refusing it.
TEST(HfConfig, AConfigAskingForTooManyParametersIsRefusedNamingWhat) {
  auto many = ModelFromHfConfigJson(R"({"num_hidden_layers": 2147483647,
      "full_attention_interval": 0, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
      "linear_key_head_dim": 32, "linear_value_head_dim": 32})",
                                    "c.json", -1, 0);
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(many.status().message().find("linear-attention layers: expected 1..4096"),
            std::string::npos)
      << many.status();
  auto huge = ModelFromHfConfigJson(R"({"linear_attn_config": {"num_heads": 65536,
      "head_dim": 256, "kda_layers": [1, 2, 3, 4]}})",
                                    "c.json", -1, 0);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("layer parameters"), std::string::npos) << huge.status();
}

}  // namespace
}  // namespace replayssm::service
