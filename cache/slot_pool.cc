#include "slot_pool.h"

#include <vector>

#include "absl/strings/str_cat.h"

namespace replayssm::cache {

absl::StatusOr<std::unique_ptr<SlotPool>> SlotPool::Create(const ModelSpec& model,
                                                           int32_t backend, int64_t num_slots) {
  std::unique_ptr<SlotPool> pool(new SlotPool(model, backend, num_slots));
  const rssm_layer_shape& s = model.shape;
  const size_t rs = rssm_dtype_size(rssm_ring_storage_dtype(&s));  // ring d, k
  pool->layers_.resize(model.num_layers);
  const size_t state_bytes = static_cast<size_t>(model.LayerStateBytes());
  for (int32_t l = 0; l < model.num_layers; ++l) {
    LayerMemory& m = pool->layers_[l];
    const cache::LayerParams& p = model.layers[l];
    for (auto [buf, bytes] : {std::pair{&m.checkpoint, num_slots * state_bytes},
                              {&m.ring_d, num_slots * rssm_ring_d_elems(&s) * rs},
                              {&m.ring_k, num_slots * rssm_ring_k_elems(&s) * rs},
                              {&m.ring_g, num_slots * rssm_ring_g_elems(&s) * 4},
                              {&m.ring_x, static_cast<size_t>(num_slots * model.ConvRingBytes())},
                              {&m.a_log, p.a_log.size() * 4},
                              {&m.dt_bias, p.dt_bias.size() * 4},
                              {&m.conv_weight, p.conv_weight.size() * 4},
                              {&m.conv_bias, p.conv_bias.size() * 4}}) {
      if (bytes == 0) continue;
      absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(backend, static_cast<size_t>(bytes));
      if (!b.ok()) return b.status();
      *buf = std::move(*b);
    }
    absl::Status st = absl::OkStatus();
    for (auto [buf, values] : {std::pair{&m.a_log, &p.a_log},
                               {&m.dt_bias, &p.dt_bias},
                               {&m.conv_weight, &p.conv_weight},
                               {&m.conv_bias, &p.conv_bias}}) {
      if (st.ok() && !values->empty()) {
        st = CopyToDevice(backend, buf->data(), values->data(), buf->size());
      }
    }
    if (!st.ok()) return st;
  }
  return pool;
}

rssm_state_pool SlotPool::LayerPool(int32_t layer) const {
  const LayerMemory& m = layers_[layer];
  // A slot's checkpoint is followed by its conv window: the checkpoint stride covers both
  // (the window's bytes are a whole number of state elements: C is a multiple of 16).
  const int64_t stride =
      static_cast<int64_t>(CheckpointBytes() / rssm_dtype_size(model_.shape.state_dtype));
  return rssm_state_pool{m.checkpoint.data(),
                         m.ring_d.data(),
                         m.ring_k.data(),
                         m.ring_g.as<float>(),
                         num_slots_,
                         stride,
                         0,
                         0,
                         0};
}

rssm_conv_state SlotPool::LayerConv(int32_t layer) const {
  const LayerMemory& m = layers_[layer];
  const size_t act = rssm_dtype_size(model_.shape.act_dtype);
  const size_t ckpt =
      rssm_checkpoint_elems(&model_.shape) * rssm_dtype_size(model_.shape.state_dtype);
  return rssm_conv_state{m.checkpoint.as<char>() + ckpt, m.ring_x.data(), num_slots_,
                         static_cast<int64_t>(CheckpointBytes() / act), 0};
}

const float* SlotPool::ConvWeight(int32_t layer) const {
  return layers_[layer].conv_weight.as<const float>();
}

const float* SlotPool::ConvBias(int32_t layer) const {
  return model_.layers[layer].conv_bias.empty() ? nullptr
                                                : layers_[layer].conv_bias.as<const float>();
}

rssm_layer_params SlotPool::LayerParams(int32_t layer) const {
  const LayerMemory& m = layers_[layer];
  const cache::LayerParams& p = model_.layers[layer];
  return rssm_layer_params{m.a_log.as<const float>(), m.dt_bias.as<const float>(), p.scale,
                           p.use_qk_l2norm ? 1 : 0, model_.round_beta ? 1 : 0};
}

size_t SlotPool::CheckpointBytes() const { return static_cast<size_t>(model_.LayerStateBytes()); }

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
    if (st.ok() && has_conv()) {
      const rssm_conv_fold_args cf{lane.Launch(),
                                   model_.ConvShape(),
                                   LayerConv(l),
                                   static_cast<int32_t>(n),
                                   s.fold_idx.as<const int32_t>(),
                                   s.fold_pos.as<const int32_t>()};
      st = KernelStatus(rssm_conv_fold(&cf), "conv fold");
    }
  }
  return st;
}

absl::Status SlotPool::CountNonfinite(int32_t slot, uint32_t counts_out[2], Lane& lane) {
  const int32_t layers = model_.num_layers;
  const size_t ckpt_bytes =
      rssm_checkpoint_elems(&model_.shape) * rssm_dtype_size(model_.shape.state_dtype);
  std::vector<const void*> parts;  // the checkpoints, then the conv windows
  for (int32_t l = 0; l < layers; ++l) parts.push_back(CheckpointPtr(slot, l));
  if (has_conv()) {
    for (int32_t l = 0; l < layers; ++l) {
      parts.push_back(static_cast<const char*>(CheckpointPtr(slot, l)) + ckpt_bytes);
    }
  }
  Scratch& s = lane.scratch;
  absl::Status st = s.ReserveDigests(backend_, 1, parts.size());  // 8 bytes: two counts
  if (st.ok()) st = lane.Upload(s.digest_parts.data(), parts.data(), parts.size() * sizeof(void*));
  uint32_t* counts = s.digests.as<uint32_t>();
  const void* const* table = s.digest_parts.as<const void* const>();
  if (st.ok()) {
    const rssm_launch l = lane.Launch();
    st = KernelStatus(rssm_count_nonfinite(&l, parts.data(), table, layers,
                                           rssm_checkpoint_elems(&model_.shape),
                                           model_.shape.state_dtype, counts),
                      "count non-finite (checkpoints)");
  }
  if (st.ok() && has_conv()) {
    const rssm_launch l = lane.Launch();
    const rssm_conv_shape c = model_.ConvShape();
    st = KernelStatus(rssm_count_nonfinite(&l, parts.data() + layers, table + layers, layers,
                                           rssm_conv_window_elems(&c), model_.shape.act_dtype,
                                           counts + 1),
                      "count non-finite (conv windows)");
  } else if (st.ok()) {
    const rssm_launch l = lane.Launch();
    st = KernelStatus(rssm_memset(&l, counts + 1, 0, sizeof(uint32_t)), "count non-finite");
  }
  if (st.ok()) st = lane.Download(counts_out, counts, 2 * sizeof(uint32_t));
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

absl::Status SlotPool::SaveState(int32_t slot, void* pinned, Lane& lane) const {
  for (int32_t l = 0; l < model_.num_layers; ++l) {
    const rssm_launch launch = lane.Launch();
    absl::Status s = KernelStatus(
        rssm_memcpy(&launch, static_cast<char*>(pinned) + l * CheckpointBytes(),
                    CheckpointPtr(slot, l), CheckpointBytes(), RSSM_COPY_DEVICE_TO_HOST),
        "spill a snapshot to host memory");
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status SlotPool::LoadState(int32_t slot, const void* pinned, Lane& lane) {
  for (int32_t l = 0; l < model_.num_layers; ++l) {
    const rssm_launch launch = lane.Launch();
    absl::Status s = KernelStatus(
        rssm_memcpy(&launch, CheckpointPtr(slot, l),
                    static_cast<const char*>(pinned) + l * CheckpointBytes(), CheckpointBytes(),
                    RSSM_COPY_HOST_TO_DEVICE),
        "promote a snapshot from host memory");
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace replayssm::cache
