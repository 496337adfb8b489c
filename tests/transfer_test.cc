// Slot transfers between two real replayssm-server processes over UCX (issue 6): prefill on
// A, transfer to B, decode on B exactly as on A; a shape mismatch refused before any byte
// moves; the receiver dying before the commit, the sender dying after the put, a corrupted
// payload — each leaves A's slot as it was and B with nothing leaked. The pull form (B asks A
// to send) with the same outcomes. A sends over its default 4 put lanes (--transfer-lanes);
// TransferLanesTest runs A with 1 and 3 lanes and small, uneven chunks.
#include <chrono>
#include <sstream>
#include <thread>

#include "replayssm/client/demo.h"

#include "service_fixture.h"

namespace replayssm::testing {
namespace {

class TransferTest : public ServiceTest {
 protected:
  std::unique_ptr<ServerProcess> StartPeer(std::vector<std::string> flags) {
    auto p = ServerProcess::Start(std::move(flags));
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? *std::move(p) : nullptr;
  }
  // A slot on A with a prefill and decode steps: its ring holds records (write_pos != 0).
  uint64_t PreparedSlot() {
    const uint64_t s = NewSlot();
    Prefill(s, 0, 5);
    DecodeStep({s}, {0});
    DecodeStep({s}, {0});
    auto info = client_->GetSlot(s);
    EXPECT_TRUE(info.ok());
    EXPECT_GT(info->write_pos(), 0) << "the transfer must materialize a non-empty ring";
    return s;
  }
  // B's slot holds A's logical state, and the same decode step on both is bit-identical.
  void ExpectSameStateAndDecode(Client& cb, uint64_t s, uint64_t on_b) {
    auto ea = client_->Export(s), eb = cb.Export(on_b);
    ASSERT_TRUE(ea.ok() && eb.ok());
    EXPECT_EQ(ea->SerializeAsString(), eb->SerializeAsString()) << "B holds A's logical state";
    const std::vector<v1::LayerInput> layers = Layers(1);
    auto da = client_->Decode(DecodeRequest({s}, layers));
    auto db = cb.Decode(DecodeRequest({on_b}, layers));
    ASSERT_TRUE(da.ok() && db.ok());
    for (int l = 0; l < num_layers(); ++l) {
      EXPECT_EQ(da->layers(l).out().data(), db->layers(l).out().data()) << "layer " << l;
    }
  }
  double Metric(const ServerProcess& p, const std::string& series) {
    auto text = HttpGet(p.metrics_address(), "/metrics");
    EXPECT_TRUE(text.ok()) << text.status();
    return text.ok() ? Sample(*text, series) : -1;
  }
};

TEST_F(TransferTest, DecodeOnTheReceiverContinuesExactlyAsOnTheSender) {
  auto b = StartPeer({});
  ASSERT_NE(b, nullptr);
  auto cb = Client::Connect(b->grpc_address());
  const uint64_t s = PreparedSlot();
  auto r = client_->TransferSlot(s, b->grpc_address(), /*keep_source=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq_len(), 7);
  EXPECT_EQ(client_->GetSlot(s)->write_pos(), 0) << "the sender folded before sending";
  auto on_b = cb->GetSlot(r->remote_slot());
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  EXPECT_EQ(on_b->seq_len(), 7);
  EXPECT_EQ(on_b->write_pos(), 0);
  ExpectSameStateAndDecode(*cb, s, r->remote_slot());
  EXPECT_EQ(Metric(*server_, "replayssm_transfer_bytes_total"),
            static_cast<double>(r->bytes()));
  // Without keep_source the sender's slot is released.
  auto moved = client_->TransferSlot(s, b->grpc_address(), /*keep_source=*/false);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(client_->GetSlot(s).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TransferTest, ShapeMismatchIsRefusedBeforeAnyByteMoves) {
  auto b = StartPeer({"--model=tiny-kda"});
  ASSERT_NE(b, nullptr);
  const uint64_t s = PreparedSlot();
  const std::string before = Observe(s);
  auto r = client_->TransferSlot(s, b->grpc_address(), false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("format.gate"), std::string::npos) << r.status();
  EXPECT_EQ(Observe(s), before);
  EXPECT_EQ(Client::Connect(b->grpc_address())->Stats()->slots_live(), 0);
}

TEST_F(TransferTest, ReceiverDyingBeforeTheCommitLeavesTheSenderIntact) {
  auto b = StartPeer({"--transfer-fault=exit-before-commit"});
  ASSERT_NE(b, nullptr);
  const uint64_t s = PreparedSlot();
  const std::string before = Observe(s);
  auto r = client_->TransferSlot(s, b->grpc_address(), false);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(Observe(s), before) << "the source is unchanged";
  DecodeStep({s}, {0});  // and usable
  ASSERT_TRUE(b->WaitExit(absl::Seconds(10)).ok());
  auto restarted = StartPeer({});  // a new instance starts with nothing reserved
  ASSERT_NE(restarted, nullptr);
  EXPECT_EQ(Client::Connect(restarted->grpc_address())->Stats()->slots_live(), 0);
  EXPECT_EQ(Metric(*server_, "replayssm_transfer_failures_total{reason=\"UNAVAILABLE\"}"), 1);
}

TEST_F(TransferTest, SenderDyingAfterThePutIsCleanedUpByTheLease) {
  auto b = StartPeer({"--transfer-lease=0.5"});
  ASSERT_NE(b, nullptr);
  auto a = StartPeer({"--transfer-fault=exit-after-put"});
  ASSERT_NE(a, nullptr);
  auto ca = Client::Connect(a->grpc_address());
  auto slot = ca->Allocate();
  ASSERT_TRUE(slot.ok());
  auto r = ca->TransferSlot(slot->slot(), b->grpc_address(), false);
  EXPECT_FALSE(r.ok()) << "the sender died";
  EXPECT_EQ(Metric(*b, "replayssm_transfer_reservations"), 1);
  auto cb = Client::Connect(b->grpc_address());
  EXPECT_EQ(cb->Stats()->slots_live(), 1) << "reserved";
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(cb->Stats()->slots_live(), 0) << "the lease released the reservation";
  EXPECT_EQ(Metric(*b, "replayssm_transfer_reservations"), 0);
}

TEST_F(TransferTest, CorruptedPayloadIsRefused) {
  auto b = StartPeer({"--transfer-fault=corrupt"});
  ASSERT_NE(b, nullptr);
  const uint64_t s = PreparedSlot();
  const std::string before = Observe(s);
  auto r = client_->TransferSlot(s, b->grpc_address(), false);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_EQ(Observe(s), before);
  EXPECT_EQ(Client::Connect(b->grpc_address())->Stats()->slots_live(), 0);
  EXPECT_EQ(Metric(*b, "replayssm_transfer_failures_total{reason=\"DATA_LOSS\"}"), 1);
  auto retry = client_->TransferSlot(s, b->grpc_address(), true);  // the next one is clean
  EXPECT_TRUE(retry.ok()) << retry.status();
}

TEST_F(TransferTest, PullFormBringsThePeersSlotHere) {
  auto b = StartPeer({});
  ASSERT_NE(b, nullptr);
  auto cb = Client::Connect(b->grpc_address());
  const uint64_t s = PreparedSlot();  // on A; B pulls it
  auto pulled = cb->PullSlot(s, server_->grpc_address(), /*keep_source=*/true);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_EQ(pulled->seq_len(), 7);
  EXPECT_EQ(client_->GetSlot(s)->write_pos(), 0) << "the sender folded before sending";
  auto on_b = cb->GetSlot(pulled->slot());
  ASSERT_TRUE(on_b.ok()) << on_b.status();
  EXPECT_EQ(on_b->seq_len(), 7);
  auto ea = client_->Export(s), eb = cb->Export(pulled->slot());
  ASSERT_TRUE(ea.ok() && eb.ok());
  EXPECT_EQ(ea->SerializeAsString(), eb->SerializeAsString()) << "B holds A's logical state";
  // Failures change nothing: a slot A does not have, a sender that is not there.
  auto missing = cb->PullSlot(s ^ 0x1234, server_->grpc_address(), false);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  auto dead = cb->PullSlot(s, "127.0.0.1:1", false);
  EXPECT_EQ(dead.status().code(), absl::StatusCode::kUnavailable) << dead.status();
  auto bad = cb->PullSlot(s, server_->grpc_address(), false, "0.0.0.0:5");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("self_address"), std::string::npos) << bad.status();
  EXPECT_EQ(cb->Stats()->slots_live(), 1) << "only the pulled slot";
  EXPECT_TRUE(client_->GetSlot(s).ok()) << "the source is still there";
  // Without keep_source the sender's slot is released.
  auto moved = cb->PullSlot(s, server_->grpc_address(), /*keep_source=*/false);
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_EQ(client_->GetSlot(s).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cb->Stats()->slots_live(), 2);
}

TEST_F(TransferTest, DisaggregatedDemoPrefillsHereAndDecodesThere) {
  auto b = StartPeer({"--track-interval=16"});
  ASSERT_NE(b, nullptr);
  client::DemoOptions options;
  options.decode_address = b->grpc_address();
  options.seed = 11;
  std::ostringstream log;
  auto report = client::RunDemo(*client_, options, log);
  ASSERT_TRUE(report.ok()) << report.status() << "\n" << log.str();
  EXPECT_NE(log.str().find("to the decode server"), std::string::npos) << log.str();
  EXPECT_EQ(report->prefix_matched, report->prefix_expected);
  EXPECT_EQ(client_->Stats()->slots_live(), 0) << "every request moved to the decode server";
  EXPECT_GT(Client::Connect(b->grpc_address())->Stats()->forwards_committed(), 0);
}

// A with --transfer-lanes N and chunks small enough that the slot is many of them (their
// count not a multiple of 3); B imports in chunks of its own size.
class TransferLanesTest : public TransferTest, public ::testing::WithParamInterface<int> {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--transfer-lanes=" + std::to_string(GetParam()),
            "--transfer-chunk-bytes=1000"};
  }
};

TEST_P(TransferLanesTest, TheStateArrivesBitForBitAndACorruptionIsStillCaught) {
  auto b = StartPeer({"--transfer-chunk-bytes=700"});
  ASSERT_NE(b, nullptr);
  auto cb = Client::Connect(b->grpc_address());
  const uint64_t s = PreparedSlot();
  auto r = client_->TransferSlot(s, b->grpc_address(), /*keep_source=*/true);
  ASSERT_TRUE(r.ok()) << r.status();
  ExpectSameStateAndDecode(*cb, s, r->remote_slot());
  // A receiver that damages the payload: DATA_LOSS, nothing leaks, the source is unchanged.
  auto bad = StartPeer({"--transfer-fault=corrupt", "--transfer-chunk-bytes=700"});
  ASSERT_NE(bad, nullptr);
  const std::string before = Observe(s);
  auto lost = client_->TransferSlot(s, bad->grpc_address(), false);
  EXPECT_EQ(lost.status().code(), absl::StatusCode::kDataLoss) << lost.status();
  EXPECT_EQ(Observe(s), before);
  EXPECT_EQ(Client::Connect(bad->grpc_address())->Stats()->slots_live(), 0);
  auto retry = client_->TransferSlot(s, bad->grpc_address(), false);
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(client_->GetSlot(s).status().code(), absl::StatusCode::kNotFound) << "moved";
}

INSTANTIATE_TEST_SUITE_P(Lanes, TransferLanesTest, ::testing::Values(1, 3),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return std::to_string(i.param) + "lanes";
                         });

}  // namespace
}  // namespace replayssm::testing
