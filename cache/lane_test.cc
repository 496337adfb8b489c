// Lane: uploads and downloads through a pinned buffer much smaller than the copies (pinned at
// the first), downloads that land only at Synchronize, scratch that keeps what it outgrew, a
// pool that reuses idle lanes and one that keeps every staging ring; and, on CUDA, none of it
// waiting for doorbell waits running beside it.
#include "lane.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <numeric>
#include <thread>
#include <vector>

#include "replayssm/kernels.h"
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

TEST(Lane, ItsStagingIsPinnedAtItsFirstStagedCopy) {
  const int32_t backend = testing::TestBackend();
  absl::StatusOr<std::unique_ptr<Lane>> lane = Lane::Create(backend, 4096, /*max_waits=*/2);
  ASSERT_TRUE(lane.ok()) << lane.status();
  EXPECT_EQ((*lane)->pinned_staging_bytes(), 0u) << "a lane never used pins nothing";
  absl::StatusOr<DeviceBuffer> dev = DeviceBuffer::Allocate(backend, 64);
  ASSERT_TRUE(dev.ok());
  const std::vector<int32_t> src(16, 3);
  std::vector<int32_t> back(16, 0);
  ASSERT_TRUE((*lane)->Upload(dev->data(), src.data(), 64).ok());
  EXPECT_EQ((*lane)->pinned_staging_bytes(), 4096u);
  ASSERT_TRUE((*lane)->Download(back.data(), dev->data(), 64).ok());
  ASSERT_TRUE((*lane)->Synchronize().ok());
  EXPECT_EQ(back, src);
}

TEST(Scratch, AnOutgrownBufferIsKeptAndGrowthAtLeastDoubles) {
  const int32_t backend = testing::TestBackend();
  Scratch s;
  ASSERT_TRUE(s.ReserveDigests(backend, 1, 1).ok());
  const void* first = s.digests.data();
  EXPECT_EQ(s.digests.size(), 8u);
  EXPECT_TRUE(s.retired.empty()) << "nothing outgrown yet";
  ASSERT_TRUE(s.ReserveDigests(backend, 100, 1).ok());
  EXPECT_EQ(s.digests.size(), 800u);
  ASSERT_EQ(s.retired.size(), 1u) << "the outgrown buffer is kept, not freed";
  EXPECT_EQ(s.retired[0].data(), first);
  ASSERT_TRUE(s.ReserveDigests(backend, 101, 1).ok());
  EXPECT_EQ(s.digests.size(), 1600u) << "a small step past the size doubles it";
  size_t retired = 0;
  for (const DeviceBuffer& b : s.retired) retired += b.size();
  EXPECT_LT(retired, s.digests.size());
  ASSERT_TRUE(s.ReserveDigests(backend, 200, 1).ok());
  EXPECT_EQ(s.retired.size(), 2u) << "room enough: nothing grows";
}

TEST(StagingPool, KeepsEveryRingGivenBack) {
  StagingPool pool(testing::TestBackend());
  for (int round = 0; round < 2; ++round) {
    std::vector<StagingPool::Lease> held;
    for (int i = 0; i < 10; ++i) {
      absl::StatusOr<StagingPool::Lease> l = pool.Take(2, 256);
      ASSERT_TRUE(l.ok()) << l.status();
      held.push_back(*std::move(l));
    }
  }
  EXPECT_EQ(pool.made(), 10) << "ten moves at once, twice: the second ten reuse the first";
}

// Device words waited for by release waits (rssm_stream_wait_value32_or) on streams of their
// own, none rung: what a server holds while its planned forwards wait for their engines.
class RunningWaits {
 public:
  explicit RunningWaits(int n) : streams_(n, rssm_launch{RSSM_BACKEND_CUDA, nullptr}) {
    EXPECT_EQ(rssm_alloc(RSSM_BACKEND_CUDA, 4 * n, &words_), RSSM_OK);
    EXPECT_EQ(rssm_alloc_host(RSSM_BACKEND_CUDA, 4 * (1 + 2 * n), &host_), RSSM_OK);
    std::memset(host_, 0, 4 * (1 + 2 * n));
    rssm_launch zero{RSSM_BACKEND_CUDA, nullptr};
    EXPECT_EQ(rssm_stream_create(RSSM_BACKEND_CUDA, &zero.stream), RSSM_OK);
    EXPECT_EQ(rssm_memset(&zero, words_, 0, 4 * n), RSSM_OK);
    EXPECT_EQ(rssm_synchronize(&zero), RSSM_OK);
    rssm_stream_destroy(RSSM_BACKEND_CUDA, zero.stream);
    uint32_t* h = static_cast<uint32_t*>(host_);
    for (int i = 0; i < n; ++i) {
      EXPECT_EQ(rssm_stream_create(RSSM_BACKEND_CUDA, &streams_[i].stream), RSSM_OK);
      const rssm_release rel{h, 1, h + 1 + 2 * i};
      EXPECT_EQ(
          rssm_stream_wait_value32_or(&streams_[i], static_cast<uint32_t*>(words_) + i, 1, &rel),
          RSSM_OK)
          << rssm_last_error();
    }
  }
  ~RunningWaits() {
    Release();
    for (rssm_launch& l : streams_) {
      rssm_synchronize(&l);
      rssm_stream_destroy(RSSM_BACKEND_CUDA, l.stream);
    }
    rssm_free(RSSM_BACKEND_CUDA, words_);
    rssm_free_host(RSSM_BACKEND_CUDA, host_);
  }
  void Release() { std::atomic_ref<uint32_t>(*static_cast<uint32_t*>(host_)).store(1); }

 private:
  std::vector<rssm_launch> streams_;
  void* words_ = nullptr;
  void* host_ = nullptr;
};

// Runs `work` on a thread: true if it returns within 10 s; else the waits are released so that
// it does, and false.
bool ReturnsBesideWaits(RunningWaits& waits, const std::function<void()>& work) {
  std::atomic<bool> done{false};
  std::thread t([&] {
    work();
    done.store(true);
  });
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!done.load() && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const bool in_time = done.load();
  if (!in_time) waits.Release();
  t.join();
  return in_time;
}

// On CUDA, freeing device or pinned memory waits for every kernel on the device (an H100 probe,
// 2026-12-06: rssm_free and rssm_free_host did not return while release waits ran), and so can
// the runtime making a stream. What a lane and a move do while forwards wait for their engines
// -- a new lane, scratch that grows, more staging rings than ever before given back -- must
// not: each returns within 10 s with 2 waits running, none of them rung. (Two: each running
// wait holds the hardware work queue its stream maps to, and this process has CUDA's default
// 8, so work queued here could wait behind one by sharing its queue -- which is why nothing
// here queues any; the server asks for 32 queues and admits 24 planned forwards a GPU.)
TEST(LaneOnCuda, NothingALaneOrAMoveDoesBesideRunningWaitsWaitsForThem) {
  const int32_t backend = testing::TestBackend();
  if (backend != RSSM_BACKEND_CUDA) GTEST_SKIP() << "a CUDA test (REPLAYSSM_TEST_BACKEND=cuda)";
  LanePool lanes(backend, 4096, /*max_waits=*/4);
  StagingPool staging(backend);
  RunningWaits waits(2);
  EXPECT_TRUE(ReturnsBesideWaits(waits, [&] {
    std::vector<LanePool::Lease> held;
    for (int i = 0; i < 3; ++i) {
      absl::StatusOr<LanePool::Lease> lane = lanes.Take();
      ASSERT_TRUE(lane.ok()) << lane.status();
      held.push_back(*std::move(lane));
    }
  })) << "three new lanes";
  EXPECT_EQ(lanes.size(), 3);
  EXPECT_TRUE(ReturnsBesideWaits(waits, [&] {
    absl::StatusOr<LanePool::Lease> lane = lanes.Take();
    ASSERT_TRUE(lane.ok());
    for (size_t segments : {1, 64, 4096}) {
      ASSERT_TRUE((*lane)->scratch.ReserveDigests(backend, segments, 1).ok());
    }
  })) << "scratch that grows";
  EXPECT_TRUE(ReturnsBesideWaits(waits, [&] {
    std::vector<StagingPool::Lease> held;
    for (int i = 0; i < 12; ++i) {
      absl::StatusOr<StagingPool::Lease> l = staging.Take(2, 4096);
      ASSERT_TRUE(l.ok()) << l.status();
      held.push_back(*std::move(l));
    }
  })) << "twelve staging rings made and given back";
}

}  // namespace
}  // namespace replayssm::cache
