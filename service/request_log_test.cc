#include "service/request_log.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace replayssm::service {
namespace {

using Outcome = RequestLog::Outcome;

TEST(RequestLog, AnAppliedIdReplaysItsReply) {
  RequestLog log(8, 1 << 20);
  EXPECT_EQ(log.Begin("Decode", "a", 1).outcome, Outcome::kNew);
  EXPECT_EQ(log.Begin("Decode", "a", 1).outcome, Outcome::kInFlight);
  log.Complete("Decode", "a", "reply");
  RequestLog::Claim c = log.Begin("Decode", "a", 1);
  EXPECT_EQ(c.outcome, Outcome::kReplay);
  EXPECT_EQ(c.reply, "reply");
  EXPECT_EQ(log.Begin("Free", "a", 1).outcome, Outcome::kNew);  // ids are per method
}

TEST(RequestLog, AReleasedIdRunsAgain) {
  RequestLog log(8, 1 << 20);
  ASSERT_EQ(log.Begin("Allocate", "a", 1).outcome, Outcome::kNew);
  log.Release("Allocate", "a");
  EXPECT_EQ(log.Begin("Allocate", "a", 1).outcome, Outcome::kNew);
}

TEST(RequestLog, AReusedIdWithAnotherRequestIsAMismatch) {
  RequestLog log(8, 1 << 20);
  log.Begin("Decode", "a", 1);
  log.Complete("Decode", "a", "r");
  EXPECT_EQ(log.Begin("Decode", "a", 2).outcome, Outcome::kMismatch);
}

TEST(RequestLog, LeastRecentlyUsedIdsAreForgottenBeyondTheEntryBound) {
  RequestLog log(2, 1 << 20);
  for (const char* id : {"a", "b"}) {
    log.Begin("M", id, 0);
    log.Complete("M", id, id);
  }
  EXPECT_EQ(log.Begin("M", "a", 0).outcome, Outcome::kReplay);  // a is now the most recent
  log.Begin("M", "c", 0);
  log.Complete("M", "c", "c");  // evicts b
  EXPECT_EQ(log.Begin("M", "a", 0).outcome, Outcome::kReplay);
  EXPECT_EQ(log.Begin("M", "b", 0).outcome, Outcome::kNew);
}

TEST(RequestLog, TheByteBoundEvictsAndAnOversizedReplyIsNotRetained) {
  // An entry costs its reply, its key ("M/a") twice and the fixed overhead: 140 bytes here.
  const int64_t entry = 6 + 2 * 3 + RequestLog::kEntryOverhead;
  RequestLog log(100, 2 * entry - 1);
  log.Begin("M", "a", 0);
  log.Complete("M", "a", std::string(6, 'x'));
  log.Begin("M", "b", 0);
  log.Complete("M", "b", std::string(6, 'y'));  // 2 entries > the bound: a goes
  EXPECT_EQ(log.Begin("M", "a", 0).outcome, Outcome::kNew);
  log.Begin("M", "big", 0);
  log.Complete("M", "big", std::string(2 * entry, 'z'));
  EXPECT_EQ(log.Begin("M", "big", 0).outcome, Outcome::kNotRetained);
}

// Ids cost memory too: 4 MiB ids used to be kept beyond --dedup-bytes, uncounted.
TEST(RequestLog, KeptIdsCountAgainstTheByteBound) {
  RequestLog log(1000, 10000, 4096);
  const std::string id(1000, 'x');
  for (int i = 0; i < 20; ++i) {
    const std::string k = id + std::to_string(i);
    ASSERT_EQ(log.Begin("Allocate", k, 1).outcome, Outcome::kNew);
    log.Complete("Allocate", k, "r");
    EXPECT_LE(log.bytes(), 10000);
  }
  EXPECT_GT(log.bytes(), 8000);
  EXPECT_EQ(log.Begin("Allocate", id + "0", 1).outcome, Outcome::kNew) << "evicted by bytes";
  EXPECT_EQ(log.Begin("Allocate", id + "19", 1).outcome, Outcome::kReplay);
}

// Tenants share the window fairly: an outside review applied alice's retried prefill twice
// after bob's 2048 Allocate+Free pairs had pushed her id out of the one LRU.
TEST(RequestLog, AnOwnersFloodForgetsItsOwnIdsNotAnothersWithinItsShare) {
  RequestLog log(8, 1 << 20);
  const RequestLog::Scope alice("Prefill", 1), bob("Allocate", 2);
  for (const char* id : {"a1", "a2", "a3"}) {
    log.Begin(alice, id, 0);
    log.Complete(alice, id, id);
  }
  for (int i = 0; i < 100; ++i) {
    const std::string id = absl::StrCat("b", i);
    ASSERT_EQ(log.Begin(bob, id, 0).outcome, Outcome::kNew);
    log.Complete(bob, id, id);
  }
  EXPECT_EQ(log.entries_of(1), 3);
  EXPECT_EQ(log.entries_of(2), 5) << "the rest of the window, its most recent ids";
  for (const char* id : {"a1", "a2", "a3"}) {
    RequestLog::Claim c = log.Begin(alice, id, 0);
    EXPECT_EQ(c.outcome, Outcome::kReplay) << id;
    EXPECT_EQ(c.reply, id);
  }
  EXPECT_EQ(log.Begin(bob, "b94", 0).outcome, Outcome::kNew) << "bob's own older ones went";
  log.Release(bob, "b94");
  EXPECT_EQ(log.Begin(bob, "b95", 0).outcome, Outcome::kReplay);
  // Past its share an owner gives up its least recent ids until the holders are even.
  for (int i = 0; i < 4; ++i) {
    const std::string id = absl::StrCat("a", 10 + i);
    log.Begin(alice, id, 0);
    log.Complete(alice, id, id);
  }
  EXPECT_EQ(log.entries_of(1), 4);
  EXPECT_EQ(log.entries_of(2), 4);
  EXPECT_EQ(log.Begin(RequestLog::Scope("Prefill", 2), "a1", 0).outcome, Outcome::kNew)
      << "ids are per owner";
}

// The byte bound is shared the same way: the owner holding the most bytes gives them up.
TEST(RequestLog, AnOwnersLargeRepliesForgetItsOwnIdsNotAnothers) {
  const int64_t entry = 6 + 2 * 10 + RequestLog::kEntryOverhead;  // "Decode@1/a" and a reply
  RequestLog log(1000, 6 * entry);
  const RequestLog::Scope alice("Decode", 1), bob("Decode", 2);
  log.Begin(alice, "a", 0);
  log.Complete(alice, "a", std::string(6, 'x'));
  for (int i = 0; i < 20; ++i) {
    const std::string id = absl::StrCat("b", i);
    log.Begin(bob, id, 0);
    log.Complete(bob, id, std::string(600, 'y'));
    EXPECT_LE(log.bytes(), 6 * entry);
  }
  EXPECT_EQ(log.Begin(alice, "a", 0).outcome, Outcome::kReplay);
  EXPECT_EQ(log.entries_of(2), 1) << "bob's replies are large: one fits beside alice's";
}

TEST(RequestLog, CheckIdRefusesEmptyAndLongIdsNamingTheField) {
  RequestLog log(8, 1 << 20, 4);
  EXPECT_TRUE(log.CheckId("abcd").ok());
  EXPECT_EQ(log.CheckId("abcde").message(),
            "request_id: expected a non-empty id of at most 4 bytes (--max-request-id-bytes), "
            "got 5 bytes");
  EXPECT_EQ(log.CheckId("", "begin.request_id").message(),
            "begin.request_id: expected a non-empty id of at most 4 bytes "
            "(--max-request-id-bytes), got \"\"");
  EXPECT_TRUE(log.CheckTransferId(std::string(4 + RequestLog::kTransferIdSuffix, 't')).ok());
  EXPECT_FALSE(log.CheckTransferId(std::string(5 + RequestLog::kTransferIdSuffix, 't')).ok());
}

}  // namespace
}  // namespace replayssm::service
