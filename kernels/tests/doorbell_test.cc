// Doorbells, events and shared memory on the CPU backend: waits end when the word reaches the
// value (cyclically), or, with a release, when the release word reaches the ticket (recording
// the wait unrung if its word fell short), writes are visible to a waiter on another thread, an
// event is done at once, bad arguments are refused by name, and CUDA IPC is refused on the CPU with
// a message that says what to use instead.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "replayssm/kernels.h"

namespace {

const rssm_launch kCpu{RSSM_BACKEND_CPU, nullptr};

TEST(Doorbell, WaitReturnsAtOnceWhenTheWordIsAlreadyThere) {
  uint32_t word = 7;
  EXPECT_EQ(rssm_stream_wait_value32(&kCpu, &word, 7), RSSM_OK);
  EXPECT_EQ(rssm_stream_wait_value32(&kCpu, &word, 3), RSSM_OK);
}

TEST(Doorbell, WaitComparesCyclicallyAcrossTheWrap) {
  uint32_t word = 2;  // 0xFFFFFFF0 + 18: past the wrap, so later than 0xFFFFFFF0
  EXPECT_EQ(rssm_stream_wait_value32(&kCpu, &word, 0xFFFFFFF0u), RSSM_OK);
}

TEST(Doorbell, WaitEndsWhenAnotherThreadRings) {
  alignas(4) uint32_t bell = 0, payload = 0;
  std::atomic<bool> woke{false};
  std::thread waiter([&] {
    ASSERT_EQ(rssm_stream_wait_value32(&kCpu, &bell, 5), RSSM_OK);
    EXPECT_EQ(payload, 42u);  // the write before the ring is visible after the wait
    woke = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke.load());
  ASSERT_EQ(rssm_stream_write_value32(&kCpu, &bell, 4), RSSM_OK);  // not yet
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(woke.load());
  payload = 42;
  ASSERT_EQ(rssm_stream_write_value32(&kCpu, &bell, 5), RSSM_OK);
  waiter.join();
  EXPECT_TRUE(woke.load());
}

TEST(Doorbell, RefusesNullOrMisalignedWordsByName) {
  alignas(8) uint32_t words[2] = {0, 0};
  auto* odd = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(words) + 2);
  EXPECT_EQ(rssm_stream_write_value32(&kCpu, nullptr, 1), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("addr: expected"), std::string::npos);
  EXPECT_EQ(rssm_stream_write_value32(&kCpu, odd, 1), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("4-byte aligned"), std::string::npos);
  EXPECT_EQ(rssm_stream_wait_value32(&kCpu, odd, 0), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(words[0], 0u);
  EXPECT_EQ(words[1], 0u);
  const rssm_launch bad{7, nullptr};
  EXPECT_EQ(rssm_stream_write_value32(&bad, words, 1), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("launch"), std::string::npos);
  EXPECT_EQ(words[0], 0u);
}

TEST(Doorbell, RaiseWritesOnlyAWordShortOfItsValue) {
  struct Case {
    uint32_t word, value, want;
  } cases[] = {
      {3, 7, 7},            // short: raised
      {7, 7, 7},            // there
      {9, 7, 9},            // rung further: kept (a plain write sets it back to 7)
      {2, 0xFFFFFFF0u, 2},  // past the wrap, so later: kept
      {0xFFFFFFF0u, 2, 2},  // short across the wrap: raised
      {0x80000001u, 1, 1},  // half the cycle behind: short
  };
  for (const Case& c : cases) {
    alignas(4) uint32_t word = c.word;
    ASSERT_EQ(rssm_stream_raise_value32(&kCpu, &word, c.value), RSSM_OK) << rssm_last_error();
    EXPECT_EQ(word, c.want) << "word " << c.word << ", value " << c.value;
  }
}

TEST(Doorbell, RaiseEndsAWaitOnAnotherThread) {
  alignas(4) uint32_t bell = 0;
  std::thread waiter([&] { ASSERT_EQ(rssm_stream_wait_value32(&kCpu, &bell, 5), RSSM_OK); });
  std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(rssm_stream_raise_value32(&kCpu, &bell, 5), RSSM_OK);
  waiter.join();
  EXPECT_EQ(bell, 5u);
}

TEST(Doorbell, RaiseNeverLosesARingThatRacesIt) {
  // Another thread rings value + 1 while this one raises to value: the word ends at value + 1
  // whichever lands first (a load-then-store raise loses it when the ring falls between).
  constexpr int kRounds = 20000;
  alignas(4) uint32_t word = 0;
  std::atomic<int> round{-1}, rung{-1};
  std::thread ringer([&] {
    for (int r = 0; r < kRounds; ++r) {
      while (round.load(std::memory_order_acquire) != r) {
      }
      std::atomic_ref<uint32_t>(word).store(static_cast<uint32_t>(r) * 4 + 2,
                                            std::memory_order_release);
      rung.store(r, std::memory_order_release);
    }
  });
  int lost = 0;
  for (int r = 0; r < kRounds; ++r) {
    const uint32_t value = static_cast<uint32_t>(r) * 4 + 1;
    std::atomic_ref<uint32_t>(word).store(value - 1, std::memory_order_release);
    round.store(r, std::memory_order_release);
    ASSERT_EQ(rssm_stream_raise_value32(&kCpu, &word, value), RSSM_OK);
    while (rung.load(std::memory_order_acquire) != r) {
    }
    if (std::atomic_ref<uint32_t>(word).load(std::memory_order_acquire) != value + 1) ++lost;
  }
  ringer.join();
  EXPECT_EQ(lost, 0) << "rounds whose later ring the raise set back, of " << kRounds;
}

TEST(Doorbell, RaiseRefusesBadArgumentsByName) {
  alignas(8) uint32_t words[2] = {0, 0};
  auto* odd = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(words) + 2);
  EXPECT_EQ(rssm_stream_raise_value32(&kCpu, nullptr, 1), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("rssm_stream_raise_value32: addr: expected"),
            std::string::npos)
      << rssm_last_error();
  EXPECT_EQ(rssm_stream_raise_value32(&kCpu, odd, 1), RSSM_ERR_INVALID_ARGUMENT);
  const rssm_launch bad{7, nullptr};
  EXPECT_EQ(rssm_stream_raise_value32(&bad, words, 1), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("launch"), std::string::npos);
  EXPECT_EQ(words[0], 0u);
  EXPECT_EQ(words[1], 0u);
}

// CPU work has run when the call that queued it returns: its event is NULL, and done.
TEST(Event, ACpuEventIsNullAndDone) {
  void* e = &e;
  ASSERT_EQ(rssm_event_record(&kCpu, &e), RSSM_OK) << rssm_last_error();
  EXPECT_EQ(e, nullptr);
  int done = 0;
  ASSERT_EQ(rssm_event_query(RSSM_BACKEND_CPU, e, &done), RSSM_OK);
  EXPECT_EQ(done, 1);
  EXPECT_EQ(rssm_event_destroy(RSSM_BACKEND_CPU, e), RSSM_OK);
}

TEST(Event, BadArgumentsAreRefusedByName) {
  void* e = nullptr;
  EXPECT_EQ(rssm_event_record(&kCpu, nullptr), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("rssm_event_record: out"), std::string::npos);
  EXPECT_EQ(rssm_event_record(nullptr, &e), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("launch"), std::string::npos);
  const rssm_launch bad{7, nullptr};
  EXPECT_EQ(rssm_event_record(&bad, &e), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("backend"), std::string::npos);
  EXPECT_EQ(rssm_event_query(RSSM_BACKEND_CPU, nullptr, nullptr), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("rssm_event_query: done"), std::string::npos);
  int done = 1;
  EXPECT_EQ(rssm_event_query(RSSM_BACKEND_CPU, &e, &done), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(done, 0);
  EXPECT_EQ(rssm_event_destroy(RSSM_BACKEND_CPU, &e), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("rssm_event_destroy: event"), std::string::npos);
}

TEST(SharedMemory, CudaIpcIsRefusedOnTheCpuBackendWithWhatToUseInstead) {
  unsigned char handle[RSSM_IPC_HANDLE_BYTES] = {};
  void* out = reinterpret_cast<void*>(1);
  size_t bytes = 1;
  EXPECT_EQ(rssm_ipc_open(RSSM_BACKEND_CPU, handle, sizeof handle, 0, &out, &bytes),
            RSSM_ERR_UNSUPPORTED);
  EXPECT_EQ(out, nullptr);
  EXPECT_NE(std::string(rssm_last_error()).find("POSIX shared memory"), std::string::npos);
}

TEST(SharedMemory, IpcOpenRefusesAHandleOfTheWrongSizeByName) {
  unsigned char handle[8] = {};
  void* out = nullptr;
  size_t bytes = 0;
  EXPECT_EQ(rssm_ipc_open(RSSM_BACKEND_CUDA, handle, sizeof handle, 0, &out, &bytes),
            RSSM_ERR_INVALID_ARGUMENT);
  const std::string msg = rssm_last_error();
  EXPECT_NE(msg.find("handle: expected 64 bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got 8 bytes"), std::string::npos) << msg;
}

TEST(RecordedSequence, IsRefusedOnTheCpuBackendWithWhatToDoInstead) {
  EXPECT_EQ(rssm_capture_begin(&kCpu), RSSM_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(rssm_last_error()).find("run them directly"), std::string::npos)
      << rssm_last_error();
  rssm_graph* graph = reinterpret_cast<rssm_graph*>(1);
  EXPECT_EQ(rssm_capture_end(&kCpu, 1, &graph), RSSM_ERR_UNSUPPORTED);
  EXPECT_EQ(graph, nullptr) << "out is cleared whatever the outcome";
}

TEST(ReleaseWait, EndsWhenItsWordArrivesAndRecordsNothing) {
  alignas(4) uint32_t word = 0, release = 0, outcome[2] = {0, 0};
  const rssm_release r{&release, 5, outcome};
  std::thread ringer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::atomic_ref<uint32_t>(word).store(3, std::memory_order_release);
  });
  EXPECT_EQ(rssm_stream_wait_value32_or(&kCpu, &word, 3, &r), RSSM_OK);
  ringer.join();
  EXPECT_EQ(outcome[0], 0u);
  EXPECT_EQ(outcome[1], 0u);
}

TEST(ReleaseWait, EndsOnItsTicketWhateverItsWordDoesAndRecordsItUnrung) {
  // The word is set back again and again; an earlier ticket's release does not end the wait,
  // its own does, and the ticket lands in the outcome word of its parity.
  alignas(4) uint32_t word = 0, release = 6, outcome[2] = {0, 0};
  const rssm_release r{&release, 7, outcome};
  std::atomic<bool> stop{false}, woke{false};
  std::thread client([&] {
    while (!stop.load(std::memory_order_acquire)) {
      std::atomic_ref<uint32_t>(word).store(0, std::memory_order_release);
    }
  });
  std::thread waiter([&] {
    EXPECT_EQ(rssm_stream_wait_value32_or(&kCpu, &word, 5, &r), RSSM_OK);
    woke.store(true, std::memory_order_release);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  EXPECT_FALSE(woke.load()) << "ended on ticket 6, which is not its own";
  std::atomic_ref<uint32_t>(release).store(7, std::memory_order_release);
  for (int i = 0; i < 300 && !woke.load(std::memory_order_acquire); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(woke.load()) << "the wait outlived its release by 3 s";
  stop.store(true, std::memory_order_release);
  client.join();
  if (!woke.load()) std::atomic_ref<uint32_t>(word).store(5, std::memory_order_release);
  waiter.join();
  EXPECT_EQ(outcome[1], 7u) << "ticket 7 is odd: its outcome is the second word";
  EXPECT_EQ(outcome[0], 0u);
  EXPECT_EQ(word, 0u) << "the release never writes the client's word";
}

TEST(ReleaseWait, AWaitWhoseWordWasRungBeforeItsReleaseIsNotUnrung) {
  alignas(4) uint32_t word = 9, release = 4, outcome[2] = {0, 0};
  const rssm_release r{&release, 4, outcome};  // released already, and rung already
  EXPECT_EQ(rssm_stream_wait_value32_or(&kCpu, &word, 9, &r), RSSM_OK);
  EXPECT_EQ(outcome[0], 0u);
  const rssm_release no_outcome{&release, 4, nullptr};  // released, short, nowhere to record
  EXPECT_EQ(rssm_stream_wait_value32_or(&kCpu, &word, 10, &no_outcome), RSSM_OK);
}

TEST(ReleaseWait, BadArgumentsAreRefusedByNameAndWriteNothing) {
  alignas(4) uint32_t words[3] = {0, 1, 0};
  alignas(4) uint32_t outcome[3] = {0, 0, 0};
  const auto* odd = reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(words) + 2);
  auto* odd_out = reinterpret_cast<uint32_t*>(reinterpret_cast<char*>(outcome) + 2);
  const rssm_release ok{&words[1], 1, outcome};
  struct Case {
    const rssm_release* release;
    const char* what;
  };
  const rssm_release no_word{nullptr, 1, outcome};
  const rssm_release odd_word{odd, 1, outcome};
  const rssm_release odd_outcome{&words[1], 1, odd_out};
  for (const Case& c : {Case{nullptr, "release: expected a pointer, got NULL"},
                        Case{&no_word, "release.word: expected a 4-byte aligned pointer"},
                        Case{&odd_word, "release.word: expected a 4-byte aligned pointer"},
                        Case{&odd_outcome, "release.outcome: expected NULL or a 4-byte aligned"}}) {
    EXPECT_EQ(rssm_stream_wait_value32_or(&kCpu, &words[0], 1, c.release),
              RSSM_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(rssm_last_error()).find(c.what), std::string::npos) << rssm_last_error();
  }
  EXPECT_EQ(rssm_stream_wait_value32_or(&kCpu, odd, 1, &ok), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("addr: expected a 4-byte aligned pointer"),
            std::string::npos);
  EXPECT_EQ(rssm_stream_wait_value32_or(nullptr, &words[0], 1, &ok), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(outcome[0] | outcome[1] | outcome[2], 0u);
  EXPECT_EQ(words[0], 0u);
}

TEST(RecordedSequence, BadArgumentsAreRefusedByName) {
  const rssm_launch bad{7, nullptr};
  EXPECT_EQ(rssm_capture_begin(nullptr), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(rssm_capture_begin(&bad), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(
      std::string(rssm_last_error()).find("launch.backend: expected 0 (CPU) or 1 (CUDA), got 7"),
      std::string::npos)
      << rssm_last_error();
  EXPECT_EQ(rssm_capture_end(&kCpu, 1, nullptr), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("out: expected a pointer"), std::string::npos);
  rssm_graph* graph = nullptr;
  EXPECT_EQ(rssm_capture_end(&kCpu, 2, &graph), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("keep: expected 0 or 1, got 2"), std::string::npos)
      << rssm_last_error();
  EXPECT_EQ(rssm_graph_launch(&kCpu, nullptr, 1, 1), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("graph: expected a recording, got NULL"),
            std::string::npos);
  EXPECT_EQ(rssm_graph_doorbells(nullptr), 0);
  EXPECT_EQ(rssm_graph_destroy(nullptr), RSSM_OK);
}

TEST(SharedMemory, MpsDetectionFollowsThePipeDirectory) {
  setenv("CUDA_MPS_PIPE_DIRECTORY", "/nonexistent-replayssm-test", 1);
  EXPECT_EQ(rssm_mps_active(), 0);
  unsetenv("CUDA_MPS_PIPE_DIRECTORY");
}

}  // namespace
