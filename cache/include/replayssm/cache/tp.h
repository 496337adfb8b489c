// Tensor parallelism: how a model's linear-attention heads are split over the ranks of a TP
// group, and where each rank's slice lies in the unsharded ("canonical") tensors. Plain
// values and byte maps; no device memory here.
//
// Rank r of a group of size T holds v heads [r*HV/T, (r+1)*HV/T) and qk heads
// [r*H/T, (r+1)*H/T), as the reference models (Hugging Face, sglang, vLLM) split Qwen3-Next's
// and Kimi-Linear's linear attention: A_log, dt_bias, a and b with the v heads; the short
// convolution's channels per section (q, k and v sliced separately, never as one range of
// q|k|v); the state [HV, V, K] by v head. GQA stays inside a rank: v head h uses qk head
// h / (HV/H), and with T dividing H the qk heads a rank's v heads use are exactly its own.
// T must divide both H and HV (a qk head replicated over ranks, T > H, is not supported).
#ifndef REPLAYSSM_CACHE_TP_H_
#define REPLAYSSM_CACHE_TP_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "replayssm/cache/model.h"

namespace replayssm::cache {

// The most ranks a group may have (the largest TP degree of an 8-GPU node).
inline constexpr int32_t kMaxTpSize = 8;

// One rank's heads: [begin, begin + count) of the unsharded model's heads.
struct TpShard {
  int32_t rank = 0;
  int32_t size = 1;  // the group's TP degree
  int32_t qk_head_begin = 0, qk_heads = 0;
  int32_t v_head_begin = 0, v_heads = 0;
};

// OK when `tp_size` ranks can split `full` (1 <= tp_size <= kMaxTpSize, dividing H and HV);
// else INVALID_ARGUMENT naming `field` with what was expected.
absl::Status CheckTpSize(const ModelSpec& full, int32_t tp_size, const char* field = "tp_size");
// Whether a group's ranks sit on distinct devices (two or more, none shared): their work can
// then overlap, where ranks that share a device only contend for it.
bool RanksOnDistinctDevices(const std::vector<int32_t>& devices);
// Rank `rank`'s heads (CheckTpSize must have passed).
TpShard ShardOf(const ModelSpec& full, int32_t tp_size, int32_t rank);
// The model rank `s` serves: its heads, its slices of every layer's parameters (a_log,
// dt_bias, the convolution's weight rows and bias per q, k, v section). Everything else
// (dims, dtypes, ring, conv width, scale, rounding) as `full`.
ModelSpec ShardModel(const ModelSpec& full, const TpShard& s);

// A run of elements (or bytes) that is contiguous in both the unsharded tensor and a rank's.
struct SliceRun {
  int64_t full = 0;   // offset in the unsharded tensor
  int64_t shard = 0;  // offset in the rank's tensor
  int64_t count = 0;
};

// Per token, the columns of the rank's mixed_qkv [2*H_r*K + HV_r*V] within the unsharded
// row [2*H*K + HV*V]: three runs, q | k | v. (The convolution's channels are these columns.)
std::vector<SliceRun> QkvColumns(const ModelSpec& full, const TpShard& s);
// Per token, the rank's columns of a ([HV] GDN, [HV, K] KDA), b ([HV]) and out ([HV, V]).
SliceRun AColumns(const ModelSpec& full, const TpShard& s);
SliceRun BColumns(const ModelSpec& full, const TpShard& s);
SliceRun OutColumns(const ModelSpec& full, const TpShard& s);

// One layer's state as it leaves a slot (ModelSpec::LayerStateBytes: checkpoint [HV, V, K] in
// the state dtype, then the conv window [W-1, C] in the act dtype): the byte runs of rank s's
// layer state inside the unsharded one. The rank's runs cover its LayerStateBytes exactly.
std::vector<SliceRun> LayerStateRuns(const ModelSpec& full, const TpShard& s);

// Copies a rank's slice out of (CopyToShard) or back into (CopyFromShard) `rows` rows of an
// unsharded tensor [rows, full_row], the rank's being [rows, shard_row]; runs and row widths
// in elements of `elem_bytes` (bytes: 1).
void CopyToShard(const void* full, int64_t full_row, void* shard, int64_t shard_row, int64_t rows,
                 const std::vector<SliceRun>& runs, int64_t elem_bytes);
void CopyFromShard(const void* shard, int64_t shard_row, void* full, int64_t full_row,
                   int64_t rows, const std::vector<SliceRun>& runs, int64_t elem_bytes);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_TP_H_
