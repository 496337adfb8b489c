// The finiteness policy (service/finite.h) against the real server: a NaN or infinity in any
// activation of a decode, prefill, verify or stream layer message, or in an imported
// checkpoint, is refused with INVALID_ARGUMENT naming the field and the first bad value, and
// changes nothing — the slot then decodes exactly as its twin that never saw the value.
#include <cstring>
#include <string>
#include <vector>

#include "service_fixture.h"

namespace replayssm::testing {
namespace {

constexpr uint32_t kNaN = 0x7fc00000u, kPlusInf = 0x7f800000u, kMinusInf = 0xff800000u;

// Sets element `index` of an f32 tensor (tiny-gdn's activations and states) to raw `bits`.
void Poison(v1::Tensor* t, int64_t index, uint32_t bits) {
  ASSERT_EQ(t->dtype(), v1::DTYPE_F32);
  ASSERT_LE(static_cast<size_t>(4 * (index + 1)), t->data().size());
  std::memcpy(t->mutable_data()->data() + 4 * index, &bits, 4);
}

v1::Tensor* Field(v1::LayerInput* in, const std::string& field) {
  if (field == "mixed_qkv") return in->mutable_mixed_qkv();
  return field == "a" ? in->mutable_a() : in->mutable_b();
}

class FiniteTest : public ServiceTest {
 protected:
  void SetUp() override {
    ServiceTest::SetUp();
    if (HasFatalFailure()) return;
    stub_ = v1::ReplaySsm::NewStub(
        grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
    const std::vector<v1::LayerInput> prompt = Layers(5);
    victim_ = PrefilledSlot(prompt);  // gets every bad request
    twin_ = PrefilledSlot(prompt);    // never does
    ASSERT_EQ(Observe(victim_), Observe(twin_));
  }

  // A decode of `slots` (one row each, the same token) with `layers`.
  v1::DecodeRequest Decode(const std::vector<uint64_t>& slots,
                           const std::vector<v1::LayerInput>& layers) {
    v1::DecodeRequest req;
    req.set_request_id(client::NewRequestId());
    for (uint64_t s : slots) {
      v1::DecodeRow* row = req.add_rows();
      row->set_slot(s);
      row->set_token_id(42);
    }
    for (const auto& l : layers) *req.add_layers() = l;
    return req;
  }

  // The refusal every bad request must get: INVALID_ARGUMENT with `text` in its message.
  void ExpectRefused(const grpc::Status& s, const std::string& text) {
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_NE(s.error_message().find(text), std::string::npos) << s.error_message();
  }

  // The victim still equals its twin, and both decode the same finite step to the same bytes.
  void ExpectVictimUnchanged() {
    EXPECT_EQ(Observe(victim_), Observe(twin_));
    const std::vector<v1::LayerInput> step = Layers(1);
    auto a = client_->Decode(Decode({victim_}, step));
    auto b = client_->Decode(Decode({twin_}, step));
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_TRUE(b.ok()) << b.status();
    for (int l = 0; l < num_layers(); ++l) {
      EXPECT_EQ(a->layers(l).out().data(), b->layers(l).out().data()) << "layer " << l;
    }
    EXPECT_EQ(Observe(victim_), Observe(twin_));
  }

  std::unique_ptr<v1::ReplaySsm::Stub> stub_;
  uint64_t victim_ = 0, twin_ = 0;
};

TEST_F(FiniteTest, ANonFiniteDecodeActivationIsRefusedNamingFieldRowAndIndex) {
  const uint64_t other = NewSlot();
  for (const std::string field : {"mixed_qkv", "a", "b"}) {
    for (uint32_t bits : {kNaN, kPlusInf, kMinusInf}) {
      SCOPED_TRACE(field + " " + std::to_string(bits));
      // Row 1 (the victim's) of layer 2, column 3: the whole batch is refused.
      v1::DecodeRequest req = Decode({other, victim_}, Layers(2));
      v1::Tensor* t = Field(req.mutable_layers(2), field);
      Poison(t, t->shape(1) + 3, bits);
      grpc::ClientContext ctx;
      v1::DecodeResponse resp;
      const std::string got = bits == kNaN ? "NaN" : bits == kPlusInf ? "+Inf" : "-Inf";
      ExpectRefused(stub_->Decode(&ctx, req, &resp), "layers[2]." + field +
                                                         ": expected finite values, got " + got +
                                                         " at row 1, index [1, 3]");
    }
  }
  ExpectVictimUnchanged();
}

TEST_F(FiniteTest, ANonFinitePrefillActivationIsRefusedAndChangesNothing) {
  for (const std::string field : {"mixed_qkv", "a", "b"}) {
    SCOPED_TRACE(field);
    v1::PrefillRequest req;
    req.set_slot(victim_);
    req.set_request_id(client::NewRequestId());
    for (int i = 0; i < 3; ++i) req.add_tokens(200 + i);
    for (const auto& l : Layers(3)) *req.add_layers() = l;
    v1::Tensor* t = Field(req.mutable_layers(0), field);
    Poison(t, 2 * t->shape(1), kNaN);  // row 2, column 0
    grpc::ClientContext ctx;
    v1::PrefillResponse resp;
    ExpectRefused(
        stub_->Prefill(&ctx, req, &resp),
        "layers[0]." + field + ": expected finite values, got NaN at row 2, index [2, 0]");
  }
  ExpectVictimUnchanged();
}

TEST_F(FiniteTest, ANonFiniteVerifyActivationIsRefusedAndChangesNothing) {
  v1::VerifyRequest req;
  req.add_slots(victim_);
  req.set_num_draft(2);
  req.add_draft_tokens(1);
  req.add_draft_tokens(2);
  req.set_request_id(client::NewRequestId());
  for (const auto& l : Layers(2)) *req.add_layers() = l;
  Poison(req.mutable_layers(3)->mutable_b(), 1, kPlusInf);
  grpc::ClientContext ctx;
  v1::VerifyResponse resp;
  ExpectRefused(stub_->Verify(&ctx, req, &resp),
                "layers[3].b: expected finite values, got +Inf at row 0, index [0, 1]");
  ExpectVictimUnchanged();
}

TEST_F(FiniteTest, ANonFiniteImportedCheckpointIsRefusedAndChangesNothing) {
  auto state = client_->Export(victim_);  // exported by Observe already: no new fold
  ASSERT_TRUE(state.ok()) << state.status();
  v1::ImportRequest req;
  req.set_slot(victim_);
  req.set_request_id(client::NewRequestId());
  for (int i = 0; i < 9; ++i) req.add_tokens(300 + i);
  *req.mutable_checkpoints() = state->checkpoints();
  const v1::Tensor& c = req.checkpoints(1);
  const int64_t v = c.shape(1), k = c.shape(2);
  Poison(req.mutable_checkpoints(1), (2 * v + 5) * k + 7, kMinusInf);  // [2, 5, 7]
  grpc::ClientContext ctx;
  v1::ImportResponse resp;
  ExpectRefused(stub_->Import(&ctx, req, &resp),
                "checkpoints[1]: expected finite values, got -Inf at index [2, 5, 7]");
  ExpectVictimUnchanged();
}

TEST_F(FiniteTest, ANonFiniteStreamLayerIsRefusedAndChangesNothing) {
  grpc::ClientContext ctx;
  auto stream = stub_->DecodeStream(&ctx);
  v1::DecodeStreamRequest begin, first, bad;
  v1::DecodeRow* row = begin.mutable_begin()->add_rows();
  row->set_slot(victim_);
  row->set_token_id(42);
  begin.mutable_begin()->set_request_id(client::NewRequestId());
  const auto layers = Layers(1);
  *first.mutable_layer() = layers[0];
  *bad.mutable_layer() = layers[1];
  Poison(bad.mutable_layer()->mutable_a(), 3, kNaN);
  v1::DecodeStreamResponse resp;
  ASSERT_TRUE(stream->Write(begin) && stream->Read(&resp));
  ASSERT_TRUE(stream->Write(first) && stream->Read(&resp));
  stream->Write(bad);
  EXPECT_FALSE(stream->Read(&resp)) << "the server ends the stream";
  ExpectRefused(stream->Finish(),
                "layer.a: expected finite values, got NaN at row 0, index [0, 3]");
  ExpectVictimUnchanged();
}

}  // namespace
}  // namespace replayssm::testing
