// REPLAYSSM_CPU_THREADS, the kernel library's one environment setting: a whole number from 0
// to kMaxThreads, anything else the default (0) with a line on stderr.
#include "cpu/thread_pool.h"

#include <atomic>
#include <string>

#include "gtest/gtest.h"

namespace replayssm::kernels::cpu {
namespace {

TEST(CpuThreads, TheEnvironmentTakesAWholeNumberElseTheDefaultAndSaysSo) {
  EXPECT_EQ(ThreadsFromEnvironment(nullptr), 0);
  EXPECT_EQ(ThreadsFromEnvironment(""), 0);
  EXPECT_EQ(ThreadsFromEnvironment("0"), 0);
  EXPECT_EQ(ThreadsFromEnvironment("3"), 3);
  EXPECT_EQ(ThreadsFromEnvironment("1024"), kMaxThreads);
  for (const char* bad : {"abc", "4x", "-1", "1025", "99999999999999999999", " 2"}) {
    testing::internal::CaptureStderr();
    EXPECT_EQ(ThreadsFromEnvironment(bad), 0) << bad;
    const std::string said = testing::internal::GetCapturedStderr();
    EXPECT_NE(said.find(std::string("REPLAYSSM_CPU_THREADS: expected a whole number of threads "
                                    "from 0 to 1024")),
              std::string::npos)
        << bad << ": " << said;
    EXPECT_NE(said.find(std::string("got \"") + bad + "\""), std::string::npos) << said;
  }
}

TEST(CpuThreads, APoolOfTheAskedSizeRunsEveryIndexOnce) {
  ThreadPool pool(ThreadsFromEnvironment("2"));
  std::atomic<int64_t> sum{0};
  pool.ParallelFor(1000, [&](int64_t i) { sum += i; });
  EXPECT_EQ(sum.load(), 999 * 1000 / 2);
}

}  // namespace
}  // namespace replayssm::kernels::cpu
