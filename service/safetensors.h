// Layer parameters from a Hugging Face checkpoint: A_log, dt_bias and the short
// convolution of every linear-attention layer, read from the *.safetensors files in a
// directory (the format: an 8-byte little-endian header length, a JSON header of name ->
// {dtype, shape, data_offsets}, then the raw data). Tensors named
// `...layers.<i>.<module>.A_log` / `.dt_bias` are taken in layer order; their count must
// equal the model's linear-attention layers and their sizes HV (A_log), HV or HV*K (dt_bias,
// GDN or KDA). With a convolution (ModelSpec::conv_width > 0) each such layer must also have
// `.conv1d.weight` [C, 1, W] (Qwen3-Next) or `.q_conv1d/.k_conv1d/.v_conv1d.weight` (Kimi-
// Linear, concatenated in q|k|v order), biases where the checkpoint has them; a checkpoint
// without them is refused, naming the tensor. F32, BF16 and F16 tensors are read.
#ifndef REPLAYSSM_SERVICE_SAFETENSORS_H_
#define REPLAYSSM_SERVICE_SAFETENSORS_H_

#include <map>
#include <string>

#include "absl/status/statusor.h"
#include "replayssm/cache/model.h"

namespace replayssm::service {

// Fills m->layers[*].a_log / dt_bias / conv_weight / conv_bias from `dir` and clears
// m->params_from_seed. Returns false
// (changing nothing) when `dir` holds no safetensors file with such tensors; an error when
// the tensors it finds do not fit the model.
// Every header is checked before it is used: its length against the file, each entry's
// shape (non-negative integers) and data_offsets (within the file's data).
absl::StatusOr<bool> LoadLayerParams(const std::string& dir, cache::ModelSpec* m);

// The same over files given as bytes (name -> contents, read in name order, as the
// directory's files are): for tests and the fuzz target.
absl::StatusOr<bool> LoadLayerParamsFromBuffers(const std::map<std::string, std::string>& files,
                                                const std::string& dir, cache::ModelSpec* m);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_SAFETENSORS_H_
