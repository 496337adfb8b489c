// The host tier end to end (--host-snapshot-bytes): a donated turn pushed out of the server's
// GPU pool by other requests is found on the host, and the next turn starts from it.
#include <gtest/gtest.h>

#include "service_fixture.h"

namespace replayssm::testing {
namespace {

class HostTierTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    // 3 slots of tiny-gdn (135,680 bytes each) and room for several snapshots on the host.
    return {"--track-interval=0", "--memory-budget=410K", "--host-snapshot-bytes=1M",
            "--host-snapshot-policy=value"};
  }
};

TEST_F(HostTierTest, TheSecondTurnHitsAfterTheFirstWasPushedToHost) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  Prefill(a, sa, 7);
  for (int i = 0; i < 5; ++i) DecodeStep({a}, {sa});
  auto exported = client_->Export(a);
  ASSERT_TRUE(exported.ok()) << exported.status();
  std::vector<int32_t> tokens(exported->tokens().begin(), exported->tokens().end());
  ASSERT_TRUE(client_->Donate(a).ok());
  std::vector<uint64_t> others;  // the whole pool: the donation goes to the host
  for (int i = 0; i < 3; ++i) others.push_back(NewSlot());
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->slots_snapshot(), 0);
  EXPECT_EQ(stats->snapshot_spills(), 1);
  EXPECT_EQ(stats->host_snapshots(), 1);
  EXPECT_GT(stats->host_bytes(), 0);
  EXPECT_GE(stats->host_capacity_bytes(), stats->host_bytes());
  for (uint64_t s : others) ASSERT_TRUE(client_->Free(s).ok());
  tokens.push_back(42);
  EXPECT_EQ(*client_->MatchPrefix(tokens), 12);
  auto b = client_->AllocateFromPrefix(tokens);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->matched(), 12);
  stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->host_hits(), 1);
  EXPECT_EQ(stats->host_promotions(), 1);
  EXPECT_EQ(client_->GetSlot(b->slot())->seq_len(), 12);
  DecodeStep({b->slot()}, {sa});  // continues turn 1 exactly as the reference does
}

// A snapshot spilled to the host is no loss: /metrics counts it kept, and only what no tier
// holds lost (ReplaySSMSnapshotEvictionsHigh alerts on lost; it counted every spill).
TEST_F(HostTierTest, MetricsCountASpillKeptAndADropLost) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  Prefill(a, sa, 7);
  ASSERT_TRUE(client_->Donate(a).ok());
  std::vector<uint64_t> others;  // the whole pool: the donation goes to the host
  for (int i = 0; i < 3; ++i) others.push_back(NewSlot());
  auto text = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  const std::string family = "replayssm_snapshot_tier_evictions_total";
  EXPECT_EQ(Sample(*text, family + R"({tier="gpu",result="kept"})"), 1) << *text;
  EXPECT_EQ(Sample(*text, family + R"({tier="gpu",result="lost"})"), 0) << *text;
  EXPECT_EQ(Sample(*text, family + R"({tier="host",result="lost"})"), 0) << *text;
  EXPECT_EQ(Sample(*text, "replayssm_snapshot_evictions_total"), 1) << "all of them, as before";
}

}  // namespace
}  // namespace replayssm::testing
