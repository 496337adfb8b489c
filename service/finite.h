// The finiteness policy for host inputs: activations (mixed_qkv, a, b of Decode, Prefill,
// Verify and DecodeStream layer messages) and imported checkpoints sent as bytes must hold no
// NaN or infinity; a request that carries one is refused (INVALID_ARGUMENT naming the field and
// the first bad value's index) before the cache is called, so no slot, snapshot or prefix ever
// holds a value derived from it. Tensors in registered regions are not read here
// (docs/operations.md, "Finiteness").
//
// Thread safety: pure functions.
#ifndef REPLAYSSM_SERVICE_FINITE_H_
#define REPLAYSSM_SERVICE_FINITE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "replayssm/v1/replayssm.pb.h"

namespace replayssm::service {

// The index of the first NaN or infinity among `count` little-endian values of `rssm_dtype`
// (F32, BF16, F16) at `data` (any alignment); -1 when every value is finite or the dtype is
// not one of these.
int64_t FirstNonFinite(const void* data, int64_t count, int32_t rssm_dtype);

// Where a tensor's token rows are: not at all, its first dimension ([N, ...]), or its second
// behind the tensor-parallel ranks' ([tp, N, ...]).
enum class RowDim { kNone, kFirst, kAfterRank };

// OK when `tensor`'s inline bytes (already checked against its dtype and shape) are finite;
// else "<field>: expected finite values, got NaN at row R, index [R, ...]" (kFirst), "... at
// rank K, row R, index [K, R, ...]" (kAfterRank) or "... got +Inf at index [...]" (kNone). A
// tensor naming a region passes (its bytes are not here).
absl::Status CheckFinite(const v1::Tensor& tensor, absl::string_view field, int32_t rssm_dtype,
                         RowDim rows);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_FINITE_H_
