// Wire tensors for clients: dtype conversion (f32/bf16/f16 <-> float), construction,
// comparison, slicing by token, and deterministic synthetic activations for demos and tests.
// Plain functions; thread-safe.
#ifndef REPLAYSSM_CLIENT_TENSOR_H_
#define REPLAYSSM_CLIENT_TENSOR_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"
#include "replayssm/v1/replayssm.pb.h"

namespace replayssm::client {

uint16_t FloatToBf16(float x);  // round to nearest even
float Bf16ToFloat(uint16_t x);
uint16_t FloatToF16(float x);  // round to nearest even
float F16ToFloat(uint16_t x);
size_t DtypeSize(v1::DType dtype);  // 0 when unspecified

v1::Tensor MakeTensor(v1::DType dtype, const std::vector<int64_t>& shape,
                      absl::Span<const float> values);
std::vector<float> ToFloats(const v1::Tensor& tensor);

// Tokens [begin, begin + count) of a tensor whose first dimension is tokens.
v1::Tensor SliceTokens(const v1::Tensor& tensor, int64_t begin, int64_t count);
v1::LayerInput SliceTokens(const v1::LayerInput& input, int64_t begin, int64_t count);
// Concatenates tensors along the token dimension (same dtype and trailing shape).
v1::Tensor ConcatTokens(absl::Span<const v1::Tensor> parts);

// |got - want| <= atol + rtol * |want| everywhere; otherwise false and `why` says where.
bool AllClose(const v1::Tensor& got, const v1::Tensor& want, double atol, double rtol,
              std::string* why);
// Tolerances for comparing outputs in an act dtype against the fp32 reference.
double OutputTolerance(v1::DType act_dtype);

// Activations for `n` tokens of every layer, uniform in [-1, 1], a pure function of
// (model shape, n, seed): layers[i].layer == i. With model.tp_size > 1 the tensors have the
// shapes a TP server takes, [tp_size, n, width / tp_size].
std::vector<v1::LayerInput> SyntheticLayers(const v1::ModelInfo& model, int64_t n, uint64_t seed);

}  // namespace replayssm::client

#endif  // REPLAYSSM_CLIENT_TENSOR_H_
