// SlotPool: the backend memory of N slots for every layer of a model (checkpoint followed by
// the convolution window, ring d, k, g and the convolution's ring x), and the kernel calls that act
// on whole slots across all layers (fold, copy, zero, read, write). It knows nothing of ids,
// cursors or snapshots: StateCache does. Every call only queues its work on the caller's lane; the
// caller synchronizes the lane when it needs the result (Lane::Synchronize).
//
// Thread safety: calls on disjoint slots may run concurrently (on different lanes).
#ifndef REPLAYSSM_CACHE_SLOT_POOL_H_
#define REPLAYSSM_CACHE_SLOT_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "device_buffer.h"
#include "lane.h"
#include "replayssm/cache/io_memory.h"
#include "replayssm/cache/model.h"

namespace replayssm::cache {

class SlotPool {
 public:
  static absl::StatusOr<std::unique_ptr<SlotPool>> Create(const ModelSpec& model,
                                                          int32_t backend, int64_t num_slots);

  int64_t num_slots() const { return num_slots_; }
  int32_t backend() const { return backend_; }
  const ModelSpec& model() const { return model_; }
  rssm_state_pool LayerPool(int32_t layer) const;
  rssm_layer_params LayerParams(int32_t layer) const;
  // The convolution of a layer (has_conv() only): its state in the pool, weight and bias.
  bool has_conv() const { return model_.conv_width > 0; }
  rssm_conv_state LayerConv(int32_t layer) const;
  const float* ConvWeight(int32_t layer) const;
  const float* ConvBias(int32_t layer) const;  // null: no bias
  // One layer of one slot's folded state: the checkpoint and, right after it, the conv
  // window (ModelSpec::LayerStateBytes). Everything that copies a state copies these bytes.
  size_t CheckpointBytes() const;
  // Queues the count of NaN / Inf values in slot `slot`'s folded state: counts[0] over every
  // layer's checkpoint, counts[1] over the conv windows; there once the lane is synchronized.
  absl::Status CountNonfinite(int32_t slot, uint32_t counts[2], Lane& lane);

  // Folds slots[i] at cursor write_pos[i] in every layer, the convolution's window with the
  // recurrence's checkpoint (the caller resets the cursors).
  // Uses the lane's scratch fold_idx/fold_pos.
  absl::Status Fold(absl::Span<const int32_t> slots, absl::Span<const int32_t> write_pos,
                    Lane& lane);
  // dst's checkpoints <- src's (all layers). src must be folded (write_pos 0).
  absl::Status CopyCheckpoints(int32_t dst, int32_t src, Lane& lane);
  absl::Status ZeroCheckpoints(int32_t slot, Lane& lane);
  // Host memory of one layer's checkpoint: filled when the lane is synchronized (read), free
  // to reuse when the call returns (write).
  absl::Status ReadCheckpoint(int32_t slot, int32_t layer, void* host, Lane& lane) const;
  absl::Status WriteCheckpoint(int32_t slot, int32_t layer, const void* host, Lane& lane);
  // The same with `memory` saying where the caller's bytes are (backend memory: a copy on
  // the device, done when the lane is synchronized).
  absl::Status ReadCheckpoint(int32_t slot, int32_t layer, void* dst, IoMemory memory,
                              Lane& lane) const;
  absl::Status WriteCheckpoint(int32_t slot, int32_t layer, const void* src, IoMemory memory,
                               Lane& lane);
  // A whole folded state (every layer's CheckpointBytes(), layer after layer: StateBytes())
  // between a slot and pinned host memory (rssm_alloc_host), one DMA per layer on the lane:
  // the host tier's spill (Save) and promotion (Load). Done when the lane is synchronized.
  size_t StateBytes() const { return CheckpointBytes() * model_.num_layers; }
  absl::Status SaveState(int32_t slot, void* pinned, Lane& lane) const;
  absl::Status LoadState(int32_t slot, const void* pinned, Lane& lane);

 private:
  SlotPool(const ModelSpec& model, int32_t backend, int64_t num_slots)
      : model_(model), backend_(backend), num_slots_(num_slots) {}
  void* CheckpointPtr(int32_t slot, int32_t layer) const;

  struct LayerMemory {
    DeviceBuffer checkpoint, ring_d, ring_k, ring_g, ring_x;
    DeviceBuffer a_log, dt_bias, conv_weight, conv_bias;
  };
  ModelSpec model_;
  int32_t backend_;
  int64_t num_slots_;
  std::vector<LayerMemory> layers_;
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_SLOT_POOL_H_
