// CpuReference: what the server's outputs should be, computed in-process by the kernel C ABI's
// CPU backend as the plain recurrence (baseline decode: the fp32 state is rewritten every
// token; no ring, no folds, no snapshots). It shares nothing with the server's cache but the
// math, so it checks the whole service path: ring replay, folds, cursors, prefix copies.
//
// Sequences are numbered 0..capacity-1. Not thread-safe.
#ifndef REPLAYSSM_CLIENT_REFERENCE_H_
#define REPLAYSSM_CLIENT_REFERENCE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "replayssm/kernels.h"
#include "replayssm/v1/replayssm.pb.h"

namespace replayssm::client {

class CpuReference {
 public:
  static absl::StatusOr<std::unique_ptr<CpuReference>> Create(const v1::ModelInfo& model,
                                                              int32_t capacity);

  // A sequence at seq_len 0 (zero state).
  absl::StatusOr<int32_t> NewSequence();
  // A copy of `seq`'s state.
  absl::StatusOr<int32_t> Fork(int32_t seq);
  void Release(int32_t seq);

  // Runs N tokens of every layer (layers[l] holds N tokens) from the sequence's state;
  // outputs [num_layers] of [N, HV, V] in the act dtype.
  absl::StatusOr<std::vector<v1::Tensor>> Prefill(int32_t seq,
                                                  absl::Span<const v1::LayerInput> layers);
  // The same for one layer (input.layer()): a layer-by-layer prefill's reference.
  absl::StatusOr<v1::Tensor> PrefillLayer(int32_t seq, const v1::LayerInput& input);
  // One decode step for a batch: seqs[r] (or -1 = padding) consumes row r of every layer.
  absl::StatusOr<std::vector<v1::Tensor>> Decode(absl::Span<const int32_t> seqs,
                                                 absl::Span<const v1::LayerInput> layers);
  // The fp32 state of one layer, [HV, V, K].
  std::vector<float> State(int32_t seq, int32_t layer) const;
  // The short convolution's window of one layer ([W-1, C] in the act dtype, the bytes an
  // export's conv_windows carry); empty for a model without a convolution.
  std::string ConvWindow(int32_t seq, int32_t layer) const;

 private:
  CpuReference(const v1::ModelInfo& model, int32_t capacity);

  v1::ModelInfo model_;
  rssm_layer_shape shape_{};
  int32_t capacity_;
  std::vector<bool> used_;
  // The short convolution of n tokens of layer l for rows seqs (-1: padding): in.mixed_qkv
  // then points at its outputs (held in the layer's conv_out).
  absl::Status Convolve(int32_t l, absl::Span<const int32_t> seqs, const int32_t* cu,
                        int32_t max_tokens, rssm_token_inputs& in);

  struct Layer {
    std::vector<float> a_log, dt_bias, state, ring_d, ring_k, ring_g;
    rssm_layer_params params{};
    rssm_state_pool pool{};
    std::vector<float> conv_weight, conv_bias;
    std::string window, ring_x, conv_out;  // act dtype
    rssm_conv_state conv{};
  };
  rssm_conv_shape conv_shape_{};
  std::vector<Layer> layers_;
};

}  // namespace replayssm::client

#endif  // REPLAYSSM_CLIENT_REFERENCE_H_
