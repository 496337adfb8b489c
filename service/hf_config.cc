#include "service/hf_config.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
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
// Bounds on what a config.json may ask the server to allocate for its layer parameters (real
// models: 48 layers, under 200k parameters); beyond them a hostile config ran out of memory.
constexpr int32_t kMaxLayers = 4096;
constexpr int64_t kMaxParams = int64_t{1} << 24;  // A_log, dt_bias and conv floats, all layers

const Value* Field(const Struct& s, const std::string& key) {
  auto it = s.fields().find(key);
  return it == s.fields().end() ? nullptr : &it->second;
}

// What came, for errors: the JSON type, with the value where it is short.
std::string Describe(const Value* v) {
  if (v == nullptr) return "nothing";
  switch (v->kind_case()) {
    case Value::kNullValue: return "null";
    case Value::kNumberValue: return absl::StrCat("the number ", v->number_value());
    case Value::kStringValue:
      return absl::StrCat("a string \"", v->string_value().substr(0, 32), "\"");
    case Value::kBoolValue: return v->bool_value() ? "the boolean true" : "the boolean false";
    case Value::kStructValue: return "an object";
    case Value::kListValue: return "a list";
    default: return "nothing";
  }
}

// One JSON object of config.json and its path from the root ("", "text_config.",
// "linear_attn_config."): its typed reads name the key's full path in every error.
struct Object {
  const Struct& s;
  std::string file;    // config.json's path, the first part of every error's field
  std::string prefix;  // the object's path, ending in '.' unless it is the root

  const Value* Get(const std::string& key) const { return Field(s, key); }
  absl::Status Error(const std::string& key, absl::string_view expected) const {
    return FieldError(absl::StrCat(file, ": ", prefix, key), expected, Describe(Get(key)));
  }
  // An integer in [min, INT32_MAX]; a missing key is an error too.
  absl::StatusOr<int32_t> Int(const std::string& key, int32_t min) const {
    const Value* v = Get(key);
    const std::string expected =
        absl::StrCat("an integer in ", min, "..", std::numeric_limits<int32_t>::max());
    if (v == nullptr || v->kind_case() != Value::kNumberValue) return Error(key, expected);
    const double x = v->number_value();
    if (!(x >= min && x <= std::numeric_limits<int32_t>::max()) || x != std::floor(x)) {
      return Error(key, expected);
    }
    return static_cast<int32_t>(x);
  }
  // The object under `key`; nullptr when the key is absent (or null, as HF writes them).
  absl::StatusOr<const Struct*> OptionalObject(const std::string& key) const {
    const Value* v = Get(key);
    if (v == nullptr || v->kind_case() == Value::kNullValue) return nullptr;
    if (v->kind_case() != Value::kStructValue) return Error(key, "an object");
    return &v->struct_value();
  }
  absl::StatusOr<const google::protobuf::ListValue*> OptionalList(const std::string& key) const {
    const Value* v = Get(key);
    if (v == nullptr || v->kind_case() == Value::kNullValue) return nullptr;
    if (v->kind_case() != Value::kListValue) return Error(key, "a list");
    return &v->list_value();
  }
  absl::StatusOr<std::string> OptionalString(const std::string& key) const {
    const Value* v = Get(key);
    if (v == nullptr || v->kind_case() == Value::kNullValue) return std::string();
    if (v->kind_case() != Value::kStringValue) return Error(key, "a string");
    return v->string_value();
  }
};

// The activations' dtype: the first of torch_dtype, dtype that is set; bf16 when neither is.
// Another name is refused (an outside review: "float64" became bf16 without a word).
absl::StatusOr<int32_t> ActDtype(const Object& o) {
  for (const char* key : {"torch_dtype", "dtype"}) {
    absl::StatusOr<std::string> name = o.OptionalString(key);
    if (!name.ok()) return name.status();
    if (name->empty()) continue;
    if (*name == "bfloat16") return RSSM_DTYPE_BF16;
    if (*name == "float16") return RSSM_DTYPE_F16;
    if (*name == "float32") return RSSM_DTYPE_F32;
    return FieldError(absl::StrCat(o.file, ": ", o.prefix, key), "bfloat16, float16 or float32",
                      absl::StrCat("\"", *name, "\""));
  }
  return RSSM_DTYPE_BF16;
}

// The linear-attention layers of a GDN model: from `layer_types` when given, else every
// layer but each `full_attention_interval`-th (4 when absent, 0 = no full attention).
absl::StatusOr<int32_t> GdnLayers(const Object& o) {
  absl::StatusOr<const google::protobuf::ListValue*> types = o.OptionalList("layer_types");
  if (!types.ok()) return types.status();
  if (*types != nullptr) {
    int32_t layers = 0;
    for (int i = 0; i < (*types)->values_size(); ++i) {
      const Value& t = (*types)->values(i);
      if (t.kind_case() != Value::kStringValue) {
        return FieldError(absl::StrCat(o.file, ": ", o.prefix, "layer_types[", i, "]"), "a string",
                          Describe(&t));
      }
      // Any other name was counted as full attention, and the layer count came out wrong.
      if (t.string_value() != "linear_attention" && t.string_value() != "full_attention") {
        return FieldError(absl::StrCat(o.file, ": ", o.prefix, "layer_types[", i, "]"),
                          "\"linear_attention\" or \"full_attention\"",
                          absl::StrCat("\"", t.string_value(), "\""));
      }
      layers += t.string_value() == "linear_attention" ? 1 : 0;
    }
    return layers;
  }
  absl::StatusOr<int32_t> total = o.Int("num_hidden_layers", 1);
  if (!total.ok()) return total.status();
  int32_t interval = 4;
  if (o.Get("full_attention_interval") != nullptr) {
    absl::StatusOr<int32_t> i = o.Int("full_attention_interval", 0);  // 0: none
    if (!i.ok()) return i.status();
    interval = *i;
  }
  return *total - (interval > 0 ? *total / interval : 0);
}

// Gated DeltaNet, Qwen3-Next style.
absl::Status GdnShape(const Object& o, rssm_layer_shape* shape, int32_t* layers,
                      int32_t* conv_width) {
  absl::StatusOr<int32_t> h = o.Int("linear_num_key_heads", 1),
                          hv = o.Int("linear_num_value_heads", 1),
                          k = o.Int("linear_key_head_dim", 1),
                          v = o.Int("linear_value_head_dim", 1);
  for (const auto* x : {&h, &hv, &k, &v}) {
    if (!x->ok()) return x->status();
  }
  *shape = {RSSM_GATE_GDN, *h, *hv, *k, *v, 0, 0, 0};
  *conv_width = cache::kPresetConvWidth;  // Qwen3NextConfig's default
  if (o.Get("linear_conv_kernel_dim") != nullptr) {
    absl::StatusOr<int32_t> w = o.Int("linear_conv_kernel_dim", 2);
    if (!w.ok()) return w.status();
    *conv_width = *w;
  }
  absl::StatusOr<int32_t> n = GdnLayers(o);
  if (!n.ok()) return n.status();
  *layers = *n;
  return absl::OkStatus();
}

// Kimi Delta Attention, Kimi-Linear style: q, k, v share num_heads and head_dim.
absl::Status KdaShape(const Object& o, rssm_layer_shape* shape, int32_t* layers,
                      int32_t* conv_width) {
  absl::StatusOr<const Struct*> lac = o.OptionalObject("linear_attn_config");
  if (!lac.ok()) return lac.status();
  if (*lac == nullptr) return o.Error("linear_attn_config", "an object");
  const Object c{**lac, o.file, absl::StrCat(o.prefix, "linear_attn_config.")};
  absl::StatusOr<int32_t> heads = c.Int("num_heads", 1), dim = c.Int("head_dim", 1);
  if (!heads.ok()) return heads.status();
  if (!dim.ok()) return dim.status();
  *shape = {RSSM_GATE_KDA, *heads, *heads, *dim, *dim, 0, 0, 0};
  *conv_width = cache::kPresetConvWidth;  // Kimi-Linear's default
  if (c.Get("short_conv_kernel_size") != nullptr) {
    absl::StatusOr<int32_t> w = c.Int("short_conv_kernel_size", 2);
    if (!w.ok()) return w.status();
    *conv_width = *w;
  }
  absl::StatusOr<const google::protobuf::ListValue*> kda = c.OptionalList("kda_layers");
  if (!kda.ok()) return kda.status();
  if (*kda == nullptr) return c.Error("kda_layers", "a list");
  *layers = (*kda)->values_size();
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
  const Object top{root, name, ""};
  absl::StatusOr<const Struct*> text = top.OptionalObject("text_config");
  if (!text.ok()) return text.status();
  const Object o = *text != nullptr ? Object{**text, name, "text_config."} : top;
  cache::ModelSpec m;
  m.name = name;
  absl::Status st;
  if (o.Get("linear_attn_config") != nullptr) {
    st = KdaShape(o, &m.shape, &m.num_layers, &m.conv_width);
  } else if (o.Get("linear_num_value_heads") != nullptr) {
    st = GdnShape(o, &m.shape, &m.num_layers, &m.conv_width);
  } else {
    st = absl::InvalidArgumentError(absl::StrCat(
        name,
        ": no linear-attention layers (expected linear_num_value_heads (Gated DeltaNet) "
        "or linear_attn_config (KDA))"));
  }
  if (!st.ok()) return st;
  absl::StatusOr<int32_t> act = ActDtype(o);
  if (!act.ok()) return act.status();
  m.shape.ring_len = ring_len > 0 ? ring_len : kDefaultRingLen;
  m.shape.state_dtype = state_dtype > -1 ? state_dtype : RSSM_DTYPE_F32;
  m.shape.act_dtype = *act;
  if (m.num_layers < 1 || m.num_layers > kMaxLayers) {
    return FieldError(absl::StrCat(name, ": linear-attention layers"),
                      absl::StrCat("1..", kMaxLayers), absl::StrCat(m.num_layers));
  }
  if (rssm_check_shape(&m.shape) != RSSM_OK) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", rssm_last_error()));
  }
  if (m.conv_width > RSSM_MAX_CONV_WIDTH) {
    return FieldError(absl::StrCat(name, ": the short convolution's kernel size"),
                      absl::StrCat("2 to ", RSSM_MAX_CONV_WIDTH), absl::StrCat(m.conv_width));
  }
  const int64_t per_layer =
      int64_t{m.shape.num_v_heads} * (m.shape.gate == RSSM_GATE_KDA ? 1 + m.shape.head_k : 2) +
      (2LL * m.shape.num_qk_heads * m.shape.head_k + int64_t{m.shape.num_v_heads} * m.shape.head_v) *
          m.conv_width;
  if (per_layer * m.num_layers > kMaxParams) {
    return FieldError(absl::StrCat(name, ": layer parameters (layers x (value heads x ",
                                   m.shape.gate == RSSM_GATE_KDA ? "(1 + head_dim)" : "2",
                                   " + conv channels x conv width))"),
                      absl::StrCat("at most ", kMaxParams), absl::StrCat(per_layer * m.num_layers));
  }
  m.layers = cache::SeededParams(m.shape, m.num_layers, kParamSeed, m.conv_width);
  m.params_from_seed = true;
  m.round_beta = cache::DefaultRoundBeta(m.shape.gate);
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
