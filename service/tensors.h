// Wire tensors <-> the cache's host buffers. Every field of a request is checked here against
// the model (dtype, shape, byte count, layer index) before the cache is called, so a bad
// request touches nothing. Views point into the request's bytes: no copies.
#ifndef REPLAYSSM_SERVICE_TENSORS_H_
#define REPLAYSSM_SERVICE_TENSORS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "replayssm/cache/model.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/v1/replayssm.pb.h"

namespace replayssm::service {

using LayerInputs = google::protobuf::RepeatedPtrField<v1::LayerInput>;

// rssm_dtype <-> wire dtype. ToRssmDtype gives -1 for DTYPE_UNSPECIFIED or an unknown value.
int32_t ToRssmDtype(v1::DType dtype);
v1::DType ToWireDtype(int32_t rssm_dtype);
std::string DtypeName(v1::DType dtype);  // "bf16", "unspecified", ...

// The shapes the model expects for N tokens.
std::vector<int64_t> QkvShape(const cache::ModelSpec& model, int64_t n);
std::vector<int64_t> AShape(const cache::ModelSpec& model, int64_t n);
std::vector<int64_t> BShape(const cache::ModelSpec& model, int64_t n);
std::vector<int64_t> OutShape(const cache::ModelSpec& model, int64_t n);
std::vector<int64_t> CheckpointShape(const cache::ModelSpec& model);
// [W-1, C]: the short convolution's window of one layer (a model with conv_width > 0).
std::vector<int64_t> ConvWindowShape(const cache::ModelSpec& model);

// `field.dtype`, `field.shape` and `field.data` (byte count) against what is expected.
absl::Status CheckTensor(const v1::Tensor& tensor, absl::string_view field, int32_t dtype,
                         absl::Span<const int64_t> shape);
// One layer's inputs for N tokens, its layer index included; inline activations must be
// finite (finite.h).
absl::Status CheckLayerInput(const v1::LayerInput& input, absl::string_view field,
                             const cache::ModelSpec& model, int64_t n);
// Every layer once, in order (layers[i].layer == i), N tokens each: the unary forms. Tensors
// inline or in registered regions (CheckLayerInput's rule per layer).
absl::Status CheckAllLayers(const LayerInputs& layers, const cache::ModelSpec& model, int64_t n);

// A view of a checked input for the cache. When `output` is given, it is sized to
// [N, HV, V] in the act dtype and io.out points into it.
cache::LayerIo LayerView(const v1::LayerInput& input, const cache::ModelSpec& model, int64_t n,
                         v1::LayerOutput* output);

// Bytes of tensor payload in a message's layers (for the bytes in/out metrics).
int64_t PayloadBytes(const LayerInputs& layers);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_TENSORS_H_
