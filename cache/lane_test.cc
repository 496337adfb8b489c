// Lane: uploads and downloads through a pinned buffer much smaller than the copies, downloads
// that land only at Synchronize, and a pool that reuses idle lanes.
#include "lane.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "test_model.h"

namespace replayssm::cache {
namespace {

TEST(Lane, CopiesLargerThanItsStagingRoundTrip) {
  const int32_t backend = testing::TestBackend();
  absl::StatusOr<std::unique_ptr<Lane>> lane =
      Lane::Create(backend, /*host_bytes=*/512, /*max_waits=*/0);
  ASSERT_TRUE(lane.ok()) << lane.status();
  std::vector<int32_t> src(10000), back(src.size(), -1);
  std::iota(src.begin(), src.end(), 1);
  absl::StatusOr<DeviceBuffer> dev = DeviceBuffer::Allocate(backend, src.size() * 4);
  ASSERT_TRUE(dev.ok());
  ASSERT_TRUE((*lane)->Upload(dev->data(), src.data(), src.size() * 4).ok());
  src.assign(src.size(), 0);  // the upload was staged: src may be reused at once
  ASSERT_TRUE((*lane)->Download(back.data(), dev->data(), back.size() * 4).ok());
  ASSERT_TRUE((*lane)->Synchronize().ok());
  EXPECT_TRUE((*lane)->idle());
  for (size_t i = 0; i < back.size(); ++i) ASSERT_EQ(back[i], static_cast<int32_t>(i + 1)) << i;
}

TEST(Lane, ADownloadLandsAtSynchronize) {
  const int32_t backend = testing::TestBackend();
  absl::StatusOr<std::unique_ptr<Lane>> lane = Lane::Create(backend, 4096, /*max_waits=*/0);
  ASSERT_TRUE(lane.ok());
  const std::vector<int32_t> src(64, 7);
  std::vector<int32_t> back(64, 0);
  absl::StatusOr<DeviceBuffer> dev = DeviceBuffer::Allocate(backend, 256);
  ASSERT_TRUE(dev.ok());
  ASSERT_TRUE((*lane)->Upload(dev->data(), src.data(), 256).ok());
  ASSERT_TRUE((*lane)->Download(back.data(), dev->data(), 256).ok());
  EXPECT_FALSE((*lane)->idle());
  EXPECT_EQ(back[0], 0) << "the destination is written by Synchronize, not before";
  ASSERT_TRUE((*lane)->Synchronize().ok());
  EXPECT_EQ(back, src);
}

TEST(LanePool, ReusesIdleLanesAndMakesOneMorePerConcurrentUser) {
  LanePool pool(testing::TestBackend(), 1024, /*max_waits=*/0);
  const Lane* first = nullptr;
  {
    absl::StatusOr<LanePool::Lease> a = pool.Take();
    ASSERT_TRUE(a.ok());
    first = &**a;
  }
  absl::StatusOr<LanePool::Lease> a = pool.Take();
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(&**a, first) << "an idle lane is reused";
  absl::StatusOr<LanePool::Lease> b = pool.Take();
  ASSERT_TRUE(b.ok());
  EXPECT_NE(&**b, &**a);
  EXPECT_EQ(pool.size(), 2);
  a->reset();
  b->reset();
  absl::StatusOr<LanePool::Lease> c = pool.Take();
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(pool.size(), 2);
}

}  // namespace
}  // namespace replayssm::cache
