#include "slot_pool.h"

#include "absl/strings/str_cat.h"

namespace replayssm::cache {
namespace {

absl::Status Grow(DeviceBuffer& buf, int32_t backend, size_t bytes) {
  if (buf.size() >= bytes) return absl::OkStatus();
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(backend, bytes);
  if (!b.ok()) return b.status();
  buf = std::move(*b);
  return absl::OkStatus();
}

}  // namespace

absl::Status Staging::Reserve(int32_t backend, const ModelSpec& m, int64_t tokens, int64_t rows) {
  const size_t es = rssm_dtype_size(m.shape.act_dtype);
  for (auto [buf, bytes] : {std::pair{&qkv, tokens * m.QkvWidth() * es},
                            {&a, tokens * m.AWidth() * es},
                            {&b, tokens * m.BWidth() * es},
                            {&out, tokens * m.OutWidth() * es},
                            {&slot_idx, rows * 4},
                            {&write_pos, rows * 4},
                            {&cu, (rows + 1) * 4},
                            {&flags, rows}}) {
    absl::Status s = Grow(*buf, backend, static_cast<size_t>(bytes));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

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
                            Staging& staging) {
  if (slots.empty()) return absl::OkStatus();
  absl::Status s = staging.Reserve(backend_, model_, 0, static_cast<int64_t>(slots.size()));
  if (s.ok()) s = EnqueueCopy(backend_, staging.slot_idx.data(), slots.data(), slots.size() * 4, RSSM_COPY_HOST_TO_DEVICE);
  if (s.ok()) s = EnqueueCopy(backend_, staging.write_pos.data(), write_pos.data(), write_pos.size() * 4, RSSM_COPY_HOST_TO_DEVICE);
  for (int32_t l = 0; s.ok() && l < model_.num_layers; ++l) {
    const rssm_fold_args f{{backend_, nullptr}, model_.shape, LayerPool(l),
                           static_cast<int32_t>(slots.size()), staging.slot_idx.as<const int32_t>(),
                           staging.write_pos.as<const int32_t>()};
    s = KernelStatus(rssm_fold(&f), "fold");
  }
  if (!s.ok()) return s;
  return Synchronize(backend_);
}

absl::Status SlotPool::CopyCheckpoints(int32_t dst, int32_t src) {
  for (int32_t l = 0; l < model_.num_layers; ++l) {
    absl::Status s = EnqueueCopy(backend_, CheckpointPtr(dst, l), CheckpointPtr(src, l),
                                 CheckpointBytes(), RSSM_COPY_DEVICE_TO_DEVICE);
    if (!s.ok()) return s;
  }
  return Synchronize(backend_);
}

absl::Status SlotPool::ZeroCheckpoints(int32_t slot) {
  for (int32_t l = 0; l < model_.num_layers; ++l) {
    const rssm_launch launch{backend_, nullptr};
    absl::Status s = KernelStatus(rssm_memset(&launch, CheckpointPtr(slot, l), 0, CheckpointBytes()), "zero");
    if (!s.ok()) return s;
  }
  return Synchronize(backend_);
}

absl::Status SlotPool::ReadCheckpoint(int32_t slot, int32_t layer, void* host) const {
  return CopyToHost(backend_, host, CheckpointPtr(slot, layer), CheckpointBytes());
}

absl::Status SlotPool::WriteCheckpoint(int32_t slot, int32_t layer, const void* host) {
  return CopyToDevice(backend_, CheckpointPtr(slot, layer), host, CheckpointBytes());
}

}  // namespace replayssm::cache
