// Doorbells and shared memory on the CPU backend: waits end when the word reaches the value
// (cyclically), writes are visible to a waiter on another thread, bad arguments are refused
// by name, and CUDA IPC is refused on the CPU with a message that says what to use instead.
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
  EXPECT_EQ(rssm_graph_launch(&kCpu, nullptr, 1), RSSM_ERR_INVALID_ARGUMENT);
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
