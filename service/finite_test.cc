#include "service/finite.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "replayssm/cache/model.h"

namespace replayssm::service {
namespace {

// A value's bits in each dtype (truncating, which keeps NaN, infinities and zero as they are).
std::string Bytes(const std::vector<float>& values, int32_t dtype) {
  std::string out;
  for (float f : values) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (dtype == RSSM_DTYPE_F32) {
      out.append(reinterpret_cast<const char*>(&u), 4);
      continue;
    }
    uint16_t h;
    if (dtype == RSSM_DTYPE_BF16) {
      h = static_cast<uint16_t>(u >> 16);
    } else if (std::isnan(f)) {
      h = 0x7e00;
    } else if (std::isinf(f)) {
      h = f > 0 ? 0x7c00 : 0xfc00;
    } else {
      _Float16 x = static_cast<_Float16>(f);
      std::memcpy(&h, &x, 2);
    }
    out.append(reinterpret_cast<const char*>(&h), 2);
  }
  return out;
}

constexpr int32_t kDtypes[] = {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16};

TEST(FirstNonFinite, FindsTheFirstNaNOrInfinityAtEveryPositionInEveryDtype) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (int32_t dtype : kDtypes) {
    for (int64_t n : {1, 3, 4, 5, 8, 9, 2047, 2048, 2049, 5000}) {
      for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
        for (float b : bad) {
          std::vector<float> v(n, 1.5f);
          v[at] = b;
          if (at + 1 < n) v[n - 1] = b;  // a later one is not reported
          std::string bytes(1, 'x');     // misaligned on purpose
          bytes.append(Bytes(v, dtype));
          EXPECT_EQ(FirstNonFinite(bytes.data() + 1, n, dtype), at)
              << rssm_dtype_name(dtype) << " n=" << n << " at=" << at << " " << b;
        }
      }
    }
  }
}

TEST(FirstNonFinite, AcceptsEveryFiniteExtreme) {
  const float finite[] = {0.f,     -0.f,     1e-45f, -1e-45f,       1e-40f,
                          65504.f, -65504.f, 6e-8f,  3.3895314e38f, -3.3895314e38f};
  for (int32_t dtype : kDtypes) {
    std::vector<float> v;
    for (float f : finite) {
      if (dtype == RSSM_DTYPE_F16 && std::fabs(f) > 65504.f) continue;
      v.push_back(f);
    }
    const std::string bytes = Bytes(v, dtype);
    EXPECT_EQ(FirstNonFinite(bytes.data(), static_cast<int64_t>(v.size()), dtype), -1)
        << rssm_dtype_name(dtype);
  }
  const uint32_t largest = 0x7f7fffffu;  // FLT_MAX
  EXPECT_EQ(FirstNonFinite(&largest, 1, RSSM_DTYPE_F32), -1);
  const uint16_t bf16_max = 0x7f7f, f16_max = 0x7bff;
  EXPECT_EQ(FirstNonFinite(&bf16_max, 1, RSSM_DTYPE_BF16), -1);
  EXPECT_EQ(FirstNonFinite(&f16_max, 1, RSSM_DTYPE_F16), -1);
  EXPECT_EQ(FirstNonFinite(nullptr, 0, RSSM_DTYPE_F32), -1);
}

TEST(CheckFinite, NamesTheFieldTheRowAndTheIndex) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.add_shape(3);
  t.add_shape(4);
  t.add_shape(2);
  std::vector<float> v(24, 0.25f);
  v[2 * 8 + 1 * 2 + 1] = -std::numeric_limits<float>::infinity();
  t.set_data(Bytes(v, RSSM_DTYPE_BF16));
  const absl::Status rows = CheckFinite(t, "layers[1].a", RSSM_DTYPE_BF16, RowDim::kFirst);
  EXPECT_EQ(rows.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(rows.message(),
            "layers[1].a: expected finite values, got -Inf at row 2, index [2, 1, 1]");
  EXPECT_EQ(CheckFinite(t, "checkpoints[0]", RSSM_DTYPE_BF16, RowDim::kNone).message(),
            "checkpoints[0]: expected finite values, got -Inf at index [2, 1, 1]");
  v[0] = std::numeric_limits<float>::quiet_NaN();
  t.set_data(Bytes(v, RSSM_DTYPE_BF16));
  EXPECT_EQ(CheckFinite(t, "b", RSSM_DTYPE_BF16, RowDim::kFirst).message(),
            "b: expected finite values, got NaN at row 0, index [0, 0, 0]");
  // A tensor-parallel server's [tp, N, ...]: the rank first, then the row (an outside review
  // found the rank reported as the row).
  v[0] = 0.25f;
  v[1 * 8 + 0 * 2 + 1] = std::numeric_limits<float>::quiet_NaN();
  t.set_data(Bytes(v, RSSM_DTYPE_BF16));
  EXPECT_EQ(CheckFinite(t, "layers[1].b", RSSM_DTYPE_BF16, RowDim::kAfterRank).message(),
            "layers[1].b: expected finite values, got NaN at rank 1, row 0, index [1, 0, 1]");
}

TEST(CheckFinite, PassesFiniteTensorsAndRegions) {
  v1::Tensor t;
  t.add_shape(2);
  t.set_data(Bytes({1.f, -2.f}, RSSM_DTYPE_F32));
  EXPECT_TRUE(CheckFinite(t, "x", RSSM_DTYPE_F32, RowDim::kFirst).ok());
  t.set_data(Bytes({1.f, std::numeric_limits<float>::quiet_NaN()}, RSSM_DTYPE_F32));
  EXPECT_FALSE(CheckFinite(t, "x", RSSM_DTYPE_F32, RowDim::kFirst).ok());
  t.mutable_region()->set_region("engine");  // device-resident bytes are not read here
  EXPECT_TRUE(CheckFinite(t, "x", RSSM_DTYPE_F32, RowDim::kFirst).ok());
}

}  // namespace
}  // namespace replayssm::service
