// Peer proofs both ways (docs/transfer.md, "Peer proofs"): with --peer-token, the replies a
// sender acts on carry the receiver's proof over their fields and the sender's nonce, and the
// requests a receiver acts on are proven with their content. An outside review showed what
// each closes, through a fake peer that a client names as peer_address (any address, without
// --transfer-peers): a reservation whose remote_addr it shifted made the sender's put a write
// into the sender's own memory (a crash, or another tenant's slot overwritten); a made-up
// commit or decision freed a source nobody held; a commit whose tokens it changed landed with
// them. Here an in-test proxy (transfer_proxy.h) plays that peer between two servers.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "peer_proofs.h"
#include "service_fixture.h"
#include "transfer_proxy.h"

namespace replayssm::testing {
namespace {

using Action = TransferProxy::Action;

class PeerProofTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", peer_.Flag()};
  }
  void SetUp() override {
    ServiceTest::SetUp();
    auto b = ServerProcess::Start({peer_.Flag()});
    ASSERT_TRUE(b.ok()) << b.status();
    b_ = *std::move(b);
    cb_ = Client::Connect(b_->grpc_address());
    proxy_ = TransferProxy::Start(b_->grpc_address());
    ASSERT_NE(proxy_, nullptr);
  }
  // A slot with a prefill and a decode step, and its state as Export gives it.
  uint64_t PreparedSlot(std::string* state) {
    const uint64_t s = NewSlot();
    const int32_t seq = *ref_->NewSequence();
    Prefill(s, seq, 5);
    DecodeStep({s}, {seq});
    auto e = client_->Export(s);
    EXPECT_TRUE(e.ok()) << e.status();
    if (e.ok()) *state = e->SerializeAsString();
    return s;
  }
  // The source is as it was, and usable: exported the same, then decoded.
  void ExpectSourceIntact(uint64_t s, const std::string& state) {
    auto e = client_->Export(s);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->SerializeAsString(), state) << "the source's state";
    EXPECT_TRUE(client_->Decode(DecodeRequest({s}, Layers(1))).ok());
  }
  int LiveSlotsOnB() {
    auto listed = cb_->ListSlots();
    EXPECT_TRUE(listed.ok()) << listed.status();
    return listed.ok() ? listed->slots_size() : -1;
  }

  PeerTokenFile peer_;
  std::unique_ptr<ServerProcess> b_;
  std::unique_ptr<Client> cb_;
  std::unique_ptr<TransferProxy> proxy_;
};

// The review's crash: a reservation whose remote_addr was moved 64 GiB on. With the receiver
// on the same host UCX puts through shared memory, a copy in the sender's own process: the
// sender died of SIGSEGV in the put (and a chosen offset overwrote another slot). Now the
// sender refuses the reservation before any byte moves.
TEST_F(PeerProofTest, AShiftedReservationIsNeverWrittenTo) {
  std::string state;
  const uint64_t s = PreparedSlot(&state);
  proxy_->set_hooks({.reserve_reply = [](v1::ReserveTransferResponse& r) {
    r.set_remote_addr(r.remote_addr() + (uint64_t{1} << 36));
  }});
  auto moved = client_->TransferSlot(s, proxy_->address(), false, "shifted");
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kUnauthenticated) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(),
                                "peer ReserveTransfer: expected its reply to carry the receiver's "
                                "proof of the cluster's peer token"))
      << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(), "one that does not match"))
      << moved.status();
  ExpectSourceIntact(s, state);
  EXPECT_EQ(LiveSlotsOnB(), 0);
  EXPECT_GE(proxy_->aborts(), 1) << "the reservation was given back";
  // An unproven reply (a peer without the token) is refused the same way.
  proxy_->set_hooks({.reserve_reply = [](v1::ReserveTransferResponse& r) { r.clear_proof(); }});
  auto unproven = client_->TransferSlot(s, proxy_->address(), false, "unproven");
  EXPECT_EQ(unproven.status().code(), absl::StatusCode::kUnauthenticated) << unproven.status();
  EXPECT_TRUE(absl::StrContains(unproven.status().message(), "got none")) << unproven.status();
  // The real reply, passed on unchanged, moves the slot.
  proxy_->set_hooks({});
  state = client_->Export(s)->SerializeAsString();
  auto real = client_->TransferSlot(s, proxy_->address(), false, "real");
  ASSERT_TRUE(real.ok()) << real.status();
  EXPECT_EQ(cb_->Export(real->remote_slot())->SerializeAsString(), state);
  EXPECT_EQ(client_->GetSlot(s).status().code(), absl::StatusCode::kNotFound);
}

// A "committed" the receiver never said: the sender freed its source, and the state was gone
// from both servers. Now the outcome stays open and AbortTransfer, answered by the receiver,
// decides it: aborted, the source kept.
TEST_F(PeerProofTest, AMadeUpCommitDoesNotFreeTheSource) {
  std::string state;
  const uint64_t s = PreparedSlot(&state);
  proxy_->set_hooks({.commit = [](v1::CommitTransferRequest&) { return Action::kAnswer; },
                     .commit_reply = [](v1::CommitTransferResponse& r) { r.set_slot(12345); }});
  auto moved = client_->TransferSlot(s, proxy_->address(), false, "made-up-commit");
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kUnauthenticated) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(),
                                "peer CommitTransfer: expected its "
                                "reply to carry the receiver's proof"))
      << moved.status();
  EXPECT_GE(proxy_->aborts(), 1) << "the receiver was asked, and said: aborted";
  ExpectSourceIntact(s, state);
  EXPECT_EQ(LiveSlotsOnB(), 0);
}

// A made-up decision ("committed" from AbortTransfer after a commit went unanswered) freed
// the source the same way. Now it is no decision: the move is in doubt, the source locked,
// and a retry that reaches the receiver learns the truth (aborted) and moves the slot.
TEST_F(PeerProofTest, AMadeUpDecisionIsNoDecision) {
  std::string state;
  const uint64_t s = PreparedSlot(&state);
  proxy_->set_hooks({.commit = [](v1::CommitTransferRequest&) { return Action::kRefuse; },
                     .abort = [](v1::AbortTransferRequest&) { return Action::kAnswer; },
                     .abort_reply =
                         [](v1::AbortTransferResponse& r) {
                           r.set_committed(true);
                           r.set_slot(777);
                           r.set_seq_len(6);
                         }});
  auto moved = client_->TransferSlot(s, proxy_->address(), false, "made-up-decision");
  EXPECT_EQ(moved.status().code(), absl::StatusCode::kUnavailable) << moved.status();
  EXPECT_TRUE(absl::StrContains(moved.status().message(), "AbortTransfer: expected its reply"))
      << moved.status();
  EXPECT_TRUE(client_->GetSlot(s).ok()) << "kept, locked while in doubt";
  EXPECT_EQ(client_->Export(s).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(LiveSlotsOnB(), 0);
  proxy_->set_hooks({});
  auto retried = client_->TransferSlot(s, proxy_->address(), false, "made-up-decision");
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(cb_->Export(retried->remote_slot())->SerializeAsString(), state);
  EXPECT_EQ(client_->GetSlot(s).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(LiveSlotsOnB(), 1) << "exactly one copy";
}

// A commit whose tokens were changed on the way (the review committed [7, 7, ...] for the
// slot's history: a prefix key its state does not belong to): the receiver refuses it, the
// sender's abort learns nothing committed, and the source stays.
TEST_F(PeerProofTest, AChangedCommitIsRefused) {
  std::string state;
  const uint64_t s = PreparedSlot(&state);
  proxy_->set_hooks({.commit = [](v1::CommitTransferRequest& r) {
    for (int i = 0; i < r.tokens_size(); ++i) r.set_tokens(i, 7);
    return Action::kForward;
  }});
  auto moved = client_->TransferSlot(s, proxy_->address(), false, "changed-commit");
  EXPECT_FALSE(moved.ok());
  ExpectSourceIntact(s, state);
  EXPECT_EQ(LiveSlotsOnB(), 0);
  EXPECT_EQ(Sample(*HttpGet(b_->metrics_address(), "/metrics"),
                   "replayssm_auth_failures_total{reason=\"peer_unknown\"}"),
            1);
}

// A reservation request replayed with other content (the review reserved again with another
// seq_len and budget from one captured proof), or proven with the old v1 form: refused.
TEST_F(PeerProofTest, AProofOpensItsRequestWithItsContentOnly) {
  v1::ReserveTransferRequest seen;
  std::string proof;
  proxy_->set_hooks({.reserve = [&](v1::ReserveTransferRequest& r) {
    seen = r;
    for (const auto& [key, value] : proxy_->reserve_metadata()) {
      if (key == kPeerProofKey) proof = value;
    }
    return Action::kRefuse;
  }});
  std::string state;
  const uint64_t s = PreparedSlot(&state);
  EXPECT_FALSE(client_->TransferSlot(s, proxy_->address(), false, "captured").ok());
  ASSERT_FALSE(proof.empty());
  EXPECT_EQ(seen.nonce().size(), 32u) << "a nonce of the sender's";
  EXPECT_EQ(proof, PeerProof(PeerTokenFile::kPeerToken, "ReserveTransfer", seen.transfer_id(),
                             seen.tenant(), ReserveContent(seen)))
      << "the proof is the documented one";
  auto stub = v1::SlotTransfer::NewStub(
      grpc::CreateChannel(b_->grpc_address(), grpc::InsecureChannelCredentials()));
  auto reserve = [&](const v1::ReserveTransferRequest& r, const std::string& with) {
    v1::ReserveTransferResponse resp;
    grpc::ClientContext c;
    c.AddMetadata(kPeerProofKey, with);
    return stub->ReserveTransfer(&c, r, &resp);
  };
  for (auto edit : std::vector<std::function<void(v1::ReserveTransferRequest&)>>{
           [](v1::ReserveTransferRequest& r) { r.set_seq_len(r.seq_len() + 1); },
           [](v1::ReserveTransferRequest& r) { r.set_budget_ms(3'600'000); },
           [](v1::ReserveTransferRequest& r) { r.set_nonce(std::string(32, 'x')); },
           [](v1::ReserveTransferRequest& r) { r.mutable_format()->set_tp_size(8); }}) {
    v1::ReserveTransferRequest r = seen;
    edit(r);
    const grpc::Status st = reserve(r, proof);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAUTHENTICATED) << st.error_message();
  }
  v1::ReserveTransferRequest v1_form = seen;
  v1_form.set_transfer_id("v1-form");
  const grpc::Status old = reserve(v1_form, "v1:" + std::string(64, '0'));
  EXPECT_EQ(old.error_code(), grpc::StatusCode::UNAUTHENTICATED);
  EXPECT_TRUE(absl::StrContains(old.error_message(), "a v1 proof (a peer running an older"))
      << old.error_message();
  // Its own content, proven anew with the token (as a real peer would), is taken, and the
  // reply carries the receiver's proof over the reply and this nonce.
  v1::ReserveTransferRequest own = seen;
  own.set_transfer_id("own");
  own.set_nonce("0123456789abcdef-own-nonce");
  v1::ReserveTransferResponse resp;
  grpc::ClientContext c;
  PeerTokenFile::Prove(c, own);
  ASSERT_TRUE(stub->ReserveTransfer(&c, own, &resp).ok());
  EXPECT_EQ(resp.proof(), PeerProof(PeerTokenFile::kPeerToken, "ReserveTransfer/reply", "own",
                                    own.tenant(), ReserveReplyContent(own.nonce(), resp)));
  own.set_transfer_id("short-nonce");
  own.set_nonce("short");
  grpc::ClientContext c2;
  PeerTokenFile::Prove(c2, own);
  const grpc::Status short_nonce = stub->ReserveTransfer(&c2, own, &resp);
  EXPECT_EQ(short_nonce.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(short_nonce.error_message(), "nonce: expected 16..128 bytes"))
      << short_nonce.error_message();
}

// Without --peer-token nothing proves a client-named peer's replies: a server that
// authenticates its clients then dials only the peers of --transfer-peers.
TEST(PeerDialling, AServerWithClientsAuthenticatedAndNoPeerTokenDialsOnlyListedPeers) {
  const std::string tokens = absl::StrCat(::testing::TempDir(), "/replayssm-dial-", getpid());
  std::ofstream(tokens) << "alice alice-token-0123456789abcdef\n";
  chmod(tokens.c_str(), 0600);
  auto open = ServerProcess::Start({"--auth-tokens=" + tokens});
  auto listed = ServerProcess::Start({"--auth-tokens=" + tokens, "--transfer-peers=127.0.0.1:1"});
  ASSERT_TRUE(open.ok() && listed.ok());
  for (auto* server : {open->get(), listed->get()}) {
    auto c = Client::Connect(server->grpc_address());
    c->set_token("alice-token-0123456789abcdef");
    auto slot = c->Allocate();
    ASSERT_TRUE(slot.ok());
    auto moved = c->TransferSlot(slot->slot(), "127.0.0.1:1", false, "dial");
    EXPECT_FALSE(moved.ok());
    const bool refused =
        absl::StrContains(moved.status().message(), "this server dials no peer a client names");
    EXPECT_EQ(refused, server == open->get()) << moved.status();
    if (refused) {
      EXPECT_EQ(moved.status().code(), absl::StatusCode::kPermissionDenied);
      EXPECT_TRUE(absl::StrContains(moved.status().message(), "--peer-token")) << moved.status();
    }
    EXPECT_TRUE(c->GetSlot(slot->slot()).ok());
  }
  std::remove(tokens.c_str());
}

}  // namespace
}  // namespace replayssm::testing
