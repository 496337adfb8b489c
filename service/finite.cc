#include "service/finite.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "replayssm/cache/model.h"
#include "service/status_map.h"

namespace replayssm::service {
namespace {

// A value is NaN or infinite exactly when its exponent bits are all ones: then adding the
// exponent's lowest bit to the masked exponent carries into the sign bit. Eight bytes at a
// time (every lane of the word at once; no carry crosses a lane), so the scan runs at about
// memcpy speed (bench/results/finite.md).
struct Lanes {
  int size;           // bytes per value
  uint64_t exponent;  // the exponent mask in every lane
  uint64_t low;       // its lowest bit in every lane
  uint64_t sign;      // the sign bit of every lane
};

constexpr Lanes kF32{4, 0x7f8000007f800000ull, 0x0080000000800000ull, 0x8000000080000000ull};
constexpr Lanes kBf16{2, 0x7f807f807f807f80ull, 0x0080008000800080ull, 0x8000800080008000ull};
constexpr Lanes kF16{2, 0x7c007c007c007c00ull, 0x0400040004000400ull, 0x8000800080008000ull};

// Whether bytes [begin, end) (whole values) hold a non-finite one.
bool AnyNonFinite(const unsigned char* p, int64_t begin, int64_t end, const Lanes& l) {
  uint64_t acc = 0;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    acc |= (w & l.exponent) + l.low;
  }
  if (i < end) {  // the last values: zero bytes past them are finite
    uint64_t w = 0;
    std::memcpy(&w, p + i, static_cast<size_t>(end - i));
    acc |= (w & l.exponent) + l.low;
  }
  return (acc & l.sign) != 0;
}

int64_t FirstNonFiniteOf(const unsigned char* p, int64_t count, const Lanes& l) {
  constexpr int64_t kBlock = 4096;  // bytes scanned before looking for the exact value
  const int64_t bytes = count * l.size;
  for (int64_t begin = 0; begin < bytes; begin += kBlock) {
    const int64_t end = std::min(bytes, begin + kBlock);
    if (!AnyNonFinite(p, begin, end, l)) continue;
    for (int64_t i = begin; i < end; i += l.size) {
      if (AnyNonFinite(p, i, i + l.size, l)) return i / l.size;
    }
  }
  return -1;
}

// "NaN", "+Inf" or "-Inf" for the value at `i`.
std::string Describe(const unsigned char* p, int64_t i, int32_t dtype) {
  uint32_t bits = 0, mantissa = 0;
  bool negative = false;
  if (dtype == RSSM_DTYPE_F32) {
    std::memcpy(&bits, p + i * 4, 4);
    negative = bits >> 31;
    mantissa = bits & 0x7fffffu;
  } else {
    uint16_t h;
    std::memcpy(&h, p + i * 2, 2);
    negative = h >> 15;
    mantissa = h & (dtype == RSSM_DTYPE_BF16 ? 0x7fu : 0x3ffu);
  }
  if (mantissa != 0) return "NaN";
  return negative ? "-Inf" : "+Inf";
}

// The row-major index of element `flat` in `shape`.
std::vector<int64_t> Unflatten(int64_t flat,
                               const google::protobuf::RepeatedField<int64_t>& shape) {
  std::vector<int64_t> index(shape.size());
  for (int d = shape.size() - 1; d >= 0; --d) {
    const int64_t extent = std::max<int64_t>(shape[d], 1);
    index[d] = flat % extent;
    flat /= extent;
  }
  return index;
}

}  // namespace

int64_t FirstNonFinite(const void* data, int64_t count, int32_t rssm_dtype) {
  const auto* p = static_cast<const unsigned char*>(data);
  switch (rssm_dtype) {
    case RSSM_DTYPE_F32: return FirstNonFiniteOf(p, count, kF32);
    case RSSM_DTYPE_BF16: return FirstNonFiniteOf(p, count, kBf16);
    case RSSM_DTYPE_F16: return FirstNonFiniteOf(p, count, kF16);
    default: return -1;
  }
}

absl::Status CheckFinite(const v1::Tensor& tensor, absl::string_view field, int32_t rssm_dtype,
                         RowDim rows) {
  if (tensor.has_region()) return absl::OkStatus();
  const int64_t size = static_cast<int64_t>(rssm_dtype_size(rssm_dtype));
  if (size == 0) return absl::OkStatus();
  const auto* p = reinterpret_cast<const unsigned char*>(tensor.data().data());
  const int64_t bad =
      FirstNonFinite(p, static_cast<int64_t>(tensor.data().size()) / size, rssm_dtype);
  if (bad < 0) return absl::OkStatus();
  const std::vector<int64_t> index = Unflatten(bad, tensor.shape());
  std::string where;
  if (rows == RowDim::kFirst && !index.empty()) where = absl::StrCat("row ", index[0], ", ");
  if (rows == RowDim::kAfterRank && index.size() >= 2) {
    where = absl::StrCat("rank ", index[0], ", row ", index[1], ", ");
  }
  return FieldError(field, "finite values",
                    absl::StrCat(Describe(p, bad, rssm_dtype), " at ", where, "index [",
                                 absl::StrJoin(index, ", "), "]"));
}

}  // namespace replayssm::service
