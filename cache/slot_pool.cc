#include "slot_pool.h"

#include "absl/strings/str_cat.h"

namespace replayssm::cache {

absl::StatusOr<std::unique_ptr<SlotPool>> SlotPool::Create(const ModelSpec& model,
                                                           int32_t backend, int64_t num_slots) {
  std::unique_ptr<SlotPool> pool(new SlotPool(model, backend, num_slots));
  const rssm_layer_shape& s = model.shape;
  const size_t es = rssm_dtype_size(s.state_dtype);
  pool->layers_.resize(model.num_layers);
  for (int32_t l = 0; l < model.num_layers; ++l) {
    LayerMemory& m = pool->layers_[l];
    for (auto [buf, bytes] :
         {std::pair{&m.checkpoint, num_slots * rssm_checkpoint_elems(&s) * es},
          {&m.ring_d, num_slots * rssm_ring_d_elems(&s) * es},
          {&m.ring_k, num_slots * rssm_ring_k_elems(&s) * es},
          {&m.ring_g, num_slots * rssm_ring_g_elems(&s) * 4},
          {&m.a_log, model.layers[l].a_log.size() * 4},
          {&m.dt_bias, model.layers[l].dt_bias.size() * 4}}) {
      absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(backend, static_cast<size_t>(bytes));
      if (!b.ok()) return b.status();
      *buf = std::move(*b);
    }
    absl::Status st = CopyToDevice(backend, m.a_log.data(), model.layers[l].a_log.data(), m.a_log.size());
    if (st.ok()) {
      st = CopyToDevice(backend, m.dt_bias.data(), model.layers[l].dt_bias.data(), m.dt_bias.size());
    }
    if (!st.ok()) return st;
  }
  return pool;
}

rssm_state_pool SlotPool::LayerPool(int32_t layer) const {
  const LayerMemory& m = layers_[layer];
  return rssm_state_pool{m.checkpoint.data(), m.ring_d.data(), m.ring_k.data(),
                         m.ring_g.as<float>(), num_slots_, 0, 0, 0, 0};
}

rssm_layer_params SlotPool::LayerParams(int32_t layer) const {
  const LayerMemory& m = layers_[layer];
  const cache::LayerParams& p = model_.layers[layer];
  return rssm_layer_params{m.a_log.as<const float>(), m.dt_bias.as<const float>(), p.scale,
                           p.use_qk_l2norm ? 1 : 0};
}

size_t SlotPool::CheckpointBytes() const {
  return rssm_checkpoint_elems(&model_.shape) * rssm_dtype_size(model_.shape.state_dtype);
}

void* SlotPool::CheckpointPtr(int32_t slot, int32_t layer) const {
  return layers_[layer].checkpoint.as<char>() + slot * CheckpointBytes();
}

absl::Status SlotPool::Fold(absl::Span<const int32_t> slots, absl::Span<const int32_t> write_pos,
                            Lane& lane) {
  if (slots.empty()) return absl::OkStatus();
  const int64_t n = static_cast<int64_t>(slots.size());
  Scratch& s = lane.scratch;
  absl::Status st = s.Reserve(backend_, model_, 0, n);
  if (st.ok()) st = lane.Upload(s.fold_idx.data(), slots.data(), n * 4);
  if (st.ok()) st = lane.Upload(s.fold_pos.data(), write_pos.data(), n * 4);
  for (int32_t l = 0; st.ok() && l < model_.num_layers; ++l) {
    const rssm_fold_args f{lane.Launch(), model_.shape, LayerPool(l), static_cast<int32_t>(n),
                           s.fold_idx.as<const int32_t>(), s.fold_pos.as<const int32_t>()};
    st = KernelStatus(rssm_fold(&f), "fold");
  }
  return st;
}

absl::Status SlotPool::CopyCheckpoints(int32_t dst, int32_t src, Lane& lane) {
  for (int32_t l = 0; l < model_.num_layers; ++l) {
    const rssm_launch launch = lane.Launch();
    absl::Status s = KernelStatus(rssm_memcpy(&launch, CheckpointPtr(dst, l), CheckpointPtr(src, l),
                                              CheckpointBytes(), RSSM_COPY_DEVICE_TO_DEVICE),
                                  "copy checkpoint");
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SlotPool::ZeroCheckpoints(int32_t slot, Lane& lane) {
  for (int32_t l = 0; l < model_.num_layers; ++l) {
    const rssm_launch launch = lane.Launch();
    absl::Status s = KernelStatus(rssm_memset(&launch, CheckpointPtr(slot, l), 0, CheckpointBytes()),
                                  "zero checkpoint");
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SlotPool::ReadCheckpoint(int32_t slot, int32_t layer, void* host, Lane& lane) const {
  return lane.Download(host, CheckpointPtr(slot, layer), CheckpointBytes());
}

absl::Status SlotPool::WriteCheckpoint(int32_t slot, int32_t layer, const void* host, Lane& lane) {
  return lane.Upload(CheckpointPtr(slot, layer), host, CheckpointBytes());
}

absl::Status SlotPool::ReadCheckpoint(int32_t slot, int32_t layer, void* dst, IoMemory memory,
                                      Lane& lane) const {
  if (memory == IoMemory::kHost) return ReadCheckpoint(slot, layer, dst, lane);
  const rssm_launch l = lane.Launch();
  return KernelStatus(rssm_memcpy(&l, dst, CheckpointPtr(slot, layer), CheckpointBytes(),
                                  RSSM_COPY_DEVICE_TO_DEVICE),
                      "checkpoint copy");
}

absl::Status SlotPool::WriteCheckpoint(int32_t slot, int32_t layer, const void* src,
                                       IoMemory memory, Lane& lane) {
  if (memory == IoMemory::kHost) return WriteCheckpoint(slot, layer, src, lane);
  const rssm_launch l = lane.Launch();
  return KernelStatus(rssm_memcpy(&l, CheckpointPtr(slot, layer), src, CheckpointBytes(),
                                  RSSM_COPY_DEVICE_TO_DEVICE),
                      "checkpoint copy");
}

}  // namespace replayssm::cache
