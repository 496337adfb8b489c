// SlotPool: the backend memory of N slots for every layer of a model (checkpoint and ring
// d, k, g), and the kernel calls that act on whole slots across all layers (fold, copy,
// zero, read, write). It knows nothing of ids, cursors or snapshots: StateCache does.
//
// Thread safety: calls on disjoint slots may run concurrently.
#ifndef REPLAYSSM_CACHE_SLOT_POOL_H_
#define REPLAYSSM_CACHE_SLOT_POOL_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "device_buffer.h"
#include "replayssm/cache/model.h"

namespace replayssm::cache {

// Backend-side scratch for one call: inputs, outputs and index arrays, grown on demand.
struct Staging {
  DeviceBuffer qkv, a, b, out;          // act dtype, [tokens, width]
  DeviceBuffer slot_idx, write_pos, cu;  // int32
  DeviceBuffer flags;                    // uint8
  absl::Status Reserve(int32_t backend, const ModelSpec& m, int64_t tokens, int64_t rows);
};

class SlotPool {
 public:
  static absl::StatusOr<std::unique_ptr<SlotPool>> Create(const ModelSpec& model,
                                                          int32_t backend, int64_t num_slots);

  int64_t num_slots() const { return num_slots_; }
  int32_t backend() const { return backend_; }
  const ModelSpec& model() const { return model_; }
  rssm_state_pool LayerPool(int32_t layer) const;
  rssm_layer_params LayerParams(int32_t layer) const;
  size_t CheckpointBytes() const;  // one layer of one slot

  // Folds slots[i] at cursor write_pos[i] in every layer (the caller resets the cursors).
  absl::Status Fold(absl::Span<const int32_t> slots, absl::Span<const int32_t> write_pos,
                    Staging& staging);
  // dst's checkpoints <- src's (all layers). src must be folded (write_pos 0).
  absl::Status CopyCheckpoints(int32_t dst, int32_t src);
  absl::Status ZeroCheckpoints(int32_t slot);
  absl::Status ReadCheckpoint(int32_t slot, int32_t layer, void* host) const;
  absl::Status WriteCheckpoint(int32_t slot, int32_t layer, const void* host);

 private:
  SlotPool(const ModelSpec& model, int32_t backend, int64_t num_slots)
      : model_(model), backend_(backend), num_slots_(num_slots) {}
  void* CheckpointPtr(int32_t slot, int32_t layer) const;

  struct LayerMemory {
    DeviceBuffer checkpoint, ring_d, ring_k, ring_g;
    DeviceBuffer a_log, dt_bias;
  };
  ModelSpec model_;
  int32_t backend_;
  int64_t num_slots_;
  std::vector<LayerMemory> layers_;
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_SLOT_POOL_H_
