#include "service/cache_events.h"

#include <vector>

#include "gtest/gtest.h"

namespace replayssm::service {
namespace {

struct NullListener : KvEventListener {
  void OnBatch(TenantId, const KvEventBatch&) override {}
};

// A catch-up longer than the caller can queue is a resync: WatchCache queued it, ended the
// stream before its first write, and the reconnect its error asked for got the same answer
// for ever (with --cache-events-retain above its backlog).
TEST(CacheEventLog, ACatchUpLongerThanTheCallerTakesIsAResync) {
  NullListener listener;
  CacheEventLog log(CacheEventLogOptions{.retain = 100});
  for (int i = 0; i < 20; ++i) log.Clear(kImplicitTenant);  // batches 1..20
  const std::vector<KvEventBatch> all = log.Watch(kImplicitTenant, log.epoch(), 1, &listener, 20);
  log.Unwatch(&listener);
  ASSERT_EQ(all.size(), 20u);
  EXPECT_FALSE(all.front().resync);
  const std::vector<KvEventBatch> longer =
      log.Watch(kImplicitTenant, log.epoch(), 1, &listener, 10);
  log.Unwatch(&listener);
  ASSERT_EQ(longer.size(), 1u);
  EXPECT_TRUE(longer.front().resync);
  EXPECT_EQ(longer.front().seq, 20u) << "numbered the last one";
  const std::vector<KvEventBatch> shorter =
      log.Watch(kImplicitTenant, log.epoch(), 11, &listener, 10);
  log.Unwatch(&listener);
  ASSERT_EQ(shorter.size(), 10u);
  EXPECT_EQ(shorter.front().seq, 11u);
}

}  // namespace
}  // namespace replayssm::service
