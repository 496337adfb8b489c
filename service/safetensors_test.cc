#include "service/safetensors.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "service/hf_config.h"

namespace replayssm::service {
namespace {

namespace fs = std::filesystem;

// Writes a safetensors file with the given fp32 tensors (and one bf16 tensor when asked).
// Each tensor flat ([n]) unless `shapes` gives its shape (JSON, e.g. "[64,1,4]").
void WriteSafetensors(const fs::path& path,
                      const std::vector<std::pair<std::string, std::vector<float>>>& t,
                      bool bf16_first = false,
                      const std::map<std::string, std::string>& shapes = {}) {
  std::string header = "{";
  std::string data;
  for (size_t i = 0; i < t.size(); ++i) {
    const bool bf16 = bf16_first && i == 0;
    const size_t begin = data.size();
    for (float v : t[i].second) {
      uint32_t u;
      std::memcpy(&u, &v, 4);
      if (bf16) {
        const uint16_t h = static_cast<uint16_t>(u >> 16);
        data.append(reinterpret_cast<const char*>(&h), 2);
      } else {
        data.append(reinterpret_cast<const char*>(&v), 4);
      }
    }
    const auto shape = shapes.find(t[i].first);
    absl::StrAppend(
        &header, i ? "," : "", "\"", t[i].first, "\":{\"dtype\":\"", bf16 ? "BF16" : "F32",
        "\",\"shape\":",
        shape != shapes.end() ? shape->second : absl::StrCat("[", t[i].second.size(), "]"),
        ",\"data_offsets\":[", begin, ",", data.size(), "]}");
  }
  header += "}";
  std::ofstream out(path, std::ios::binary);
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << data;
}

class Safetensors : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / absl::StrCat("rssm-st-", getpid(), "-", counter_++);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << R"({"layer_types": ["linear_attention",
        "full_attention", "linear_attention"], "linear_num_key_heads": 1,
        "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16})";
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  static inline int counter_ = 0;
};

// A [C, 1, W] conv weight with distinct values: base + i / 64.
std::vector<float> ConvWeight(int64_t n, float base) {
  std::vector<float> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = base + static_cast<float>(i) / 64.f;
  return w;
}

// config.json's model: C = 2*1*16 + 2*16 = 64 channels, W = 4 (Qwen3-Next's default).
constexpr int64_t kConvValues = 64 * 4;

TEST_F(Safetensors, ParametersComeFromTheCheckpointBesideConfigJson) {
  WriteSafetensors(dir_ / "model-00001.safetensors",
                   {{"model.layers.0.linear_attn.A_log", {0.5f, -1.0f}},
                    {"model.layers.0.linear_attn.dt_bias", {0.25f, 2.0f}},
                    {"model.layers.0.linear_attn.conv1d.weight", ConvWeight(kConvValues, 1.f)},
                    {"model.layers.0.mlp.weight", {9, 9, 9}}},
                   /*bf16_first=*/true,
                   {{"model.layers.0.linear_attn.conv1d.weight", "[64,1,4]"},  // as HF has it
                    {"model.layers.0.linear_attn.A_log", "[1,2]"}});
  WriteSafetensors(dir_ / "model-00002.safetensors",
                   {{"model.layers.2.linear_attn.A_log", {1.5f, 3.0f}},
                    {"model.layers.2.linear_attn.dt_bias", {-0.5f, 0.125f}},
                    {"model.layers.2.linear_attn.conv1d.weight", ConvWeight(kConvValues, -2.f)},
                    {"model.layers.2.linear_attn.conv1d.bias", ConvWeight(64, 0.5f)}});
  auto m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->params_from_seed);
  ASSERT_EQ(m->num_layers, 2);
  EXPECT_EQ(m->conv_width, 4);
  EXPECT_EQ(m->layers[0].a_log, (std::vector<float>{0.5f, -1.0f}));  // from bf16, exact
  EXPECT_EQ(m->layers[0].dt_bias, (std::vector<float>{0.25f, 2.0f}));
  EXPECT_EQ(m->layers[1].a_log, (std::vector<float>{1.5f, 3.0f}));
  EXPECT_EQ(m->layers[1].dt_bias, (std::vector<float>{-0.5f, 0.125f}));
  EXPECT_EQ(m->layers[0].conv_weight, ConvWeight(kConvValues, 1.f));
  EXPECT_TRUE(m->layers[0].conv_bias.empty());
  EXPECT_EQ(m->layers[1].conv_weight, ConvWeight(kConvValues, -2.f));
  EXPECT_EQ(m->layers[1].conv_bias, ConvWeight(64, 0.5f));
}

TEST_F(Safetensors, KimiLinearConvolutionsAreConcatenatedInQkvOrder) {
  std::ofstream(dir_ / "config.json") << R"({"linear_attn_config": {"num_heads": 2,
      "head_dim": 16, "kda_layers": [1], "short_conv_kernel_size": 3}})";
  WriteSafetensors(dir_ / "model.safetensors",
                   {{"model.layers.0.self_attn.A_log", {0.5f, -1.0f}},
                    {"model.layers.0.self_attn.dt_bias", std::vector<float>(32, 0.25f)},
                    {"model.layers.0.self_attn.q_conv1d.weight", ConvWeight(32 * 3, 1.f)},
                    {"model.layers.0.self_attn.k_conv1d.weight", ConvWeight(32 * 3, 2.f)},
                    {"model.layers.0.self_attn.v_conv1d.weight", ConvWeight(32 * 3, 3.f)}},
                   false,  // dt_bias per head and channel, [HV, K]: row-major as the flat form
                   {{"model.layers.0.self_attn.dt_bias", "[2,16]"},
                    {"model.layers.0.self_attn.k_conv1d.weight", "[32,1,3]"}});
  auto m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->conv_width, 3);
  std::vector<float> want = ConvWeight(32 * 3, 1.f);
  for (float base : {2.f, 3.f}) {
    const std::vector<float> part = ConvWeight(32 * 3, base);
    want.insert(want.end(), part.begin(), part.end());
  }
  EXPECT_EQ(m->layers[0].conv_weight, want);
}

TEST_F(Safetensors, ACheckpointWithoutTheConvolutionIsRefusedByName) {
  WriteSafetensors(dir_ / "model.safetensors",
                   {{"model.layers.0.linear_attn.A_log", {0.5f, -1.0f}},
                    {"model.layers.0.linear_attn.dt_bias", {0.25f, 2.0f}},
                    {"model.layers.0.linear_attn.conv1d.weight", ConvWeight(kConvValues, 1.f)},
                    {"model.layers.2.linear_attn.A_log", {1.5f, 3.0f}},
                    {"model.layers.2.linear_attn.dt_bias", {-0.5f, 0.125f}}});
  auto m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("layer 2: expected the short convolution's weight"),
            std::string::npos)
      << m.status();
  EXPECT_NE(m.status().message().find("conv1d.weight, [64, 1, 4]"), std::string::npos)
      << m.status();
  // A weight of the wrong size is refused by its name too.
  WriteSafetensors(
      dir_ / "model.safetensors",
      {{"model.layers.0.linear_attn.A_log", {0.5f, -1.0f}},
       {"model.layers.0.linear_attn.dt_bias", {0.25f, 2.0f}},
       {"model.layers.0.linear_attn.conv1d.weight", ConvWeight(kConvValues, 1.f)},
       {"model.layers.2.linear_attn.A_log", {1.5f, 3.0f}},
       {"model.layers.2.linear_attn.dt_bias", {-0.5f, 0.125f}},
       {"model.layers.2.linear_attn.conv1d.weight", ConvWeight(kConvValues - 1, 1.f)}});
  m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  EXPECT_NE(m.status().message().find("model.layers.2.linear_attn.conv1d.weight: expected 256"),
            std::string::npos)
      << m.status();
}

// A convolution weight of the right size in another order ([W, C] for [C, 1, W]) would be read
// scrambled: refused by its name, with the shape expected. (It used to be read: only the
// element count was checked.)
TEST_F(Safetensors, AWeightOfTheRightSizeInAnotherShapeIsRefused) {
  WriteSafetensors(dir_ / "model.safetensors",
                   {{"model.layers.0.linear_attn.A_log", {0.5f, -1.0f}},
                    {"model.layers.0.linear_attn.dt_bias", {0.25f, 2.0f}},
                    {"model.layers.0.linear_attn.conv1d.weight", ConvWeight(kConvValues, 1.f)},
                    {"model.layers.2.linear_attn.A_log", {1.5f, 3.0f}},
                    {"model.layers.2.linear_attn.dt_bias", {-0.5f, 0.125f}},
                    {"model.layers.2.linear_attn.conv1d.weight", ConvWeight(kConvValues, 1.f)}},
                   false, {{"model.layers.2.linear_attn.conv1d.weight", "[4,64]"}});
  auto m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find(
                "model.layers.2.linear_attn.conv1d.weight: expected shape [64, 1, 4] (or 256 "
                "elements flat), got [4, 64]"),
            std::string::npos)
      << m.status();
}

TEST_F(Safetensors, NoCheckpointKeepsTheSeed) {
  auto m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_TRUE(m->params_from_seed);
}

TEST_F(Safetensors, TensorsThatDoNotFitAreRefusedByName) {
  WriteSafetensors(dir_ / "model.safetensors",
                   {{"model.layers.0.linear_attn.A_log", {0.5f, -1.0f, 7.0f}},
                    {"model.layers.0.linear_attn.dt_bias", {0.25f, 2.0f}},
                    {"model.layers.2.linear_attn.A_log", {1.5f, 3.0f}},
                    {"model.layers.2.linear_attn.dt_bias", {-0.5f, 0.125f}}});
  auto m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(m.status().message().find("model.layers.0.linear_attn.A_log: expected 2"),
            std::string::npos)
      << m.status();
  WriteSafetensors(dir_ / "model.safetensors",
                   {{"model.layers.0.linear_attn.A_log", {0.5f, -1.0f}},
                    {"model.layers.0.linear_attn.dt_bias", {0.25f, 2.0f}}});
  m = ModelFromHfConfigFile((dir_ / "config.json").string(), -1, 0);
  EXPECT_NE(m.status().message().find("expected A_log and dt_bias for 2"), std::string::npos)
      << m.status();
}

// One safetensors file for tiny-gdn (4 layers, HV = 4) whose layer-0 A_log entry is
// `a_log_entry` (the JSON of its value); the other tensors are valid.
std::string HostileFile(const std::string& a_log_entry, uint64_t announced_header = 0) {
  std::string header = "{\"model.layers.0.linear_attn.A_log\":" + a_log_entry;
  std::string data(16, '\0');
  for (int l = 0; l < 4; ++l) {
    for (const char* what : {"A_log", "dt_bias"}) {
      if (l == 0 && std::string(what) == "A_log") continue;
      absl::StrAppend(&header, ",\"model.layers.", l, ".linear_attn.", what,
                      "\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[", data.size(), ",",
                      data.size() + 16, "]}");
      data.append(16, '\0');
    }
  }
  header += "}";
  const uint64_t n = announced_header ? announced_header : header.size();
  return std::string(reinterpret_cast<const char*>(&n), 8) + header + data;
}

// tiny-gdn without its short convolution: these files carry A_log and dt_bias only (the
// convolution's tensors have their own tests above).
cache::ModelSpec WithoutConv() {
  auto m = cache::ModelPreset("tiny-gdn");
  EXPECT_TRUE(m.ok());
  m->conv_width = 0;
  for (cache::LayerParams& p : m->layers) p.conv_weight.clear();
  return *m;
}

absl::Status LoadHostile(const std::string& file) {
  std::optional<cache::ModelSpec> m = WithoutConv();
  const std::vector<float> before = m->layers[0].a_log;
  absl::StatusOr<bool> loaded = LoadLayerParamsFromBuffers({{"model.safetensors", file}}, ".", &*m);
  if (!loaded.ok()) {
    EXPECT_EQ(m->layers[0].a_log, before) << "a refused checkpoint changes nothing";
  }
  return loaded.status();
}

// Found by fuzz/ (safetensors target) or by reading the parser: each was accepted, or cast a
// JSON number to an integer it cannot hold (undefined behaviour), or allocated what the file
// announced before looking at the file's size.
TEST(SafetensorsHeader, HostileEntriesAreRefusedNamingTheTensorAndKey) {
  const std::string ok = R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})";
  ASSERT_TRUE(LoadHostile(HostileFile(ok)).ok()) << LoadHostile(HostileFile(ok));
  const struct {
    const char* entry;
    const char* error;
  } cases[] = {
      {R"({"dtype":"F32","shape":[-2,-2],"data_offsets":[0,16]})", "A_log.shape: expected"},
      {R"({"dtype":"F32","shape":[1e30,1e30],"data_offsets":[0,16]})", "A_log.shape: expected"},
      {R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,16]})", "A_log.shape: expected"},
      {R"({"dtype":"F32","shape":"4","data_offsets":[0,16]})", "A_log.shape: expected a list"},
      {R"({"dtype":"F32","shape":[4],"data_offsets":[1e300,1e300]})", "A_log.data_offsets"},
      {R"({"dtype":"F32","shape":[4],"data_offsets":[-16,0]})", "A_log.data_offsets"},
      {R"({"dtype":"F32","shape":[4],"data_offsets":[16,0]})", "A_log.data_offsets"},
      {R"({"dtype":"F32","shape":[4],"data_offsets":[4096,4112]})", "A_log.data_offsets"},
      {R"({"dtype":"F32","shape":[4],"data_offsets":[0]})", "A_log.data_offsets"},
  };
  for (const auto& c : cases) {
    const absl::Status s = LoadHostile(HostileFile(c.entry));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.entry;
    EXPECT_NE(s.message().find(c.error), std::string::npos) << c.entry << ": " << s;
  }
}

TEST(SafetensorsHeader, AHeaderLongerThanTheFileIsRefusedBeforeAllocating) {
  const absl::Status s = LoadHostile(
      HostileFile(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})", uint64_t{1} << 29));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("truncated safetensors header (536870912 bytes announced"),
            std::string::npos)
      << s;
}

TEST(SafetensorsHeader, ATensorTwiceOrANonFiniteParameterIsRefused) {
  std::string twice = HostileFile(R"({"dtype":"F32","shape":[4],"data_offsets":[0,16]})");
  cache::ModelSpec m = WithoutConv();
  auto loaded =
      LoadLayerParamsFromBuffers({{"a.safetensors", twice}, {"b.safetensors", twice}}, ".", &m);
  EXPECT_NE(loaded.status().message().find("appears twice"), std::string::npos) << loaded.status();
  std::string nan = twice;
  const uint32_t bits = 0x7fc00000u;
  std::memcpy(nan.data() + nan.size() - 8 * 16 + 4, &bits, 4);  // layer 0's A_log, value 1
  const absl::Status s = LoadHostile(nan);
  EXPECT_NE(s.message().find("A_log: expected finite values, got nan at index 1"),
            std::string::npos)
      << s;
}

}  // namespace
}  // namespace replayssm::service
