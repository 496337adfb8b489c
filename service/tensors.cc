#include "service/tensors.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "service/finite.h"
#include "service/status_map.h"

namespace replayssm::service {

int32_t ToRssmDtype(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return RSSM_DTYPE_F32;
    case v1::DTYPE_BF16:
      return RSSM_DTYPE_BF16;
    case v1::DTYPE_F16:
      return RSSM_DTYPE_F16;
    default:
      return -1;
  }
}

v1::DType ToWireDtype(int32_t rssm_dtype) {
  switch (rssm_dtype) {
    case RSSM_DTYPE_F32:
      return v1::DTYPE_F32;
    case RSSM_DTYPE_BF16:
      return v1::DTYPE_BF16;
    case RSSM_DTYPE_F16:
      return v1::DTYPE_F16;
    default:
      return v1::DTYPE_UNSPECIFIED;
  }
}

std::string DtypeName(v1::DType dtype) {
  const int32_t rssm = ToRssmDtype(dtype);
  return rssm < 0 ? absl::StrCat("unspecified(", static_cast<int>(dtype), ")")
                  : rssm_dtype_name(rssm);
}

namespace {

// A TP group's activations: [tp, N, ...] with each rank's heads (TP = 1: no leading dim).
std::vector<int64_t> RankMajor(const cache::ModelSpec& model, std::vector<int64_t> shape) {
  if (model.tp_size > 1) shape.insert(shape.begin(), model.tp_size);
  return shape;
}

}  // namespace

std::vector<int64_t> QkvShape(const cache::ModelSpec& model, int64_t n) {
  return RankMajor(model, {n, model.QkvWidth() / model.tp_size});
}

std::vector<int64_t> AShape(const cache::ModelSpec& model, int64_t n) {
  const int64_t hv = model.shape.num_v_heads / model.tp_size;
  if (model.shape.gate == RSSM_GATE_KDA) return RankMajor(model, {n, hv, model.shape.head_k});
  return RankMajor(model, {n, hv});
}

std::vector<int64_t> BShape(const cache::ModelSpec& model, int64_t n) {
  return RankMajor(model, {n, model.shape.num_v_heads / model.tp_size});
}

std::vector<int64_t> OutShape(const cache::ModelSpec& model, int64_t n) {
  return RankMajor(model, {n, model.shape.num_v_heads / model.tp_size, model.shape.head_v});
}

std::vector<int64_t> CheckpointShape(const cache::ModelSpec& model) {
  return {model.shape.num_v_heads, model.shape.head_v, model.shape.head_k};
}

std::vector<int64_t> ConvWindowShape(const cache::ModelSpec& model) {
  return {model.conv_width - 1, model.QkvWidth()};
}

namespace {

std::string ShapeString(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

int64_t Elements(absl::Span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

absl::Status CheckTensor(const v1::Tensor& tensor, absl::string_view field, int32_t dtype,
                         absl::Span<const int64_t> shape) {
  if (ToRssmDtype(tensor.dtype()) != dtype) {
    return FieldError(absl::StrCat(field, ".dtype"), rssm_dtype_name(dtype),
                      DtypeName(tensor.dtype()));
  }
  const absl::Span<const int64_t> got(tensor.shape().data(), tensor.shape().size());
  if (got != shape) {
    return FieldError(absl::StrCat(field, ".shape"), ShapeString(shape), ShapeString(got));
  }
  if (tensor.has_region()) {  // the bytes are checked against the region when it is resolved
    if (tensor.data().empty()) return absl::OkStatus();
    return FieldError(absl::StrCat(field, ".data"), "no bytes (the tensor names a region)",
                      absl::StrCat(tensor.data().size(), " bytes"));
  }
  const int64_t bytes = Elements(shape) * static_cast<int64_t>(rssm_dtype_size(dtype));
  if (static_cast<int64_t>(tensor.data().size()) != bytes) {
    return FieldError(absl::StrCat(field, ".data"), absl::StrCat(bytes, " bytes"),
                      absl::StrCat(tensor.data().size(), " bytes"));
  }
  return absl::OkStatus();
}

absl::Status CheckLayerInput(const v1::LayerInput& input, absl::string_view field,
                             const cache::ModelSpec& model, int64_t n) {
  if (input.layer() < 0 || input.layer() >= model.num_layers) {
    return FieldError(absl::StrCat(field, ".layer"), absl::StrCat("0..", model.num_layers - 1),
                      absl::StrCat(input.layer()));
  }
  const int32_t act = model.shape.act_dtype;
  absl::Status s =
      CheckTensor(input.mixed_qkv(), absl::StrCat(field, ".mixed_qkv"), act, QkvShape(model, n));
  if (s.ok()) s = CheckTensor(input.a(), absl::StrCat(field, ".a"), act, AShape(model, n));
  if (s.ok()) s = CheckTensor(input.b(), absl::StrCat(field, ".b"), act, BShape(model, n));
  if (!s.ok()) return s;
  // All in regions (the output too) or all inline: one memory per layer.
  const bool regions = input.mixed_qkv().has_region();
  const struct {
    bool region;
    const char* name;
  } parts[] = {{input.a().has_region(), ".a.region"},
               {input.b().has_region(), ".b.region"},
               {input.has_out(), ".out"}};
  for (const auto& p : parts) {
    if (p.region != regions) {
      return FieldError(absl::StrCat(field, p.name),
                        regions ? "set, as mixed_qkv names a region" : "unset, as mixed_qkv is inline",
                        p.region ? "set" : "unset");
    }
  }
  // Inline activations hold no NaN or infinity (finite.h); regions are not read here.
  if (regions) return absl::OkStatus();
  const RowDim rows = model.tp_size > 1 ? RowDim::kAfterRank : RowDim::kFirst;  // RankMajor
  s = CheckFinite(input.mixed_qkv(), absl::StrCat(field, ".mixed_qkv"), act, rows);
  if (s.ok()) s = CheckFinite(input.a(), absl::StrCat(field, ".a"), act, rows);
  if (s.ok()) s = CheckFinite(input.b(), absl::StrCat(field, ".b"), act, rows);
  return s;
}

absl::Status CheckAllLayers(const LayerInputs& layers, const cache::ModelSpec& model, int64_t n) {
  if (layers.size() != model.num_layers) {
    return FieldError("layers", absl::StrCat(model.num_layers, " layers"),
                      absl::StrCat(layers.size()));
  }
  for (int i = 0; i < layers.size(); ++i) {
    const std::string field = absl::StrCat("layers[", i, "]");
    if (layers[i].layer() != i) {
      return FieldError(absl::StrCat(field, ".layer"), absl::StrCat(i),
                        absl::StrCat(layers[i].layer()));
    }
    absl::Status s = CheckLayerInput(layers[i], field, model, n);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

cache::LayerIo LayerView(const v1::LayerInput& input, const cache::ModelSpec& model, int64_t n,
                         v1::LayerOutput* output) {
  cache::LayerIo io;
  io.mixed_qkv = input.mixed_qkv().data().data();
  io.a = input.a().data().data();
  io.b = input.b().data().data();
  if (output != nullptr) {
    output->set_layer(input.layer());
    v1::Tensor* out = output->mutable_out();
    out->set_dtype(ToWireDtype(model.shape.act_dtype));
    out->clear_shape();
    for (int64_t d : OutShape(model, n)) out->add_shape(d);
    const int64_t bytes =
        n * model.OutWidth() * static_cast<int64_t>(rssm_dtype_size(model.shape.act_dtype));
    out->mutable_data()->assign(static_cast<size_t>(bytes), '\0');
    io.out = out->mutable_data()->data();
  }
  return io;
}

int64_t PayloadBytes(const LayerInputs& layers) {
  int64_t bytes = 0;
  for (const v1::LayerInput& l : layers) {
    bytes += l.mixed_qkv().data().size() + l.a().data().size() + l.b().data().size();
  }
  return bytes;
}

}  // namespace replayssm::service
