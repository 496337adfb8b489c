// Every bad-input class gets its gRPC code, names the field, and changes nothing: the test
// slot's cursors (seq_len, write_pos 2, drafts waiting) are compared before and after without
// folding it (an export would: the bad calls used to meet a folded slot, an outside review),
// and its next decode still matches the CPU reference (its checkpoint and ring intact).
#include <algorithm>
#include <functional>
#include <future>
#include <string>
#include <vector>

#include "grpcpp/generic/generic_stub.h"
#include "absl/strings/match.h"
#include "service_fixture.h"

namespace replayssm::testing {
namespace {

constexpr int kMaxBatch = 4;

class ErrorsTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--max-batch=4", "--max-message-bytes=1M",
            "--memory-budget=725000"};  // ~8 tiny-gdn slots
  }

  void SetUp() override {
    ServiceTest::SetUp();
    if (HasFatalFailure()) return;
    stub_ = v1::ReplaySsm::NewStub(
        grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
    slot_ = NewSlot();
    seq_ = *ref_->NewSequence();
    Prefill(slot_, seq_, 5);
    DecodeStep({slot_}, {seq_});
    DecodeStep({slot_}, {seq_});
  }

  // Sends a decode through the raw stub (so that no field is filled in for us).
  grpc::Status RawDecode(const v1::DecodeRequest& req) {
    grpc::ClientContext ctx;
    v1::DecodeResponse resp;
    return stub_->Decode(&ctx, req, &resp);
  }

  v1::DecodeRequest Valid(const std::vector<uint64_t>& slots) {
    v1::DecodeRequest req = DecodeRequest(slots, Layers(static_cast<int64_t>(slots.size())));
    req.set_request_id(client::NewRequestId());
    return req;
  }

  std::unique_ptr<v1::ReplaySsm::Stub> stub_;
  uint64_t slot_ = 0;
  int32_t seq_ = -1;
};

struct BadDecode {
  const char* name;
  std::function<void(v1::DecodeRequest&, uint64_t slot)> mutate;
  grpc::StatusCode code;
  const char* field;  // must appear in the message
  int rows = 1;       // rows of the valid request before the mutation (all the test slot)
};

TEST_F(ErrorsTest, EveryBadDecodeFieldReturnsItsCodeAndChangesNothing) {
  const int last = num_layers() - 1;
  const uint64_t freed = NewSlot();
  ASSERT_TRUE(client_->Free(freed).ok());
  const std::vector<BadDecode> cases = {
      {"wrong dtype",
       [](auto& r, auto) { r.mutable_layers(0)->mutable_mixed_qkv()->set_dtype(v1::DTYPE_BF16); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[0].mixed_qkv.dtype"},
      {"unspecified dtype",
       [](auto& r, auto) { r.mutable_layers(1)->mutable_b()->set_dtype(v1::DTYPE_UNSPECIFIED); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[1].b.dtype"},
      {"wrong shape",
       [](auto& r, auto) {
         auto* a = r.mutable_layers(1)->mutable_a();
         a->set_shape(1, a->shape(1) + 1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[1].a.shape"},
      {"short data",
       [](auto& r, auto) { r.mutable_layers(0)->mutable_b()->mutable_data()->resize(2); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers[0].b.data"},
      {"layer index", [last](auto& r, auto) { r.mutable_layers(last)->set_layer(last + 5); },
       grpc::StatusCode::INVALID_ARGUMENT, "layer"},
      {"missing layer", [](auto& r, auto) { r.mutable_layers()->RemoveLast(); },
       grpc::StatusCode::INVALID_ARGUMENT, "layers"},
      {"batch too large",
       [](auto& r, auto) {
         for (int i = 0; i < kMaxBatch; ++i) r.add_rows();
       },
       grpc::StatusCode::INVALID_ARGUMENT, "rows"},
      {"duplicate slot", [](auto&, auto) {}, grpc::StatusCode::INVALID_ARGUMENT, "rows[1].slot", 2},
      {"empty request id", [](auto& r, auto) { r.clear_request_id(); },
       grpc::StatusCode::INVALID_ARGUMENT, "request_id"},
      {"no rows", [](auto& r, auto) { r.clear_rows(); }, grpc::StatusCode::INVALID_ARGUMENT,
       "rows"},
      {"unknown slot",
       [](auto& r, auto s) { r.mutable_rows(0)->set_slot(s ^ (uint64_t{0x5a5a} << 40)); },
       grpc::StatusCode::NOT_FOUND, "slot"},
      {"freed slot", [freed](auto& r, auto) { r.mutable_rows(0)->set_slot(freed); },
       grpc::StatusCode::NOT_FOUND, "slot"},
  };
  const std::string before = Cursors(slot_);
  for (const BadDecode& c : cases) {
    v1::DecodeRequest req = Valid(std::vector<uint64_t>(c.rows, slot_));
    c.mutate(req, slot_);
    const grpc::Status s = RawDecode(req);
    EXPECT_EQ(s.error_code(), c.code) << c.name << ": " << s.error_message();
    EXPECT_NE(s.error_message().find(c.field), std::string::npos)
        << c.name << ": " << s.error_message();
    EXPECT_EQ(Cursors(slot_), before) << c.name << " changed the slot";
  }
  DecodeStep({slot_}, {seq_});  // the slot still works and still matches the reference
}

TEST_F(ErrorsTest, AForeignSlotFromAnotherServerIsNotFound) {
  auto other = ServerProcess::Start({});
  ASSERT_TRUE(other.ok()) << other.status();
  auto other_client = Client::Connect((*other)->grpc_address());
  auto foreign = other_client->Allocate();
  ASSERT_TRUE(foreign.ok());
  const std::string before = Cursors(slot_);
  v1::DecodeRequest req = Valid({slot_, foreign->slot()});
  EXPECT_EQ(RawDecode(req).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(client_->Free(foreign->slot()).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Cursors(slot_), before);
  DecodeStep({slot_}, {seq_});  // the state intact: the next decode matches the reference
}

// Handles carry 64 random bits: one slot's handle says nothing of another's (the generation-1
// slots used to share their high half, so a second client found and freed the first's
// slots), and an error names the handle the caller sent, never the server's internal id.
TEST_F(ErrorsTest, NeighbouringAndFreedHandlesAreNotFoundAndErrorsEchoTheCallersHandle) {
  std::vector<uint64_t> live = {slot_, NewSlot(), NewSlot(), NewSlot()};
  int shared_high = 0;
  for (size_t i = 1; i < live.size(); ++i) shared_high += (live[i] >> 32) == (slot_ >> 32);
  EXPECT_LT(shared_high, 3) << "every handle shares slot_'s high half";
  const uint64_t freed = NewSlot();
  ASSERT_TRUE(client_->Free(freed).ok());
  std::vector<uint64_t> guesses = {freed,
                                   slot_ + 1,
                                   slot_ - 1,
                                   slot_ ^ (uint64_t{1} << 32),
                                   slot_ + (uint64_t{1} << 32),
                                   (uint64_t{1} << 32) | 1};
  for (uint64_t index = 0; index < 16; ++index) {  // slot_'s high half, every low index
    guesses.push_back((slot_ & ~uint64_t{0xffffffff}) | index);
  }
  const std::string before = Cursors(slot_);
  for (uint64_t guess : guesses) {
    if (std::find(live.begin(), live.end(), guess) != live.end()) continue;
    const std::string handle = std::to_string(guess);
    const absl::Status freed_status = client_->Free(guess);
    EXPECT_EQ(freed_status.code(), absl::StatusCode::kNotFound) << handle;
    EXPECT_NE(freed_status.message().find(handle), std::string::npos) << freed_status;
    EXPECT_EQ(freed_status.message().find("0x"), std::string::npos) << freed_status;
    EXPECT_EQ(client_->GetSlot(guess).status().code(), absl::StatusCode::kNotFound) << handle;
    const grpc::Status decode = RawDecode(Valid({guess}));
    EXPECT_EQ(decode.error_code(), grpc::StatusCode::NOT_FOUND) << handle;
    EXPECT_NE(decode.error_message().find("rows[0].slot: expected a live slot id, got " + handle),
              std::string::npos)
        << decode.error_message();
  }
  for (uint64_t h : live) EXPECT_TRUE(client_->GetSlot(h).ok()) << "a guess freed " << h;
  EXPECT_EQ(Cursors(slot_), before);
  // Handle 0 (padding) names no slot; the error says it got 0 (an outside review: it said
  // "got (a slot without a handle)", nothing the caller sent).
  for (const absl::Status& zero : {client_->Free(0), client_->GetSlot(0).status()}) {
    EXPECT_EQ(zero.code(), absl::StatusCode::kNotFound) << zero;
    EXPECT_NE(zero.message().find("slot: expected a live slot id, got 0, the padding handle"),
              std::string::npos)
        << zero;
  }
  // A busy slot's error names its handle too.
  v1::DecodeRequest twice = Valid({slot_, slot_});
  const grpc::Status dup = RawDecode(twice);
  EXPECT_EQ(dup.error_message().find("0x"), std::string::npos) << dup.error_message();
  DecodeStep({slot_}, {seq_});  // the state intact: the next decode matches the reference
}

// gRPC answers a unary request that does not parse with UNIMPLEMENTED and no text, before any
// handler runs; the server's interceptor makes it INVALID_ARGUMENT naming the method, counted.
TEST_F(ErrorsTest, AnUnparseableRequestIsInvalidArgumentWithTextAndCounted) {
  grpc::GenericStub generic(
      grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  const auto call = [&](const std::string& method, const std::string& bytes) {
    grpc::ClientContext context;
    grpc::Slice slice(bytes);
    grpc::ByteBuffer request(&slice, 1), response;
    std::promise<grpc::Status> done;
    generic.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                      [&done](grpc::Status s) { done.set_value(std::move(s)); });
    return done.get_future().get();
  };
  const std::string truncated(
      "\x0a\x10"
      "abc",
      5);  // field 1: 16 bytes announced, 3 sent
  const std::string before = Cursors(slot_);
  const grpc::Status allocate = call("/replayssm.v1.ReplaySsm/Allocate", truncated);
  EXPECT_EQ(allocate.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(allocate.error_message(),
            "request: expected a serialized replayssm.v1 Allocate request, got bytes that do not "
            "parse");
  const grpc::Status free = call("/replayssm.v1.ReplaySsm/Free", std::string("\xff", 1));
  EXPECT_EQ(free.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << free.error_message();
  EXPECT_EQ(call("/replayssm.v1.SlotTransfer/TransferSlot", truncated).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  // A method that does not exist stays UNIMPLEMENTED.
  EXPECT_EQ(call("/replayssm.v1.ReplaySsm/NoSuchMethod", "").error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  EXPECT_EQ(Cursors(slot_), before);
  auto metrics = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(Sample(*metrics, R"(replayssm_rpcs_total{code="INVALID_ARGUMENT",method="Allocate"})"),
            1);
  EXPECT_EQ(Sample(*metrics, R"(replayssm_rpcs_total{code="INVALID_ARGUMENT",method="Free"})"), 1);
  DecodeStep({slot_}, {seq_});  // the state intact: the next decode matches the reference
}

TEST_F(ErrorsTest, BadPrefillImportVerifyAndAcceptChangeNothing) {
  const std::string before = Cursors(slot_);
  v1::PrefillRequest prefill;
  prefill.set_slot(slot_);
  prefill.add_tokens(1);
  prefill.add_tokens(2);
  for (const auto& l : Layers(3)) *prefill.add_layers() = l;  // 3 tokens of inputs for 2
  auto p = client_->Prefill(prefill);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(p.status().message().find("layers[0].mixed_qkv.shape"), std::string::npos)
      << p.status();
  prefill.clear_tokens();
  EXPECT_EQ(client_->Prefill(prefill).status().code(), absl::StatusCode::kInvalidArgument);

  auto exported = client_->Export(NewSlot());  // the shapes of a state; slot_ stays unfolded
  ASSERT_TRUE(exported.ok());
  v1::ImportRequest imp;
  imp.set_slot(slot_);
  *imp.mutable_checkpoints() = exported->checkpoints();
  *imp.mutable_conv_windows() = exported->conv_windows();
  imp.mutable_checkpoints(0)->set_shape(0, 1);
  auto i = client_->Import(imp);
  EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(i.status().message().find("checkpoints[0].shape"), std::string::npos) << i.status();
  imp.mutable_checkpoints()->RemoveLast();
  EXPECT_EQ(client_->Import(imp).status().code(), absl::StatusCode::kInvalidArgument);

  v1::VerifyRequest verify;
  verify.add_slots(slot_);
  verify.set_num_draft(model().ring_len() + 1);
  for (int d = 0; d < model().ring_len() + 1; ++d) verify.add_draft_tokens(d);
  for (const auto& l : Layers(model().ring_len() + 1)) *verify.add_layers() = l;
  auto v = client_->Verify(verify);
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(v.status().message().find("num_draft"), std::string::npos) << v.status();

  auto accept = client_->Accept(slot_, 1);
  EXPECT_EQ(accept.status().code(), absl::StatusCode::kInvalidArgument);
  // Issue 31 §7: the error names the request's field (it said `n`).
  EXPECT_TRUE(absl::StartsWith(accept.status().message(), "num_accepted: expected 0 to 0"))
      << accept.status();
  EXPECT_EQ(Cursors(slot_), before);
  DecodeStep({slot_}, {seq_});  // the state intact: the next decode matches the reference
}

TEST_F(ErrorsTest, ExportWithUnacceptedDraftsIsRefusedAsAnInvariant) {
  v1::VerifyRequest verify;
  verify.add_slots(slot_);
  verify.set_num_draft(2);
  verify.add_draft_tokens(1);
  verify.add_draft_tokens(2);
  for (const auto& l : Layers(2)) *verify.add_layers() = l;
  ASSERT_TRUE(client_->Verify(verify).ok());
  const int64_t refusals = client_->Stats()->invariant_refusals();
  EXPECT_EQ(client_->Export(slot_).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(client_->Donate(slot_).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_GE(client_->Stats()->invariant_refusals(), refusals + 1);
  ASSERT_TRUE(client_->Accept(slot_, 0).ok());  // reject all: back to where it was
  DecodeStep({slot_}, {seq_});
}

TEST_F(ErrorsTest, ASlotInAnOpenForwardIsRefusedAndAnAbandonedForwardChangesNothing) {
  const std::string before = Cursors(slot_);
  auto stream = client_->OpenStream();
  std::vector<v1::DecodeRow> rows(1);
  rows[0].set_slot(slot_);
  ASSERT_TRUE(stream->Begin(rows).ok());
  auto layers = Layers(1);
  ASSERT_TRUE(stream->RunLayer(layers[0]).ok());
  EXPECT_EQ(client_->Decode(DecodeRequest({slot_}, Layers(1))).status().code(),
            absl::StatusCode::kFailedPrecondition);
  auto early = stream->Commit();  // not every layer ran
  EXPECT_EQ(early.status().code(), absl::StatusCode::kFailedPrecondition);
  stream->Finish().IgnoreError();  // the server abandoned the forward
  EXPECT_EQ(Cursors(slot_), before);
  DecodeStep({slot_}, {seq_});
}

TEST_F(ErrorsTest, ClosingAStreamMidForwardAbandonsItAndChangesNothing) {
  const std::string before = Cursors(slot_);
  const int64_t abandoned = client_->Stats()->forwards_abandoned();
  auto stream = client_->OpenStream();
  std::vector<v1::DecodeRow> rows(1);
  rows[0].set_slot(slot_);
  ASSERT_TRUE(stream->Begin(rows).ok());
  auto layers = Layers(1);
  for (int l = 0; l < num_layers(); ++l) ASSERT_TRUE(stream->RunLayer(layers[l]).ok());
  EXPECT_TRUE(stream->Finish().ok());  // every layer ran, but no commit
  EXPECT_EQ(Cursors(slot_), before);
  EXPECT_EQ(client_->Stats()->forwards_abandoned(), abandoned + 1);
  DecodeStep({slot_}, {seq_});
}

TEST_F(ErrorsTest, ALayerTwiceInOneForwardIsAFailedPrecondition) {
  auto stream = client_->OpenStream();
  std::vector<v1::DecodeRow> rows(1);
  rows[0].set_slot(slot_);
  ASSERT_TRUE(stream->Begin(rows).ok());
  auto layers = Layers(1);
  ASSERT_TRUE(stream->RunLayer(layers[0]).ok());
  auto again = stream->RunLayer(layers[0]);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
}

TEST_F(ErrorsTest, StreamLayerWithoutBeginIsAFailedPrecondition) {
  auto stream = client_->OpenStream();
  auto out = stream->RunLayer(Layers(1)[0]);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kFailedPrecondition) << out.status();
}

// A bad message inside a prefill or verify stream forward, after its first layer ran.
struct BadLayerMessage {
  const char* name;
  std::function<void(v1::DecodeStreamRequest&)> mutate;  // of a valid layer 1 message
  grpc::StatusCode code;
  const char* field;
};

TEST_F(ErrorsTest, BadLayerMessagesOfPrefillAndVerifyForwardsChangeNothing) {
  const int last = num_layers() - 1;
  const std::vector<BadLayerMessage> cases = {
      {"wrong layer index", [last](auto& r) { r.mutable_layer()->set_layer(last + 1); },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.layer"},
      {"layer twice", [](auto& r) { r.mutable_layer()->set_layer(0); },
       grpc::StatusCode::FAILED_PRECONDITION, "layer.layer"},
      {"wrong token count",
       [](auto& r) {
         auto* qkv = r.mutable_layer()->mutable_mixed_qkv();
         qkv->set_shape(0, qkv->shape(0) + 1);
       },
       grpc::StatusCode::INVALID_ARGUMENT, "layer.mixed_qkv.shape"},
      {"commit before every layer", [](auto& r) { r.mutable_commit(); },
       grpc::StatusCode::FAILED_PRECONDITION, "commit"},
      {"a second begin", [this](auto& r) { r.mutable_verify_begin()->add_slots(slot_); },
       grpc::StatusCode::FAILED_PRECONDITION, "begin"},
  };
  const std::string before = Cursors(slot_);
  const int64_t free_before = client_->Stats()->slots_free();
  for (bool prefill : {true, false}) {
    for (const BadLayerMessage& c : cases) {
      SCOPED_TRACE(std::string(prefill ? "prefill: " : "verify: ") + c.name);
      grpc::ClientContext ctx;
      auto stream = stub_->DecodeStream(&ctx);
      v1::DecodeStreamRequest begin;
      if (prefill) {
        v1::PrefillRow* row = begin.mutable_prefill_begin()->add_rows();
        row->set_slot(slot_);
        for (int i = 0; i < 3; ++i) row->add_tokens(i);
        begin.mutable_prefill_begin()->set_request_id(client::NewRequestId());
      } else {
        begin.mutable_verify_begin()->add_slots(slot_);
        begin.mutable_verify_begin()->set_num_draft(3);
        for (int i = 0; i < 3; ++i) begin.mutable_verify_begin()->add_draft_tokens(i);
        begin.mutable_verify_begin()->set_request_id(client::NewRequestId());
      }
      const auto layers = Layers(3);
      v1::DecodeStreamRequest first, bad;
      *first.mutable_layer() = layers[0];
      *bad.mutable_layer() = layers[1];
      c.mutate(bad);
      v1::DecodeStreamResponse resp;
      ASSERT_TRUE(stream->Write(begin) && stream->Read(&resp));
      EXPECT_EQ(resp.begun().tokens(), 3);
      ASSERT_TRUE(stream->Write(first) && stream->Read(&resp));
      EXPECT_EQ(resp.layer().out().shape(0), 3);
      stream->Write(bad);
      EXPECT_FALSE(stream->Read(&resp)) << "the server ends the stream";
      const grpc::Status s = stream->Finish();
      EXPECT_EQ(s.error_code(), c.code) << s.error_message();
      EXPECT_NE(s.error_message().find(c.field), std::string::npos) << s.error_message();
      EXPECT_EQ(Cursors(slot_), before);
      EXPECT_EQ(client_->Stats()->slots_free(), free_before) << "the spare slot came back";
    }
  }
  DecodeStep({slot_}, {seq_});  // the slot still works and still matches the reference
}

TEST_F(ErrorsTest, BadPrefillAndVerifyBeginsNameTheirFieldAndChangeNothing) {
  const uint64_t freed = NewSlot();
  ASSERT_TRUE(client_->Free(freed).ok());
  const std::string before = Cursors(slot_);
  auto prefill = [&](const std::vector<std::pair<uint64_t, int>>& rows) {
    std::vector<v1::PrefillRow> r;
    for (auto [slot, n] : rows)
      r.push_back(client::MakePrefillRow(slot, std::vector<int32_t>(n, 1)));
    return client_->OpenStream()->BeginPrefill(r).status();
  };
  auto verify = [&](const std::vector<uint64_t>& slots, int t, int drafts) {
    return client_->OpenStream()->BeginVerify(slots, t, std::vector<int32_t>(drafts, 1)).status();
  };
  struct Case {
    const char* name;
    absl::Status status;
    absl::StatusCode code;
    const char* field;
  };
  const std::vector<Case> cases = {
      {"no prefill rows", prefill({}), absl::StatusCode::kInvalidArgument, "rows"},
      {"a row without tokens", prefill({{slot_, 2}, {NewSlot(), 0}}),
       absl::StatusCode::kInvalidArgument, "rows[1].tokens"},
      {"padding row", prefill({{0, 2}}), absl::StatusCode::kInvalidArgument, "rows[0].slot"},
      {"duplicate row", prefill({{slot_, 1}, {slot_, 1}}), absl::StatusCode::kInvalidArgument,
       "rows[1].slot"},
      {"too many rows", prefill(std::vector<std::pair<uint64_t, int>>(kMaxBatch + 1, {slot_, 1})),
       absl::StatusCode::kInvalidArgument, "rows"},
      {"freed slot", prefill({{slot_, 1}, {freed, 1}}), absl::StatusCode::kNotFound,
       "rows[1].slot"},
      {"num_draft beyond the ring", verify({slot_}, model().ring_len() + 1, model().ring_len() + 1),
       absl::StatusCode::kInvalidArgument, "num_draft"},
      {"draft count", verify({slot_}, 2, 3), absl::StatusCode::kInvalidArgument, "draft_tokens"},
      {"verify of slot 0", verify({0}, 1, 1), absl::StatusCode::kInvalidArgument, "slots[0]"},
      {"verify of a freed slot", verify({slot_, freed}, 1, 2), absl::StatusCode::kNotFound,
       "slots[1]"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(c.status.code(), c.code) << c.name << ": " << c.status;
    EXPECT_NE(c.status.message().find(c.field), std::string::npos) << c.name << ": " << c.status;
  }
  EXPECT_EQ(Cursors(slot_), before);
  EXPECT_EQ(client_->Stats()->open_forwards(), 0);
  DecodeStep({slot_}, {seq_});  // the state intact: the next decode matches the reference
}

TEST_F(ErrorsTest, AllocationBeyondCapacityIsResourceExhaustedAndFreeingMakesRoom) {
  std::vector<uint64_t> slots;
  absl::Status last;
  for (int i = 0; i < 64; ++i) {
    auto a = client_->Allocate();
    if (!a.ok()) {
      last = a.status();
      break;
    }
    slots.push_back(a->slot());
  }
  EXPECT_EQ(last.code(), absl::StatusCode::kResourceExhausted) << last;
  EXPECT_EQ(static_cast<int64_t>(slots.size()) + 1, info_.capacity_slots());  // +1: slot_
  ASSERT_FALSE(slots.empty());
  ASSERT_TRUE(client_->Free(slots.back()).ok());
  EXPECT_TRUE(client_->Allocate().ok());
}

TEST_F(ErrorsTest, AMessageOverTheLimitIsResourceExhausted) {
  const std::string before = Cursors(slot_);
  v1::PrefillRequest prefill;
  prefill.set_slot(slot_);
  const int n = 400;  // ~4 KiB per token over all layers of tiny-gdn: > 1 MiB
  for (int i = 0; i < n; ++i) prefill.add_tokens(i);
  for (const auto& l : Layers(n)) *prefill.add_layers() = l;
  ASSERT_GT(prefill.ByteSizeLong(), size_t{1} << 20);
  EXPECT_EQ(client_->Prefill(prefill).status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Cursors(slot_), before);
  DecodeStep({slot_}, {seq_});  // the state intact: the next decode matches the reference
}

}  // namespace
}  // namespace replayssm::testing
