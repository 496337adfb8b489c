// Cache events against real server processes (docs/api.md, "Cache events"): WatchCache streams
// every snapshot stored (track snapshots, donations) and removed (evictions) with chained block
// hashes; a reconnecting watcher gets exactly what it missed, or a resync; tenants see only
// their own events; the ZMQ publisher speaks vLLM's KV-events wire format, with replay.
#include <zmq.h>

#include <cstdlib>
#include <memory>
#include <msgpack.hpp>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "replayssm/v1/replayssm.grpc.pb.h"
#include "service_fixture.h"
#include "zmq_testing.h"

namespace replayssm::testing {
namespace {

// A WatchCache call as a test reads it.
class Watch {
 public:
  Watch(const std::string& address, uint64_t epoch, uint64_t from_seq,
        const std::string& token = "")
      : stub_(v1::ReplaySsm::NewStub(
            grpc::CreateChannel(address, grpc::InsecureChannelCredentials()))) {
    if (!token.empty()) ctx_.AddMetadata("authorization", "Bearer " + token);
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::WatchCacheRequest req;
    req.set_epoch(epoch);
    req.set_from_seq(from_seq);
    reader_ = stub_->WatchCache(&ctx_, req);
  }
  ~Watch() {
    if (finished_) return;
    ctx_.TryCancel();
    v1::CacheEventBatch b;
    while (reader_->Read(&b)) {
    }
    reader_->Finish().ok();
  }
  // The next batch; fails the test when the stream ends.
  v1::CacheEventBatch Next() {
    v1::CacheEventBatch b;
    if (!reader_->Read(&b)) ADD_FAILURE() << "the stream ended: " << Finish().error_message();
    return b;
  }
  // Events until `n` of them came (batches may group them as they like).
  std::vector<v1::CacheEvent> Events(size_t n, uint64_t* last_seq = nullptr) {
    std::vector<v1::CacheEvent> out;
    while (out.size() < n) {
      v1::CacheEventBatch b = Next();
      if (finished_) break;
      if (last_seq != nullptr) *last_seq = b.seq();
      for (const auto& e : b.events()) out.push_back(e);
    }
    return out;
  }
  grpc::Status Finish() {
    finished_ = true;
    return reader_->Finish();
  }

 private:
  bool finished_ = false;
  std::unique_ptr<v1::ReplaySsm::Stub> stub_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::CacheEventBatch>> reader_;
};

class CacheEventsTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--memory-budget=725000"};  // ~8 tiny-gdn slots
  }

  // A slot with the 10 prompt tokens 100.. and `steps` decode steps: its tokens.
  std::vector<int32_t> Run(uint64_t slot, int32_t seq, int steps) {
    Prefill(slot, seq, 10);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 10; ++i) tokens.push_back(100 + i);
    for (int i = 0; i < steps; ++i) {
      DecodeStep({slot}, {seq});
      tokens.push_back(static_cast<int32_t>(7 + slot % 1000));
    }
    return tokens;
  }
};

// A track snapshot at 16 tokens and a donation at 20 are streamed as stored, the donation
// chained to the snapshot's hash; evictions as removed, with the same hashes.
TEST_F(CacheEventsTest, SnapshotsAreStreamedStoredThenRemoved) {
  Watch w(server_->grpc_address(), 0, 0);
  const v1::CacheEventBatch first = w.Next();
  EXPECT_TRUE(first.resync());
  ASSERT_EQ(first.events_size(), 1);
  EXPECT_TRUE(first.events(0).has_cleared()) << "a resync starts with AllBlocksCleared";
  const uint64_t slot = NewSlot();
  const std::vector<int32_t> tokens = Run(slot, 0, 10);  // seq_len 20, a track snapshot at 16
  ASSERT_TRUE(client_->Donate(slot).ok());
  uint64_t seq = 0;
  const std::vector<v1::CacheEvent> stored = w.Events(2, &seq);
  ASSERT_EQ(stored.size(), 2u);
  ASSERT_TRUE(stored[0].has_stored() && stored[1].has_stored());
  const v1::BlockStored& track = stored[0].stored();
  const v1::BlockStored& donation = stored[1].stored();
  EXPECT_EQ(track.num_tokens(), 16);
  EXPECT_FALSE(track.has_parent()) << "a key of one block has no parent";
  EXPECT_EQ(std::vector<int32_t>(track.token_ids().begin(), track.token_ids().end()),
            std::vector<int32_t>(tokens.begin(), tokens.begin() + 16));
  EXPECT_EQ(donation.num_tokens(), 20);
  EXPECT_TRUE(donation.has_parent());
  EXPECT_EQ(donation.parent_block_hash(), track.block_hashes(0))
      << "the donation's parent is the block the track snapshot ends";
  EXPECT_EQ(std::vector<int32_t>(donation.token_ids().begin(), donation.token_ids().end()),
            std::vector<int32_t>(tokens.begin() + 16, tokens.end()));
  EXPECT_EQ(track.block_size(), 16);
  EXPECT_EQ(track.medium(), "GPU");
  EXPECT_NE(track.block_hashes(0), donation.block_hashes(0));
  // Fill the pool: both snapshots are evicted, oldest first.
  std::vector<uint64_t> slots;
  for (int64_t i = 0; i < info_.capacity_slots(); ++i) slots.push_back(NewSlot());
  const std::vector<v1::CacheEvent> removed = w.Events(2, &seq);
  ASSERT_EQ(removed.size(), 2u);
  ASSERT_TRUE(removed[0].has_removed() && removed[1].has_removed());
  EXPECT_EQ(removed[0].removed().block_hashes(0), track.block_hashes(0));
  EXPECT_EQ(removed[1].removed().block_hashes(0), donation.block_hashes(0));
  EXPECT_EQ(removed[1].removed().medium(), "GPU");
}

// A watcher that reconnects from its next sequence number gets exactly the batches it missed;
// one from another epoch (a restart) or too far back gets a resync with what is stored now.
TEST_F(CacheEventsTest, AReconnectingWatcherGetsWhatItMissedOrAResync) {
  uint64_t epoch = 0, seq = 0;
  {
    Watch w(server_->grpc_address(), 0, 0);
    const v1::CacheEventBatch first = w.Next();
    epoch = first.epoch();
    seq = first.seq();
    EXPECT_NE(epoch, 0u);
  }
  const uint64_t a = NewSlot();
  Prefill(a, 0, 10);
  ASSERT_TRUE(client_->Donate(a).ok());
  const uint64_t b = NewSlot();
  Prefill(b, 1, 12);
  ASSERT_TRUE(client_->Donate(b).ok());
  absl::SleepFor(absl::Milliseconds(100));  // the log numbers its batches every 10 ms
  std::vector<v1::CacheEvent> missed;
  {
    Watch w(server_->grpc_address(), epoch, seq + 1);
    uint64_t last = 0;
    missed = w.Events(2, &last);
    EXPECT_GT(last, seq);
  }
  ASSERT_EQ(missed.size(), 2u);
  EXPECT_EQ(missed[0].stored().num_tokens(), 10);
  EXPECT_EQ(missed[1].stored().num_tokens(), 12);
  {
    Watch w(server_->grpc_address(), epoch, seq + 1);
    const v1::CacheEventBatch replayed = w.Next();
    EXPECT_FALSE(replayed.resync()) << "the same batches again, not a resync";
  }
  Watch restarted(server_->grpc_address(), epoch + 1, seq + 1);  // as after a restart
  const v1::CacheEventBatch r = restarted.Next();
  EXPECT_TRUE(r.resync());
  ASSERT_EQ(r.events_size(), 3);
  EXPECT_TRUE(r.events(0).has_cleared());
  EXPECT_EQ(r.events(1).stored().num_tokens(), 10) << "shorter keys first";
  EXPECT_EQ(r.events(2).stored().num_tokens(), 12);
  EXPECT_EQ(r.events(1).stored().block_hashes(0), missed[0].stored().block_hashes(0));
}

// With --auth-tokens a watcher sees its own tenant's snapshots only, and needs a token.
class CacheEventsTenantsTest : public CacheEventsTest {
 protected:
  void SetUp() override {
    tokens_path_ = absl::StrCat(::testing::TempDir(), "/replayssm-events-tokens-", getpid());
    FILE* f = std::fopen(tokens_path_.c_str(), "w");
    std::fputs("alice alice-token-0123456789abcdef\nbob bob-token-0123456789abcdef\n", f);
    std::fclose(f);
    CacheEventsTest::SetUp();
  }
  void TearDown() override { std::remove(tokens_path_.c_str()); }
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--auth-tokens=" + tokens_path_};
  }
  std::string ClientToken() const override { return "alice-token-0123456789abcdef"; }
  std::string tokens_path_;
};

TEST_F(CacheEventsTenantsTest, AWatcherSeesOnlyItsTenantsSnapshots) {
  {
    Watch anonymous(server_->grpc_address(), 0, 0);
    EXPECT_EQ(anonymous.Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  Watch bob(server_->grpc_address(), 0, 0, "bob-token-0123456789abcdef");
  Watch alice(server_->grpc_address(), 0, 0, "alice-token-0123456789abcdef");
  EXPECT_TRUE(bob.Next().resync());
  EXPECT_TRUE(alice.Next().resync());
  const uint64_t slot = NewSlot();  // alice's
  Prefill(slot, 0, 10);
  ASSERT_TRUE(client_->Donate(slot).ok());
  const std::vector<v1::CacheEvent> got = alice.Events(1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].stored().num_tokens(), 10);
  // Bob's stream carries nothing of alice's: a resync of bob's shows no snapshot either.
  Watch bob_again(server_->grpc_address(), 1, 1, "bob-token-0123456789abcdef");
  const v1::CacheEventBatch r = bob_again.Next();
  EXPECT_TRUE(r.resync());
  EXPECT_EQ(r.events_size(), 1) << "only AllBlocksCleared";
}

// --kv-events-endpoint: vLLM's wire format, (topic, seq, msgpack [ts, [events]]), and replay.
class ZmqEventsTest : public CacheEventsTest {
 protected:
  void SetUp() override {
    const int64_t now = absl::ToUnixMicros(absl::Now());
    port_ = 20000 + static_cast<int>((getpid() * 7 + now % 9973) % 30000);
    CacheEventsTest::SetUp();
  }
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", absl::StrCat("--kv-events-endpoint=tcp://127.0.0.1:", port_),
            absl::StrCat("--kv-events-replay-endpoint=tcp://127.0.0.1:", port_ + 1),
            "--kv-events-topic=replayssm"};
  }
  int port_ = 0;
};

using zmq_testing::Frames;
using zmq_testing::Seq;

TEST_F(ZmqEventsTest, BatchesAreVllmKvEventsWithReplay) {
  void* ctx = zmq_ctx_new();
  void* sub = zmq_socket(ctx, ZMQ_SUB);
  const int timeout_ms = 10000;
  zmq_setsockopt(sub, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
  zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "replayssm", 9);
  ASSERT_EQ(zmq_connect(sub, absl::StrCat("tcp://127.0.0.1:", port_).c_str()), 0);
  absl::SleepFor(absl::Milliseconds(300));  // the subscription reaches the publisher
  const uint64_t slot = NewSlot();
  Prefill(slot, 0, 20);
  ASSERT_TRUE(client_->Donate(slot).ok());
  const std::vector<std::string> f = Frames(sub);
  ASSERT_EQ(f.size(), 3u) << "topic, sequence number, payload";
  EXPECT_EQ(f[0], "replayssm");
  ASSERT_EQ(f[1].size(), 8u);
  EXPECT_EQ(Seq(f[1]), 2) << "1 was the start's AllBlocksCleared";
  msgpack::object_handle h = msgpack::unpack(f[2].data(), f[2].size());
  const msgpack::object& batch = h.get();
  ASSERT_EQ(batch.type, msgpack::type::ARRAY);
  ASSERT_EQ(batch.via.array.size, 2u) << "[ts, events]";
  EXPECT_EQ(batch.via.array.ptr[0].type, msgpack::type::FLOAT64);
  const msgpack::object& events = batch.via.array.ptr[1];
  ASSERT_EQ(events.via.array.size, 1u);
  const msgpack::object& e = events.via.array.ptr[0];
  ASSERT_EQ(e.via.array.size, 7u)
      << "[tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]";
  EXPECT_EQ(e.via.array.ptr[0].as<std::string>(), "BlockStored");
  EXPECT_EQ(e.via.array.ptr[1].via.array.size, 1u);
  EXPECT_EQ(e.via.array.ptr[2].type, msgpack::type::POSITIVE_INTEGER) << "20 tokens: a parent";
  const std::vector<int32_t> tail = e.via.array.ptr[3].as<std::vector<int32_t>>();
  EXPECT_EQ(tail, (std::vector<int32_t>{116, 117, 118, 119}));
  EXPECT_EQ(e.via.array.ptr[4].as<int32_t>(), 16);
  EXPECT_TRUE(e.via.array.ptr[5].is_nil());
  EXPECT_EQ(e.via.array.ptr[6].as<std::string>(), "GPU");

  void* req = zmq_socket(ctx, ZMQ_REQ);
  zmq_setsockopt(req, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
  ASSERT_EQ(zmq_connect(req, absl::StrCat("tcp://127.0.0.1:", port_ + 1).c_str()), 0);
  const std::string from(7, '\0');
  ASSERT_EQ(zmq_send(req, (from + '\1').data(), 8, 0), 8);  // from seq 1
  std::vector<std::string> r = Frames(req);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(Seq(r[0]), 1);
  msgpack::object_handle cleared = msgpack::unpack(r[1].data(), r[1].size());
  EXPECT_EQ(cleared.get().via.array.ptr[1].via.array.ptr[0].via.array.ptr[0].as<std::string>(),
            "AllBlocksCleared");
  zmq_close(req);
  zmq_close(sub);
  zmq_ctx_term(ctx);
}

// A replay from a batch no longer kept (--cache-events-retain), or from one ahead of the last
// (a router that missed a restart: ZMQ carries no epoch), answered with the kept batches from
// there: no mark that anything was missed, and the router rebuilt a wrong picture (an outside
// review). Those get a resync, as WatchCache gives: AllBlocksCleared, then what is stored now.
class ZmqEventsRetainTest : public ZmqEventsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    std::vector<std::string> f = ZmqEventsTest::ServerFlags();
    f.push_back("--cache-events-retain=2");
    return f;
  }
};

TEST_F(ZmqEventsRetainTest, AReplayOfWhatIsGoneIsAResync) {
  for (int32_t i = 0; i < 3; ++i) {  // batches 2, 3, 4 (1: the start's AllBlocksCleared)
    const uint64_t slot = NewSlot();
    Prefill(slot, i, 17 + i);  // three keys
    ASSERT_TRUE(client_->Donate(slot).ok());
    absl::SleepFor(absl::Milliseconds(100));  // a batch each
  }
  void* ctx = zmq_ctx_new();
  void* dealer = zmq_socket(ctx, ZMQ_DEALER);
  const int timeout_ms = 10000;
  zmq_setsockopt(dealer, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
  ASSERT_EQ(zmq_connect(dealer, absl::StrCat("tcp://127.0.0.1:", port_ + 1).c_str()), 0);
  // (seq, first event's tag, events) of each reply up to the end marker.
  struct Reply {
    int64_t seq;
    std::string first;
    size_t events;
  };
  auto replay = [&](uint64_t from) {
    std::string start(8, '\0');
    for (int b = 0; b < 8; ++b) start[7 - b] = static_cast<char>((from >> (8 * b)) & 0xff);
    EXPECT_EQ(zmq_send(dealer, start.data(), 8, 0), 8);
    std::vector<Reply> out;
    for (;;) {
      const std::vector<std::string> f = Frames(dealer);
      if (f.size() != 2) {
        ADD_FAILURE() << "a reply of " << f.size() << " frames";
        return out;
      }
      if (Seq(f[0]) == -1) return out;
      msgpack::object_handle h = msgpack::unpack(f[1].data(), f[1].size());
      const msgpack::object& events = h.get().via.array.ptr[1];
      out.push_back({Seq(f[0]), events.via.array.ptr[0].via.array.ptr[0].as<std::string>(),
                     events.via.array.size});
    }
  };
  const std::vector<Reply> kept = replay(3);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept[0].seq, 3);
  EXPECT_EQ(kept[1].seq, 4);
  EXPECT_EQ(kept[1].first, "BlockStored");
  for (const uint64_t from : {uint64_t{1}, uint64_t{2}, uint64_t{9}}) {
    const std::vector<Reply> got = replay(from);
    ASSERT_EQ(got.size(), 1u) << "from " << from;
    EXPECT_EQ(got[0].seq, 4) << "numbered the last batch";
    EXPECT_EQ(got[0].first, "AllBlocksCleared") << "from " << from;
    EXPECT_EQ(got[0].events, 4u) << "then the 3 snapshots stored now";
  }
  EXPECT_TRUE(replay(5).empty()) << "up to date: the end marker alone";
  zmq_close(dealer);
  zmq_ctx_term(ctx);
}

// --kv-events-curve-secret-file + --kv-events-clients-file: only a router holding an admitted
// key hears the events; one with another key, or without CURVE, hears nothing.
class ZmqCurveEventsTest : public ZmqEventsTest {
 protected:
  void SetUp() override {
    char pub[41], sec[41];
    ASSERT_EQ(zmq_curve_keypair(pub, sec), 0);
    client_public_ = pub;
    client_secret_ = sec;
    dir_ = absl::StrCat(::testing::TempDir(), "/replayssm-curve-", getpid());
    std::string mkdir = "mkdir -p " + dir_;
    ASSERT_EQ(std::system(mkdir.c_str()), 0);
    char server_secret[41];
    ASSERT_EQ(zmq_curve_keypair(pub, server_secret), 0);
    server_public_ = pub;
    Write(dir_ + "/secret", std::string(server_secret) + "\n");
    Write(dir_ + "/clients", "# routers\n" + client_public_ + "\n");
    ZmqEventsTest::SetUp();
  }
  static void Write(const std::string& path, const std::string& text) {
    FILE* f = std::fopen(path.c_str(), "w");
    std::fputs(text.c_str(), f);
    std::fclose(f);
  }
  std::vector<std::string> ServerFlags() const override {
    std::vector<std::string> f = ZmqEventsTest::ServerFlags();
    f.push_back("--kv-events-curve-secret-file=" + dir_ + "/secret");
    f.push_back("--kv-events-clients-file=" + dir_ + "/clients");
    return f;
  }
  // A SUB socket (CURVE with `public`/`secret` unless empty), subscribed.
  void* Subscriber(void* ctx, const std::string& public_key, const std::string& secret_key) {
    void* sub = zmq_socket(ctx, ZMQ_SUB);
    const int timeout_ms = 1500;
    zmq_setsockopt(sub, ZMQ_RCVTIMEO, &timeout_ms, sizeof(timeout_ms));
    if (!public_key.empty()) {
      zmq_setsockopt(sub, ZMQ_CURVE_SERVERKEY, server_public_.c_str(), 40);
      zmq_setsockopt(sub, ZMQ_CURVE_PUBLICKEY, public_key.c_str(), 40);
      zmq_setsockopt(sub, ZMQ_CURVE_SECRETKEY, secret_key.c_str(), 40);
    }
    zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "replayssm", 9);
    EXPECT_EQ(zmq_connect(sub, absl::StrCat("tcp://127.0.0.1:", port_).c_str()), 0);
    return sub;
  }
  std::string dir_, server_public_, client_public_, client_secret_;
};

TEST_F(ZmqCurveEventsTest, OnlyAnAdmittedRouterHearsTheEvents) {
  void* ctx = zmq_ctx_new();
  char stranger_public[41], stranger_secret[41];
  ASSERT_EQ(zmq_curve_keypair(stranger_public, stranger_secret), 0);
  void* admitted = Subscriber(ctx, client_public_, client_secret_);
  void* stranger = Subscriber(ctx, stranger_public, stranger_secret);
  void* plain = Subscriber(ctx, "", "");
  absl::SleepFor(absl::Milliseconds(500));  // handshakes, subscriptions
  const uint64_t slot = NewSlot();
  Prefill(slot, 0, 20);
  ASSERT_TRUE(client_->Donate(slot).ok());
  const std::vector<std::string> got = Frames(admitted);
  ASSERT_EQ(got.size(), 3u) << "the admitted router hears the donation";
  EXPECT_EQ(got[0], "replayssm");
  EXPECT_TRUE(Frames(stranger).empty()) << "a key not in the clients file is refused";
  EXPECT_TRUE(Frames(plain).empty()) << "a socket without CURVE is refused";
  for (void* s : {admitted, stranger, plain}) zmq_close(s);
  zmq_ctx_term(ctx);
}

}  // namespace
}  // namespace replayssm::testing
