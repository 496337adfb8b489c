#include "service/request_log.h"

#include <string>

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
  RequestLog log(100, 10);
  log.Begin("M", "a", 0);
  log.Complete("M", "a", std::string(6, 'x'));
  log.Begin("M", "b", 0);
  log.Complete("M", "b", std::string(6, 'y'));  // 12 bytes > 10: a goes
  EXPECT_EQ(log.Begin("M", "a", 0).outcome, Outcome::kNew);
  log.Begin("M", "big", 0);
  log.Complete("M", "big", std::string(11, 'z'));
  EXPECT_EQ(log.Begin("M", "big", 0).outcome, Outcome::kNotRetained);
}

}  // namespace
}  // namespace replayssm::service
