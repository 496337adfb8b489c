// Recorded sequences on the device (rssm_capture_begin / end, rssm_graph_launch): a recording
// of doorbell waits, copies and doorbell writes runs nothing until launched, then runs as
// recorded, and each launch's doorbell value reaches every wait and write in it — a wait for a
// value not yet rung holds the recording back, and ringing it lets it finish; a release wait
// takes each launch's ticket too. And the release waits themselves (rssm_stream_wait_value32_or):
// a store on the host ends one whose word never arrives, with every hardware queue held.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "device_words.h"
#include "replayssm/kernels.h"

namespace {

using replayssm::kernels::cuda::testing::DeviceWords;
using replayssm::kernels::cuda::testing::HostWords;

TEST(CudaRecordedSequence, EachLaunchCarriesItsDoorbellValue) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  // Words: 0 ready, 1 done, 2 payload source, 3 payload copy.
  DeviceWords w(4);
  for (size_t i = 0; i < 4; ++i) w.Set(i, 0);
  rssm_launch l{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &l.stream));
  // Recorded with value 5: wait ready >= 5, copy the payload, write done = 5.
  ASSERT_RSSM(rssm_capture_begin(&l));
  ASSERT_RSSM(rssm_stream_wait_value32(&l, w.at(0), 5));
  ASSERT_RSSM(rssm_memcpy(&l, w.at(3), w.at(2), 4, RSSM_COPY_DEVICE_TO_DEVICE));
  ASSERT_RSSM(rssm_stream_write_value32(&l, w.at(1), 5));
  rssm_graph* g = nullptr;
  ASSERT_RSSM(rssm_capture_end(&l, 1, &g));
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(rssm_graph_doorbells(g), 2);
  ASSERT_RSSM(rssm_synchronize(&l));
  EXPECT_EQ(w.Read(), (std::vector<uint32_t>{0, 0, 0, 0})) << "recording runs nothing";

  for (uint32_t value : {5u, 9u, 12u, 0xFFFFFFFEu, 3u /* past the wrap */}) {
    SCOPED_TRACE(value);
    w.Set(2, value * 7);
    w.Set(0, value - 1);  // not yet rung for this launch (rung for the recorded 5 at 9 and up)
    ASSERT_RSSM(rssm_graph_launch(&l, g, value, 0));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    std::vector<uint32_t> now = w.Read();
    EXPECT_NE(now[1], value) << "done written before its ready word was rung";
    w.Set(0, value);  // ring
    ASSERT_RSSM(rssm_synchronize(&l));
    now = w.Read();
    EXPECT_EQ(now[1], value);
    EXPECT_EQ(now[3], value * 7);
  }
  // Ended with keep = 0 (what a caller whose call failed asks): discarded, nothing ran, and
  // the stream runs calls again.
  ASSERT_RSSM(rssm_capture_begin(&l));
  EXPECT_EQ(rssm_memcpy(&l, w.at(3), w.at(2), 4, RSSM_COPY_DEVICE_TO_DEVICE), RSSM_OK);
  rssm_graph* dropped = reinterpret_cast<rssm_graph*>(1);
  ASSERT_RSSM(rssm_capture_end(&l, 0, &dropped));
  EXPECT_EQ(dropped, nullptr);
  ASSERT_RSSM(rssm_synchronize(&l));
  EXPECT_EQ(w.Read()[3], 3u * 7);
  w.Set(2, 77);
  ASSERT_RSSM(rssm_memcpy(&l, w.at(3), w.at(2), 4, RSSM_COPY_DEVICE_TO_DEVICE));
  ASSERT_RSSM(rssm_synchronize(&l));
  EXPECT_EQ(w.Read()[3], 77u);
  ASSERT_RSSM(rssm_graph_destroy(g));
  ASSERT_RSSM(rssm_stream_destroy(RSSM_BACKEND_CUDA, l.stream));
}

// Whether `stream`'s work is done within `seconds`, asked without blocking on it.
bool DrainsWithin(const rssm_launch& l, double seconds) {
  void* e = nullptr;
  if (rssm_event_record(&l, &e) != RSSM_OK) return false;
  int done = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (rssm_event_query(RSSM_BACKEND_CUDA, e, &done) == RSSM_OK && done == 0 &&
         std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  rssm_event_destroy(RSSM_BACKEND_CUDA, e);
  return done == 1;
}

TEST(CudaReleaseWait, AHostStoreEndsAWaitWhoseWordNeverArrives) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  DeviceWords w(3);
  for (size_t i = 0; i < 3; ++i) w.Set(i, 0);
  w.Set(2, 5);
  HostWords h(3);  // release word, outcome pair
  rssm_launch l{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &l.stream));
  const rssm_release rel{h.at(0), 1, h.at(1)};
  ASSERT_RSSM(rssm_stream_wait_value32_or(&l, w.at(2), 5, &rel));  // rung already: passes
  ASSERT_RSSM(rssm_stream_wait_value32_or(&l, w.at(0), 5, &rel));  // never rung
  ASSERT_RSSM(rssm_stream_write_value32(&l, w.at(1), 77));
  EXPECT_FALSE(DrainsWithin(l, 0.05)) << "the work behind an unrung wait ran";
  h.Set(0, 1);  // the release: a store on the host, no stream
  ASSERT_TRUE(DrainsWithin(l, 5.0)) << "the release did not end the wait";
  const std::vector<uint32_t> now = w.Read();
  EXPECT_EQ(now[1], 77u) << "the work behind it ran";
  EXPECT_EQ(now[0], 0u) << "a release never writes the client's word";
  EXPECT_EQ(h.Get(2), 1u) << "the wait ended unrung: ticket 1 in its outcome word (odd)";
  EXPECT_EQ(h.Get(1), 0u);
  // A later ticket is not released by the word as it stands; its own word ends it, unrecorded.
  const rssm_release later{h.at(0), 2, h.at(1)};
  ASSERT_RSSM(rssm_stream_wait_value32_or(&l, w.at(0), 6, &later));
  ASSERT_RSSM(rssm_stream_write_value32(&l, w.at(1), 78));
  EXPECT_FALSE(DrainsWithin(l, 0.05)) << "ticket 1's release ended ticket 2's wait";
  w.Set(0, 6);
  ASSERT_TRUE(DrainsWithin(l, 5.0));
  EXPECT_EQ(w.Read()[1], 78u);
  EXPECT_EQ(h.Get(1), 0u) << "rung: no outcome";
  ASSERT_RSSM(rssm_stream_destroy(RSSM_BACKEND_CUDA, l.stream));
}

// With every hardware work queue held by an unrung wait (40 streams on CUDA's 8 or 32), a
// stream memory operation's wait could be ended only by a ring from a new stream, which then
// found no queue (an H100 probe, 2026-12-06: nothing from a new stream ran). Release waits end
// on a host store: everything drains, the new stream's work too (H100, 2026-12-06: 40 and 100).
// Every stream is made before the first wait: made after them, the process's 36th stream did
// not return while the waits ran, before rssm_stream_create kept a reserve of streams made at
// the device's first (the test below). RW_STREAMS: another count.
TEST(CudaReleaseWait, EveryQueueHeldByAnUnrungWaitStillDrainsOnTheHostsStore) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  const size_t kStreams = std::getenv("RW_STREAMS") ? std::atoi(std::getenv("RW_STREAMS")) : 40;
  DeviceWords w(2 * kStreams + 1);
  for (size_t i = 0; i < 2 * kStreams + 1; ++i) w.Set(i, 0);
  HostWords h(1 + 2 * kStreams);
  std::vector<rssm_launch> ls(kStreams, rssm_launch{RSSM_BACKEND_CUDA, nullptr});
  for (rssm_launch& l : ls) ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &l.stream));
  rssm_launch fresh{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &fresh.stream));
  for (size_t i = 0; i < kStreams; ++i) {
    const rssm_release rel{h.at(0), 1, h.at(1 + 2 * i)};
    ASSERT_RSSM(rssm_stream_wait_value32_or(&ls[i], w.at(i), 1, &rel));
    ASSERT_RSSM(rssm_stream_write_value32(&ls[i], w.at(kStreams + i), 1));
  }
  ASSERT_RSSM(rssm_stream_write_value32(&fresh, w.at(2 * kStreams), 9));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  h.Set(0, 1);
  for (size_t i = 0; i < kStreams; ++i) {
    EXPECT_TRUE(DrainsWithin(ls[i], 5.0)) << "stream " << i << " held past its release";
  }
  EXPECT_TRUE(DrainsWithin(fresh, 5.0)) << "the new stream's work never ran";
  const std::vector<uint32_t> now = w.Read();
  for (size_t i = 0; i < kStreams; ++i) {
    EXPECT_EQ(now[kStreams + i], 1u) << i;
    EXPECT_EQ(h.Get(1 + 2 * i + 1), 1u) << "stream " << i << "'s wait ended unrung";
  }
  EXPECT_EQ(now[2 * kStreams], 9u);
  for (rssm_launch& l : ls) rssm_stream_destroy(RSSM_BACKEND_CUDA, l.stream);
  rssm_stream_destroy(RSSM_BACKEND_CUDA, fresh.stream);
}

// Streams made one by one while release waits run, as a server makes a staging stream or a
// late lane: each returns at once (H100, 2026-12-06, before the device's stream reserve: the
// process's 36th, made after 33 waits, did not return until they ended). Each creation runs on
// a thread of its own; one that has not returned in 10 s fails the test, and the release then
// ends the waits so that it does.
TEST(CudaReleaseWait, StreamsMadeWhileWaitsRunReturnAtOnce) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kStreams = 64;
  DeviceWords w(kStreams);
  for (size_t i = 0; i < kStreams; ++i) w.Set(i, 0);
  HostWords h(1 + 2 * kStreams);
  std::vector<rssm_launch> ls;
  for (size_t i = 0; i < kStreams; ++i) {
    std::atomic<bool> made{false};
    rssm_launch l{RSSM_BACKEND_CUDA, nullptr};
    rssm_status st = RSSM_OK;
    std::thread maker([&] {
      st = rssm_stream_create(RSSM_BACKEND_CUDA, &l.stream);
      made.store(true);
    });
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!made.load() && std::chrono::steady_clock::now() < end) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const bool in_time = made.load();
    if (!in_time) h.Set(0, 1);  // end the waits, so that the creation returns
    maker.join();
    ASSERT_RSSM(st);
    ls.push_back(l);
    ASSERT_TRUE(in_time) << "stream " << i << " (" << i << " waits running) waited for them";
    const rssm_release rel{h.at(0), 1, h.at(1 + 2 * i)};
    ASSERT_RSSM(rssm_stream_wait_value32_or(&ls[i], w.at(i), 1, &rel));
  }
  h.Set(0, 1);
  for (size_t i = 0; i < kStreams; ++i) EXPECT_TRUE(DrainsWithin(ls[i], 5.0)) << i;
  for (rssm_launch& l : ls) rssm_stream_destroy(RSSM_BACKEND_CUDA, l.stream);
}

// A destroyed stream goes back to the device's reserve only when nothing is queued on it: one
// destroyed behind an unrung wait is not handed out again, so the next stream's work runs.
TEST(CudaReleaseWait, AStreamDestroyedBehindAWaitIsNotHandedOutAgain) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  DeviceWords w(2);
  w.Set(0, 0);
  w.Set(1, 0);
  HostWords h(3);
  rssm_launch held{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &held.stream));
  const rssm_release rel{h.at(0), 1, h.at(1)};
  ASSERT_RSSM(rssm_stream_wait_value32_or(&held, w.at(0), 1, &rel));
  ASSERT_RSSM(rssm_stream_destroy(RSSM_BACKEND_CUDA, held.stream));
  std::vector<rssm_launch> next(4, rssm_launch{RSSM_BACKEND_CUDA, nullptr});
  for (rssm_launch& l : next) {
    ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &l.stream));
    ASSERT_RSSM(rssm_stream_write_value32(&l, w.at(1), 5));
    EXPECT_TRUE(DrainsWithin(l, 5.0)) << "a new stream's work waited behind the old wait";
  }
  EXPECT_EQ(w.Read()[1], 5u);
  h.Set(0, 1);
  for (rssm_launch& l : next) {
    ASSERT_RSSM(rssm_synchronize(&l));
    ASSERT_RSSM(rssm_stream_destroy(RSSM_BACKEND_CUDA, l.stream));
  }
}

TEST(CudaRecordedSequence, EachLaunchCarriesItsTicketToItsReleaseWaits) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  DeviceWords w(2);  // 0 ready, 1 done
  w.Set(0, 4);
  w.Set(1, 0);
  HostWords h(3);  // release word, outcome pair
  rssm_launch l{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &l.stream));
  ASSERT_RSSM(rssm_capture_begin(&l));
  const rssm_release rel{h.at(0), 1, h.at(1)};
  ASSERT_RSSM(rssm_stream_wait_value32_or(&l, w.at(0), 5, &rel));
  ASSERT_RSSM(rssm_stream_write_value32(&l, w.at(1), 5));
  rssm_graph* g = nullptr;
  ASSERT_RSSM(rssm_capture_end(&l, 1, &g));
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(rssm_graph_doorbells(g), 2) << "the release wait counts as a doorbell";
  ASSERT_RSSM(rssm_synchronize(&l));
  EXPECT_EQ(w.Read(), (std::vector<uint32_t>{4, 0})) << "recording runs nothing";
  // Launch 1 (value 5, ticket 1): never rung, ended by the release.
  ASSERT_RSSM(rssm_graph_launch(&l, g, 5, 1));
  EXPECT_FALSE(DrainsWithin(l, 0.05));
  h.Set(0, 1);
  ASSERT_TRUE(DrainsWithin(l, 5.0));
  EXPECT_EQ(w.Read()[1], 5u);
  EXPECT_EQ(h.Get(2), 1u);
  // Launch 2 (value 6, ticket 2): rung, nothing recorded.
  w.Set(0, 6);
  ASSERT_RSSM(rssm_graph_launch(&l, g, 6, 2));
  ASSERT_TRUE(DrainsWithin(l, 5.0));
  EXPECT_EQ(w.Read()[1], 6u);
  EXPECT_EQ(h.Get(1), 0u);
  // Launch 3 (value 7, ticket 3): ticket 1's release does not end it; its ring does.
  ASSERT_RSSM(rssm_graph_launch(&l, g, 7, 3));
  EXPECT_FALSE(DrainsWithin(l, 0.05)) << "an earlier ticket's release ended a later launch";
  w.Set(0, 7);
  ASSERT_TRUE(DrainsWithin(l, 5.0));
  EXPECT_EQ(w.Read()[1], 7u);
  EXPECT_EQ(h.Get(2), 1u) << "ticket 3 rang: its outcome word keeps ticket 1's";
  ASSERT_RSSM(rssm_graph_destroy(g));
  ASSERT_RSSM(rssm_stream_destroy(RSSM_BACKEND_CUDA, l.stream));
}

TEST(CudaDoorbell, RaiseWritesOnlyAWordShortOfItsValueAndEndsAWait) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  DeviceWords w(6);
  const uint32_t start[6] = {3, 7, 9, 2, 0xFFFFFFF0u, 0};
  const uint32_t value[6] = {7, 7, 7, 0xFFFFFFF0u, 2, 5};
  for (size_t i = 0; i < 6; ++i) w.Set(i, start[i]);
  rssm_launch waiting{RSSM_BACKEND_CUDA, nullptr}, side{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &waiting.stream));
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &side.stream));
  // A wait on word 5 for 5, then a copy behind it: held until the raise on another stream.
  ASSERT_RSSM(rssm_stream_wait_value32(&waiting, w.at(5), 5));
  ASSERT_RSSM(rssm_stream_write_value32(&waiting, w.at(4), 77));
  for (size_t i = 0; i < 5; ++i) ASSERT_RSSM(rssm_stream_raise_value32(&side, w.at(i), value[i]));
  ASSERT_RSSM(rssm_synchronize(&side));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::vector<uint32_t> now = w.Read();
  EXPECT_EQ(now, (std::vector<uint32_t>{7, 7, 9, 2, 2, 0}))
      << "short words raised, words rung further (9; 2 past the wrap) kept";
  ASSERT_RSSM(rssm_stream_raise_value32(&side, w.at(5), 5));
  ASSERT_RSSM(rssm_synchronize(&waiting));
  now = w.Read();
  EXPECT_EQ(now[5], 5u);
  EXPECT_EQ(now[4], 77u) << "the work behind the wait ran once the raise rang it";
  rssm_stream_destroy(RSSM_BACKEND_CUDA, waiting.stream);
  rssm_stream_destroy(RSSM_BACKEND_CUDA, side.stream);
}

// An event recorded behind a wait that nobody rang is not done, whatever else happens to the
// memory the wait reads elsewhere; the ring finishes it. Querying never waits, and a query
// that finds it not done leaves no error for the next launch's check.
TEST(CudaEvent, IsDoneOnlyOnceTheWorkBeforeItHasRun) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "no CUDA device";
  DeviceWords w(2);
  w.Set(0, 0);
  w.Set(1, 0);
  rssm_launch waiting{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &waiting.stream));
  ASSERT_RSSM(rssm_stream_wait_value32(&waiting, w.at(0), 1));
  ASSERT_RSSM(rssm_stream_write_value32(&waiting, w.at(1), 9));
  void* e = nullptr;
  ASSERT_RSSM(rssm_event_record(&waiting, &e));
  ASSERT_NE(e, nullptr);
  w.Set(1, 9);  // the word the work would write, written by someone else: proves nothing
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  int done = 1;
  ASSERT_RSSM(rssm_event_query(RSSM_BACKEND_CUDA, e, &done));
  EXPECT_EQ(done, 0) << "the wait is not rung";
  // Rung by a kernel: its launch check would fail on an error the query left behind.
  rssm_launch side{RSSM_BACKEND_CUDA, nullptr};
  ASSERT_RSSM(rssm_stream_create(RSSM_BACKEND_CUDA, &side.stream));
  ASSERT_RSSM(rssm_stream_raise_value32(&side, w.at(0), 1));
  ASSERT_RSSM(rssm_synchronize(&waiting));
  ASSERT_RSSM(rssm_stream_destroy(RSSM_BACKEND_CUDA, side.stream));
  ASSERT_RSSM(rssm_event_query(RSSM_BACKEND_CUDA, e, &done));
  EXPECT_EQ(done, 1);
  ASSERT_RSSM(rssm_event_destroy(RSSM_BACKEND_CUDA, e));
  ASSERT_RSSM(rssm_stream_destroy(RSSM_BACKEND_CUDA, waiting.stream));
}

}  // namespace
