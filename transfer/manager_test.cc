// TransferManager: moves by request id on threads of its own, against real receivers in the
// same process (and a peer that never answers).
#include "replayssm/transfer/manager.h"

#include <gtest/gtest.h>

#include <atomic>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "replayssm/transfer/ucx_transport.h"
#include "test_model.h"
#include "transfer_testing.h"

namespace replayssm::transfer {
namespace {

using cache::SlotId;
using testing::DirectPeer;
using testing::HungPeer;
using testing::MakeCache;

// A peer that forwards to a shared DirectPeer (which outlives it).
class Forward final : public Peer {
 public:
  explicit Forward(Peer* to) : to_(to) {}
  absl::StatusOr<Reservation> Reserve(const std::string& id, const StateFormat& f, int64_t n,
                                      uint32_t v, absl::Duration b, absl::Time d) override {
    return to_->Reserve(id, f, n, v, b, d);
  }
  absl::StatusOr<uint64_t> Commit(const std::string& id, const std::vector<int32_t>& t, uint64_t c,
                                  absl::Time d) override {
    return to_->Commit(id, t, c, d);
  }
  absl::StatusOr<Decision> Abort(const std::string& id, absl::Time d) override {
    return to_->Abort(id, d);
  }
  void Acknowledge(const std::string& id) override { to_->Acknowledge(id); }

 private:
  Peer* to_;
};

// The result of one Transfer call, once its `done` ran.
struct Answer {
  absl::Notification done;
  absl::StatusOr<SendResult> result;
  absl::Time at;
  TransferManager::Done Callback() {
    return [this](const absl::StatusOr<SendResult>& r) {
      result = r;
      at = absl::Now();
      done.Notify();
    };
  }
  const absl::StatusOr<SendResult>& Wait() {
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
    return result;
  }
};

class ManagerTest : public testing::TwoInstancesTest {
 protected:
  void SetUp() override {
    TwoInstancesTest::SetUp();
    rx_ = std::make_unique<Receiver>(b_.get(), ucx_b_.get(), ReceiverOptions{});
    peer_ = std::make_unique<DirectPeer>(rx_.get());
    sender_ = std::make_unique<Sender>(a_.get(), std::vector<PutLane*>{ucx_a_.get()});
  }
  std::unique_ptr<TransferManager> Manager(ManagerOptions o = {}) {
    return std::make_unique<TransferManager>(
        sender_.get(),
        [this](const std::string& address) -> std::unique_ptr<Peer> {
          if (address == "hung") return std::make_unique<HungPeer>();
          return std::make_unique<Forward>(peer_.get());
        },
        o);
  }
  SlotId NewSlot() { return Prepare(0); }

  std::unique_ptr<Receiver> rx_;
  std::unique_ptr<DirectPeer> peer_;
  std::unique_ptr<Sender> sender_;
};

TEST_F(ManagerTest, ARetryGetsTheOriginalResultAndAnotherRequestUnderItsIdIsRefused) {
  auto m = Manager();
  const SlotId s = NewSlot();
  Answer first, again, other;
  m->Transfer({"r1", s, "b", false}, first.Callback());
  ASSERT_TRUE(first.Wait().ok()) << first.result.status();
  m->Transfer({"r1", s, "b", false}, again.Callback());
  ASSERT_TRUE(again.Wait().ok()) << again.result.status();
  EXPECT_EQ(again.result->remote_slot, first.result->remote_slot);
  EXPECT_EQ(peer_->reserves.load(), 1) << "moved once";
  m->Transfer({"r1", s, "b", true}, other.Callback());
  EXPECT_EQ(other.Wait().status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ManagerTest, ARetryInFlightJoinsTheMove) {
  auto m = Manager();
  const SlotId s = NewSlot();
  absl::Notification release;
  peer_->before_commit = [&] { release.WaitForNotification(); };
  Answer one, two;
  m->Transfer({"r2", s, "b", true}, one.Callback());
  m->Transfer({"r2", s, "b", true}, two.Callback());
  release.Notify();
  ASSERT_TRUE(one.Wait().ok() && two.Wait().ok()) << one.result.status() << two.result.status();
  EXPECT_EQ(one.result->remote_slot, two.result->remote_slot);
  EXPECT_EQ(peer_->reserves.load(), 1);
  EXPECT_EQ(b_->stats().slots_live, 1);
}

TEST_F(ManagerTest, AFailedMoveRunsAnewOnRetry) {
  auto m = Manager();
  const SlotId s = NewSlot();
  peer_->corrupt_checksum = true;
  Answer bad, good;
  m->Transfer({"r3", s, "b", false}, bad.Callback());
  EXPECT_EQ(bad.Wait().status().code(), absl::StatusCode::kDataLoss);
  peer_->corrupt_checksum = false;
  m->Transfer({"r3", s, "b", false}, good.Callback());
  ASSERT_TRUE(good.Wait().ok()) << good.result.status();
  EXPECT_EQ(a_->Info(s).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(ManagerTest, AMoveInDoubtKeepsItsSourceUntilARetryOrTheResolverLearnsTheOutcome) {
  auto m = Manager({.timeout = absl::Seconds(2), .resolve_interval = absl::Milliseconds(100)});
  // Resolved by the retry: the receiver had committed (only the answers were lost).
  const SlotId s = NewSlot();
  peer_->lose_commit_reply = peer_->drop_abort = true;
  Answer lost;
  m->Transfer({"r4", s, "b", false}, lost.Callback());
  EXPECT_EQ(lost.Wait().status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(m->in_doubt(), 1);
  EXPECT_EQ(a_->Info(s)->seq_len, 3) << "the source is still here";
  EXPECT_EQ(a_->BeginForward({{s, 1}}).status().code(), absl::StatusCode::kFailedPrecondition);
  peer_->lose_commit_reply = peer_->drop_abort = false;
  Answer retry;
  m->Transfer({"r4", s, "b", false}, retry.Callback());
  ASSERT_TRUE(retry.Wait().ok()) << retry.result.status();
  EXPECT_EQ(b_->stats().slots_live, 1) << "the committed copy, not a second one";
  EXPECT_EQ(a_->Info(s).status().code(), absl::StatusCode::kNotFound) << "moved";
  EXPECT_EQ(m->in_doubt(), 0);
  // Resolved in the background: nothing was committed, the source is released.
  const SlotId t = NewSlot();
  peer_->drop_commit = peer_->drop_abort = true;
  Answer quiet;
  m->Transfer({"r5", t, "b", false}, quiet.Callback());
  EXPECT_EQ(quiet.Wait().status().code(), absl::StatusCode::kUnavailable);
  peer_->drop_commit = peer_->drop_abort = false;
  for (int i = 0; i < 200 && m->in_doubt() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(m->in_doubt(), 0);
  EXPECT_TRUE(a_->BeginForward({{t, 1}}).ok()) << "released once the receiver said: aborted";
  EXPECT_EQ(b_->stats().slots_live, 1);
}

// A retry that joins the resolver's asking of the peer (begun before the caller asked; the peer
// has come back since) gets an attempt of its own, not that attempt's failure.
TEST_F(ManagerTest, ARetryJoiningTheResolversAskGetsAnAskOfItsOwn) {
  absl::Notification asking, release;
  std::atomic<bool> armed{false};
  std::atomic<int> aborts{0};
  peer_->before_abort = [&] {
    if (!armed) return;
    if (++aborts == 1) {  // the resolver asks while the peer is still gone
      asking.Notify();
      release.WaitForNotification();
    } else {
      peer_->drop_abort = false;  // the peer is back for every later ask
    }
  };
  auto m = Manager({.timeout = absl::Seconds(5), .resolve_interval = absl::Milliseconds(20)});
  const SlotId s = NewSlot();
  peer_->drop_commit = peer_->drop_abort = true;  // the peer is gone: the move is in doubt
  Answer lost;
  m->Transfer({"r6", s, "b", false}, lost.Callback());
  EXPECT_EQ(lost.Wait().status().code(), absl::StatusCode::kUnavailable);
  ASSERT_EQ(m->in_doubt(), 1);
  armed = true;
  ASSERT_TRUE(asking.WaitForNotificationWithTimeout(absl::Seconds(10)));
  Answer retry;
  m->Transfer({"r6", s, "b", false}, retry.Callback());  // joins the resolver's ask
  peer_->drop_commit = false;
  release.Notify();  // the resolver's ask fails: the peer was gone when it asked
  ASSERT_TRUE(retry.Wait().ok()) << retry.result.status();
  EXPECT_GE(aborts.load(), 2) << "the retry asked the peer itself";
  EXPECT_EQ(b_->stats().slots_live, 1) << "moved afresh once the peer said: aborted";
  EXPECT_EQ(a_->Info(s).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->in_doubt(), 0);
  m.reset();  // its threads gone before the hook's captures are
  peer_->before_abort = nullptr;
}

TEST_F(ManagerTest, TransfersToAHungPeerHoldNoCallerAndEndByTheirTimeout) {
  constexpr absl::Duration kTimeout = absl::Milliseconds(600);
  auto m = Manager({.timeout = kTimeout});
  std::vector<SlotId> slots = {NewSlot(), NewSlot(), NewSlot()};
  const SlotId good = NewSlot();
  Answer hung[3], ok;
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < 3; ++i) {
    m->Transfer({absl::StrCat("h", i), slots[i], "hung", false}, hung[i].Callback());
  }
  EXPECT_LT(absl::Now() - t0, absl::Milliseconds(50)) << "Transfer returns at once";
  m->Transfer({"good", good, "b", false}, ok.Callback());
  ASSERT_TRUE(ok.Wait().ok()) << ok.result.status();
  EXPECT_LT(ok.at - t0, kTimeout) << "not behind the hung peer's transfers";
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE(hung[i].Wait().ok());
    EXPECT_GE(hung[i].at - t0, kTimeout * 3 / 4) << i << ": it waited for the peer";
    EXPECT_LT(hung[i].at - t0, kTimeout + absl::Milliseconds(500)) << i;
    EXPECT_TRUE(a_->Info(slots[i]).ok()) << "the source stays";
    EXPECT_TRUE(a_->BeginForward({{slots[i], 1}}).ok()) << "and is released";
  }
}

TEST_F(ManagerTest, StopAnswersWhatWaitsAndRefusesWhatComes) {
  auto m = Manager({.timeout = absl::Milliseconds(500), .max_concurrent = 1});
  Answer running, waiting, late;
  const SlotId s = NewSlot();
  m->Transfer({"run", s, "hung", false}, running.Callback());
  m->Transfer({"wait", NewSlot(), "b", false}, waiting.Callback());
  m->Stop();
  EXPECT_FALSE(running.Wait().ok());
  EXPECT_EQ(waiting.Wait().status().code(), absl::StatusCode::kUnavailable);
  m->Transfer({"late", NewSlot(), "b", false}, late.Callback());
  EXPECT_EQ(late.Wait().status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace replayssm::transfer
