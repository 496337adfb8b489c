// Moves between two caches in one process over real UCX: the Sender's one pipeline on every
// slot I/O path and lane count, the Receiver's import and decisions, and faults injected by
// swapping the Peer (a receiver that fails, lies or never answers) or a PutLane (a lane that
// fails mid-transfer).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "replayssm/transfer/receiver.h"
#include "replayssm/transfer/sender.h"
#include "replayssm/transfer/ucx_transport.h"
#include "test_model.h"
#include "transfer_testing.h"

namespace replayssm::transfer {
namespace {

using cache::SlotId;
using cache::SlotIoPath;
using cache::StateCache;
using testing::DirectPeer;
using testing::MakeCache;

constexpr SlotIoPath kPaths[] = {SlotIoPath::kHostDirect, SlotIoPath::kStaged,
                                 SlotIoPath::kDeviceDirect};

// A lane that fails the `fail_write`-th put (counting from 1) instead of making it, or calls
// `on_write` after each put it made: a transport that breaks mid-transfer.
class FaultyLane final : public PutLane {
 public:
  explicit FaultyLane(PutLane* inner) : inner_(inner) {}
  bool takes_device_memory() const override { return inner_->takes_device_memory(); }
  absl::StatusOr<std::unique_ptr<PutStream>> OpenPutStream(const std::string& peer,
                                                           const std::string& rkey,
                                                           absl::Time deadline) override {
    absl::StatusOr<std::unique_ptr<PutStream>> s = inner_->OpenPutStream(peer, rkey, deadline);
    if (!s.ok()) return s.status();
    return std::make_unique<Stream>(this, *std::move(s));
  }
  std::atomic<int> writes{0};
  int fail_write = 0;
  std::function<void(int)> on_write;

 private:
  class Stream final : public PutStream {
   public:
    Stream(FaultyLane* lane, std::unique_ptr<PutStream> inner)
        : lane_(lane), inner_(std::move(inner)) {}
    absl::StatusOr<uint64_t> Write(const void* p, size_t n, uint64_t remote) override {
      const int k = ++lane_->writes;
      if (k == lane_->fail_write) return absl::InternalError(absl::StrCat("put ", k, " failed"));
      absl::StatusOr<uint64_t> t = inner_->Write(p, n, remote);
      if (lane_->on_write) lane_->on_write(k);
      return t;
    }
    absl::Status WaitFor(uint64_t t) override { return inner_->WaitFor(t); }
    absl::Status Fence() override { return inner_->Fence(); }
    absl::Status Flush() override { return inner_->Flush(); }
    absl::Status Finish() override { return inner_->Finish(); }

   private:
    FaultyLane* lane_;
    std::unique_ptr<PutStream> inner_;
  };
  PutLane* inner_;
};

class TransferTest : public testing::TwoInstancesTest {
 protected:
  // A's transport and n - 1 put lanes of its own (what the service makes for --transfer-lanes).
  std::vector<PutLane*> Lanes(int n) {
    std::vector<PutLane*> out = {ucx_a_.get()};
    while (static_cast<int>(lanes_.size()) < n - 1) {
      absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create(false);
      EXPECT_TRUE(t.ok()) << t.status();
      lanes_.push_back(std::move(*t));
    }
    for (int k = 0; k < n - 1; ++k) out.push_back(lanes_[k].get());
    return out;
  }
  absl::StatusOr<SendResult> Send(Sender& sender, Peer& peer, SlotId s, const std::string& id,
                                  SendOptions o = {}) {
    if (o.deadline == absl::InfiniteFuture()) o.deadline = absl::Now() + absl::Seconds(30);
    SendOutcome out = sender.Send(peer, s, id, id, o);
    EXPECT_EQ(out.in_doubt, nullptr) << id;
    return out.result;
  }
  void ExpectSameState(StateCache& a, SlotId s, StateCache& b, SlotId on_b,
                       const std::string& what) {
    absl::StatusOr<cache::ExportedState> ea = a.Export(s), eb = b.Export(on_b);
    ASSERT_TRUE(ea.ok() && eb.ok()) << what;
    EXPECT_TRUE(ea->checkpoints == eb->checkpoints) << what << ": B holds A's state, bit for bit";
    EXPECT_EQ(ea->tokens, eb->tokens) << what;
  }
  // What a sender does after its puts: tells the receiver how many bytes have landed.
  void RingDoorbell(const Reservation& r, uint64_t landed) {
    ASSERT_NE(r.doorbell_addr, 0u);
    ASSERT_TRUE(ucx_a_
                    ->Put(r.worker_address, &landed, sizeof(landed), r.doorbell_addr, r.rkey, 0,
                          absl::Seconds(10))
                    .ok());
  }
  // A sender by hand: reserves `id` for `e`, puts `payload` (the first `landed` bytes of it)
  // in one put and rings the doorbell.
  absl::StatusOr<Reservation> ReserveAndPut(Receiver& rx, const std::string& id,
                                            const std::vector<uint8_t>& payload, int64_t seq_len,
                                            size_t landed, uint64_t owner = 0) {
    absl::StatusOr<Reservation> r = rx.Reserve(id, StateFormat::Of(a_->model()), seq_len,
                                               cache::kChecksumVersion, absl::Seconds(30), "",
                                               owner);
    if (!r.ok()) return r;
    EXPECT_TRUE(ucx_a_
                    ->Put(r->worker_address, payload.data(), landed, r->remote_addr, r->rkey, 1000,
                          absl::Seconds(10))
                    .ok());
    RingDoorbell(*r, landed);
    return r;
  }

  std::vector<std::unique_ptr<UcxTransport>> lanes_;
};

TEST_F(TransferTest, ReceiverGetsTheFoldedStateAndDecodesIdentically) {
  const SlotId s = Prepare(2);
  ASSERT_EQ(a_->Info(s)->write_pos, 2) << "the ring is not empty: the move must fold it";
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  Sender sender(a_.get(), Lanes(1));
  absl::StatusOr<SendResult> r = Send(sender, peer, s, "t1", {.keep_source = true});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq_len, 5);
  EXPECT_EQ(a_->Info(s)->write_pos, 0) << "the sender folded; its logical state is the same";
  EXPECT_EQ(b_->Info(r->remote_slot)->seq_len, 5);
  EXPECT_EQ(b_->Info(r->remote_slot)->write_pos, 0);
  ExpectSameState(*a_, s, *b_, r->remote_slot, "t1");
  EXPECT_EQ(Step(*a_, s, 42, 5), Step(*b_, r->remote_slot, 42, 5)) << "decode continues alike";
  EXPECT_EQ(rx.open(), 0);
}

TEST_F(TransferTest, SourceIsFreedUnlessKept) {
  const SlotId s = Prepare(1);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  Sender sender(a_.get(), Lanes(1));
  ASSERT_TRUE(Send(sender, peer, s, "t2").ok());
  EXPECT_EQ(a_->Info(s).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TransferTest, ShapeMismatchIsRefusedBeforeAnyByteMoves) {
  auto kda = MakeCache("tiny-kda", 2);
  Receiver rx(kda.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  Sender sender(a_.get(), Lanes(1));
  const SlotId s = Prepare(2);
  absl::StatusOr<SendResult> r = Send(sender, peer, s, "t3");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("format.gate: expected 1 (Kimi Delta Attention) (this "
                                      "server's model), got 0 (Gated DeltaNet)"),
            std::string::npos)
      << r.status() << ": codes named";
  EXPECT_EQ(kda->stats().slots_live, 0);
  EXPECT_TRUE(a_->Info(s).ok()) << "the source is released, unchanged";
  auto other = MakeCache("tiny-gdn", 3);
  Receiver rx3(other.get(), ucx_b_.get(), {});
  DirectPeer peer3(&rx3);
  EXPECT_EQ(Send(sender, peer3, s, "t3b").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST_F(TransferTest, EveryPathAndLaneCountMovesTheSameBytesAndCatchesAMismatch) {
  // Sender and receiver each on every path (forced on the CPU backend, where the same code
  // runs over host memory), chunks that do not divide the layers or the lanes evenly and
  // more lanes than chunks, the receiver importing 200-byte pieces with 3 writers. Then a
  // commit whose checksum does not match: DATA_LOSS, nothing left on B, the source released.
  const SlotId s = Prepare(2);
  for (SlotIoPath tx : kPaths) {
    for (SlotIoPath rx_path : kPaths) {
      Receiver rx(b_.get(), ucx_b_.get(),
                  {.chunk_bytes = 200, .import_threads = 3, .path = rx_path});
      ASSERT_EQ(rx.path(), rx_path);
      DirectPeer peer(&rx);
      for (int lanes : {1, 2, 3, 5}) {
        Sender sender(a_.get(), Lanes(lanes));
        for (size_t chunk : {size_t{328}, size_t{1000}, size_t{1} << 30}) {
          const std::string id =
              absl::StrCat(cache::SlotIoPathName(tx), "-to-", cache::SlotIoPathName(rx_path), "-",
                           lanes, "-", chunk);
          absl::StatusOr<SendResult> r =
              Send(sender, peer, s, id, {.keep_source = true, .chunk_bytes = chunk, .path = tx});
          ASSERT_TRUE(r.ok()) << id << ": " << r.status();
          EXPECT_EQ(r->path, tx);
          ExpectSameState(*a_, s, *b_, r->remote_slot, id);
          ASSERT_TRUE(b_->Free(r->remote_slot).ok());
        }
        peer.corrupt_checksum = true;
        const std::string bad = absl::StrCat("bad-", cache::SlotIoPathName(tx), "-",
                                             cache::SlotIoPathName(rx_path), "-", lanes);
        absl::StatusOr<SendResult> r =
            Send(sender, peer, s, bad, {.keep_source = true, .chunk_bytes = 328, .path = tx});
        peer.corrupt_checksum = false;
        EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << bad << ": " << r.status();
        EXPECT_EQ(b_->stats().slots_live, 0) << bad;
        EXPECT_EQ(rx.open(), 0) << bad;
        EXPECT_TRUE(a_->Info(s).ok()) << bad;
      }
    }
  }
}

TEST_F(TransferTest, ManySegmentsWithUnalignedChunksStillAgree) {
  // Several 1 MiB checksum segments (3 of qwen3-next's 2 MiB layers), sender chunks that do
  // not align with them over 1 and 3 lanes, the receiver writing 700-byte pieces with 3
  // threads: segments are hashed out of order and partly from parts kept aside.
  std::unique_ptr<StateCache> a = MakeCache("qwen3-next-80b-a3b", 3),
                              b = MakeCache("qwen3-next-80b-a3b", 3);
  ASSERT_GE(cache::SlotPayloadBytes(a->model()), 5 * cache::kChecksumSegmentBytes);
  const SlotId s = testing::RandomSlot(*a, 11);
  for (SlotIoPath path : {SlotIoPath::kHostDirect, SlotIoPath::kStaged}) {
    Receiver rx(b.get(), ucx_b_.get(), {.chunk_bytes = 700, .import_threads = 3, .path = path});
    DirectPeer peer(&rx);
    for (int lanes : {1, 3}) {
      Sender sender(a.get(), Lanes(lanes));
      const std::string id = absl::StrCat("seg-", cache::SlotIoPathName(path), "-", lanes);
      absl::StatusOr<SendResult> r =
          Send(sender, peer, s, id,
               {.keep_source = true, .chunk_bytes = (size_t{1} << 20) + 17, .path = path});
      ASSERT_TRUE(r.ok()) << id << ": " << r.status();
      ExpectSameState(*a, s, *b, r->remote_slot, id);
      ASSERT_TRUE(b->Free(r->remote_slot).ok());
    }
  }
}

TEST_F(TransferTest, AMovingSourceRefusesMutationsUntilTheMoveIsDecided) {
  // The receiver's commit is slow: meanwhile a forward, an export and a free of the source
  // are refused, naming the move; once committed the source is gone (not kept).
  const SlotId s = Prepare(2);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  std::vector<absl::Status> refused;
  peer.before_commit = [&] {
    refused.push_back(a_->BeginForward({{s, 9}}).status());
    refused.push_back(a_->Export(s).status());
    refused.push_back(a_->Free(s));
  };
  Sender sender(a_.get(), Lanes(2));
  absl::StatusOr<SendResult> r = Send(sender, peer, s, "moving");
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(refused.size(), 3u);
  for (const absl::Status& st : refused) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("being transferred (request id moving)"), std::string::npos) << st;
  }
  EXPECT_EQ(b_->Info(r->remote_slot)->seq_len, 5);
  EXPECT_EQ(a_->Info(s).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TransferTest, NoAnswerToTheCommitOrTheAbortLeavesTheOutcomeInDoubtUntilResolved) {
  const SlotId s = Prepare(2);
  const absl::StatusOr<cache::ExportedState> before = a_->Export(s);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  peer.drop_commit = peer.drop_abort = true;  // the peer went quiet after the put
  Sender sender(a_.get(), Lanes(2));
  SendOutcome o =
      sender.Send(peer, s, "doubt", "doubt-1", {.deadline = absl::Now() + absl::Seconds(5)});
  EXPECT_EQ(o.result.status().code(), absl::StatusCode::kUnavailable) << o.result.status();
  EXPECT_NE(o.result.status().message().find("retry with request_id doubt"), std::string::npos)
      << o.result.status();
  ASSERT_NE(o.in_doubt, nullptr);
  EXPECT_EQ(a_->BeginForward({{s, 9}}).status().code(), absl::StatusCode::kFailedPrecondition)
      << "the source stays locked while the receiver may have committed";
  EXPECT_EQ(rx.open(), 1);
  // The peer answers again: it decides abort (nothing was committed); the source is released.
  peer.drop_commit = peer.drop_abort = false;
  SendOutcome resolved = sender.Resolve(peer, std::move(o.in_doubt), "doubt", "doubt-1",
                                        /*keep_source=*/false, absl::Now() + absl::Seconds(5));
  EXPECT_EQ(resolved.result.status().code(), absl::StatusCode::kAborted);
  EXPECT_EQ(resolved.in_doubt, nullptr);
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0);
  EXPECT_EQ(a_->Export(s)->checkpoints, before->checkpoints) << "released as it was";
  Step(*a_, s, 7, 5);
}

TEST_F(TransferTest, ACommitWhoseAnswerIsLostIsLearnedFromTheAbort) {
  const SlotId s = Prepare(2);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  peer.lose_commit_reply = true;  // applied on B, its answer never reaches A
  Sender sender(a_.get(), Lanes(1));
  absl::StatusOr<SendResult> r = Send(sender, peer, s, "lost-reply");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(b_->Info(r->remote_slot)->seq_len, 5) << "the abort answered: committed, this slot";
  EXPECT_EQ(b_->stats().slots_live, 1) << "no second copy";
  EXPECT_EQ(a_->Info(s).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TransferTest, OnePeerHoldsAtMostItsShareOfReservations) {
  ReceiverOptions o;
  o.max_open_per_peer = 2;
  Receiver rx(b_.get(), ucx_b_.get(), o);
  const StateFormat f = StateFormat::Of(a_->model());
  const auto reserve = [&](const std::string& id, const std::string& peer) {
    return rx.Reserve(id, f, 3, cache::kChecksumVersion, absl::Seconds(30), peer).status();
  };
  EXPECT_TRUE(reserve("x1", "peer-x").ok());
  EXPECT_TRUE(reserve("x2", "peer-x").ok());
  const absl::Status third = reserve("x3", "peer-x");
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("peer-x"), std::string::npos) << third;
  EXPECT_TRUE(reserve("y1", "peer-y").ok()) << "another peer is not locked out";
  EXPECT_TRUE(reserve("x1", "peer-x").ok()) << "a retried Reserve of an open id is no new one";
  // Another peer neither gets an open reservation's buffer nor commits it (an outside review:
  // a peer's garbage commit of another's id aborted that transfer, DATA_LOSS).
  EXPECT_EQ(reserve("x1", "peer-y").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(rx.Commit("x1", {1, 2, 3}, 12345, "peer-y").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(rx.open(), 3) << "x1 stays open for its own peer";
  rx.Abort("x1").IgnoreError();
  EXPECT_TRUE(reserve("x4", "peer-x").ok()) << "an abort gives the share back";
  for (const char* id : {"x2", "x4", "y1"}) rx.Abort(id).IgnoreError();
}

TEST_F(TransferTest, EachTransferIsDecidedOnce) {
  Receiver rx(b_.get(), ucx_b_.get(), {});
  const StateFormat f = StateFormat::Of(a_->model());
  const SlotId s = Prepare(0);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = testing::Payload(*e);
  const uint64_t sum = testing::Checksum(payload);
  // Retries of an open or committed transfer get the same answer.
  absl::StatusOr<Reservation> r1 = ReserveAndPut(rx, "t6", payload, 3, payload.size());
  absl::StatusOr<Reservation> r2 =
      rx.Reserve("t6", f, 3, cache::kChecksumVersion, absl::Seconds(30));
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_EQ(r1->remote_addr, r2->remote_addr);
  absl::StatusOr<Decision> c1 = rx.Commit("t6", e->tokens, sum),
                           c2 = rx.Commit("t6", e->tokens, sum);
  ASSERT_TRUE(c1.ok() && c2.ok()) << c1.status() << c2.status();
  EXPECT_EQ(c1->slot, c2->slot);
  const Decision d = *rx.Abort("t6");
  EXPECT_TRUE(d.committed) << "an abort after the commit learns the commit";
  EXPECT_EQ(d.slot, c1->slot);
  EXPECT_EQ(d.seq_len, 3);
  EXPECT_EQ(rx.Reserve("t6", f, 3, cache::kChecksumVersion, absl::Seconds(30)).status().code(),
            absl::StatusCode::kAlreadyExists);
  // An abort first: the commit that follows is refused, and so is a late reservation.
  ASSERT_TRUE(ReserveAndPut(rx, "t7", payload, 3, payload.size()).ok());
  EXPECT_FALSE(rx.Abort("t7")->committed);
  EXPECT_EQ(rx.Commit("t7", e->tokens, sum).status().code(), absl::StatusCode::kAborted);
  EXPECT_FALSE(rx.Abort("never-seen")->committed);
  EXPECT_EQ(
      rx.Reserve("never-seen", f, 3, cache::kChecksumVersion, absl::Seconds(30)).status().code(),
      absl::StatusCode::kAborted);
  EXPECT_EQ(rx.Commit("unknown", e->tokens, sum).status().code(), absl::StatusCode::kNotFound);
  // A commit read after its commit-by time (the sender gave up long ago) is refused.
  ASSERT_TRUE(rx.Reserve("late", f, 3, cache::kChecksumVersion, absl::Milliseconds(40)).ok());
  absl::SleepFor(absl::Milliseconds(60));
  absl::StatusOr<Decision> late = rx.Commit("late", e->tokens, sum);
  EXPECT_EQ(late.status().code(), absl::StatusCode::kAborted) << late.status();
  EXPECT_NE(late.status().message().find("commit-by"), std::string::npos) << late.status();
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 1) << "only t6";
}

TEST_F(TransferTest, ReservationsAreCheckedBeforeAnyByteMoves) {
  Receiver rx(b_.get(), ucx_b_.get(), {});
  const StateFormat f = StateFormat::Of(a_->model());
  const struct {
    absl::StatusOr<Reservation> got;
    absl::StatusCode code;
    const char* field;
  } cases[] = {
      {rx.Reserve("v2", f, 0, 2, absl::Seconds(1)), absl::StatusCode::kFailedPrecondition,
       "checksum_version: expected 3, got 2"},
      {rx.Reserve("", f, 0, 3, absl::Seconds(1)), absl::StatusCode::kInvalidArgument,
       "transfer_id"},
      {rx.Reserve("neg", f, -1, 3, absl::Seconds(1)), absl::StatusCode::kInvalidArgument,
       "seq_len"},
      {rx.Reserve("nobudget", f, 0, 3, absl::ZeroDuration()), absl::StatusCode::kInvalidArgument,
       "budget"},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(c.got.status().code(), c.code) << c.got.status();
    EXPECT_NE(c.got.status().message().find(c.field), std::string::npos) << c.got.status();
  }
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0);
}

// Issue 31 §1: a commit stays decided while its sender may ask, whatever other ids come
// (aborts of ids never seen, other transfers' decisions); it goes when the sender
// acknowledges it or after the horizon, and a peer that never acknowledges is refused new
// reservations rather than have an older commit forgotten.
TEST_F(TransferTest, ACommitIsRememberedUntilAcknowledgedWhateverOtherIdsCome) {
  const SlotId s = Prepare(0);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = testing::Payload(*e);
  const uint64_t sum = testing::Checksum(payload);
  const StateFormat f = StateFormat::Of(a_->model());
  Receiver rx(b_.get(), ucx_b_.get(),
              {.remembered = 8, .decision_horizon = absl::Milliseconds(300),
               .max_unacknowledged_per_peer = 1});
  ASSERT_TRUE(ReserveAndPut(rx, "kept", payload, 3, payload.size(), /*owner=*/7).ok());
  absl::StatusOr<Decision> c = rx.Commit("kept", e->tokens, sum);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->owner, 7u) << "the owner travels with the reservation (issue 31 §2)";
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(rx.Abort(absl::StrCat("junk-", i))->committed);
  EXPECT_TRUE(rx.Abort("kept")->committed) << "100 unknown ids evicted nothing";
  EXPECT_EQ(rx.Abort("kept")->owner, 7u);
  EXPECT_EQ(rx.Reserve("next", f, 3, cache::kChecksumVersion, absl::Seconds(30)).status().code(),
            absl::StatusCode::kResourceExhausted)
      << "one unacknowledged commit is this peer's most";
  rx.Acknowledge("kept", "another-peer");
  EXPECT_TRUE(rx.Abort("kept")->committed) << "only the peer that reserved it may acknowledge";
  rx.Acknowledge("kept", "");
  EXPECT_FALSE(rx.Abort("kept")->committed) << "acknowledged: forgotten";
  ASSERT_TRUE(ReserveAndPut(rx, "next", payload, 3, payload.size()).ok());
  ASSERT_TRUE(rx.Commit("next", e->tokens, sum).ok());
  absl::SleepFor(absl::Milliseconds(50));
  rx.ExpireLeases();
  EXPECT_TRUE(rx.Abort("next")->committed) << "within the horizon";
  absl::SleepFor(absl::Milliseconds(300));
  rx.ExpireLeases();
  EXPECT_FALSE(rx.Abort("next")->committed) << "past the horizon";
  EXPECT_EQ(b_->stats().slots_live, 2) << "forgetting a decision frees nothing";
}

TEST_F(TransferTest, ACommitBeforeEveryByteLandedIsDataLoss) {
  Receiver rx(b_.get(), ucx_b_.get(), {});
  std::vector<uint8_t> payload(cache::SlotPayloadBytes(a_->model()), 3);
  ASSERT_TRUE(ReserveAndPut(rx, "half", payload, 0, payload.size() / 2).ok());
  absl::StatusOr<Decision> c = rx.Commit("half", {}, testing::Checksum(payload));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << c.status();
  EXPECT_NE(c.status().message().find("of " + std::to_string(payload.size()) + " bytes"),
            std::string::npos)
      << c.status();
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0) << "the reserved slot went back";
}

TEST_F(TransferTest, TheReservedSlotKeepsNoStaleByteAndIsFreedOnAbortExpiryAndMismatch) {
  testing::DirtyEverySlot(*b_);
  const SlotId s = Prepare(0);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = testing::Payload(*e);
  // A lease long enough for each reservation's steps on a loaded machine: with 50 ms the test
  // failed once beside a parallel build (a commit past its commit-by is refused as ABORTED).
  Receiver rx(b_.get(), ucx_b_.get(),
              {.lease = absl::Milliseconds(400), .chunk_bytes = 512, .import_threads = 2});
  ASSERT_TRUE(ReserveAndPut(rx, "abort", payload, 3, payload.size()).ok());
  EXPECT_EQ(b_->stats().slots_live, 1) << "reserved: in use, but nobody's";
  rx.Abort("abort").IgnoreError();
  EXPECT_EQ(b_->stats().slots_live, 0);
  ASSERT_TRUE(ReserveAndPut(rx, "expire", payload, 3, payload.size()).ok());
  absl::SleepFor(absl::Milliseconds(450));
  EXPECT_EQ(rx.ExpireLeases(), 1);
  EXPECT_EQ(b_->stats().slots_live, 0);
  ASSERT_TRUE(ReserveAndPut(rx, "mismatch", payload, 3, payload.size()).ok());
  EXPECT_EQ(rx.Commit("mismatch", e->tokens, 12345).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(b_->stats().slots_live, 0);
  ASSERT_TRUE(ReserveAndPut(rx, "ok", payload, 3, payload.size()).ok());
  absl::StatusOr<Decision> c = rx.Commit("ok", e->tokens, testing::Checksum(payload));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(b_->Export(c->slot)->checkpoints, e->checkpoints) << "every stale byte was overwritten";
  EXPECT_EQ(Step(*a_, s, 42, 3), Step(*b_, c->slot, 42, 3));
  EXPECT_EQ(rx.open(), 0);
}

// Device-direct receive buffers for ReceiverOptions::allocate_device (host memory, as the CPU
// backend's) that record their frees, each by the order it was made in; while the gate is
// closed a free waits in its destructor.
class WatchedBuffers {
 public:
  ReceiverOptions::AllocateDevice Allocator() {
    return [this](size_t n) -> absl::StatusOr<std::unique_ptr<cache::BackendBuffer>> {
      absl::MutexLock lock(&mu_);
      return std::make_unique<Buffer>(n, this, made_++);
    };
  }
  void SetOpen(bool open) {
    absl::MutexLock lock(&mu_);
    open_ = open;
  }
  int made() {
    absl::MutexLock lock(&mu_);
    return made_;
  }
  int entered() {  // frees begun
    absl::MutexLock lock(&mu_);
    return entered_;
  }
  std::vector<int> freed() {  // frees ended, by the order the buffers were made
    absl::MutexLock lock(&mu_);
    return freed_;
  }
  // Waits up to `timeout` for `n` frees to have begun (AwaitEntered) or ended (AwaitFreed).
  bool AwaitEntered(int n, absl::Duration timeout) { return Await(&entered_, n, timeout); }
  std::vector<int> AwaitFreed(int n, absl::Duration timeout) {
    Await(&freed_count_, n, timeout);
    return freed();
  }

 private:
  class Buffer final : public cache::BackendBuffer {
   public:
    Buffer(size_t n, WatchedBuffers* w, int index) : bytes_(n), w_(w), index_(index) {}
    ~Buffer() override {
      absl::MutexLock lock(&w_->mu_);
      ++w_->entered_;
      w_->mu_.Await(absl::Condition(&w_->open_));
      w_->freed_.push_back(index_);
      ++w_->freed_count_;
    }
    void* data() const override { return bytes_.data(); }
    size_t size() const override { return bytes_.size(); }

   private:
    mutable std::vector<uint8_t> bytes_;
    WatchedBuffers* w_;
    int index_;
  };
  bool Await(const int* count, int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    struct Arg {
      const int* count;
      int n;
    } arg{count, n};
    return mu_.AwaitWithTimeout(absl::Condition(
                                    +[](Arg* a) { return *a->count >= a->n; }, &arg),
                                timeout);
  }

  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
  int made_ ABSL_GUARDED_BY(mu_) = 0;
  int entered_ ABSL_GUARDED_BY(mu_) = 0;
  int freed_count_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<int> freed_ ABSL_GUARDED_BY(mu_);  // by the order they were made
};

// A device-direct buffer dropped by an abort or an expired lease is freed off the receiver's
// lock. On CUDA a free waits for every kernel running on the device, and a planned forward's
// doorbell wait runs until its engine rings: freed under the lock, it held every transfer of
// the server that long. Here each buffer's free blocks until the test opens a gate; the
// abort, the next reservation and the lease expiry return meanwhile, the slots are freed at
// once, and every buffer is freed once the gate opens and the receiver goes.
TEST_F(TransferTest, ADroppedDeviceBufferIsFreedOffTheReceiversLock) {
  WatchedBuffers buffers;
  buffers.SetOpen(false);
  ReceiverOptions o{.lease = absl::Milliseconds(300), .path = SlotIoPath::kDeviceDirect};
  o.allocate_device = buffers.Allocator();
  {
    Receiver rx(b_.get(), ucx_b_.get(), o);
    struct OpenOnExit {  // before rx goes: its destructor waits for the frees
      WatchedBuffers* w;
      ~OpenOnExit() { w->SetOpen(true); }
    } open_on_exit{&buffers};
    const StateFormat f = StateFormat::Of(a_->model());
    auto reserve = [&](const std::string& id) {
      return rx.Reserve(id, f, 3, cache::kChecksumVersion, absl::Seconds(30)).status();
    };
    // Runs fn on a thread of its own; false if it has not returned in 10 s (the gate then
    // opens, so that it does).
    auto returns = [&](const std::function<void()>& fn) {
      std::atomic<bool> done{false};
      std::thread t([&] {
        fn();
        done = true;
      });
      for (int i = 0; i < 10000 && !done.load(); ++i) absl::SleepFor(absl::Milliseconds(1));
      const bool in_time = done.load();
      if (!in_time) buffers.SetOpen(true);
      t.join();
      return in_time;
    };
    ASSERT_TRUE(reserve("aborted").ok());
    absl::Status aborted;
    ASSERT_TRUE(returns([&] { aborted = rx.Abort("aborted").status(); }))
        << "the abort waited for its buffer's free";
    EXPECT_TRUE(aborted.ok()) << aborted;
    ASSERT_TRUE(buffers.AwaitEntered(1, absl::Seconds(10)));
    EXPECT_EQ(b_->stats().slots_live, 0) << "the slot is freed at once";
    absl::Status next;
    EXPECT_TRUE(returns([&] { next = reserve("expires"); }))
        << "a reservation waited for another's buffer to be freed";
    EXPECT_TRUE(next.ok()) << next;
    absl::SleepFor(absl::Milliseconds(350));
    int expired = 0;
    EXPECT_TRUE(returns([&] { expired = rx.ExpireLeases(); }))
        << "the lease expiry waited for the buffer's free";
    EXPECT_EQ(expired, 1);
    EXPECT_EQ(rx.open(), 0);
    EXPECT_EQ(b_->stats().slots_live, 0);
    EXPECT_EQ(buffers.entered(), 1) << "the second free waits behind the first, on the reaper";
    EXPECT_EQ(buffers.freed().size(), 0u) << "nothing was freed past the gate";
  }
  EXPECT_EQ(buffers.made(), 2);
  EXPECT_EQ(buffers.freed().size(), 2u)
      << "every buffer freed, once, by the time the receiver went";
}

// On CUDA the free itself waits while a doorbell wait runs, and every other CUDA call of the
// process with it (H100, 2026-12-07): a dropped device-direct buffer waits for a quiet device
// (ReceiverOptions::device_quiet). None is freed while it says no; past max_open held, the
// oldest is freed all the same; the rest once it says yes; and whatever is held when the
// receiver goes, with it.
TEST_F(TransferTest, ADroppedDeviceBufferWaitsForAQuietDevice) {
  WatchedBuffers buffers;
  std::atomic<bool> quiet{false};
  ReceiverOptions o{.max_open = 2, .path = SlotIoPath::kDeviceDirect};
  o.allocate_device = buffers.Allocator();
  o.device_quiet = [&] { return quiet.load(); };
  // The buffers freed once `n` were, or 5 s passed.
  auto freed = [&](int n) { return buffers.AwaitFreed(n, absl::Seconds(5)); };
  {
    Receiver rx(b_.get(), ucx_b_.get(), o);
    const StateFormat f = StateFormat::Of(a_->model());
    auto drop = [&](const std::string& id) {
      ASSERT_TRUE(rx.Reserve(id, f, 3, cache::kChecksumVersion, absl::Seconds(30)).ok()) << id;
      ASSERT_TRUE(rx.Abort(id).ok()) << id;
    };
    drop("a");
    drop("b");
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_EQ(freed(0), std::vector<int>{}) << "two held, the device busy: none freed";
    EXPECT_EQ(rx.held_device_buffers(), 2);
    EXPECT_EQ(b_->stats().slots_live, 0) << "the slots go at once";
    drop("c");
    EXPECT_EQ(freed(1), std::vector<int>{0}) << "past max_open held, the oldest goes";
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_EQ(freed(1), std::vector<int>{0}) << "and no other";
    EXPECT_EQ(rx.held_device_buffers(), 2);
    EXPECT_EQ(rx.forced_device_frees(), 1);
    quiet = true;
    EXPECT_EQ(freed(3), (std::vector<int>{0, 1, 2})) << "quiet: the rest, in order";
    EXPECT_EQ(rx.held_device_buffers(), 0);
    EXPECT_EQ(rx.forced_device_frees(), 1) << "a quiet free is not forced";
    quiet = false;
    drop("d");
    absl::SleepFor(absl::Milliseconds(50));
    EXPECT_EQ(freed(3).size(), 3u) << "busy again: held";
  }
  EXPECT_EQ(freed(4), (std::vector<int>{0, 1, 2, 3})) << "held ones go with the receiver";
  EXPECT_EQ(buffers.made(), 4);
}

// The owners' bounds: admit is asked before a reservation is made (its refusal makes none),
// and every admitted reservation settles exactly once, with its slot when it commits. Only the
// reserving peer aborts a reservation.
TEST_F(TransferTest, ReservationsAreAdmittedAndSettleOnceAndOnlyTheirPeerAbortsThem) {
  const SlotId s = Prepare(0);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = testing::Payload(*e);
  int admitted = 0;
  std::vector<std::pair<uint64_t, SlotId>> settled;
  ReceiverOptions o;
  o.lease = absl::Milliseconds(300);
  o.admit = [&](uint64_t owner) {
    if (owner == 9) return absl::ResourceExhaustedError("owner 9 is full");
    ++admitted;
    return absl::OkStatus();
  };
  o.settle = [&](uint64_t owner, SlotId slot) { settled.emplace_back(owner, slot); };
  Receiver rx(b_.get(), ucx_b_.get(), o);
  const StateFormat f = StateFormat::Of(a_->model());
  auto reserve = [&](const std::string& id, const std::string& peer, uint64_t owner) {
    return rx.Reserve(id, f, 3, cache::kChecksumVersion, absl::Seconds(30), peer, owner).status();
  };
  EXPECT_EQ(reserve("full", "p1", 9).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0) << "refused before the slot was opened";
  ASSERT_TRUE(reserve("r1", "p1", 1).ok());
  EXPECT_TRUE(reserve("r1", "p1", 1).ok()) << "a retry is no new reservation";
  const absl::Status other =
      rx.Reserve("r1", f, 4, cache::kChecksumVersion, absl::Seconds(30), "p1", 1).status();
  EXPECT_EQ(other.code(), absl::StatusCode::kInvalidArgument) << other;
  EXPECT_NE(other.message().find("seq_len: expected 3"), std::string::npos) << other;
  // Another peer's abort leaves it open, and says so: "aborted" would be a decision its
  // sender acts on (frees its source) while the reservation can still commit.
  const absl::StatusOr<Decision> foreign = rx.Abort("r1", "p2");
  EXPECT_EQ(foreign.status().code(), absl::StatusCode::kNotFound) << foreign.status();
  EXPECT_EQ(rx.open(), 1) << "another peer's abort leaves it";
  rx.Abort("r1", "p1").IgnoreError();
  EXPECT_EQ(rx.open(), 0);
  ASSERT_TRUE(reserve("late", "p1", 3).ok());
  absl::SleepFor(absl::Milliseconds(350));
  EXPECT_EQ(rx.ExpireLeases(), 1);
  ASSERT_TRUE(ReserveAndPut(rx, "ok", payload, 3, payload.size(), 2).ok());
  absl::StatusOr<Decision> c = rx.Commit("ok", e->tokens, testing::Checksum(payload));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(rx.Commit("ok", e->tokens, testing::Checksum(payload)).ok());  // a retry
  ASSERT_TRUE(ReserveAndPut(rx, "bad", payload, 3, payload.size(), 4).ok());
  EXPECT_EQ(rx.Commit("bad", e->tokens, 12345).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(admitted, 4);
  const std::vector<std::pair<uint64_t, SlotId>> want = {
      {1, cache::kPaddingSlot}, {3, cache::kPaddingSlot}, {2, c->slot}, {4, cache::kPaddingSlot}};
  EXPECT_EQ(settled, want);
}

// A commit decided after the service began draining (ReceiverOptions::accepting) is aborted:
// the slot it made goes, the owner's bound settles empty, and the sender's abort learns that
// nothing was committed, so it keeps its source. The service checked the drain only as the
// commit began, and a drain that began during a commit (~1 s for a large state) exited with
// the state its sender had let go (an outside review).
TEST_F(TransferTest, ACommitDecidedAfterTheDrainBeganIsAborted) {
  const SlotId s = Prepare(0);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = testing::Payload(*e);
  const uint64_t sum = testing::Checksum(payload);
  std::atomic<bool> draining{false};
  std::vector<SlotId> settled;
  ReceiverOptions o;
  o.admit = [](uint64_t) { return absl::OkStatus(); };
  o.settle = [&](uint64_t, SlotId slot) { settled.push_back(slot); };
  o.accepting = [&] { return !draining.load(); };
  Receiver rx(b_.get(), ucx_b_.get(), o);
  const int64_t live = b_->stats().slots_live;
  ASSERT_TRUE(ReserveAndPut(rx, "late", payload, 3, payload.size(), 1).ok());
  draining = true;  // after the commit's start, before its decision
  const absl::StatusOr<Decision> c = rx.Commit("late", e->tokens, sum);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_NE(c.status().message().find("draining"), std::string::npos) << c.status();
  EXPECT_EQ(rx.open(), 0) << "decided: the drain's wait ends";
  EXPECT_EQ(b_->stats().slots_live, live) << "the slot the commit made is gone";
  EXPECT_EQ(settled, std::vector<SlotId>{cache::kPaddingSlot});
  const absl::StatusOr<Decision> asked = rx.Abort("late");
  ASSERT_TRUE(asked.ok()) << asked.status();
  EXPECT_FALSE(asked->committed) << "the sender keeps its source";
  EXPECT_EQ(rx.Commit("late", e->tokens, sum).status().code(), absl::StatusCode::kAborted);
}

// A slot lease that frees a committed slot before its sender acknowledged the commit turns
// the decision into an abort, so the sender in doubt keeps its source; an acknowledged one's
// slot is just freed, and a slot in use is neither freed nor changes its decision.
TEST_F(TransferTest, AnIdleCommittedSlotFreedBeforeItsAcknowledgementBecomesAnAbort) {
  const SlotId s = Prepare(0);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = testing::Payload(*e);
  const uint64_t sum = testing::Checksum(payload);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  ASSERT_TRUE(ReserveAndPut(rx, "doubt", payload, 3, payload.size()).ok());
  absl::StatusOr<Decision> c = rx.Commit("doubt", e->tokens, sum);
  ASSERT_TRUE(c.ok()) << c.status();
  {
    absl::StatusOr<std::unique_ptr<cache::Forward>> busy = b_->BeginForward({{c->slot, 7}});
    ASSERT_TRUE(busy.ok()) << busy.status();
    EXPECT_EQ(rx.FreeSlot(c->slot).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(rx.Abort("doubt")->committed) << "in use: the commit stands";
  }
  ASSERT_TRUE(rx.FreeSlot(c->slot).ok());
  EXPECT_FALSE(b_->Info(c->slot).ok());
  EXPECT_FALSE(rx.Abort("doubt")->committed) << "the sender keeps its source";
  EXPECT_EQ(rx.Commit("doubt", e->tokens, sum).status().code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(ReserveAndPut(rx, "acked", payload, 3, payload.size()).ok());
  absl::StatusOr<Decision> d = rx.Commit("acked", e->tokens, sum);
  ASSERT_TRUE(d.ok()) << d.status();
  rx.Acknowledge("acked", "");
  ASSERT_TRUE(rx.FreeSlot(d->slot).ok());
  EXPECT_FALSE(b_->Info(d->slot).ok());
}

TEST_F(TransferTest, ALaneFailingMidTransferAbortsAndLeavesNothing) {
  const SlotId s = Prepare(2);
  const absl::StatusOr<cache::ExportedState> before = a_->Export(s);
  ASSERT_TRUE(before.ok());
  for (SlotIoPath path : {SlotIoPath::kHostDirect, SlotIoPath::kStaged}) {
    Receiver rx(b_.get(), ucx_b_.get(), {.chunk_bytes = 200, .path = path});
    DirectPeer peer(&rx);
    std::vector<PutLane*> lanes = Lanes(3);
    FaultyLane faulty(lanes[1]);
    faulty.fail_write = 4;  // lane 1's 4th put: the other lanes' puts are in flight
    lanes[1] = &faulty;
    Sender sender(a_.get(), lanes);
    const std::string id = absl::StrCat("lane-fail-", cache::SlotIoPathName(path));
    absl::StatusOr<SendResult> r =
        Send(sender, peer, s, id, {.keep_source = true, .chunk_bytes = 328, .path = path});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
    EXPECT_NE(r.status().message().find("put 4 failed"), std::string::npos) << r.status();
    EXPECT_EQ(rx.open(), 0) << "the sender aborted the reservation";
    EXPECT_EQ(b_->stats().slots_live, 0) << "the reserved slot went back";
    EXPECT_EQ(a_->Export(s)->checkpoints, before->checkpoints) << "the source is untouched";
    // The lanes' endpoints were dropped; the next move starts fresh and succeeds.
    faulty.fail_write = 0;
    absl::StatusOr<SendResult> again = Send(
        sender, peer, s, id + "-again", {.keep_source = true, .chunk_bytes = 328, .path = path});
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(b_->Export(again->remote_slot)->checkpoints, before->checkpoints);
    ASSERT_TRUE(b_->Free(again->remote_slot).ok());
  }
}

TEST_F(TransferTest, AnAbortWhileLanesAreInFlightLeavesNothingLive) {
  // The receiver drops the reservation while the lanes still put: the late chunks land in a
  // pooled buffer nobody imports, the commit is refused, nothing is half-written anywhere.
  const SlotId s = Prepare(2);
  Receiver rx(b_.get(), ucx_b_.get(), {.chunk_bytes = 200});
  DirectPeer peer(&rx);
  std::vector<PutLane*> lanes = Lanes(4);
  FaultyLane watched(lanes[2]);
  std::atomic<bool> aborted{false};
  watched.on_write = [&](int k) {
    if (k >= 2 && !aborted.exchange(true)) rx.Abort("mid-abort").IgnoreError();
  };
  lanes[2] = &watched;
  Sender sender(a_.get(), lanes);
  absl::StatusOr<SendResult> r =
      Send(sender, peer, s, "mid-abort", {.keep_source = true, .chunk_bytes = 328});
  EXPECT_TRUE(aborted.load());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kAborted) << r.status();
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0) << "the reserved slot went back, never live";
  EXPECT_EQ(a_->Info(s)->seq_len, 5) << "the source is released, untouched";
  absl::StatusOr<SendResult> again = Send(sender, peer, s, "after-abort", {.chunk_bytes = 328});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(b_->stats().slots_live, 1);
}

TEST_F(TransferTest, ADeadlineThatPassedRefusesToStart) {
  const SlotId s = Prepare(1);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  Sender sender(a_.get(), Lanes(1));
  SendOutcome o =
      sender.Send(peer, s, "late", "late", {.deadline = absl::Now() - absl::Seconds(1)});
  EXPECT_EQ(o.result.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(a_->BeginForward({{s, 1}}).ok()) << "released";
}

}  // namespace
}  // namespace replayssm::transfer
