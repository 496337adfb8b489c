// Bearer tokens and tenants (--auth-tokens; docs/operations.md, "Security"), against real
// server processes: a call without a token or with a wrong one is UNAUTHENTICATED; a tenant
// cannot reach, list, replay or share another tenant's slots, request ids, prefix snapshots or
// regions (its valid handle is NOT_FOUND exactly as an unknown one); a changed token file is
// read again; a moved slot belongs to its sender's tenant on the receiver.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "peer_proofs.h"
#include "service_fixture.h"
#include "transfer_proxy.h"

namespace replayssm::testing {
namespace {

constexpr char kAlice[] = "alice-token-0123456789abcdef";
constexpr char kAlice2[] = "alice-second-token-0123456789";  // a second token, same tenant
constexpr char kBob[] = "bob-token-0123456789abcdef";
constexpr uint64_t kUnknownHandle = 0x5eed5eed5eed5eedULL;  // never issued (2^-64 odds)

// A token file in a temporary directory, replaced atomically (rename) as Kubernetes does.
class TokenFile {
 public:
  explicit TokenFile(const std::string& text)
      : path_(absl::StrCat(::testing::TempDir(), "/replayssm-tokens-", getpid(), "-", ++n_)) {
    Write(text);
  }
  ~TokenFile() { std::remove(path_.c_str()); }
  void Write(const std::string& text) const {
    std::ofstream(path_ + ".new") << text;
    std::rename((path_ + ".new").c_str(), path_.c_str());
  }
  std::string Flag() const { return "--auth-tokens=" + path_; }

 private:
  static inline int n_ = 0;
  std::string path_;
};

std::string Tokens() {
  return absl::StrCat("# tenant token\nalice ", kAlice, "\nalice ", kAlice2, "\nbob ", kBob, "\n");
}

std::unique_ptr<Client> As(const ServerProcess& server, const std::string& token) {
  auto c = Client::Connect(server.grpc_address());
  c->set_token(token);
  return c;
}

class TenantsTest : public ServiceTest {
 protected:
  // --transfer-peers: without a peer token, a server with tenants dials only listed peers.
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", tokens_.Flag(), "--transfer-peers=127.0.0.1:1"};
  }
  void SetUp() override {
    // The fixture's own client speaks as alice.
    auto server = ServerProcess::Start(ServerFlags());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = As(*server_, kAlice);
    bob_ = As(*server_, kBob);
    auto info = client_->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    info_ = *info;
    auto ref = client::CpuReference::Create(info_.model(), 16);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = *std::move(ref);
  }

  TokenFile tokens_{Tokens()};
  std::unique_ptr<Client> bob_;
};

TEST_F(TenantsTest, ACallWithoutATokenIsUnauthenticatedAndCounted) {
  auto anonymous = Client::Connect(server_->grpc_address());
  for (const absl::Status& s : {anonymous->Info().status(), anonymous->Allocate().status(),
                                anonymous->ListSlots().status(), anonymous->RegionStatus().status(),
                                anonymous->TransferSlot(1, "127.0.0.1:1", false, "r").status(),
                                anonymous->OpenStream()->Begin({}).status()}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << s;
  }
  EXPECT_GE(Scrape(*server_, "replayssm_auth_failures_total{reason=\"missing\"}"), 6);
  EXPECT_GE(
      Scrape(*server_, "replayssm_rpcs_total{code=\"UNAUTHENTICATED\",method=\"Allocate\"}"),
      1);
  auto health = anonymous->Health();  // probes need no token
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(TenantsTest, AWrongTokenIsUnauthenticatedAndNeverEchoed) {
  auto wrong = As(*server_, "not-a-token-of-this-server-0123");
  auto a = wrong->Allocate();
  EXPECT_EQ(a.status().code(), absl::StatusCode::kUnauthenticated) << a.status();
  EXPECT_EQ(a.status().message().find("not-a-token"), std::string::npos) << a.status();
  EXPECT_GE(Scrape(*server_, "replayssm_auth_failures_total{reason=\"unknown\"}"), 1);
  EXPECT_TRUE(client_->Allocate().ok()) << "alice's token works";
  EXPECT_TRUE(As(*server_, kAlice2)->Allocate().ok()) << "so does her second one";
}

TEST_F(TenantsTest, AnotherTenantsValidHandleIsNotFoundExactlyAsAnUnknownOne) {
  const uint64_t slot = NewSlot();
  Prefill(slot, 0, 4);
  const std::string before = Observe(slot);
  // What bob hears for alice's live handle must be what he hears for a handle never issued.
  const auto expect_unknown = [&](const absl::Status& got, const absl::Status& unknown,
                                  const char* call) {
    EXPECT_EQ(got.code(), absl::StatusCode::kNotFound) << call << ": " << got;
    EXPECT_EQ(got.message(), absl::StrReplaceAll(unknown.message(), {{absl::StrCat(kUnknownHandle),
                                                                      absl::StrCat(slot)}}))
        << call;
  };
  expect_unknown(bob_->GetSlot(slot).status(), bob_->GetSlot(kUnknownHandle).status(), "GetSlot");
  expect_unknown(bob_->Export(slot).status(), bob_->Export(kUnknownHandle).status(), "Export");
  expect_unknown(bob_->Accept(slot, 0).status(), bob_->Accept(kUnknownHandle, 0).status(),
                 "Accept");
  const std::vector<v1::LayerInput> one = Layers(1);
  expect_unknown(bob_->Decode(DecodeRequest({slot}, one)).status(),
                 bob_->Decode(DecodeRequest({kUnknownHandle}, one)).status(), "Decode");
  v1::PrefillRequest prefill;
  prefill.add_tokens(5);
  for (const auto& l : one) *prefill.add_layers() = l;
  prefill.set_slot(slot);
  v1::PrefillRequest prefill_unknown = prefill;
  prefill_unknown.set_slot(kUnknownHandle);
  expect_unknown(bob_->Prefill(prefill).status(), bob_->Prefill(prefill_unknown).status(),
                 "Prefill");
  expect_unknown(bob_->Donate(slot), bob_->Donate(kUnknownHandle), "Donate");
  expect_unknown(bob_->Free(slot), bob_->Free(kUnknownHandle), "Free");
  auto moved = bob_->TransferSlot(slot, "127.0.0.1:1", false);
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kNotFound) << moved.status();
  EXPECT_EQ(Observe(slot), before) << "alice's slot is as it was";
  auto listed = bob_->ListSlots();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->slots_size(), 0);
}

TEST_F(TenantsTest, ListSlotsListsTheCallersTenantOnly) {
  const uint64_t a1 = NewSlot(), a2 = NewSlot();
  auto b1 = bob_->Allocate();
  ASSERT_TRUE(b1.ok());
  auto alice = client_->ListSlots();
  auto bob = bob_->ListSlots();
  ASSERT_TRUE(alice.ok() && bob.ok());
  std::vector<uint64_t> alices;
  for (const auto& l : alice->slots()) alices.push_back(l.state().slot());
  std::sort(alices.begin(), alices.end());
  EXPECT_EQ(alices, (std::vector<uint64_t>{std::min(a1, a2), std::max(a1, a2)}));
  ASSERT_EQ(bob->slots_size(), 1);
  EXPECT_EQ(bob->slots(0).state().slot(), b1->slot());
  // Alice's second token is alice: same slots.
  auto again = As(*server_, kAlice2)->ListSlots();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->slots_size(), 2);
}

TEST_F(TenantsTest, ThePrefixCacheIsSharedWithinATenantOnly) {
  const uint64_t slot = NewSlot();
  Prefill(slot, 0, 20);  // tokens 100..119
  ASSERT_TRUE(client_->Donate(slot).ok());
  std::vector<int32_t> prompt;
  for (int i = 0; i < 24; ++i) prompt.push_back(100 + i);
  auto bob_match = bob_->MatchPrefix(prompt);
  ASSERT_TRUE(bob_match.ok());
  EXPECT_EQ(*bob_match, 0) << "bob must not hit alice's snapshot";
  auto bob_slot = bob_->AllocateFromPrefix(prompt);
  ASSERT_TRUE(bob_slot.ok()) << bob_slot.status();
  EXPECT_EQ(bob_slot->matched(), 0);
  auto stats = bob_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->snapshot_hits(), 0);
  // Alice (through either token) hits it.
  auto alice2 = As(*server_, kAlice2);
  auto hit = alice2->AllocateFromPrefix(prompt);
  ASSERT_TRUE(hit.ok()) << hit.status();
  EXPECT_EQ(hit->matched(), 20);
  // A snapshot bob donates stays bob's.
  ASSERT_TRUE(bob_->Donate(bob_slot->slot()).ok());
}

// Issue 31 §6: one tenant could fill the pool (evicting the others' prefix snapshots), and
// GetStats showed every tenant's counters to each. A tenant now holds at most
// --tenant-max-slots live slots, and its GetStats is its own view.
class TenantQuotaTest : public TenantsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    // 8 slots of tiny-gdn (135,680 bytes each); bob may hold 3 of them.
    return {"--track-interval=16", tokens_.Flag(), "--memory-budget=1100K",
            "--tenant-max-slots=3"};
  }
};

TEST_F(TenantQuotaTest, ATenantHoldsAtMostItsSlotsAndSeesItsOwnCountersOnly) {
  const uint64_t slot = NewSlot();
  Prefill(slot, 0, 20);  // tokens 100..119
  ASSERT_TRUE(client_->Donate(slot).ok());  // alice's prefix snapshot
  std::vector<int32_t> prompt;
  for (int i = 0; i < 20; ++i) prompt.push_back(100 + i);
  prompt.push_back(7);  // a match leaves the prompt's last token to prefill
  ASSERT_EQ(*client_->MatchPrefix(prompt), 20);
  std::vector<uint64_t> bobs;
  for (int i = 0; i < 3; ++i) {
    auto s = bob_->Allocate();
    ASSERT_TRUE(s.ok()) << i << ": " << s.status();
    bobs.push_back(s->slot());
  }
  for (int i = 0; i < 6; ++i) {  // would fill the pool and evict alice's snapshot
    auto more = bob_->Allocate();
    EXPECT_EQ(more.status().code(), absl::StatusCode::kResourceExhausted) << more.status();
    EXPECT_NE(more.status().message().find("--tenant-max-slots 3"), std::string::npos)
        << more.status();
  }
  auto from_prefix = bob_->AllocateFromPrefix(prompt);
  EXPECT_EQ(from_prefix.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(*client_->MatchPrefix(prompt), 20) << "alice's snapshot was not evicted";
  auto bob_stats = bob_->Stats();
  ASSERT_TRUE(bob_stats.ok());
  EXPECT_TRUE(bob_stats->tenant_view());
  EXPECT_EQ(bob_stats->slots_live(), 3);
  EXPECT_EQ(bob_stats->tenant_max_slots(), 3);
  EXPECT_EQ(bob_stats->slots_snapshot(), 0) << "alice's snapshot is not bob's to count";
  EXPECT_EQ(bob_stats->snapshots_taken(), 0);
  EXPECT_EQ(bob_stats->forwards_committed(), 0) << "alice's prefill is not bob's to count";
  auto alice_stats = client_->Stats();
  ASSERT_TRUE(alice_stats.ok());
  EXPECT_EQ(alice_stats->slots_live(), 0) << "alice donated hers";
  // Freeing one gives the share back.
  ASSERT_TRUE(bob_->Free(bobs[0]).ok());
  EXPECT_TRUE(bob_->Allocate().ok());
  EXPECT_TRUE(client_->Allocate().ok()) << "alice has a share of her own";
}

// Within its slot bound a tenant could still donate until the pool's snapshots were its own,
// pushing the others' out by LRU. With --tenant-max-snapshots its donations evict only its own.
class TenantSnapshotBoundTest : public TenantsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    // 8 slots of tiny-gdn; bob keeps at most 2 snapshots.
    return {"--track-interval=0", tokens_.Flag(), "--memory-budget=1100K",
            "--tenant-max-snapshots=2"};
  }
};

TEST_F(TenantSnapshotBoundTest, ATenantsDonationsEvictOnlyItsOwnSnapshots) {
  const uint64_t slot = NewSlot();
  Prefill(slot, 0, 10);  // tokens 100..109
  ASSERT_TRUE(client_->Donate(slot).ok());  // alice's prefix snapshot
  std::vector<int32_t> alice_prompt;
  for (int i = 0; i < 10; ++i) alice_prompt.push_back(100 + i);
  alice_prompt.push_back(7);  // a match leaves the prompt's last token to prefill
  ASSERT_EQ(*client_->MatchPrefix(alice_prompt), 10);
  std::vector<std::vector<int32_t>> bobs;
  for (int d = 0; d < 10; ++d) {  // more donations than the pool has slots
    auto s = bob_->Allocate();
    ASSERT_TRUE(s.ok()) << d << ": " << s.status();
    v1::PrefillRequest req;
    req.set_slot(s->slot());
    std::vector<int32_t> tokens;
    for (int i = 0; i < 4; ++i) tokens.push_back(1000 * (d + 1) + i);
    for (int32_t t : tokens) req.add_tokens(t);
    for (const auto& l : Layers(4)) *req.add_layers() = l;
    ASSERT_TRUE(bob_->Prefill(req).ok());
    ASSERT_TRUE(bob_->Donate(s->slot()).ok());
    tokens.push_back(7);  // the prompt that finds it: one token more
    bobs.push_back(tokens);
  }
  EXPECT_EQ(*client_->MatchPrefix(alice_prompt), 10) << "alice's snapshot outlived bob's ten";
  EXPECT_EQ(*bob_->MatchPrefix(bobs[9]), 4) << "bob's newest kept";
  EXPECT_EQ(*bob_->MatchPrefix(bobs[8]), 4);
  EXPECT_EQ(*bob_->MatchPrefix(bobs[0]), 0) << "bob's oldest evicted for his newer ones";
}

TEST_F(TenantsTest, RequestIdsAreTheTenantsOwn) {
  auto a = client_->Allocate("request-1");
  auto b = bob_->Allocate("request-1");
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  EXPECT_NE(a->slot(), b->slot()) << "bob's id must not replay alice's reply (her handle)";
  auto again = client_->Allocate("request-1");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->slot(), a->slot()) << "alice's retry still replays";
  EXPECT_TRUE(bob_->GetSlot(b->slot()).ok());
}

// A stream opened with a token ends once the token file no longer holds it: DecodeStream
// refuses its next begin, WatchCache ends before its next batch (an outside review: both went
// on, the watcher receiving its tenant's new events, while unary calls were refused within a
// second). The server looks at the file once a second itself: no call with any token comes
// between the removal and the refused begin here.
TEST_F(TenantsTest, ARemovedTokenEndsTheStreamsItOpened) {
  const uint64_t slot = NewSlot();
  Prefill(slot, 0, 4);
  auto second = As(*server_, kAlice2);  // alice's second token, about to be removed
  auto stream = second->OpenStream();
  v1::DecodeRow row;
  row.set_slot(slot);
  ASSERT_TRUE(stream->Forward({row}, Layers(1)).ok());
  auto stub = v1::ReplaySsm::NewStub(
      grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext wc;
  wc.AddMetadata("authorization", absl::StrCat("Bearer ", kAlice2));
  wc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto watch = stub->WatchCache(&wc, v1::WatchCacheRequest());
  v1::CacheEventBatch batch;
  ASSERT_TRUE(watch->Read(&batch)) << "the catch-up";
  tokens_.Write(absl::StrCat("alice ", kAlice, "\nbob ", kBob, "\n"));
  absl::SleepFor(absl::Seconds(3));
  auto refused = stream->Forward({row}, Layers(1));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated) << refused.status();
  EXPECT_NE(refused.status().message().find("no longer in the server's token file"),
            std::string::npos)
      << refused.status();
  ASSERT_TRUE(client_->Donate(slot).ok()) << "alice's other token still works";
  EXPECT_FALSE(watch->Read(&batch)) << "the removed token's watcher got the donation's event";
  EXPECT_EQ(watch->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_EQ(Scrape(*server_, "replayssm_auth_failures_total{reason=\"revoked\"}"), 2);
}

// A watcher of a quiet tenant: its stream checked the token only before a batch went out, so
// with no event to send a removed token's stream stayed open (holding --max-watchers room)
// until its client's deadline (an outside review). It ends when the file's change is read:
// by the server's sweep, or by a call whose new token reloaded the file first (a rotation; the
// sweep then compared with the generation before its own reload and told no watcher).
TEST_F(TenantsTest, ARemovedTokensQuietWatcherEndsWithoutAnEvent) {
  const std::string carol = "carol-token-0123456789abcdef";
  for (const bool by_call : {false, true}) {
    SCOPED_TRACE(by_call ? "a call reloads the file" : "the sweep reloads the file");
    tokens_.Write(Tokens());
    ASSERT_TRUE(As(*server_, kAlice2)->ListSlots().ok()) << "alice's second token is back";
    auto stub = v1::ReplaySsm::NewStub(
        grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext wc;
    wc.AddMetadata("authorization", absl::StrCat("Bearer ", kAlice2));
    wc.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    auto watch = stub->WatchCache(&wc, v1::WatchCacheRequest());
    v1::CacheEventBatch batch;
    ASSERT_TRUE(watch->Read(&batch)) << "the catch-up";
    const absl::Time removed = absl::Now();
    tokens_.Write(absl::StrCat("alice ", kAlice, "\nbob ", kBob, "\ncarol ", carol, "\n"));
    if (by_call) {
      EXPECT_TRUE(As(*server_, carol)->Allocate().ok()) << "it reloads the file";
    }
    EXPECT_FALSE(watch->Read(&batch));
    const grpc::Status ended = watch->Finish();
    EXPECT_EQ(ended.error_code(), grpc::StatusCode::UNAUTHENTICATED) << ended.error_message();
    EXPECT_LT(absl::Now() - removed, absl::Seconds(10)) << "ended by the reload, not the deadline";
  }
}

// A token set_token refuses (it cannot travel as a header value) fails a stream's calls with
// that error, as it fails unary calls: the stream went without any token before.
TEST_F(TenantsTest, AStreamOfARefusedTokenFailsWithItsError) {
  auto bad = Client::Connect(server_->grpc_address());
  bad->set_token(std::string(kAlice) + "\n");
  const absl::Status unary = bad->Allocate().status();
  EXPECT_EQ(unary.code(), absl::StatusCode::kInvalidArgument) << unary;
  auto stream = bad->OpenStream();
  v1::DecodeRow row;
  row.set_slot(NewSlot());
  const absl::Status begun = stream->Begin({row}).status();
  EXPECT_EQ(begun, unary) << "the same error, naming the token's byte";
  EXPECT_NE(begun.message().find("got byte 0x0a"), std::string::npos) << begun;
  EXPECT_EQ(stream->Finish(), unary);
  stream->Cancel();  // nothing to cancel
}

// Two authorization headers: a proxy in front may have checked the other one, so neither is
// taken (the server used the first).
TEST_F(TenantsTest, TwoAuthorizationHeadersAreRefused) {
  auto stub = v1::ReplaySsm::NewStub(
      grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext c;
  c.AddMetadata("authorization", absl::StrCat("Bearer ", kAlice));
  c.AddMetadata("authorization", absl::StrCat("Bearer ", kBob));
  v1::GetInfoResponse info;
  const grpc::Status st = stub->GetInfo(&c, v1::GetInfoRequest(), &info);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_NE(st.error_message().find("expected one `authorization: Bearer <token>` header, got 2"),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(Scrape(*server_, "replayssm_auth_failures_total{reason=\"malformed\"}"), 1);
}

// --tenant-max-streams and --tenant-max-watchers: one tenant's open streams cannot take every
// one (an outside review: alice's 64 WatchCache streams locked bob's router out).
class TenantStreamBoundTest : public TenantsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", tokens_.Flag(), "--tenant-max-streams=1",
            "--tenant-max-watchers=1"};
  }
};

TEST_F(TenantStreamBoundTest, ATenantsStreamsLeaveOthersTheirs) {
  auto stub = v1::ReplaySsm::NewStub(
      grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  struct Watcher {
    grpc::ClientContext c;
    std::unique_ptr<grpc::ClientReader<v1::CacheEventBatch>> reader;
  };
  auto watch = [&](const std::string& token) {
    auto w = std::make_unique<Watcher>();
    w->c.AddMetadata("authorization", absl::StrCat("Bearer ", token));
    w->c.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    w->reader = stub->WatchCache(&w->c, v1::WatchCacheRequest());
    return w;
  };
  v1::CacheEventBatch batch;
  auto alices = watch(kAlice);
  ASSERT_TRUE(alices->reader->Read(&batch));
  auto again = watch(kAlice2);  // the same tenant, another token
  EXPECT_FALSE(again->reader->Read(&batch));
  const grpc::Status refused = again->reader->Finish();
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("--tenant-max-watchers"), std::string::npos)
      << refused.error_message();
  auto bobs = watch(kBob);
  EXPECT_TRUE(bobs->reader->Read(&batch)) << "bob's router is not locked out";
  const uint64_t slot = NewSlot();
  v1::DecodeRow row;
  row.set_slot(slot);
  auto first = client_->OpenStream();
  ASSERT_TRUE(first->Forward({row}, Layers(1)).ok());
  auto second = client_->OpenStream();
  auto over = second->Forward({row}, Layers(1));
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("--tenant-max-streams"), std::string::npos)
      << over.status();
  auto bob_slot = bob_->Allocate();
  ASSERT_TRUE(bob_slot.ok());
  row.set_slot(bob_slot->slot());
  EXPECT_TRUE(bob_->OpenStream()->Forward({row}, Layers(1)).ok()) << "bob's stream is his own";
  for (auto* w : {alices.get(), bobs.get()}) w->c.TryCancel();
  for (auto* w : {alices.get(), bobs.get()}) {
    while (w->reader->Read(&batch)) {
    }
    w->reader->Finish().IgnoreError();
  }
}

// The dedup window (--dedup-entries) is shared fairly: another tenant's flood of ids forgets
// its own. It was one LRU: after bob's Allocate+Free pairs pushed alice's id out, her retry
// of a prefill was applied twice (an outside review); here her retried Allocate would make a
// second slot.
class TenantDedupTest : public TenantsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", tokens_.Flag(), "--dedup-entries=8"};
  }
};

TEST_F(TenantDedupTest, AnotherTenantsFloodOfIdsKeepsTheRetriesOfOneWithinItsShare) {
  auto first = client_->Allocate("alice-1");
  ASSERT_TRUE(first.ok()) << first.status();
  for (int i = 0; i < 20; ++i) {
    const std::string id = absl::StrCat("bob-", i);
    auto s = bob_->Allocate(id);
    ASSERT_TRUE(s.ok()) << s.status();
    ASSERT_TRUE(bob_->Free(s->slot(), id).ok());
  }
  auto retry = client_->Allocate("alice-1");
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->slot(), first->slot()) << "the original reply, not a second slot";
  auto listed = client_->ListSlots();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->slots_size(), 1);
  EXPECT_EQ(Scrape(*server_, "replayssm_dedup_replays_total"), 1);
}

// A POSIX shm object of `bytes` named `key`, unlinked when it goes.
class Shm {
 public:
  Shm(std::string key, off_t bytes) : key_(std::move(key)) {
    const int fd = CreateOwnShm(key_);
    EXPECT_GE(fd, 0) << key_;
    EXPECT_EQ(ftruncate(fd, bytes), 0);
    close(fd);
  }
  ~Shm() { shm_unlink(key_.c_str()); }
  const std::string& key() const { return key_; }

 private:
  std::string key_;
};

TEST_F(TenantsTest, RegionsAreTheTenantsOwn) {
  Shm alices(absl::StrCat("/alice:tenants-", getpid()), 4096);
  Shm bobs(absl::StrCat("/bob:tenants-", getpid()), 4096);
  const std::string key = alices.key();
  v1::RegisterSystemRegionRequest r;
  r.set_name("engine");
  r.set_key(key);
  r.set_byte_size(4096);
  ASSERT_TRUE(client_->RegisterSystemRegion(r).ok());
  auto bob_all = bob_->RegionStatus();
  ASSERT_TRUE(bob_all.ok());
  EXPECT_EQ(bob_all->regions_size(), 0);
  auto bob_one = bob_->RegionStatus("engine");
  auto bob_none = bob_->RegionStatus("never-registered");
  EXPECT_EQ(bob_one.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(bob_one.status().message(),
            absl::StrReplaceAll(bob_none.status().message(), {{"never-registered", "engine"}}));
  EXPECT_EQ(bob_->UnregisterRegion("engine").code(), absl::StatusCode::kNotFound);
  r.set_key(bobs.key());
  EXPECT_TRUE(bob_->RegisterSystemRegion(r).ok()) << "the same name is free for bob";
  auto alice_all = client_->RegionStatus();
  ASSERT_TRUE(alice_all.ok());
  EXPECT_EQ(alice_all->regions_size(), 1);
  // Unmapped at once (shm; only a CUDA region's unmapping waits for no planned forward open,
  // on a CUDA server), and the held and forced series over every tenant's table exist at 0.
  EXPECT_TRUE(client_->UnregisterRegion("engine").ok());
  EXPECT_TRUE(bob_->UnregisterRegion("engine").ok());
  EXPECT_EQ(Scrape(*server_, "replayssm_region_unmaps_held"), 0);
  EXPECT_EQ(Scrape(*server_, "replayssm_region_unmaps_forced_total"), 0);
}

// Issue 31 §4: any tenant could register any shm object of the host (another engine's
// memory, read and written through forwards), and the errors said whether a name existed and
// how large it was. A tenant now maps only "/<tenant>:..." objects, and a missing object and a
// short one get the same answer.
TEST_F(TenantsTest, ATenantMapsOnlyItsOwnShmObjectsAndLearnsNothingOfOthers) {
  Shm alices(absl::StrCat("/alice:engine-", getpid()), 4096);
  Shm others(absl::StrCat("/replayssm-other-engine-", getpid()), 4096);
  const auto reg = [](const std::string& key, uint64_t bytes) {
    v1::RegisterSystemRegionRequest r;
    r.set_name("engine");
    r.set_key(key);
    r.set_byte_size(bytes);
    return r;
  };
  // Bob names alice's object, another engine's, and one that does not exist: one answer.
  const std::string missing = absl::StrCat("/alice:nothing-", getpid());
  const absl::Status theirs = bob_->RegisterSystemRegion(reg(alices.key(), 4096));
  EXPECT_EQ(theirs.code(), absl::StatusCode::kPermissionDenied) << theirs;
  EXPECT_NE(theirs.message().find("starts with \"/bob:\""), std::string::npos) << theirs;
  const absl::Status none = bob_->RegisterSystemRegion(reg(missing, 4096));
  EXPECT_EQ(none.message(),
            absl::StrReplaceAll(theirs.message(), {{alices.key(), missing}}));
  EXPECT_EQ(client_->RegisterSystemRegion(reg(others.key(), 4096)).code(),
            absl::StatusCode::kPermissionDenied)
      << "nor does alice map an object outside her prefix";
  // Within her prefix: a short object and a missing one read alike, sizes never shown.
  const absl::Status short_one = client_->RegisterSystemRegion(reg(alices.key(), 8192));
  const absl::Status gone = client_->RegisterSystemRegion(reg(missing, 8192));
  EXPECT_EQ(short_one.code(), absl::StatusCode::kInvalidArgument) << short_one;
  EXPECT_EQ(gone.message(), absl::StrReplaceAll(short_one.message(), {{alices.key(), missing}}));
  EXPECT_EQ(short_one.message().find("4096"), std::string::npos) << short_one;
  EXPECT_TRUE(client_->RegisterSystemRegion(reg(alices.key(), 4096)).ok());
  EXPECT_EQ(bob_->RegionStatus()->regions_size(), 0);
}

TEST_F(TenantsTest, AChangedTokenFileIsReadAgain) {
  const std::string carol = "carol-token-0123456789abcdef";
  EXPECT_EQ(As(*server_, carol)->Allocate().status().code(), absl::StatusCode::kUnauthenticated);
  tokens_.Write(absl::StrCat("alice ", kAlice, "\ncarol ", carol, "\n"));
  auto c = As(*server_, carol)->Allocate();
  EXPECT_TRUE(c.ok()) << "a new token works at its first use: " << c.status();
  // A removed token stops within a second (the file is looked at once a second at most).
  absl::Status bob = absl::OkStatus();
  for (absl::Time end = absl::Now() + absl::Seconds(10); absl::Now() < end && bob.ok();) {
    bob = bob_->ListSlots().status();
    if (bob.ok()) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(bob.code(), absl::StatusCode::kUnauthenticated) << bob;
  // A file that no longer parses keeps the tokens loaded.
  tokens_.Write("alice\n");
  auto still = As(*server_, carol)->ListSlots();
  EXPECT_TRUE(still.ok()) << still.status();
  EXPECT_TRUE(client_->ListSlots().ok());
}

// Issue 31 §7: a token file others may read is named in a warning at start (never its
// tokens); one only its owner may read is not.
TEST(TokenFilePermissions, AFileOthersMayReadIsWarnedAbout) {
  TokenFile tokens(Tokens());
  const std::string path = tokens.Flag().substr(std::string("--auth-tokens=").size());
  ASSERT_EQ(chmod(path.c_str(), 0644), 0);
  auto open = ServerProcess::Start({tokens.Flag()});
  ASSERT_TRUE(open.ok()) << open.status();
  const std::string log = (*open)->Log();
  EXPECT_NE(log.find("warning: --auth-tokens " + path + " may be read by others (mode 0644)"),
            std::string::npos)
      << log;
  EXPECT_EQ(log.find(kAlice), std::string::npos) << "never a token";
  ASSERT_EQ(chmod(path.c_str(), 0600), 0);
  auto private_file = ServerProcess::Start({tokens.Flag()});
  ASSERT_TRUE(private_file.ok()) << private_file.status();
  EXPECT_EQ((*private_file)->Log().find("may be read"), std::string::npos)
      << (*private_file)->Log();
}

// Two servers with the same token file: a slot moved by alice is alice's on the receiver.
// Keeps the last ReserveTransfer the proxy forwards: a real request, to replay as others.
void RecordReservations(TransferProxy& proxy, v1::ReserveTransferRequest* seen) {
  proxy.set_hooks({.reserve = [seen](v1::ReserveTransferRequest& r) {
    *seen = r;
    return TransferProxy::Action::kForward;
  }});
}

TEST(TenantTransfers, AMovedSlotBelongsToTheSendersTenant) {
  TokenFile tokens(Tokens());
  PeerTokenFile peer;
  auto a = ServerProcess::Start({tokens.Flag(), peer.Flag()});
  auto b = ServerProcess::Start({tokens.Flag(), peer.Flag()});
  ASSERT_TRUE(a.ok() && b.ok());
  auto alice_a = As(**a, kAlice), alice_b = As(**b, kAlice), bob_b = As(**b, kBob);
  auto slot = alice_a->Allocate();
  ASSERT_TRUE(slot.ok());
  auto moved = alice_a->TransferSlot(slot->slot(), (*b)->grpc_address(), false, "move-1");
  ASSERT_TRUE(moved.ok()) << moved.status();
  // Bob naming alice's move (its request id and handle) learns nothing of it: no replay.
  auto bob_a = As(**a, kBob);
  auto replay = bob_a->TransferSlot(slot->slot(), (*b)->grpc_address(), false, "move-1");
  EXPECT_EQ(replay.status().code(), absl::StatusCode::kNotFound) << replay.status();
  auto retry = alice_a->TransferSlot(slot->slot(), (*b)->grpc_address(), false, "move-1");
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->remote_slot(), moved->remote_slot()) << "alice's retry replays";
  EXPECT_TRUE(alice_b->GetSlot(moved->remote_slot()).ok());
  EXPECT_EQ(bob_b->GetSlot(moved->remote_slot()).status().code(), absl::StatusCode::kNotFound);
  auto listed = bob_b->ListSlots();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->slots_size(), 0);
  // The pull form carries the caller's token to the sender: bob pulls a slot of his.
  auto bobs = bob_a->Allocate();
  ASSERT_TRUE(bobs.ok());
  auto pulled = bob_b->PullSlot(bobs->slot(), (*a)->grpc_address(), false);
  ASSERT_TRUE(pulled.ok()) << pulled.status();
  EXPECT_TRUE(bob_b->GetSlot(pulled->slot()).ok());
  EXPECT_EQ(alice_b->GetSlot(pulled->slot()).status().code(), absl::StatusCode::kNotFound);
  // Nor can alice pull bob's slot: on the sender it is an unknown handle.
  auto bobs2 = bob_a->Allocate();
  ASSERT_TRUE(bobs2.ok());
  auto stolen = alice_b->PullSlot(bobs2->slot(), (*a)->grpc_address(), false);
  EXPECT_EQ(stolen.status().code(), absl::StatusCode::kNotFound) << stolen.status();
  EXPECT_TRUE(bob_a->GetSlot(bobs2->slot()).ok());
}

// Issue 31 §2: the receiver looked a commit's tenant up in a side table of the last 4096
// reservations and fell back to the implicit tenant: reservations made (and aborted) while
// a sender paused before its commit pushed the entry out, and the committed slot belonged to
// nobody (its owner got NOT_FOUND, nothing freed it). The tenant now travels with the
// reservation.
TEST(TenantTransfers, AMovedSlotLandsInItsTenantWhateverReservationsComeMeanwhile) {
  TokenFile tokens(Tokens());
  PeerTokenFile peer;
  auto a = ServerProcess::Start({tokens.Flag(), peer.Flag(), "--transfer-timeout=300"});
  auto b = ServerProcess::Start({tokens.Flag(), peer.Flag(), "--transfer-lease=300"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto proxy = TransferProxy::Start((*b)->grpc_address());
  ASSERT_NE(proxy, nullptr);
  v1::ReserveTransferRequest seen;
  absl::Notification committing, flooded;
  proxy->set_hooks({.reserve = [&](v1::ReserveTransferRequest& r) {
                      seen = r;
                      return TransferProxy::Action::kForward;
                    },
                    .commit = [&](v1::CommitTransferRequest&) {
                      committing.Notify();
                      flooded.WaitForNotification();  // the sender pauses before its commit
                      return TransferProxy::Action::kForward;
                    }});
  auto alice_a = As(**a, kAlice), alice_b = As(**b, kAlice), bob_b = As(**b, kBob);
  auto slot = alice_a->Allocate();
  ASSERT_TRUE(slot.ok());
  absl::StatusOr<v1::TransferSlotResponse> moved;
  std::thread t([&] { moved = alice_a->TransferSlot(slot->slot(), proxy->address(), false); });
  ASSERT_TRUE(committing.WaitForNotificationWithTimeout(absl::Seconds(60)));
  auto stub = v1::SlotTransfer::NewStub(
      grpc::CreateChannel((*b)->grpc_address(), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 4200; ++i) {  // another tenant's reservations, each aborted
    v1::ReserveTransferRequest r = seen;
    r.set_transfer_id("flood-" + std::to_string(i));
    r.set_tenant("bob");
    v1::ReserveTransferResponse reserved;
    grpc::ClientContext rc;
    r.clear_nonce();
    PeerTokenFile::Prove(rc, r);  // a peer's
    const grpc::Status st = stub->ReserveTransfer(&rc, r, &reserved);
    ASSERT_TRUE(st.ok()) << i << ": " << st.error_message();
    v1::AbortTransferRequest abort;
    abort.set_transfer_id(r.transfer_id());
    v1::AbortTransferResponse aborted;
    grpc::ClientContext ac;
    PeerTokenFile::Prove(ac, abort);
    ASSERT_TRUE(stub->AbortTransfer(&ac, abort, &aborted).ok()) << i;
  }
  flooded.Notify();
  t.join();
  ASSERT_TRUE(moved.ok()) << moved.status();
  EXPECT_TRUE(alice_b->GetSlot(moved->remote_slot()).ok()) << "alice's slot is alice's";
  EXPECT_EQ(bob_b->GetSlot(moved->remote_slot()).status().code(), absl::StatusCode::kNotFound);
  auto listed = alice_b->ListSlots();
  ASSERT_TRUE(listed.ok());
  EXPECT_EQ(listed->slots_size(), 1);
  EXPECT_TRUE(alice_b->Free(moved->remote_slot()).ok()) << "and its owner can free it";
}

// --tenant-max-slots counts incoming transfers from their reservation: two reservations (or
// a reservation and an Allocate) can no longer both pass the bound and both land.
TEST(TenantTransfers, AReservationCountsAgainstItsTenantsSlotBound) {
  TokenFile tokens(Tokens());
  PeerTokenFile peer;
  auto a = ServerProcess::Start({tokens.Flag(), peer.Flag()});
  auto b = ServerProcess::Start({tokens.Flag(), peer.Flag(), "--tenant-max-slots=1"});
  ASSERT_TRUE(a.ok() && b.ok());
  auto proxy = TransferProxy::Start((*b)->grpc_address());
  ASSERT_NE(proxy, nullptr);
  v1::ReserveTransferRequest seen;
  RecordReservations(*proxy, &seen);
  auto alice_a = As(**a, kAlice), alice_b = As(**b, kAlice), bob_b = As(**b, kBob);
  auto slot = alice_a->Allocate();
  ASSERT_TRUE(slot.ok());
  auto moved = alice_a->TransferSlot(slot->slot(), proxy->address(), false);
  ASSERT_TRUE(moved.ok()) << moved.status();  // alice holds her one slot on b
  auto stub = v1::SlotTransfer::NewStub(
      grpc::CreateChannel((*b)->grpc_address(), grpc::InsecureChannelCredentials()));
  auto reserve = [&](const std::string& id) {
    v1::ReserveTransferRequest r = seen;
    r.set_transfer_id(id);
    v1::ReserveTransferResponse resp;
    grpc::ClientContext c;
    r.clear_nonce();
    PeerTokenFile::Prove(c, r);
    return stub->ReserveTransfer(&c, r, &resp);
  };
  auto abort = [&](const std::string& id) {
    v1::AbortTransferRequest r;
    r.set_transfer_id(id);
    v1::AbortTransferResponse resp;
    grpc::ClientContext c;
    PeerTokenFile::Prove(c, r);
    return stub->AbortTransfer(&c, r, &resp).ok();
  };
  const grpc::Status full = reserve("q-0");
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  EXPECT_NE(full.error_message().find("--tenant-max-slots 1"), std::string::npos)
      << full.error_message();
  ASSERT_TRUE(alice_b->Free(moved->remote_slot()).ok());
  const grpc::Status first = reserve("q-1");
  ASSERT_TRUE(first.ok()) << first.error_message();
  EXPECT_EQ(reserve("q-2").error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "the open reservation holds alice's one slot";
  EXPECT_EQ(alice_b->Allocate().status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(bob_b->Allocate().ok()) << "bob's bound is his own";
  EXPECT_TRUE(abort("q-1"));
  EXPECT_TRUE(alice_b->Allocate().ok()) << "the aborted reservation gave it back";
}

// A move whose commit reply was lost is in doubt; the sender's resolver then asks the peer
// on its own, learns "committed" and frees the source. Its handle was retired only in the
// answer to a TransferSlot call, so with nobody retrying it still counted against the
// tenant's --tenant-max-slots (and in ListSlots) for good: the outside review's LOW.
TEST(TenantTransfers, AMoveTheResolverSettlesGivesBackItsPlaceUnderTheBound) {
  TokenFile tokens(Tokens());
  PeerTokenFile peer;
  auto a = ServerProcess::Start({tokens.Flag(), peer.Flag(), "--tenant-max-slots=1"});
  auto b = ServerProcess::Start({tokens.Flag(), peer.Flag()});
  ASSERT_TRUE(a.ok() && b.ok());
  auto proxy = TransferProxy::Start((*b)->grpc_address());
  ASSERT_NE(proxy, nullptr);
  proxy->set_hooks(
      {.commit =
           [](v1::CommitTransferRequest&) { return TransferProxy::Action::kForwardLoseReply; },
       .abort = [](v1::AbortTransferRequest&) { return TransferProxy::Action::kRefuse; }});
  auto alice_a = As(**a, kAlice), alice_b = As(**b, kAlice);
  auto slot = alice_a->Allocate();
  ASSERT_TRUE(slot.ok()) << slot.status();
  auto r = alice_a->TransferSlot(slot->slot(), proxy->address(), false, "settled-1");
  EXPECT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << "in doubt: " << r.status();
  EXPECT_EQ(alice_a->Allocate().status().code(), absl::StatusCode::kResourceExhausted)
      << "the source is locked while in doubt, and counts";
  proxy->set_hooks({});  // the resolver (once a second) now hears B's decision
  absl::StatusOr<v1::AllocateResponse> next;
  for (absl::Time end = absl::Now() + absl::Seconds(20); absl::Now() < end;) {
    next = alice_a->Allocate();
    if (next.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(next.ok()) << "the moved slot still counts: " << next.status();
  auto listed = alice_a->ListSlots();
  ASSERT_TRUE(listed.ok());
  ASSERT_EQ(listed->slots_size(), 1) << "only the new slot";
  EXPECT_EQ(listed->slots(0).state().slot(), next->slot());
  EXPECT_EQ(alice_a->GetSlot(slot->slot()).status().code(), absl::StatusCode::kNotFound);
  auto on_b = alice_b->ListSlots();
  ASSERT_TRUE(on_b.ok());
  EXPECT_EQ(on_b->slots_size(), 1) << "the state lives on B, once";
  // A late retry still gets the move's answer (the handle is retired, not unknown).
  auto retry = alice_a->TransferSlot(slot->slot(), proxy->address(), false, "settled-1");
  ASSERT_TRUE(retry.ok()) << retry.status();
  EXPECT_EQ(retry->remote_slot(), on_b->slots(0).state().slot());
}

// Issue 31 §3: ReserveTransfer, CommitTransfer and AbortTransfer checked no credential: a
// tenant's client could create slots in any tenant, and anonymous reservations from the host
// of a real peer used up that host's share (--transfer-reservations-per-peer) and locked the
// peer out for a whole lease. Peer calls now need the cluster's peer token; a tenant's token
// is never enough, and calls without it reserve nothing.
TEST(PeerCredentials, OnlyThePeerTokenOpensThePeerMethods) {
  TokenFile tokens(Tokens());
  PeerTokenFile peer;
  auto a = ServerProcess::Start({tokens.Flag(), peer.Flag()});
  auto b = ServerProcess::Start({tokens.Flag(), peer.Flag()});
  ASSERT_TRUE(a.ok() && b.ok());
  // A real reservation's request, to replay as others.
  auto proxy = TransferProxy::Start((*b)->grpc_address());
  ASSERT_NE(proxy, nullptr);
  v1::ReserveTransferRequest seen;
  RecordReservations(*proxy, &seen);
  auto alice_a = As(**a, kAlice);
  auto first = alice_a->Allocate();
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(alice_a->TransferSlot(first->slot(), proxy->address(), false).ok());
  auto stub = v1::SlotTransfer::NewStub(
      grpc::CreateChannel((*b)->grpc_address(), grpc::InsecureChannelCredentials()));
  const auto reserve = [&](const std::string& id, const std::string& key,
                           const std::string& value) {
    v1::ReserveTransferRequest r = seen;
    r.set_transfer_id(id);
    v1::ReserveTransferResponse resp;
    grpc::ClientContext c;
    if (!key.empty()) c.AddMetadata(key, value);
    return stub->ReserveTransfer(&c, r, &resp).error_code();
  };
  for (int i = 0; i < 8; ++i) {  // from this host, as the servers are
    EXPECT_EQ(reserve("anon-" + std::to_string(i), "", ""), grpc::StatusCode::UNAUTHENTICATED);
  }
  EXPECT_EQ(reserve("tenant", "authorization", absl::StrCat("Bearer ", kAlice)),
            grpc::StatusCode::UNAUTHENTICATED)
      << "a client's token is no peer's";
  EXPECT_EQ(reserve("guess", kPeerProofKey,
                    PeerProof("peer-token-0123456789abcdeX", "ReserveTransfer", "guess",
                              seen.tenant(), ReserveContent(seen))),
            grpc::StatusCode::UNAUTHENTICATED)
      << "a proof of another token";
  EXPECT_EQ(reserve("raw", kPeerProofKey, PeerTokenFile::kPeerToken),
            grpc::StatusCode::UNAUTHENTICATED)
      << "the token itself is no proof";
  // What the sender sent its peer (the proxy here; any address a client names, without
  // --transfer-peers) opens that one call and nothing else. It used to be the token itself:
  // a client naming its own address as the peer read the cluster's peer token.
  std::string proof;
  for (const auto& [key, value] : proxy->reserve_metadata()) {
    EXPECT_EQ(value.find(PeerTokenFile::kPeerToken), std::string::npos) << key;
    if (key == kPeerProofKey) proof = value;
  }
  ASSERT_FALSE(proof.empty());
  EXPECT_EQ(reserve("another-id", kPeerProofKey, proof), grpc::StatusCode::UNAUTHENTICATED);
  {
    v1::ReserveTransferRequest r = seen;
    r.set_tenant("bob");  // the same move's proof, for a slot in another tenant
    v1::ReserveTransferResponse resp;
    grpc::ClientContext c;
    c.AddMetadata(kPeerProofKey, proof);
    EXPECT_EQ(stub->ReserveTransfer(&c, r, &resp).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  for (const char* method : {"commit", "abort", "acknowledge"}) {
    grpc::ClientContext c;
    c.AddMetadata("authorization", absl::StrCat("Bearer ", kAlice));
    grpc::Status st;
    if (method[0] == 'c') {
      v1::CommitTransferRequest r;
      r.set_transfer_id("x");
      v1::CommitTransferResponse resp;
      st = stub->CommitTransfer(&c, r, &resp);
    } else if (method[1] == 'b') {
      v1::AbortTransferRequest r;
      r.set_transfer_id("x");
      v1::AbortTransferResponse resp;
      st = stub->AbortTransfer(&c, r, &resp);
    } else {
      v1::AcknowledgeTransferRequest r;
      r.set_transfer_id("x");
      v1::AcknowledgeTransferResponse resp;
      st = stub->AcknowledgeTransfer(&c, r, &resp);
    }
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << method;
  }
  auto metrics = HttpGet((*b)->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(Sample(*metrics, "replayssm_slots{state=\"live\"}"), 1)
      << "only the real transfer's slot";
  // Refused callers are auth failures of their own reasons, never transfer failures (whose
  // alert points at the data path).
  EXPECT_EQ(Sample(*metrics, "replayssm_auth_failures_total{reason=\"peer_missing\"}"), 12)
      << "8 anonymous, a client's token on 4 methods";
  EXPECT_EQ(Sample(*metrics, "replayssm_auth_failures_total{reason=\"peer_unknown\"}"), 4)
      << "another token's proof, the raw token, the proof for another id and tenant";
  EXPECT_EQ(Sample(*metrics,
                   "replayssm_transfer_failures_total{reason=\"UNAUTHENTICATED\",role=\"peer\"}"),
            0);
  // The real peer on the same host is not locked out.
  auto next = alice_a->Allocate();
  ASSERT_TRUE(next.ok());
  auto moved = alice_a->TransferSlot(next->slot(), (*b)->grpc_address(), false);
  EXPECT_TRUE(moved.ok()) << moved.status();
}

TEST(TenantTransfers, AReceiverRefusesASlotOfATenantItDoesNotKnow) {
  TokenFile sender_tokens(Tokens());
  TokenFile receiver_tokens(absl::StrCat("bob ", kBob, "\n"));
  PeerTokenFile peer;
  auto a = ServerProcess::Start({sender_tokens.Flag(), peer.Flag()});
  auto b = ServerProcess::Start({receiver_tokens.Flag(), peer.Flag()});
  auto open = ServerProcess::Start({peer.Flag()});  // no tenants at all
  ASSERT_TRUE(a.ok() && b.ok() && open.ok());
  auto alice_a = As(**a, kAlice);
  auto slot = alice_a->Allocate();
  ASSERT_TRUE(slot.ok());
  auto refused = alice_a->TransferSlot(slot->slot(), (*b)->grpc_address(), false);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_NE(refused.status().message().find("tenant"), std::string::npos) << refused.status();
  EXPECT_TRUE(alice_a->GetSlot(slot->slot()).ok()) << "the source stays";
  // A sender without tenants names none: a receiver with tenants cannot place the slot.
  auto anon = Client::Connect((*open)->grpc_address());
  auto s = anon->Allocate();
  ASSERT_TRUE(s.ok());
  auto none = anon->TransferSlot(s->slot(), (*b)->grpc_address(), false);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kPermissionDenied) << none.status();
  // A receiver without tenants takes every slot (its one tenant).
  auto taken = alice_a->TransferSlot(slot->slot(), (*open)->grpc_address(), false);
  ASSERT_TRUE(taken.ok()) << taken.status();
  EXPECT_TRUE(anon->GetSlot(taken->remote_slot()).ok());
}

}  // namespace
}  // namespace replayssm::testing
