#include "service/zmq_events.h"

#include <unistd.h>
#include <zmq.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "replayssm/cache/events.h"
#include "tests/zmq_testing.h"

namespace replayssm::service {
namespace {

using zmq_testing::Frames;
using zmq_testing::Seq;

// A replay longer than the ROUTER socket's queue (1000 messages past what the socket buffers
// hold) lost batches and its end marker silently (an outside review): the router waited for
// an end that never came. It is sent at the pace the router reads now, and the publisher goes
// on publishing meanwhile.
TEST(ZmqEventPublisher, AReplayLongerThanTheSocketsQueueArrivesWhole) {
  constexpr int kBatches = 3000;
  CacheEventLog log(
      CacheEventLogOptions{.block_size = 2048, .retain = 4096, .flush_interval = absl::Hours(1)});
  cache::CacheEventSink sink = log.Sink();
  for (int i = 0; i < kBatches; ++i) {  // ~10 KB each: 2048 tokens of 5 msgpack bytes
    cache::CacheEvent e;
    e.tokens.resize(2048);
    for (int j = 0; j < 2048; ++j) e.tokens[j] = 1000000 + i * 2048 + j;
    sink(e);
    log.Flush();
  }
  ASSERT_EQ(log.batches(), kBatches);
  const std::string dir = ::testing::TempDir() + "/zmq_replay_" + std::to_string(getpid());
  ZmqEventsOptions options;
  options.endpoint = absl::StrCat("ipc://", dir, "_pub");
  options.replay_endpoint = absl::StrCat("ipc://", dir, "_replay");
  auto publisher = ZmqEventPublisher::Start(&log, options);
  ASSERT_TRUE(publisher.ok()) << publisher.status();  // its start: batch kBatches + 1

  void* ctx = zmq_ctx_new();
  void* dealer = zmq_socket(ctx, ZMQ_DEALER);
  const int timeout_ms = 20000;
  const int hwm = 100;  // the router's own queue holds little either
  zmq_setsockopt(dealer, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
  zmq_setsockopt(dealer, ZMQ_RCVHWM, &hwm, sizeof(hwm));
  ASSERT_EQ(zmq_connect(dealer, options.replay_endpoint.c_str()), 0);
  const std::string from = std::string(7, '\0') + '\1';
  ASSERT_EQ(zmq_send(dealer, from.data(), from.size(), 0), 8);
  absl::SleepFor(absl::Milliseconds(500));  // the router reads nothing yet: the queues fill
  log.Clear(kImplicitTenant);               // published while the replay waits
  for (int i = 0; i < 200 && (*publisher)->published() < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ((*publisher)->published(), 2) << "the start's batch and this one";

  int64_t expected = 1;
  for (;;) {
    const std::vector<std::string> f = Frames(dealer);
    ASSERT_EQ(f.size(), 2u) << "no reply within 20 s after batch " << expected - 1;
    ASSERT_EQ(f[0].size(), 8u);
    if (Seq(f[0]) == -1) break;
    ASSERT_EQ(Seq(f[0]), expected) << "a batch missing from the replay";
    ++expected;
  }
  EXPECT_GE(expected, kBatches + 2) << "every kept batch, the start's among them";
  zmq_close(dealer);
  zmq_ctx_term(ctx);
  publisher->reset();
}

}  // namespace
}  // namespace replayssm::service
