// StateCache::Create: the checks of a model and its options, then a TP group or the cache of
// one rank (StateCacheImpl, whose constructor and stats are here).
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "state_cache_impl.h"
#include "tp_group.h"

namespace replayssm::cache {
namespace internal {

StateCacheImpl::StateCacheImpl(ModelSpec model, CacheOptions options,
                               std::unique_ptr<SlotPool> pool)
    : model_(std::move(model)),
      options_(options),
      pool_(std::move(pool)),
      lanes_(options_.backend, LaneHostBytes(model_, options_.max_batch), model_.num_layers),
      staging_(options_.backend) {
  slots_.resize(pool_->num_slots());
  for (int64_t i = pool_->num_slots() - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
  const int64_t host_entries =
      options_.host_snapshot_bytes / static_cast<int64_t>(pool_->StateBytes());
  if (host_entries > 0) {
    host_ = std::make_unique<HostTier>(options_.backend, pool_->StateBytes(), host_entries,
                                       options_.host_policy,
                                       options_.max_snapshots_per_namespace);
    if (options_.host_spill_ahead > 0) {
      // The spiller makes lanes (streams) when none is idle, and a new thread starts on device
      // 0: it takes the device this cache was created on (a TP group's rank on its own GPU),
      // else its lanes, given back to this cache's pool, would run rank r's forwards on GPU 0
      // (an outside review). Not knowing it, no spill runs ahead (spills on demand still do).
      int32_t device = 0;
      if (rssm_get_device(options_.backend, &device) == RSSM_OK) {
        spiller_ = std::thread([this, device] {
          if (rssm_set_device(options_.backend, device) == RSSM_OK) SpillAhead();
        });
      }
    }
  }
}

StateCacheImpl::~StateCacheImpl() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (spiller_.joinable()) spiller_.join();
}

CacheStats StateCacheImpl::stats() const {
  absl::MutexLock lock(&mu_);
  CacheStats s = stats_;
  s.slots_total = capacity();
  s.slots_free = static_cast<int64_t>(free_.size());
  s.slots_snapshot = radix_.size();
  s.slots_live = s.slots_total - s.slots_free - s.slots_snapshot;
  s.lanes = lanes_.size();
  s.backend_snapshot_bytes = s.slots_snapshot * model_.SlotBytes();
  if (host_ != nullptr) {
    const int64_t entry = static_cast<int64_t>(host_->entry_bytes());
    s.host_snapshots = host_->stored();
    for (int32_t i : lru_) s.host_backed_snapshots += slots_[i].host >= 0 ? 1 : 0;
    s.host_bytes = s.host_snapshots * entry;
    s.host_capacity_bytes = host_->capacity() * entry;
  }
  return s;
}

}  // namespace internal

absl::StatusOr<std::unique_ptr<StateCache>> StateCache::Create(ModelSpec model,
                                                               CacheOptions options) {
  if (options.tp_size != 1) return CreateTpGroup(std::move(model), std::move(options));
  if (rssm_check_shape(&model.shape) != RSSM_OK) {
    return absl::InvalidArgumentError(absl::StrCat("model.", rssm_last_error()));
  }
  if (model.shape.ring_len < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring_len: expected >= 2 (the cache keeps decode kernels from folding, so a ring holds "
        "L-1 decode records), got ", model.shape.ring_len));
  }
  if (model.num_layers < 1 || static_cast<int32_t>(model.layers.size()) != model.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("model.layers: expected ", model.num_layers,
                                                   " layers of parameters, got ", model.layers.size()));
  }
  if (model.conv_width != 0) {
    if (model.conv_width < 2 || model.conv_width > RSSM_MAX_CONV_WIDTH) {
      return absl::InvalidArgumentError(absl::StrCat("model.conv_width: expected 0 (none) or 2 to ",
                                                     RSSM_MAX_CONV_WIDTH, ", got ",
                                                     model.conv_width));
    }
    const size_t c = static_cast<size_t>(model.QkvWidth());
    for (int32_t l = 0; l < model.num_layers; ++l) {
      const LayerParams& p = model.layers[l];
      if (p.conv_weight.size() != c * model.conv_width) {
        return absl::InvalidArgumentError(absl::StrCat(
            "model.layers[", l, "].conv_weight: expected ", c * model.conv_width, " values ([", c,
            ", ", model.conv_width, "]), got ", p.conv_weight.size()));
      }
      if (!p.conv_bias.empty() && p.conv_bias.size() != c) {
        return absl::InvalidArgumentError(absl::StrCat("model.layers[", l,
                                                       "].conv_bias: expected none or ", c,
                                                       " values, got ", p.conv_bias.size()));
      }
    }
  }
  if (!rssm_backend_available(options.backend)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "backend: ", options.backend == RSSM_BACKEND_CUDA ? "CUDA" : "unknown",
        " is not available in this build or on this machine"));
  }
  if (options.max_batch < 1 || options.track_interval < 0 || options.max_prefill_tokens < 1) {
    return absl::InvalidArgumentError("options: max_batch and max_prefill_tokens must be >= 1 and track_interval >= 0");
  }
  if (options.lanes_at_start < 1 || options.lanes_at_start > kMaxLanesAtStart) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lanes_at_start: expected 1 to ", kMaxLanesAtStart, ", got ", options.lanes_at_start));
  }
  const int64_t slot_bytes = model.SlotBytes();
  const int64_t state_bytes = model.LayerStateBytes() * model.num_layers;
  if (options.host_snapshot_bytes != 0 && options.host_snapshot_bytes < state_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "host_snapshot_bytes: expected 0 (no host tier) or at least one snapshot (", state_bytes,
        " bytes: checkpoints and conv windows of ", model.num_layers, " layers), got ",
        options.host_snapshot_bytes));
  }
  if (options.host_snapshot_bytes / state_bytes > 0x7fffffff) {
    return absl::InvalidArgumentError("host_snapshot_bytes: more than 2^31 snapshots");
  }
  if (options.host_policy != HostPolicy::kLru && options.host_policy != HostPolicy::kValue) {
    return absl::InvalidArgumentError(absl::StrCat("host_policy: expected kLru or kValue, got ",
                                                   static_cast<int32_t>(options.host_policy)));
  }
  const int64_t n = options.memory_budget_bytes / slot_bytes;
  if (n < 1) {
    return absl::ResourceExhaustedError(absl::StrCat("memory_budget: expected at least one slot (",
                                                     slot_bytes, " bytes), got ", options.memory_budget_bytes));
  }
  if (n > 0x7fffffff) return absl::InvalidArgumentError("memory_budget: more than 2^31 slots");
  absl::StatusOr<std::unique_ptr<SlotPool>> pool = SlotPool::Create(model, options.backend, n);
  if (!pool.ok()) return pool.status();
  auto cache =
      std::make_unique<internal::StateCacheImpl>(std::move(model), options, std::move(*pool));
  absl::Status st = cache->WarmLanes(options.lanes_at_start);
  if (st.ok() && options.host_pin_at_start) st = cache->PinHostTier();
  if (!st.ok()) return st;
  return std::unique_ptr<StateCache>(std::move(cache));
}

}  // namespace replayssm::cache
