#include "service/hf_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "service/safetensors.h"
#include "service/status_map.h"

namespace replayssm::service {

namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

constexpr uint64_t kParamSeed = 0x9e3779b97f4a7c15ULL;  // the presets' seed
constexpr int32_t kDefaultRingLen = 16;

const Value* Field(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

absl::StatusOr<int32_t> Int(const Struct& s, const std::string& key) {
  const Value* v = Field(s, key);
  if (v == nullptr || v->kind_case() != Value::kNumberValue) {
    return FieldError(absl::StrCat("config.json: ", key), "a number",
                      v == nullptr ? "nothing" : "another type");
  }
  return static_cast<int32_t>(v->number_value());
}

int32_t ActDtype(const Struct& s) {
  for (const char* key : {"torch_dtype", "dtype"}) {
    const Value* v = Field(s, key);
    if (v == nullptr || v->kind_case() != Value::kStringValue) continue;
    if (v->string_value() == "float16") return RSSM_DTYPE_F16;
    if (v->string_value() == "float32") return RSSM_DTYPE_F32;
  }
  return RSSM_DTYPE_BF16;
}

// Gated DeltaNet, Qwen3-Next style.
absl::Status GdnShape(const Struct& s, rssm_layer_shape* shape, int32_t* layers) {
  absl::StatusOr<int32_t> h = Int(s, "linear_num_key_heads"), hv = Int(s, "linear_num_value_heads"),
                          k = Int(s, "linear_key_head_dim"), v = Int(s, "linear_value_head_dim");
  for (const auto* x : {&h, &hv, &k, &v}) {
    if (!x->ok()) return x->status();
  }
  *shape = {RSSM_GATE_GDN, *h, *hv, *k, *v, 0, 0, 0};
  const Value* types = Field(s, "layer_types");
  if (types != nullptr && types->kind_case() == Value::kListValue) {
    *layers = 0;
    for (const Value& t : types->list_value().values()) {
      *layers += t.string_value() == "linear_attention" ? 1 : 0;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<int32_t> total = Int(s, "num_hidden_layers");
  if (!total.ok()) return total.status();
  const int32_t interval =
      Field(s, "full_attention_interval") != nullptr ? *Int(s, "full_attention_interval") : 4;
  *layers = *total - (interval > 0 ? *total / interval : 0);
  return absl::OkStatus();
}

// Kimi Delta Attention, Kimi-Linear style: q, k, v share num_heads and head_dim.
absl::Status KdaShape(const Struct& s, rssm_layer_shape* shape, int32_t* layers) {
  const Struct& lac = Field(s, "linear_attn_config")->struct_value();
  absl::StatusOr<int32_t> heads = Int(lac, "num_heads"), dim = Int(lac, "head_dim");
  if (!heads.ok()) return heads.status();
  if (!dim.ok()) return dim.status();
  *shape = {RSSM_GATE_KDA, *heads, *heads, *dim, *dim, 0, 0, 0};
  const Value* kda = Field(lac, "kda_layers");
  if (kda == nullptr || kda->kind_case() != Value::kListValue) {
    return FieldError("config.json: linear_attn_config.kda_layers", "a list", "nothing");
  }
  *layers = kda->list_value().values_size();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<cache::ModelSpec> ModelFromHfConfigJson(const std::string& json,
                                                       const std::string& name, int32_t state_dtype,
                                                       int32_t ring_len) {
  Struct root;
  if (!google::protobuf::util::JsonStringToMessage(json, &root).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": not a JSON object"));
  }
  const Value* text = Field(root, "text_config");
  const Struct& s =
      text != nullptr && text->kind_case() == Value::kStructValue ? text->struct_value() : root;
  cache::ModelSpec m;
  m.name = name;
  absl::Status st;
  if (Field(s, "linear_attn_config") != nullptr) {
    st = KdaShape(s, &m.shape, &m.num_layers);
  } else if (Field(s, "linear_num_value_heads") != nullptr) {
    st = GdnShape(s, &m.shape, &m.num_layers);
  } else {
    st = absl::InvalidArgumentError(absl::StrCat(
        name,
        ": no linear-attention layers (expected linear_num_value_heads (Gated DeltaNet) "
        "or linear_attn_config (KDA))"));
  }
  if (!st.ok()) return st;
  m.shape.ring_len = ring_len > 0 ? ring_len : kDefaultRingLen;
  m.shape.state_dtype = state_dtype > -1 ? state_dtype : RSSM_DTYPE_F32;
  m.shape.act_dtype = ActDtype(s);
  if (m.num_layers < 1) {
    return FieldError(absl::StrCat(name, ": linear-attention layers"), ">= 1",
                      absl::StrCat(m.num_layers));
  }
  if (rssm_check_shape(&m.shape) != RSSM_OK) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", rssm_last_error()));
  }
  m.layers = cache::SeededParams(m.shape, m.num_layers, kParamSeed);
  m.params_from_seed = true;
  return m;
}

absl::StatusOr<cache::ModelSpec> ModelFromHfConfigFile(const std::string& path, int32_t state_dtype,
                                                       int32_t ring_len) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--model ", path, ": cannot open"));
  std::stringstream json;
  json << in.rdbuf();
  absl::StatusOr<cache::ModelSpec> m = ModelFromHfConfigJson(json.str(), path, state_dtype, ring_len);
  if (!m.ok()) return m;
  // A_log / dt_bias from the checkpoint beside config.json, when there is one.
  const std::string dir = std::filesystem::path(path).parent_path().string();
  absl::StatusOr<bool> loaded = LoadLayerParams(dir.empty() ? "." : dir, &*m);
  if (!loaded.ok()) return loaded.status();
  return m;
}

}  // namespace replayssm::service
