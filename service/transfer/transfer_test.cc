// Slot transfers between two caches in one process over real UCX, with an in-process peer
// that can fail on purpose.
#include "transfer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"

#include "test_model.h"

namespace replayssm::transfer {
namespace {

using cache::SlotId;
using cache::StateCache;

std::unique_ptr<StateCache> MakeCache(const char* preset, int32_t layers) {
  absl::StatusOr<cache::ModelSpec> m = cache::ModelPreset(preset, RSSM_DTYPE_F32, 4);
  EXPECT_TRUE(m.ok());
  m->num_layers = layers;
  m->layers.resize(layers);
  cache::CacheOptions o;
  o.memory_budget_bytes = 4 * m->SlotBytes();
  return std::move(*StateCache::Create(*m, o));
}

// Calls the receiver directly; `fail_commit` makes Commit fail as if the peer died after the
// bytes were put; `fail_abort` as if it stayed dead.
class DirectPeer : public Peer {
 public:
  explicit DirectPeer(Receiver* r) : r_(r) {}
  absl::StatusOr<Reservation> Reserve(const std::string& id, const StateFormat& f,
                                      int64_t seq_len, uint32_t version) override {
    declared = version;
    return r_->Reserve(id, f, seq_len, version);
  }
  absl::StatusOr<SlotId> Commit(const std::string& id, const std::vector<int32_t>& tokens,
                                uint64_t checksum) override {
    if (fail_commit) return absl::UnavailableError("peer: connection reset");
    return r_->Commit(id, tokens, checksum);
  }
  absl::Status Abort(const std::string& id) override {
    if (fail_abort) return absl::UnavailableError("peer: connection reset");
    return r_->Abort(id);
  }
  bool fail_commit = false, fail_abort = false;
  uint32_t declared = 0;  // the checksum_version of the last Reserve

 private:
  Receiver* r_;
};

class TransferTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = MakeCache("tiny-gdn", 2);
    b_ = MakeCache("tiny-gdn", 2);
    ucx_a_ = std::move(*UcxTransport::Create());
    ucx_b_ = std::move(*UcxTransport::Create());
    oracle_ = std::make_unique<cache::testing::Oracle>(a_->model());
  }
  // A slot on A with a prefill and `steps` decode steps (ring not empty when steps % 3 != 0).
  SlotId Prepare(int steps) {
    const SlotId s = *a_->Allocate();
    cache::testing::Batch p = oracle_->MakeBatch({{1, 0}, {2, 1}, {3, 2}});
    EXPECT_TRUE(a_->Prefill(s, {1, 2, 3}, p.io).ok());
    for (int t = 0; t < steps; ++t) Step(*a_, s, 10 + t, 3 + t);
    return s;
  }
  std::vector<std::vector<uint8_t>> Step(StateCache& c, SlotId s, int32_t tok, int64_t pos) {
    cache::testing::Batch b = oracle_->MakeBatch({{tok, pos}});
    auto f = c.BeginForward({{s, tok}});
    EXPECT_TRUE(f.ok()) << f.status();
    for (int l = 0; l < c.model().num_layers; ++l) EXPECT_TRUE((*f)->RunLayer(l, b.io[l]).ok());
    EXPECT_TRUE((*f)->Commit().ok());
    return b.out;
  }
  // A's transport and n - 1 put lanes of its own (what the service makes for --transfer-lanes).
  std::vector<UcxTransport*> Lanes(int n) {
    std::vector<UcxTransport*> out = {ucx_a_.get()};
    while (static_cast<int>(lanes_.size()) < n - 1) {
      absl::StatusOr<std::unique_ptr<UcxTransport>> t = UcxTransport::Create(/*progress_thread=*/false);
      EXPECT_TRUE(t.ok()) << t.status();
      lanes_.push_back(std::move(*t));
    }
    for (int k = 0; k < n - 1; ++k) out.push_back(lanes_[k].get());
    return out;
  }
  // What a sender does after its puts: tells the receiver how many bytes have landed.
  void RingDoorbell(const Reservation& r, uint64_t landed) {
    ASSERT_NE(r.doorbell_addr, 0u);
    ASSERT_TRUE(ucx_a_->Put(r.worker_address, &landed, sizeof(landed), r.doorbell_addr, r.rkey, 0,
                            absl::Seconds(10)).ok());
  }
  // A's exported state `want` as one payload (every layer's checkpoint, layer-major).
  static std::vector<uint8_t> Payload(const cache::ExportedState& want) {
    std::vector<uint8_t> payload;
    for (const auto& l : want.checkpoints) payload.insert(payload.end(), l.begin(), l.end());
    return payload;
  }
  // An older sender, by hand: reserves `id` declaring checksum `version`, puts `want`'s
  // payload in one put, rings the doorbell where the receiver has one (a device-direct
  // receiver has none: it imports at the commit) and commits with `checksum`. A `good` one
  // leaves B holding `want` (then freed); otherwise the commit is DATA_LOSS.
  void SendByHand(Receiver& rx, const std::string& id, const cache::ExportedState& want,
                  uint32_t version, uint64_t checksum, bool good, bool device_direct) {
    const std::vector<uint8_t> payload = Payload(want);
    absl::StatusOr<Reservation> r = rx.Reserve(id, StateFormat::Of(a_->model()),
                                               static_cast<int64_t>(want.tokens.size()), version);
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
    if (device_direct) EXPECT_EQ(r->doorbell_addr, 0u) << "a device-direct receiver imports at the commit";
    ASSERT_TRUE(ucx_a_->Put(r->worker_address, payload.data(), payload.size(), r->remote_addr,
                            r->rkey, 1000, absl::Seconds(10)).ok());
    if (!device_direct) RingDoorbell(*r, payload.size());
    absl::StatusOr<SlotId> c = rx.Commit(id, want.tokens, checksum);
    if (!good) {
      EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << id << ": " << c.status();
      return;
    }
    ASSERT_TRUE(c.ok()) << id << ": " << c.status();
    absl::StatusOr<cache::ExportedState> eb = b_->Export(*c);
    ASSERT_TRUE(eb.ok());
    EXPECT_EQ(eb->checkpoints, want.checkpoints) << id;
    ASSERT_TRUE(b_->Free(*c).ok());
  }
  std::unique_ptr<StateCache> a_, b_;
  std::unique_ptr<UcxTransport> ucx_a_, ucx_b_;
  std::vector<std::unique_ptr<UcxTransport>> lanes_;
  std::unique_ptr<cache::testing::Oracle> oracle_;
};

TEST_F(TransferTest, ReceiverGetsTheMaterializedStateAndDecodesIdentically) {
  const SlotId s = Prepare(2);
  ASSERT_EQ(a_->Info(s)->write_pos, 2) << "the ring is not empty: the transfer must fold it";
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  absl::StatusOr<SendResult> r = Sender(a_.get(), ucx_a_.get()).Send(peer, s, "t1", {.keep_source = true});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->seq_len, 5);
  EXPECT_EQ(a_->Info(s)->write_pos, 0) << "the sender materialized";
  EXPECT_EQ(b_->Info(r->remote_slot)->seq_len, 5);
  EXPECT_EQ(b_->Info(r->remote_slot)->write_pos, 0);
  absl::StatusOr<cache::ExportedState> ea = a_->Export(s), eb = b_->Export(r->remote_slot);
  ASSERT_TRUE(ea.ok() && eb.ok());
  EXPECT_EQ(ea->checkpoints, eb->checkpoints) << "B holds A's logical state, bit for bit";
  EXPECT_EQ(ea->tokens, eb->tokens);
  EXPECT_EQ(Step(*a_, s, 42, 5), Step(*b_, r->remote_slot, 42, 5)) << "decode continues alike";
  EXPECT_EQ(rx.open(), 0);
}

TEST_F(TransferTest, SourceIsFreedUnlessKept) {
  const SlotId s = Prepare(1);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  ASSERT_TRUE(Sender(a_.get(), ucx_a_.get()).Send(peer, s, "t2", {}).ok());
  EXPECT_EQ(a_->Info(s).status().code(), absl::StatusCode::kNotFound);
}

TEST_F(TransferTest, ShapeMismatchIsRefusedBeforeAnyByteMoves) {
  auto kda = MakeCache("tiny-kda", 2);
  Receiver rx(kda.get(), ucx_b_.get(), {});
  DirectPeer peer(&rx);
  const SlotId s = Prepare(2);
  absl::StatusOr<SendResult> r = Sender(a_.get(), ucx_a_.get()).Send(peer, s, "t3", {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("format.gate"), std::string::npos) << r.status();
  EXPECT_EQ(kda->stats().slots_live, 0);
  EXPECT_TRUE(a_->Info(s).ok()) << "the source is untouched";
  auto other = MakeCache("tiny-gdn", 3);
  Receiver rx3(other.get(), ucx_b_.get(), {});
  DirectPeer peer3(&rx3);
  EXPECT_EQ(Sender(a_.get(), ucx_a_.get()).Send(peer3, s, "t3b", {}).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_F(TransferTest, CorruptedPayloadIsRefusedAndNothingLeaks) {
  const SlotId s = Prepare(2);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  rx.CorruptNextPayloadForTest();
  DirectPeer peer(&rx);
  absl::StatusOr<SendResult> r = Sender(a_.get(), ucx_a_.get()).Send(peer, s, "t4", {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0) << "the reserved slot went back";
  EXPECT_EQ(a_->Info(s)->seq_len, 5) << "the source is untouched and still usable";
  Step(*a_, s, 7, 5);
  ASSERT_TRUE(Sender(a_.get(), ucx_a_.get()).Send(peer, s, "t4-retry", {}).ok()) << "a new attempt succeeds";
}

TEST_F(TransferTest, PeerDyingAfterThePutLeavesTheSourceAndTheLeaseCleansUp) {
  const SlotId s = Prepare(2);
  Receiver rx(b_.get(), ucx_b_.get(), {.lease = absl::Milliseconds(50)});
  DirectPeer peer(&rx);
  peer.fail_commit = peer.fail_abort = true;
  absl::StatusOr<SendResult> r = Sender(a_.get(), ucx_a_.get()).Send(peer, s, "t5", {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(a_->Info(s).ok());
  EXPECT_EQ(rx.open(), 1) << "the abort did not reach the peer";
  absl::SleepFor(absl::Milliseconds(80));
  EXPECT_EQ(rx.ExpireLeases(), 1);
  EXPECT_EQ(b_->stats().slots_live, 0);
  EXPECT_EQ(rx.Commit("t5", {1, 2, 3, 10, 11}, 0).status().code(), absl::StatusCode::kNotFound)
      << "a late commit finds no reservation";
}

TEST_F(TransferTest, RetriesAreSafe) {
  const SlotId s = Prepare(0);
  Receiver rx(b_.get(), ucx_b_.get(), {});
  const StateFormat f = StateFormat::Of(a_->model());
  absl::StatusOr<Reservation> r1 = rx.Reserve("t6", f, 3, kChecksumVersion),
                              r2 = rx.Reserve("t6", f, 3, kChecksumVersion);
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_EQ(r1->remote_addr, r2->remote_addr);
  EXPECT_EQ(rx.open(), 1);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  const std::vector<uint8_t> payload = Payload(*e);
  ASSERT_TRUE(ucx_a_->Put(r1->worker_address, payload.data(), payload.size(), r1->remote_addr,
                          r1->rkey, 1 << 20, absl::Seconds(10)).ok());
  RingDoorbell(*r1, payload.size());
  const uint64_t sum = ChecksumV3(payload.data(), payload.size());
  absl::StatusOr<SlotId> c1 = rx.Commit("t6", e->tokens, sum), c2 = rx.Commit("t6", e->tokens, sum);
  ASSERT_TRUE(c1.ok() && c2.ok());
  EXPECT_EQ(*c1, *c2);
  EXPECT_EQ(b_->stats().slots_live, 1);
  EXPECT_EQ(rx.Reserve("t6", f, 3, kChecksumVersion).status().code(),
            absl::StatusCode::kAlreadyExists);
}

TEST_F(TransferTest, HostStagedPipelineMovesTheSameBytes) {
  // The staging ring (pinned buffers, streams, copy ahead) on both sides, forced on the CPU
  // backend; a chunk that splits layers unevenly and is not a multiple of 64 bytes. The sender
  // hashes its slot on the backend (HashedOnDevice); the receiver verifies and catches a
  // corruption.
  EXPECT_TRUE(HashedOnDevice(DataPath::kHostStaged));
  EXPECT_TRUE(HashedOnDevice(DataPath::kDeviceDirect));
  EXPECT_FALSE(HashedOnDevice(DataPath::kHostDirect));
  const SlotId s = Prepare(2);
  Receiver rx(b_.get(), ucx_b_.get(),
              {.chunk_bytes = 1000, .force_path = DataPath::kHostStaged});
  DirectPeer peer(&rx);
  Sender sender(a_.get(), ucx_a_.get());
  for (size_t chunk : {size_t{1000}, size_t{4096}, size_t{1} << 30}) {
    const std::string id = absl::StrCat("staged-", chunk);
    absl::StatusOr<SendResult> r = sender.Send(
        peer, s, id,
        {.keep_source = true, .chunk_bytes = chunk, .force_path = DataPath::kHostStaged});
    ASSERT_TRUE(r.ok()) << id << ": " << r.status();
    EXPECT_EQ(r->path, DataPath::kHostStaged);
    absl::StatusOr<cache::ExportedState> ea = a_->Export(s), eb = b_->Export(r->remote_slot);
    ASSERT_TRUE(ea.ok() && eb.ok());
    EXPECT_EQ(ea->checkpoints, eb->checkpoints) << id;
    ASSERT_TRUE(b_->Free(r->remote_slot).ok());
  }
  rx.CorruptNextPayloadForTest();
  EXPECT_EQ(sender
                .Send(peer, s, "staged-bad",
                      {.keep_source = true, .chunk_bytes = 1000,
                       .force_path = DataPath::kHostStaged})
                .status()
                .code(),
            absl::StatusCode::kDataLoss);
  EXPECT_EQ(b_->stats().slots_live, 0);
  EXPECT_EQ(rx.open(), 0);
}

TEST_F(TransferTest, CommitBeforeEveryByteLandedIsDataLoss) {
  Receiver rx(b_.get(), ucx_b_.get(), {});
  const StateFormat f = StateFormat::Of(a_->model());
  absl::StatusOr<Reservation> r = rx.Reserve("half", f, 0, kChecksumVersion);
  ASSERT_TRUE(r.ok()) << r.status();
  std::vector<uint8_t> payload(static_cast<size_t>(f.Bytes()), 3);
  ASSERT_TRUE(ucx_a_->Put(r->worker_address, payload.data(), payload.size() / 2, r->remote_addr,
                          r->rkey, 0, absl::Seconds(10)).ok());
  RingDoorbell(*r, payload.size() / 2);
  absl::StatusOr<SlotId> c = rx.Commit("half", {}, ChecksumV3(payload.data(), payload.size()));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss) << c.status();
  EXPECT_NE(c.status().message().find("of " + std::to_string(payload.size()) + " bytes"),
            std::string::npos) << c.status();
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0) << "the reserved slot went back";
}

TEST_F(TransferTest, AnUnknownChecksumVersionIsRefusedBeforeAnyByteMoves) {
  Receiver rx(b_.get(), ucx_b_.get(), {});
  absl::StatusOr<Reservation> r = rx.Reserve("v0", StateFormat::Of(a_->model()), 0, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("checksum_version: expected 3"), std::string::npos)
      << r.status();
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0);
}

TEST_F(TransferTest, AVersion2SenderIsStillAcceptedAndVerified) {
  // An older sender: declares 2 and commits the in-order v2 digest of the payload; the
  // receiver verifies v2 (a v3 digest of the same bytes is a mismatch), with copiers and
  // chunks that do not divide the payload, on both host paths.
  const SlotId s = Prepare(2);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = Payload(*e);
  for (DataPath path : {DataPath::kHostDirect, DataPath::kHostStaged}) {
    Receiver rx(b_.get(), ucx_b_.get(),
                {.chunk_bytes = 700, .import_threads = 3, .force_path = path});
    for (const bool good : {true, false}) {
      const uint64_t sum = good ? Checksum(payload.data(), payload.size())
                                : ChecksumV3(payload.data(), payload.size());
      SendByHand(rx, absl::StrCat("v2-", DataPathName(path), "-", good), *e, kChecksumV2, sum,
                 good, /*device_direct=*/false);
    }
    EXPECT_EQ(rx.open(), 0);
    EXPECT_EQ(b_->stats().slots_live, 0);
  }
}

// A slot of `c` holding random bytes in every layer's checkpoint (and tokens 1, 2, 3).
SlotId RandomSlot(StateCache& c, uint32_t seed) {
  const size_t per = static_cast<size_t>(StateFormat::Of(c.model()).Bytes()) / c.model().num_layers;
  std::mt19937 rng(seed);
  std::vector<std::vector<uint8_t>> layers(c.model().num_layers, std::vector<uint8_t>(per));
  std::vector<absl::Span<const uint8_t>> spans;
  for (auto& l : layers) {
    for (auto& x : l) x = static_cast<uint8_t>(rng() & 0x3f);
    spans.push_back(absl::MakeConstSpan(l));
  }
  const SlotId s = *c.Allocate();
  EXPECT_TRUE(c.Import(s, {1, 2, 3}, spans).ok());
  return s;
}

TEST_F(TransferTest, Version3OverManySegmentsWithUnalignedChunksOnBothHostPaths) {
  // A payload of several 1 MiB segments (a real model's layers, 3 of 2 MiB), sender chunks
  // that do not align with the segments (1000 B; 1 MiB + 17) over 1 and 3 lanes, the
  // receiver importing 700 B chunks with 3 copiers: the segments are hashed on many threads,
  // out of order, and partly from parts kept aside; the digests must still agree, and a
  // corruption must still be caught.
  std::unique_ptr<StateCache> a = MakeCache("qwen3-next-80b-a3b", 3),
                              b = MakeCache("qwen3-next-80b-a3b", 3);
  const StateFormat f = StateFormat::Of(a->model());
  ASSERT_GE(static_cast<size_t>(f.Bytes()), 5 * kChecksumSegmentBytes);
  const SlotId s = RandomSlot(*a, 11);
  absl::StatusOr<cache::ExportedState> ea = a->Export(s);
  ASSERT_TRUE(ea.ok());
  for (DataPath path : {DataPath::kHostDirect, DataPath::kHostStaged}) {
    Receiver rx(b.get(), ucx_b_.get(),
                {.chunk_bytes = 700, .import_threads = 3, .force_path = path});
    DirectPeer peer(&rx);
    for (int lanes : {1, 3}) {
      Sender sender(a.get(), Lanes(lanes));
      for (size_t chunk : {size_t{1000}, (size_t{1} << 20) + 17}) {
        const std::string id = absl::StrCat("seg-", DataPathName(path), "-", lanes, "-", chunk);
        absl::StatusOr<SendResult> r = sender.Send(
            peer, s, id, {.keep_source = true, .chunk_bytes = chunk, .force_path = path});
        ASSERT_TRUE(r.ok()) << id << ": " << r.status();
        absl::StatusOr<cache::ExportedState> eb = b->Export(r->remote_slot);
        ASSERT_TRUE(eb.ok());
        EXPECT_TRUE(ea->checkpoints == eb->checkpoints) << id;
        ASSERT_TRUE(b->Free(r->remote_slot).ok());
      }
      rx.CorruptNextPayloadForTest();
      EXPECT_EQ(sender.Send(peer, s, absl::StrCat("seg-bad-", DataPathName(path), "-", lanes),
                            {.keep_source = true, .chunk_bytes = (size_t{1} << 20) + 17,
                             .force_path = path})
                    .status()
                    .code(),
                absl::StatusCode::kDataLoss)
          << lanes << " lanes";
      EXPECT_EQ(b->stats().slots_live, 0);
      EXPECT_EQ(rx.open(), 0);
    }
  }
}

TEST_F(TransferTest, DeviceDirectSendsDeclareVersion3AndEveryReceiverVerifiesThem) {
  // The device-direct path forced on the CPU backend (the faked UCX CUDA capability selects it
  // only for a CUDA backend: DataPath.FollowsTheBackendAndTheUcxCudaCapability): the sender
  // hashes its slot with rssm_segment_digests_parts (its layers in place, one call) beside the
  // puts and declares 3; a device-direct receiver hashes its receive buffer (contiguous) after
  // copying it into the slot, a host-direct one on the host as before, so each direction
  // checks the backend's digests against the host's. tiny-gdn: one segment across the layers;
  // qwen3-next, 3 layers: 6 segments. 1 and 3 lanes; a corruption in flight is refused
  // (DATA_LOSS, as on the host paths) and leaves nothing behind.
  for (const char* preset : {"tiny-gdn", "qwen3-next-80b-a3b"}) {
    std::unique_ptr<StateCache> a = MakeCache(preset, 3), b = MakeCache(preset, 3);
    const SlotId s = RandomSlot(*a, 7);
    absl::StatusOr<cache::ExportedState> ea = a->Export(s);
    ASSERT_TRUE(ea.ok());
    for (DataPath tx : {DataPath::kDeviceDirect, DataPath::kHostDirect}) {
      for (DataPath rx_path : {DataPath::kDeviceDirect, DataPath::kHostDirect}) {
        if (tx == DataPath::kHostDirect && rx_path == DataPath::kHostDirect) continue;
        Receiver rx(b.get(), ucx_b_.get(),
                    {.chunk_bytes = 700, .import_threads = 3, .force_path = rx_path});
        ASSERT_EQ(rx.path(), rx_path);
        DirectPeer peer(&rx);
        for (int lanes : {1, 3}) {
          Sender sender(a.get(), Lanes(lanes));
          const std::string id = absl::StrCat(preset, "-", DataPathName(tx), "-to-",
                                              DataPathName(rx_path), "-", lanes);
          const SendOptions o{.keep_source = true, .chunk_bytes = (size_t{1} << 20) + 17,
                              .force_path = tx};
          absl::StatusOr<SendResult> r = sender.Send(peer, s, id, o);
          ASSERT_TRUE(r.ok()) << id << ": " << r.status();
          EXPECT_EQ(r->path, tx);
          EXPECT_EQ(peer.declared, kChecksumVersion) << id;
          absl::StatusOr<cache::ExportedState> eb = b->Export(r->remote_slot);
          ASSERT_TRUE(eb.ok());
          EXPECT_TRUE(ea->checkpoints == eb->checkpoints) << id;
          ASSERT_TRUE(b->Free(r->remote_slot).ok());
          rx.CorruptNextPayloadForTest();
          r = sender.Send(peer, s, id + "-bad", o);
          EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << id << ": " << r.status();
          EXPECT_NE(r.status().message().find("checksum"), std::string::npos) << r.status();
          EXPECT_EQ(b->stats().slots_live, 0) << id;
          EXPECT_EQ(rx.open(), 0) << id;
          EXPECT_TRUE(a->Info(s).ok()) << "the source is untouched";
        }
      }
    }
  }
}

TEST_F(TransferTest, ADeviceDirectReceiverStillAcceptsOlderSenders) {
  // 100 (an older device-direct sender, which did not hash): accepted whatever its checksum;
  // 2 (an older host sender): verified as one segment of the whole payload; 3 verified.
  const SlotId s = Prepare(2);
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = Payload(*e);
  const uint64_t v2 = Checksum(payload.data(), payload.size()),
                 v3 = ChecksumV3(payload.data(), payload.size());
  Receiver rx(b_.get(), ucx_b_.get(), {.force_path = DataPath::kDeviceDirect});
  const struct {
    uint32_t version;
    uint64_t checksum;
    bool good;
  } cases[] = {{kChecksumNone, 12345, true}, {kChecksumV2, v2, true}, {kChecksumV2, v3, false},
               {kChecksumVersion, v3, true}, {kChecksumVersion, v2, false}};
  for (const auto& c : cases) {
    SendByHand(rx, absl::StrCat("older-", c.version, "-", c.good), *e, c.version, c.checksum,
               c.good, /*device_direct=*/true);
  }
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0);
}

// Fills every slot of `c` with a non-zero state and frees them again: whatever is allocated
// next holds stale bytes unless something overwrites them.
void DirtyEverySlot(StateCache& c) {
  std::vector<SlotId> slots;
  for (absl::StatusOr<SlotId> s = c.Allocate(); s.ok(); s = c.Allocate()) slots.push_back(*s);
  const size_t per = static_cast<size_t>(StateFormat::Of(c.model()).Bytes()) / c.model().num_layers;
  std::vector<uint8_t> junk(per, 0x3c);
  std::vector<absl::Span<const uint8_t>> cps(c.model().num_layers, absl::MakeConstSpan(junk));
  for (SlotId s : slots) {
    EXPECT_TRUE(c.Import(s, {9, 9}, cps).ok());
    EXPECT_TRUE(c.Free(s).ok());
  }
}

TEST_F(TransferTest, TheReservedSlotIsNobodysUntilTheCommitAndKeepsNoStaleByte) {
  DirtyEverySlot(*b_);
  const SlotId s = Prepare(0);
  Receiver rx(b_.get(), ucx_b_.get(), {.chunk_bytes = 512});
  const StateFormat f = StateFormat::Of(a_->model());
  absl::StatusOr<Reservation> r = rx.Reserve("fresh", f, 3, kChecksumVersion);
  ASSERT_TRUE(r.ok()) << r.status();
  const SlotId reserved = rx.ReservedSlotForTest("fresh");
  ASSERT_NE(reserved, cache::kPaddingSlot);
  // Allocated for the import, not zeroed: the cache refuses it to anyone else.
  for (const absl::Status& st : {b_->Export(reserved).status(), b_->Donate(reserved),
                                 b_->BeginForward({{reserved, 1}}).status()}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << st;
    EXPECT_NE(st.message().find("allocated for an import"), std::string::npos) << st;
  }
  absl::StatusOr<cache::ExportedState> e = a_->Export(s);
  ASSERT_TRUE(e.ok());
  const std::vector<uint8_t> payload = Payload(*e);
  ASSERT_TRUE(ucx_a_->Put(r->worker_address, payload.data(), payload.size(), r->remote_addr,
                          r->rkey, 1000, absl::Seconds(10)).ok());
  RingDoorbell(*r, payload.size());
  absl::StatusOr<SlotId> c = rx.Commit("fresh", e->tokens, ChecksumV3(payload.data(), payload.size()));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(*c, reserved);
  absl::StatusOr<cache::ExportedState> eb = b_->Export(*c);
  ASSERT_TRUE(eb.ok()) << eb.status();
  EXPECT_EQ(eb->checkpoints, e->checkpoints) << "every stale byte was overwritten";
  EXPECT_EQ(Step(*a_, s, 42, 3), Step(*b_, *c, 42, 3));
}

TEST_F(TransferTest, TheReservedSlotIsFreedOnAbortExpiryAndChecksumMismatch) {
  Receiver rx(b_.get(), ucx_b_.get(), {.lease = absl::Milliseconds(50), .import_threads = 2});
  const StateFormat f = StateFormat::Of(a_->model());
  std::vector<uint8_t> payload(static_cast<size_t>(f.Bytes()), 5);
  auto reserve_and_put = [&](const std::string& id) {
    absl::StatusOr<Reservation> r = rx.Reserve(id, f, 0, kChecksumVersion);
    EXPECT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(ucx_a_->Put(r->worker_address, payload.data(), payload.size(), r->remote_addr,
                            r->rkey, 256, absl::Seconds(10)).ok());
    RingDoorbell(*r, payload.size());  // the import's copies may still be running below
    return rx.ReservedSlotForTest(id);
  };
  const SlotId aborted = reserve_and_put("abort");
  ASSERT_TRUE(rx.Abort("abort").ok());
  EXPECT_EQ(b_->Info(aborted).status().code(), absl::StatusCode::kNotFound);
  const SlotId expired = reserve_and_put("expire");
  absl::SleepFor(absl::Milliseconds(80));
  EXPECT_EQ(rx.ExpireLeases(), 1);
  EXPECT_EQ(b_->Info(expired).status().code(), absl::StatusCode::kNotFound);
  const SlotId mismatched = reserve_and_put("mismatch");
  EXPECT_EQ(rx.Commit("mismatch", {}, 12345).status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(b_->Info(mismatched).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0);
  reserve_and_put("ok");
  EXPECT_TRUE(rx.Commit("ok", {}, ChecksumV3(payload.data(), payload.size())).ok())
      << "the slots came back usable";
}

TEST_F(TransferTest, ParallelImportCopiesMoveTheSameBytesOnBothHostPaths) {
  // Many small, uneven chunks, several copier threads, both host paths; then a corrupted
  // payload, which the in-order hash of what was copied must still catch.
  const SlotId s = Prepare(2);
  Sender sender(a_.get(), ucx_a_.get());
  for (DataPath path : {DataPath::kHostDirect, DataPath::kHostStaged}) {
    for (int32_t threads : {1, 3}) {
      Receiver rx(b_.get(), ucx_b_.get(),
                  {.chunk_bytes = 200, .import_threads = threads, .force_path = path});
      DirectPeer peer(&rx);
      const std::string id = absl::StrCat("par-", DataPathName(path), "-", threads);
      absl::StatusOr<SendResult> r = sender.Send(
          peer, s, id, {.keep_source = true, .chunk_bytes = 328, .force_path = path});
      ASSERT_TRUE(r.ok()) << id << ": " << r.status();
      absl::StatusOr<cache::ExportedState> ea = a_->Export(s), eb = b_->Export(r->remote_slot);
      ASSERT_TRUE(ea.ok() && eb.ok());
      EXPECT_EQ(ea->checkpoints, eb->checkpoints) << id;
      ASSERT_TRUE(b_->Free(r->remote_slot).ok());
      rx.CorruptNextPayloadForTest();
      EXPECT_EQ(sender.Send(peer, s, id + "-bad", {.keep_source = true, .chunk_bytes = 328,
                                                   .force_path = path})
                    .status()
                    .code(),
                absl::StatusCode::kDataLoss)
          << id;
      EXPECT_EQ(b_->stats().slots_live, 0) << id;
    }
  }
}

TEST_F(TransferTest, MultiLaneSendsMoveTheSameBytesOnBothHostPaths) {
  // Chunks spread over 1, 2, 3 and 5 lanes: counts that do not divide evenly, and more lanes
  // than chunks; both host paths; the receiver with small chunks of its own. Then a corrupted
  // payload, which must still be caught with the lanes' chunks landing out of order.
  const SlotId s = Prepare(2);
  const size_t per_layer = static_cast<size_t>(StateFormat::Of(a_->model()).Bytes()) /
                           static_cast<size_t>(a_->model().num_layers);
  bool uneven = false;
  for (DataPath path : {DataPath::kHostDirect, DataPath::kHostStaged}) {
    Receiver rx(b_.get(), ucx_b_.get(),
                {.chunk_bytes = 200, .import_threads = 3, .force_path = path});
    DirectPeer peer(&rx);
    for (int lanes : {1, 2, 3, 5}) {
      Sender sender(a_.get(), Lanes(lanes));
      ASSERT_EQ(sender.lanes(), lanes);
      for (size_t chunk : {size_t{328}, size_t{1000}, size_t{1} << 30}) {
        const size_t pieces = SplitPayload(a_->model().num_layers, per_layer, chunk).size();
        uneven |= lanes > 1 && pieces % static_cast<size_t>(lanes) != 0;
        const std::string id = absl::StrCat("lanes-", DataPathName(path), "-", lanes, "-", chunk);
        absl::StatusOr<SendResult> r = sender.Send(
            peer, s, id, {.keep_source = true, .chunk_bytes = chunk, .force_path = path});
        ASSERT_TRUE(r.ok()) << id << ": " << r.status();
        absl::StatusOr<cache::ExportedState> ea = a_->Export(s), eb = b_->Export(r->remote_slot);
        ASSERT_TRUE(ea.ok() && eb.ok());
        EXPECT_EQ(ea->checkpoints, eb->checkpoints) << id << " (" << pieces << " chunks)";
        ASSERT_TRUE(b_->Free(r->remote_slot).ok());
      }
      rx.CorruptNextPayloadForTest();
      EXPECT_EQ(sender.Send(peer, s, absl::StrCat("lanes-bad-", DataPathName(path), "-", lanes),
                            {.keep_source = true, .chunk_bytes = 328, .force_path = path})
                    .status()
                    .code(),
                absl::StatusCode::kDataLoss)
          << lanes << " lanes";
      EXPECT_EQ(b_->stats().slots_live, 0);
      EXPECT_EQ(rx.open(), 0);
    }
  }
  EXPECT_TRUE(uneven) << "some case left the lanes with unequal chunk counts";
}

TEST_F(TransferTest, ALaneFailingMidTransferAbortsAndLeavesNothing) {
  const SlotId s = Prepare(2);
  const absl::StatusOr<cache::ExportedState> before = a_->Export(s);
  ASSERT_TRUE(before.ok());
  for (DataPath path : {DataPath::kHostDirect, DataPath::kHostStaged}) {
    Receiver rx(b_.get(), ucx_b_.get(), {.chunk_bytes = 200, .force_path = path});
    DirectPeer peer(&rx);
    Sender sender(a_.get(), Lanes(3));
    // Piece 7 of ~30: the other lanes' puts before and after it are in flight.
    absl::StatusOr<SendResult> r =
        sender.Send(peer, s, absl::StrCat("lane-fail-", DataPathName(path)),
                    {.keep_source = true, .chunk_bytes = 328, .force_path = path,
                     .fail_piece_for_test = 7});
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInternal) << r.status();
    EXPECT_NE(r.status().message().find("piece 7"), std::string::npos) << r.status();
    EXPECT_EQ(rx.open(), 0) << "the sender aborted the reservation";
    EXPECT_EQ(b_->stats().slots_live, 0) << "the reserved slot went back";
    absl::StatusOr<cache::ExportedState> after = a_->Export(s);
    ASSERT_TRUE(after.ok());
    EXPECT_EQ(after->checkpoints, before->checkpoints) << "the source is untouched";
    // The lanes' endpoints were dropped; the next send starts fresh and succeeds.
    absl::StatusOr<SendResult> again =
        sender.Send(peer, s, absl::StrCat("lane-retry-", DataPathName(path)),
                    {.keep_source = true, .chunk_bytes = 328, .force_path = path});
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(b_->Export(again->remote_slot)->checkpoints, before->checkpoints);
    ASSERT_TRUE(b_->Free(again->remote_slot).ok());
  }
}

TEST_F(TransferTest, AnAbortWhileLanesAreInFlightLeavesNothingLive) {
  // The receiver drops the reservation (an operator's abort, a lease) while the lanes still
  // put: the late chunks land in a pooled buffer nobody imports, the commit finds nothing,
  // neither side keeps anything half-written, and the next transfer is clean.
  const SlotId s = Prepare(2);
  Receiver rx(b_.get(), ucx_b_.get(), {.chunk_bytes = 200});
  DirectPeer peer(&rx);
  Sender sender(a_.get(), Lanes(4));
  std::atomic<bool> aborted{false};
  absl::StatusOr<SendResult> r = sender.Send(
      peer, s, "mid-abort",
      {.keep_source = true, .chunk_bytes = 328, .on_piece_landed_for_test = [&](size_t i) {
         if (i >= 5 && !aborted.exchange(true)) EXPECT_TRUE(rx.Abort("mid-abort").ok());
       }});
  EXPECT_TRUE(aborted.load());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound) << r.status();
  EXPECT_EQ(rx.open(), 0);
  EXPECT_EQ(b_->stats().slots_live, 0) << "the reserved slot went back, never live";
  EXPECT_EQ(a_->Info(s)->seq_len, 5) << "the source is untouched";
  absl::StatusOr<SendResult> again = sender.Send(peer, s, "after-abort", {.chunk_bytes = 328});
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(b_->stats().slots_live, 1);
}

TEST(TaskPool, RunsTasksAtOnceAndABatchWaitsForAllOfThem) {
  TaskPool pool(2);
  std::atomic<int> started{0}, finished{0};
  {
    TaskPool::Batch batch(&pool);
    for (int i = 0; i < 2; ++i) {
      batch.Submit([&] {
        ++started;
        // Both tasks run at once, or this one gives up.
        for (int t = 0; t < 5000 && started.load() < 2; ++t) absl::SleepFor(absl::Milliseconds(1));
        absl::SleepFor(absl::Milliseconds(20));
        ++finished;
        return started.load() == 2 ? absl::OkStatus() : absl::InternalError("ran alone");
      });
    }
    const size_t last = batch.Submit([] { return absl::DataLossError("third"); });
    absl::Status st;
    ASSERT_TRUE(batch.WaitFor(0, absl::Seconds(10), &st));
    EXPECT_TRUE(st.ok()) << st;
    ASSERT_TRUE(batch.WaitFor(last, absl::Seconds(10), &st));
    EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss);
  }
  EXPECT_EQ(finished.load(), 2);
  std::atomic<bool> done{false};
  {
    TaskPool::Batch batch(&pool);
    batch.Submit([&] {
      absl::SleepFor(absl::Milliseconds(50));
      done = true;
      return absl::OkStatus();
    });
  }  // the batch ends only after its task
  EXPECT_TRUE(done.load());
}

TEST(DataPath, FollowsTheBackendAndTheUcxCudaCapability) {
  EXPECT_EQ(SelectDataPath(RSSM_BACKEND_CPU, false), DataPath::kHostDirect);
  EXPECT_EQ(SelectDataPath(RSSM_BACKEND_CPU, true), DataPath::kHostDirect)
      << "host memory never needs CUDA support";
  EXPECT_EQ(SelectDataPath(RSSM_BACKEND_CUDA, false), DataPath::kHostStaged);
  EXPECT_EQ(SelectDataPath(RSSM_BACKEND_CUDA, true), DataPath::kDeviceDirect);
  // The capability as the transport reports it, faked both ways.
  auto ucx = UcxTransport::Create();
  ASSERT_TRUE(ucx.ok());
  (*ucx)->OverrideCudaMemoryForTest(true);
  EXPECT_EQ(SelectDataPath(RSSM_BACKEND_CUDA, (*ucx)->cuda_memory()), DataPath::kDeviceDirect);
  (*ucx)->OverrideCudaMemoryForTest(false);
  EXPECT_EQ(SelectDataPath(RSSM_BACKEND_CUDA, (*ucx)->cuda_memory()), DataPath::kHostStaged);
  auto cache = MakeCache("tiny-gdn", 2);
  (*ucx)->OverrideCudaMemoryForTest(true);
  Receiver rx(cache.get(), ucx->get(), {});
  EXPECT_EQ(rx.path(), DataPath::kHostDirect) << "a CPU-backend receiver stays on host memory";
  EXPECT_STREQ(DataPathName(DataPath::kHostStaged), "host-staged");
}

TEST(SplitPayload, ChunksCoverThePayloadAndNeverCrossALayer) {
  const std::vector<Piece> p = SplitPayload(3, 1000, 384);
  size_t next = 0;
  for (const Piece& x : p) {
    EXPECT_EQ(x.offset, next);
    EXPECT_EQ(x.offset, x.layer * 1000 + x.layer_offset);
    EXPECT_LE(x.layer_offset + x.size, 1000u);
    EXPECT_LE(x.size, 384u);
    next += x.size;
  }
  EXPECT_EQ(next, 3000u);
  EXPECT_EQ(p.size(), 9u);  // 384 + 384 + 232 per layer
  EXPECT_EQ(SplitRange(900, 1100, 1000, 384).size(), 2u) << "split at the layer boundary";
}

TEST(Checksum, ChunkByChunkEqualsOneShotForAnySplit) {
  std::vector<uint8_t> x(100003);
  std::mt19937 rng(9);
  for (auto& b : x) b = static_cast<uint8_t>(rng());
  const uint64_t whole = Checksum(x.data(), x.size());
  for (size_t step : {1, 7, 63, 64, 65, 4096, 99999}) {
    Checksummer c, copied;
    std::vector<uint8_t> dst(x.size());
    for (size_t off = 0; off < x.size(); off += step) {
      const size_t n = std::min(step, x.size() - off);
      c.Update(x.data() + off, n);
      copied.CopyAndUpdate(dst.data() + off, x.data() + off, n);
    }
    EXPECT_EQ(c.Digest(), whole) << "step " << step;
    EXPECT_EQ(copied.Digest(), whole) << "step " << step;
    EXPECT_EQ(dst, x);
  }
  for (size_t i : {size_t{0}, size_t{63}, size_t{64}, size_t{50000}, x.size() - 1}) {
    x[i] ^= 0x10;
    EXPECT_NE(Checksum(x.data(), x.size()), whole) << "a flipped bit at " << i;
    x[i] ^= 0x10;
  }
}

// Version 3 written out from docs/transfer.md, independently of checksum.cc: v2 of every
// 1 MiB (here: `segment`) segment, mixed in order, then the length.
uint64_t ReferenceV3(const std::vector<uint8_t>& x, size_t segment) {
  auto mix = [](uint64_t h, uint64_t v) {
    h ^= v * 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    return h ^ (h >> 32);
  };
  uint64_t h = 0x5eed0003;
  for (size_t off = 0; off < x.size(); off += segment) {
    Checksummer c;
    c.Update(x.data() + off, std::min(segment, x.size() - off));
    h = mix(h, c.Digest());
  }
  return mix(h, x.size());
}

// Random pieces of [0, size): sizes 1..max_piece (unaligned with anything), shuffled.
std::vector<std::pair<size_t, size_t>> RandomPieces(size_t size, size_t max_piece, std::mt19937& rng) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t off = 0; off < size;) {
    const size_t n = std::min<size_t>(size - off, 1 + rng() % max_piece);
    out.emplace_back(off, n);
    off += n;
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

TEST(ChecksumV3, EqualForAnyChunkingOrderAndThreadsAndToTheReference) {
  std::mt19937 rng(17);
  for (size_t segment : {size_t{64}, size_t{1000}, size_t{4096}, kChecksumSegmentBytes}) {
    for (size_t size : {size_t{0}, size_t{1}, size_t{999}, size_t{64 * 1000 + 7}, size_t{3} << 20,
                        (size_t{5} << 20) + 333}) {
      if (segment < 4096 && size > (size_t{1} << 20)) continue;  // the time goes to the big cases
      std::vector<uint8_t> x(size);
      for (auto& b : x) b = static_cast<uint8_t>(rng());
      const uint64_t want = ReferenceV3(x, segment);
      ASSERT_EQ(ChecksumV3(x.data(), x.size(), segment), want) << segment << " " << size;
      if (segment == kChecksumSegmentBytes) EXPECT_EQ(ChecksumV3(x.data(), x.size()), want);
      if (size > 0) EXPECT_NE(want, Checksum(x.data(), x.size())) << "v3 is not v2";
      // Pieces as the sender's and receiver's chunkings make them: the receiver's 700 and
      // 1000 bytes, the real 4 MiB, and random sizes; in order, shuffled, over 4 threads.
      for (size_t max_piece : {size_t{700}, size_t{1000}, size_t{4} << 20, size_t{3 * 1024 + 5},
                               segment + 1, size_t{333333}}) {
        for (int threads : {1, 4}) {
          std::vector<std::pair<size_t, size_t>> pieces = RandomPieces(size, max_piece, rng);
          if (threads == 1) std::sort(pieces.begin(), pieces.end());
          SegmentedChecksum sum(size, segment), copied(size, segment);
          std::vector<uint8_t> dst(size);
          std::atomic<size_t> next{0};
          auto work = [&] {
            for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
              const auto [off, n] = pieces[i];
              sum.Add(off, x.data() + off, n);
              copied.CopyAndAdd(dst.data() + off, x.data() + off, off, n);
            }
          };
          std::vector<std::thread> th;
          for (int t = 0; t < threads; ++t) th.emplace_back(work);
          for (auto& t : th) t.join();
          EXPECT_EQ(sum.Digest(), want) << segment << " " << size << " " << max_piece << " " << threads;
          EXPECT_EQ(copied.Digest(), want) << segment << " " << size << " " << max_piece;
          EXPECT_EQ(dst, x);
        }
      }
    }
  }
}

TEST(ChecksumV3, ACorruptionInAnySegmentIsDetected) {
  const size_t segment = 4096, size = 10 * 4096 + 100;  // 11 segments, the last one short
  std::vector<uint8_t> x(size);
  std::mt19937 rng(3);
  for (auto& b : x) b = static_cast<uint8_t>(rng());
  const uint64_t whole = ChecksumV3(x.data(), x.size(), segment);
  for (size_t seg = 0; seg * segment < size; ++seg) {
    for (size_t at : {size_t{0}, size_t{63}, size_t{2049}, segment - 1}) {
      const size_t i = std::min(size - 1, seg * segment + at);
      x[i] ^= 0x04;
      EXPECT_NE(ChecksumV3(x.data(), x.size(), segment), whole) << "byte " << i;
      SegmentedChecksum s(size, segment);
      for (const auto& [off, n] : RandomPieces(size, 1000, rng)) s.Add(off, x.data() + off, n);
      EXPECT_NE(s.Digest(), whole) << "byte " << i << ", out of order";
      x[i] ^= 0x04;
    }
  }
  // Swapped segments, a missing tail, the real segment size.
  std::vector<uint8_t> swapped = x;
  std::swap_ranges(swapped.begin(), swapped.begin() + segment, swapped.begin() + segment);
  EXPECT_NE(ChecksumV3(swapped.data(), size, segment), whole);
  EXPECT_NE(ChecksumV3(x.data(), size - 1, segment), whole);
  std::vector<uint8_t> big((size_t{3} << 20) + 10, 1);
  const uint64_t b = ChecksumV3(big.data(), big.size());
  big[(size_t{2} << 20) + 5] ^= 1;
  EXPECT_NE(ChecksumV3(big.data(), big.size()), b);
}

// Backend memory (rssm_alloc on the CPU backend: what device memory is on CUDA) of random bytes.
struct BackendBytes {
  BackendBytes(size_t n, std::mt19937& rng) : size(n) {
    EXPECT_EQ(rssm_alloc(RSSM_BACKEND_CPU, n, &p), RSSM_OK);
    for (size_t i = 0; i < n; ++i) data()[i] = static_cast<uint8_t>(rng());
  }
  ~BackendBytes() { rssm_free(RSSM_BACKEND_CPU, p); }
  uint8_t* data() const { return static_cast<uint8_t*>(p); }
  void* p = nullptr;
  size_t size;
};

TEST(BackendChecksum, SegmentDigestsAreChecksummersPerSegmentAndCombineToVersion3) {
  const rssm_launch cpu{RSSM_BACKEND_CPU, nullptr};
  const size_t seg = kChecksumSegmentBytes;
  std::mt19937 rng(29);
  for (size_t size : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, seg - 1, seg,
                      seg + 1, 3 * seg + seg / 2 + 17}) {
    BackendBytes x(size, rng);
    std::vector<uint64_t> d((size + seg - 1) / seg);
    ASSERT_EQ(rssm_segment_digests(&cpu, x.data(), size, seg, d.data()), RSSM_OK);
    for (size_t i = 0; i < d.size(); ++i) {
      const size_t off = i * seg, n = std::min(seg, size - off);
      Checksummer c;  // fed in two uneven parts: the incremental path
      c.Update(x.data() + off, n / 3);
      c.Update(x.data() + off + n / 3, n - n / 3);
      EXPECT_EQ(d[i], c.Digest()) << "size " << size << ", segment " << i;
    }
    EXPECT_EQ(*BackendChecksum(cpu, x.data(), size), ChecksumV3(x.data(), size)) << size;
    EXPECT_EQ(*BackendChecksum(cpu, x.data(), size, kChecksumV2), Checksum(x.data(), size))
        << size;
  }
}

TEST(BackendChecksum, ASlotHashedOnItsBackendIsVersion3OfItsLayers) {
  // Layers that do not divide into segments (segments span layers), apart in memory, hashed in
  // place (rssm_segment_digests_parts, no gather) on a stream kept across hashes; version 2 of
  // the same parts is the one-buffer digest.
  std::mt19937 rng(31);
  const size_t per = 700 * 1024 + 64;
  std::vector<std::unique_ptr<BackendBytes>> layers;
  cache::StateCache::CheckpointMemory m{RSSM_BACKEND_CPU, per, {}};
  std::vector<uint8_t> payload;
  for (int l = 0; l < 4; ++l) {
    layers.push_back(std::make_unique<BackendBytes>(per, rng));
    m.layers.push_back(layers.back()->p);
    payload.insert(payload.end(), layers.back()->data(), layers.back()->data() + per);
  }
  TaskPool pool(2);
  BackendStream stream;
  absl::StatusOr<void*> s = stream.Get(m.backend);
  ASSERT_TRUE(s.ok()) << s.status();
  for (int round = 0; round < 2; ++round) {  // the second reuses the stream
    SlotHasher h(&pool, *s, m);
    absl::StatusOr<uint64_t> d = h.Finish();
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(*d, ChecksumV3(payload.data(), payload.size()));
  }
  EXPECT_EQ(*BackendPartsChecksum({RSSM_BACKEND_CPU, nullptr}, m.layers.data(), m.layers.size(),
                                  per, kChecksumV2),
            Checksum(payload.data(), payload.size()));
  layers[2]->data()[per / 2] ^= 1;
  SlotHasher h(&pool, *s, m);
  EXPECT_NE(*h.Finish(), ChecksumV3(payload.data(), payload.size()));
}

TEST(StateFormat, BytesAndChecksum) {
  auto m = cache::ModelPreset("qwen3-next-80b-a3b");
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(StateFormat::Of(*m).Bytes(), 36LL * 32 * 128 * 128 * 4);
  std::vector<uint8_t> x(1000, 1);
  const uint64_t c = Checksum(x.data(), x.size());
  x[517] ^= 1;
  EXPECT_NE(Checksum(x.data(), x.size()), c);
  EXPECT_NE(Checksum(x.data(), 999), Checksum(x.data(), 1000));
}

}  // namespace
}  // namespace replayssm::transfer
