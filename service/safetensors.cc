#include "service/safetensors.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <istream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/span.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace replayssm::service {
namespace {

struct TensorRef {
  std::string file;
  std::string name;
  std::string dtype;
  int64_t numel = 0;
  std::vector<int64_t> dims;    // the header's shape
  uint64_t begin = 0, end = 0;  // absolute file offsets
};

// The per-layer tensors read from a checkpoint, by the end of their Hugging Face names.
enum class Param { kALog, kDtBias, kConv, kConvBias, kQConv, kKConv, kVConv, kQConvBias,
                   kKConvBias, kVConvBias };
constexpr std::pair<const char*, Param> kParamSuffixes[] = {
    {".A_log", Param::kALog},
    {".dt_bias", Param::kDtBias},
    {".conv1d.weight", Param::kConv},  // Qwen3-Next: linear_attn.conv1d ([C, 1, W])
    {".conv1d.bias", Param::kConvBias},
    {".q_conv1d.weight", Param::kQConv},  // Kimi-Linear: one convolution each for q, k, v
    {".k_conv1d.weight", Param::kKConv},
    {".v_conv1d.weight", Param::kVConv},
    {".q_conv1d.bias", Param::kQConvBias},
    {".k_conv1d.bias", Param::kKConvBias},
    {".v_conv1d.bias", Param::kVConvBias},
};

// For a name like `model.layers.12.linear_attn.A_log`: the layer (12) and which parameter;
// nullopt for any other tensor. (".q_conv1d.weight" also ends with ".conv1d.weight": the
// longest suffix wins.)
std::optional<std::pair<int, Param>> MatchParam(const std::string& name) {
  std::optional<Param> param;
  size_t matched = 0;
  for (const auto& [suffix, p] : kParamSuffixes) {
    const size_t n = std::strlen(suffix);
    if (n > matched && absl::EndsWith(name, suffix)) {
      param = p;
      matched = n;
    }
  }
  if (!param) return std::nullopt;
  const size_t at = name.find("layers.");
  if (at == std::string::npos) return std::nullopt;
  size_t i = at + 7, digits = 0;
  int layer = 0;
  while (i < name.size() && absl::ascii_isdigit(name[i]) && digits < 6) {
    layer = layer * 10 + (name[i++] - '0');
    ++digits;
  }
  if (digits == 0 || i >= name.size() || name[i] != '.') return std::nullopt;
  return std::make_pair(layer, *param);
}

using TensorMap = std::map<Param, std::map<int, TensorRef>>;

constexpr uint64_t kMaxHeaderBytes = uint64_t{1} << 30;  // HF headers are a few MB at most
constexpr double kMaxOffset = 9007199254740992.0;        // 2^53: exact in a JSON number
constexpr int64_t kMaxDim = int64_t{1} << 31;
constexpr int64_t kMaxElements = int64_t{1} << 40;

// Opens a file of the checkpoint by name: a file on disk, or a buffer (fuzz target, tests).
using Opener = absl::FunctionRef<std::unique_ptr<std::istream>(const std::string&)>;

absl::Status EntryError(const std::string& path, const std::string& name, absl::string_view what,
                        absl::string_view expected, absl::string_view got) {
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": ", name, ".", what, ": expected ", expected, ", got ", got));
}

// `value` as an integer in [0, max]; nullopt for anything else (a string, a fraction, NaN).
std::optional<double> Whole(const google::protobuf::Value& value, double max) {
  if (value.kind_case() != google::protobuf::Value::kNumberValue) return std::nullopt;
  const double x = value.number_value();
  if (!(x >= 0 && x <= max) || x != std::floor(x)) return std::nullopt;
  return x;
}

// `shape`'s dimensions into t->dims and their product into t->numel (non-negative integer
// dimensions, at most 2^40 elements).
absl::Status Dims(const google::protobuf::Value& shape, const std::string& path,
                  const std::string& name, TensorRef* t) {
  if (shape.kind_case() != google::protobuf::Value::kListValue) {
    return EntryError(path, name, "shape", "a list", "another JSON type");
  }
  int64_t numel = 1;
  for (const auto& d : shape.list_value().values()) {
    const std::optional<double> x = Whole(d, static_cast<double>(kMaxDim - 1));
    if (!x) return EntryError(path, name, "shape", "integers in 0..2^31-1", "another value");
    const int64_t dim = static_cast<int64_t>(*x);
    if (dim != 0 && numel > kMaxElements / dim) {
      return EntryError(path, name, "shape", "at most 2^40 elements", "more");
    }
    numel *= dim;
    t->dims.push_back(dim);
  }
  t->numel = numel;
  return absl::OkStatus();
}

// One entry of the header: `data_offsets` within the `data_bytes` after the header.
absl::StatusOr<TensorRef> Entry(const std::string& path, const std::string& name,
                                const google::protobuf::Value& value, uint64_t data_start,
                                uint64_t data_bytes) {
  const auto& f = value.struct_value().fields();
  if (!f.count("dtype") || !f.count("shape") || !f.count("data_offsets")) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, ": incomplete entry"));
  }
  TensorRef t;
  t.file = path;
  t.name = name;
  t.dtype = f.at("dtype").string_value();
  if (absl::Status s = Dims(f.at("shape"), path, name, &t); !s.ok()) return s;
  const auto& off = f.at("data_offsets").list_value().values();
  const std::optional<double> begin = off.size() == 2 ? Whole(off[0], kMaxOffset) : std::nullopt;
  const std::optional<double> end = off.size() == 2 ? Whole(off[1], kMaxOffset) : std::nullopt;
  if (!begin || !end || *begin > *end || *end > static_cast<double>(data_bytes)) {
    return EntryError(
        path, name, "data_offsets",
        absl::StrCat("[begin, end] with 0 <= begin <= end <= ", data_bytes, " (the data's bytes)"),
        "another value");
  }
  t.begin = data_start + static_cast<uint64_t>(*begin);
  t.end = data_start + static_cast<uint64_t>(*end);
  return t;
}

// name -> tensor, for every per-layer parameter of a numbered layer in one file.
absl::Status ScanFile(const std::string& path, std::istream& in, TensorMap* found) {
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.seekg(0);
  uint64_t header_len = 0;
  if (size < 8 || !in.read(reinterpret_cast<char*>(&header_len), 8) ||
      header_len > kMaxHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a safetensors file"));
  }
  const uint64_t bytes = static_cast<uint64_t>(size) - 8;
  if (header_len > bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated safetensors header (",
                                                   header_len, " bytes announced, ", bytes,
                                                   " in the file)"));
  }
  std::string header(header_len, '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(header_len))) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": truncated safetensors header"));
  }
  google::protobuf::Struct root;
  if (!google::protobuf::util::JsonStringToMessage(header, &root).ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": the safetensors header is not JSON"));
  }
  for (const auto& [name, value] : root.fields()) {
    const std::optional<std::pair<int, Param>> m = MatchParam(name);
    if (!m) continue;
    absl::StatusOr<TensorRef> t = Entry(path, name, value, 8 + header_len, bytes - header_len);
    if (!t.ok()) return t.status();
    if (!(*found)[m->second].emplace(m->first, *std::move(t)).second) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": ", name, ": layer ", m->first,
                                                     "'s tensor appears twice in the checkpoint"));
    }
  }
  return absl::OkStatus();
}

float HalfToFloat(uint16_t h, bool bf16) {
  if (bf16) {
    const uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // subnormal or zero: exact in fp32
    const float v = static_cast<float>(mant) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// `dims` without its dimensions of 1.
std::vector<int64_t> Squeezed(absl::Span<const int64_t> dims) {
  std::vector<int64_t> out;
  for (int64_t d : dims) {
    if (d != 1) out.push_back(d);
  }
  return out;
}

// The tensor's values as floats. Its shape must be `want` (`what` names its dimensions), up
// to dimensions of 1, or a flat vector of as many elements: both are `want` in row-major
// order. Any other shape of the same count (a [W, C] convolution weight for [C, 1, W]) would
// be read in the wrong order, and is refused.
absl::StatusOr<std::vector<float>> Read(const TensorRef& t, absl::Span<const int64_t> want_dims,
                                        const std::string& what, Opener open) {
  int64_t want = 1;
  for (int64_t d : want_dims) want *= d;
  if (t.numel != want) {
    return absl::InvalidArgumentError(absl::StrCat(t.file, ": ", t.name, ": expected ", want,
                                                   " elements (", what, "), got ", t.numel));
  }
  const std::vector<int64_t> got = Squeezed(t.dims);
  if (got != Squeezed(want_dims) && got.size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(t.file, ": ", t.name, ": expected shape ", what,
                                                   " (or ", want, " elements flat), got [",
                                                   absl::StrJoin(t.dims, ", "), "]"));
  }
  const size_t es = t.dtype == "F32" ? 4 : (t.dtype == "BF16" || t.dtype == "F16") ? 2 : 0;
  if (es == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(t.file, ": ", t.name, ": expected dtype F32, BF16 or F16, got ", t.dtype));
  }
  if (t.end - t.begin != es * static_cast<uint64_t>(want)) {
    return absl::InvalidArgumentError(absl::StrCat(t.file, ": ", t.name, ": data size mismatch"));
  }
  std::unique_ptr<std::istream> in = open(t.file);
  std::vector<char> raw(t.end - t.begin);
  in->seekg(static_cast<std::streamoff>(t.begin));
  if (!in->read(raw.data(), static_cast<std::streamsize>(raw.size()))) {
    return absl::InvalidArgumentError(absl::StrCat(t.file, ": ", t.name, ": truncated data"));
  }
  std::vector<float> out(want);
  for (int64_t i = 0; i < want; ++i) {
    if (es == 4) {
      std::memcpy(&out[i], &raw[i * 4], 4);
    } else {
      uint16_t h;
      std::memcpy(&h, &raw[i * 2], 2);
      out[i] = HalfToFloat(h, t.dtype == "BF16");
    }
    if (!std::isfinite(out[i])) {  // a NaN parameter would poison every state
      return absl::InvalidArgumentError(absl::StrCat(
          t.file, ": ", t.name, ": expected finite values, got ", out[i], " at index ", i));
    }
  }
  return out;
}

// LoadLayerParams over `files`, each opened through `open`.
absl::StatusOr<bool> LoadFrom(const std::vector<std::string>& files, Opener open,
                              const std::string& dir, cache::ModelSpec* m) {
  TensorMap found;
  for (const std::string& f : files) {
    std::unique_ptr<std::istream> in = open(f);
    absl::Status s = ScanFile(f, *in, &found);
    if (!s.ok()) return s;
  }
  std::map<int, TensorRef>& a_log = found[Param::kALog];
  std::map<int, TensorRef>& dt_bias = found[Param::kDtBias];
  if (a_log.empty() && dt_bias.empty()) return false;
  if (static_cast<int32_t>(a_log.size()) != m->num_layers || a_log.size() != dt_bias.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        dir, ": expected A_log and dt_bias for ", m->num_layers,
        " linear-attention layers, got ", a_log.size(), " A_log and ", dt_bias.size(), " dt_bias"));
  }
  const int64_t hv = m->shape.num_v_heads;
  const bool kda = m->shape.gate == RSSM_GATE_KDA;
  const int64_t head_k = m->shape.head_k;
  const int64_t qk = int64_t{m->shape.num_qk_heads} * head_k;
  const int64_t vw = hv * m->shape.head_v;
  const int64_t W = m->conv_width;
  std::vector<cache::LayerParams> layers = m->layers;
  auto a = a_log.begin();
  auto d = dt_bias.begin();
  for (int32_t l = 0; l < m->num_layers; ++l, ++a, ++d) {
    if (a->first != d->first) {
      return absl::InvalidArgumentError(absl::StrCat(dir, ": layer ", a->first,
                                                     " has A_log but its dt_bias is missing"));
    }
    absl::StatusOr<std::vector<float>> av = Read(a->second, {hv}, "[HV]", open);
    if (!av.ok()) return av.status();
    absl::StatusOr<std::vector<float>> dv = kda ? Read(d->second, {hv, head_k}, "[HV, K]", open)
                                                : Read(d->second, {hv}, "[HV]", open);
    if (!dv.ok()) return dv.status();
    layers[l].a_log = *std::move(av);
    layers[l].dt_bias = *std::move(dv);
    if (W == 0) continue;
    // The short convolution: GDN one conv1d over q|k|v; KDA q_conv1d, k_conv1d, v_conv1d,
    // concatenated in mixed_qkv's channel order. Weight [C, 1, W] -> [C, W] row-major.
    struct Part {
      Param weight, bias;
      int64_t channels;
      const char* name;
    };
    std::vector<Part> parts;
    if (kda) {
      parts = {{Param::kQConv, Param::kQConvBias, qk, "q_conv1d"},
               {Param::kKConv, Param::kKConvBias, qk, "k_conv1d"},
               {Param::kVConv, Param::kVConvBias, vw, "v_conv1d"}};
    } else {
      parts = {{Param::kConv, Param::kConvBias, 2 * qk + vw, "conv1d"}};
    }
    std::vector<float> weight, bias;
    int biases = 0;
    for (const Part& p : parts) {
      auto w = found[p.weight].find(a->first);
      if (w == found[p.weight].end()) {
        return absl::InvalidArgumentError(absl::StrCat(
            dir, ": layer ", a->first, ": expected the short convolution's weight (a tensor "
            "named ...layers.", a->first, ".<module>.", p.name, ".weight, [", p.channels, ", 1, ",
            W, "]) beside its A_log (", a->second.name, "), got none"));
      }
      absl::StatusOr<std::vector<float>> wv =
          Read(w->second, {p.channels, 1, W}, absl::StrCat("[", p.channels, ", 1, ", W, "]"), open);
      if (!wv.ok()) return wv.status();
      weight.insert(weight.end(), wv->begin(), wv->end());
      auto b = found[p.bias].find(a->first);
      if (b == found[p.bias].end()) {
        bias.insert(bias.end(), p.channels, 0.f);
        continue;
      }
      absl::StatusOr<std::vector<float>> bv =
          Read(b->second, {p.channels}, absl::StrCat("[", p.channels, "]"), open);
      if (!bv.ok()) return bv.status();
      bias.insert(bias.end(), bv->begin(), bv->end());
      ++biases;
    }
    layers[l].conv_weight = std::move(weight);
    if (biases > 0) {
      layers[l].conv_bias = std::move(bias);
    } else {
      layers[l].conv_bias.clear();
    }
  }
  m->layers = std::move(layers);
  m->params_from_seed = false;
  return true;
}

}  // namespace

absl::StatusOr<bool> LoadLayerParams(const std::string& dir, cache::ModelSpec* m) {
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".safetensors") files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return LoadFrom(
      files,
      [](const std::string& f) -> std::unique_ptr<std::istream> {
        return std::make_unique<std::ifstream>(f, std::ios::binary);
      },
      dir, m);
}

absl::StatusOr<bool> LoadLayerParamsFromBuffers(const std::map<std::string, std::string>& files,
                                                const std::string& dir, cache::ModelSpec* m) {
  std::vector<std::string> names;
  for (const auto& [name, bytes] : files) names.push_back(name);
  return LoadFrom(
      names,
      [&files](const std::string& f) -> std::unique_ptr<std::istream> {
        return std::make_unique<std::istringstream>(files.at(f), std::ios::binary);
      },
      dir, m);
}

}  // namespace replayssm::service
