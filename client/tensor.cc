#include "replayssm/client/tensor.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace replayssm::client {

uint16_t FloatToBf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float Bf16ToFloat(uint16_t x) {
  const uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t FloatToF16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t abs = u & 0x7fffffffu;
  if (abs >= 0x7f800000u)
    return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {                                               // subnormal or zero in f16
    float f;
    std::memcpy(&f, &abs, 4);
    const uint32_t m = static_cast<uint32_t>(std::nearbyint(f * 16777216.0f));  // / 2^-24
    return static_cast<uint16_t>(sign | m);
  }
  uint32_t r = abs + 0xfffu + ((abs >> 13) & 1u);
  r -= 0x38000000u;  // rebias 127 -> 15
  return static_cast<uint16_t>(sign | (r >> 13));
}

float F16ToFloat(uint16_t x) {
  const uint32_t sign = static_cast<uint32_t>(x & 0x8000u) << 16;
  const uint32_t exp = (x >> 10) & 0x1fu;
  const uint32_t man = x & 0x3ffu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    f = man ? NAN : INFINITY;
  } else {
    f = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u |= sign;
  std::memcpy(&f, &u, 4);
  return f;
}

size_t DtypeSize(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_F32:
      return 4;
    case v1::DTYPE_BF16:
    case v1::DTYPE_F16:
      return 2;
    default:
      return 0;
  }
}

v1::Tensor MakeTensor(v1::DType dtype, const std::vector<int64_t>& shape,
                      absl::Span<const float> values) {
  v1::Tensor t;
  t.set_dtype(dtype);
  for (int64_t d : shape) t.add_shape(d);
  std::string* data = t.mutable_data();
  data->resize(values.size() * DtypeSize(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    if (dtype == v1::DTYPE_F32) {
      std::memcpy(data->data() + 4 * i, &values[i], 4);
    } else {
      const uint16_t h = dtype == v1::DTYPE_BF16 ? FloatToBf16(values[i]) : FloatToF16(values[i]);
      std::memcpy(data->data() + 2 * i, &h, 2);
    }
  }
  return t;
}

std::vector<float> ToFloats(const v1::Tensor& tensor) {
  const size_t size = DtypeSize(tensor.dtype());
  if (size == 0) return {};
  std::vector<float> out(tensor.data().size() / size);
  const char* p = tensor.data().data();
  for (size_t i = 0; i < out.size(); ++i) {
    if (tensor.dtype() == v1::DTYPE_F32) {
      std::memcpy(&out[i], p + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      out[i] = tensor.dtype() == v1::DTYPE_BF16 ? Bf16ToFloat(h) : F16ToFloat(h);
    }
  }
  return out;
}

v1::Tensor SliceTokens(const v1::Tensor& tensor, int64_t begin, int64_t count) {
  v1::Tensor t;
  t.set_dtype(tensor.dtype());
  const int64_t n = tensor.shape_size() > 0 ? tensor.shape(0) : 0;
  const size_t row = n > 0 ? tensor.data().size() / static_cast<size_t>(n) : 0;
  t.add_shape(count);
  for (int i = 1; i < tensor.shape_size(); ++i) t.add_shape(tensor.shape(i));
  t.set_data(
      tensor.data().substr(static_cast<size_t>(begin) * row, static_cast<size_t>(count) * row));
  return t;
}

v1::LayerInput SliceTokens(const v1::LayerInput& input, int64_t begin, int64_t count) {
  v1::LayerInput out;
  out.set_layer(input.layer());
  *out.mutable_mixed_qkv() = SliceTokens(input.mixed_qkv(), begin, count);
  *out.mutable_a() = SliceTokens(input.a(), begin, count);
  *out.mutable_b() = SliceTokens(input.b(), begin, count);
  return out;
}

v1::Tensor ConcatTokens(absl::Span<const v1::Tensor> parts) {
  v1::Tensor t;
  if (parts.empty()) return t;
  t.set_dtype(parts[0].dtype());
  int64_t n = 0;
  for (const v1::Tensor& p : parts) {
    n += p.shape(0);
    t.mutable_data()->append(p.data());
  }
  t.add_shape(n);
  for (int i = 1; i < parts[0].shape_size(); ++i) t.add_shape(parts[0].shape(i));
  return t;
}

bool AllClose(const v1::Tensor& got, const v1::Tensor& want, double atol, double rtol,
              std::string* why) {
  if (!std::equal(got.shape().begin(), got.shape().end(), want.shape().begin(),
                  want.shape().end())) {  // the same count of values in another shape is not
    if (why) {
      *why = absl::StrCat("shape [", absl::StrJoin(got.shape(), ", "), "] vs [",
                          absl::StrJoin(want.shape(), ", "), "]");
    }
    return false;
  }
  const std::vector<float> g = ToFloats(got), w = ToFloats(want);
  if (g.size() != w.size() || g.empty()) {  // empty: nothing was compared, which is no match
    if (why) *why = absl::StrCat("size ", g.size(), " vs ", w.size());
    return false;
  }
  for (size_t i = 0; i < g.size(); ++i) {
    const double err = std::fabs(static_cast<double>(g[i]) - w[i]);
    if (!(err <= atol + rtol * std::fabs(w[i]))) {
      if (why) *why = absl::StrCat("element ", i, ": got ", g[i], ", want ", w[i]);
      return false;
    }
  }
  return true;
}

double OutputTolerance(v1::DType act_dtype) {
  switch (act_dtype) {
    case v1::DTYPE_F32:
      return 1e-4;  // replay vs plain recurrence: fp32 reassociation
    case v1::DTYPE_F16:
      return 5e-3;  // ~5 ulp of f16
    default:
      return 3e-2;  // bf16: 8-bit mantissa, ~4 ulp
  }
}

std::vector<v1::LayerInput> SyntheticLayers(const v1::ModelInfo& model, int64_t n, uint64_t seed) {
  const int64_t h = model.num_qk_heads(), hv = model.num_v_heads();
  const int64_t k = model.head_k(), v = model.head_v();
  const int64_t qkv = 2 * h * k + hv * v;
  const bool kda = model.gate() == v1::GATE_KDA;
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(n));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto fill = [&](int64_t count) {
    std::vector<float> x(static_cast<size_t>(count));
    for (float& e : x) e = u(rng);
    return x;
  };
  // A TP server takes each rank's tensors rank-major: [tp, n, width / tp] (random values
  // either way, so only the shape differs).
  const int64_t tp = std::max<int64_t>(1, model.tp_size());
  auto shape = [&](std::vector<int64_t> dims) {
    if (tp == 1) return dims;
    dims[1] /= tp;
    dims.insert(dims.begin(), tp);
    return dims;
  };
  std::vector<v1::LayerInput> layers(static_cast<size_t>(model.num_layers()));
  for (int32_t l = 0; l < model.num_layers(); ++l) {
    v1::LayerInput& in = layers[l];
    in.set_layer(l);
    *in.mutable_mixed_qkv() = MakeTensor(model.act_dtype(), shape({n, qkv}), fill(n * qkv));
    if (kda) {
      *in.mutable_a() = MakeTensor(model.act_dtype(), shape({n, hv, k}), fill(n * hv * k));
    } else {
      *in.mutable_a() = MakeTensor(model.act_dtype(), shape({n, hv}), fill(n * hv));
    }
    *in.mutable_b() = MakeTensor(model.act_dtype(), shape({n, hv}), fill(n * hv));
  }
  return layers;
}

}  // namespace replayssm::client
