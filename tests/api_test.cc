// The whole replayssm.v1 API against a real server, every output checked against the CPU
// reference (the plain recurrence, computed in the test process).
#include <algorithm>
#include <sstream>

#include "grpc/reflection/v1alpha/reflection_subset.grpc.pb.h"
#include "replayssm/client/demo.h"
#include "absl/strings/match.h"
#include "service_fixture.h"

namespace replayssm::testing {
namespace {

using ApiTest = ServiceTest;

TEST_F(ApiTest, InfoReportsModelShapesCapacityAndBackend) {
  EXPECT_EQ(model().name(), "tiny-gdn");
  EXPECT_GT(num_layers(), 0);
  EXPECT_EQ(model().layer_params_size(), num_layers());
  EXPECT_EQ(model().layer_params(0).a_log_size(), model().num_v_heads());
  // The backend the servers were started on: cpu, or cuda:N where the GPU runs (--device=cuda
  // names the device it took; the H100 run of 2026-12-05 expected "cpu" there and failed).
  const std::string device = ServerProcess::Device();
  if (device == "cpu") {
    EXPECT_EQ(info_.backend(), "cpu");
  } else {
    EXPECT_TRUE(absl::StartsWith(info_.backend(), "cuda")) << info_.backend();
  }
  EXPECT_GT(info_.capacity_slots(), 0);
  EXPECT_EQ(info_.track_interval(), 16);
  EXPECT_TRUE(model().params_from_seed());
  auto health = client_->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
  health = client_->Health("replayssm.v1.ReplaySsm");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(ApiTest, ReflectionListsTheServiceAndHealth) {
  namespace refl = ::grpc::reflection::v1alpha;
  auto stub = refl::ServerReflection::NewStub(
      grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  auto stream = stub->ServerReflectionInfo(&ctx);
  refl::ServerReflectionRequest req;
  req.set_list_services("*");
  ASSERT_TRUE(stream->Write(req));
  refl::ServerReflectionResponse resp;
  ASSERT_TRUE(stream->Read(&resp));
  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  std::vector<std::string> names;
  for (const auto& s : resp.list_services_response().service()) names.push_back(s.name());
  EXPECT_NE(std::find(names.begin(), names.end(), "replayssm.v1.ReplaySsm"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "grpc.health.v1.Health"), names.end());
}

TEST_F(ApiTest, StreamDecodeMatchesReferenceAcrossRingFoldsAndTrackSnapshots) {
  const std::vector<uint64_t> slots = {NewSlot(), NewSlot(), NewSlot()};
  const std::vector<int32_t> seqs = {*ref_->NewSequence(), *ref_->NewSequence(),
                                     *ref_->NewSequence()};
  for (int i = 0; i < 3; ++i) Prefill(slots[i], seqs[i], 5 + i);
  auto stream = client_->OpenStream();
  const int steps = 2 * info_.track_interval() + 3;  // crosses ring folds and track snapshots
  for (int step = 0; step < steps; ++step) {
    std::vector<v1::DecodeRow> rows(3);
    for (int i = 0; i < 3; ++i) {
      rows[i].set_slot(slots[i]);
      rows[i].set_token_id(step);
    }
    auto layers = Layers(3);
    auto begun = stream->Begin(rows);
    ASSERT_TRUE(begun.ok()) << begun.status();
    EXPECT_FALSE(begun->replayed());
    auto want = ref_->Decode(seqs, layers);
    ASSERT_TRUE(want.ok());
    for (int l = num_layers() - 1; l >= 0; --l) {  // any layer order is allowed
      auto out = stream->RunLayer(layers[l]);
      ASSERT_TRUE(out.ok()) << out.status();
      EXPECT_EQ(out->layer(), l);
      ExpectClose(out->out(), (*want)[l]);
    }
    auto committed = stream->Commit();
    ASSERT_TRUE(committed.ok()) << committed.status();
    ASSERT_EQ(committed->rows_size(), 3);
    EXPECT_EQ(committed->rows(1).seq_len(), 6 + step + 1);
  }
  EXPECT_TRUE(stream->Finish().ok());
  auto stats = client_->Stats();
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->folds_ring_full(), 0);
  EXPECT_GT(stats->folds_track(), 0);
  EXPECT_GT(stats->snapshots_taken(), 0);
  // The exported (folded) state is the reference's state.
  auto exported = client_->Export(slots[2]);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->seq_len(), 7 + steps);
  for (int l = 0; l < num_layers(); ++l) {
    const std::vector<float> want = ref_->State(seqs[2], l);
    v1::Tensor want_t = client::MakeTensor(
        v1::DTYPE_F32, {model().num_v_heads(), model().head_v(), model().head_k()}, want);
    if (model().state_dtype() == v1::DTYPE_F32) {
      ExpectClose(exported->checkpoints(l), want_t);
    }
    // The short convolution's window: the last W-1 pre-convolution inputs, bit for bit.
    ASSERT_EQ(exported->conv_windows_size(), num_layers());
    EXPECT_EQ(exported->conv_windows(l).data(), ref_->ConvWindow(seqs[2], l)) << "layer " << l;
  }
}

TEST_F(ApiTest, UnaryDecodeMatchesReferenceAndPaddingRowsAreZero) {
  const uint64_t a = NewSlot(), b = NewSlot();
  const int32_t sa = *ref_->NewSequence(), sb = *ref_->NewSequence();
  Prefill(a, sa, 4);
  Prefill(b, sb, 9);
  for (int step = 0; step < model().ring_len() + 2; ++step) {
    auto layers = Layers(3);
    auto got = client_->Decode(DecodeRequest({a, 0, b}, layers));
    ASSERT_TRUE(got.ok()) << got.status();
    auto want = ref_->Decode({sa, -1, sb}, layers);
    ASSERT_TRUE(want.ok());
    for (int l = 0; l < num_layers(); ++l) {
      ExpectClose(got->layers(l).out(), (*want)[l]);
      const auto out = client::ToFloats(got->layers(l).out());
      const size_t row = out.size() / 3;
      for (size_t i = row; i < 2 * row; ++i) ASSERT_EQ(out[i], 0.0f) << "padding row";
    }
    ASSERT_EQ(got->rows_size(), 3);
    EXPECT_EQ(got->rows(0).seq_len(), 4 + step + 1);
    EXPECT_EQ(got->rows(1).slot(), 0u);
    EXPECT_EQ(got->rows(2).seq_len(), 9 + step + 1);
  }
}

TEST_F(ApiTest, ImportOfAnExportContinuesExactlyLikeTheOriginal) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  Prefill(a, sa, 6);
  for (int i = 0; i < 3; ++i) DecodeStep({a}, {sa});  // leaves records in the ring
  auto exported = client_->Export(a);
  ASSERT_TRUE(exported.ok()) << exported.status();
  EXPECT_EQ(exported->seq_len(), 9);
  ASSERT_EQ(exported->tokens_size(), 9);
  const uint64_t b = NewSlot();
  v1::ImportRequest imp;
  imp.set_slot(b);
  *imp.mutable_tokens() = exported->tokens();
  *imp.mutable_checkpoints() = exported->checkpoints();
  // Without the conv windows the import is refused by field and b stays empty.
  auto refused = client_->Import(imp);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("conv_windows"), std::string::npos) << refused.status();
  *imp.mutable_conv_windows() = exported->conv_windows();
  imp.mutable_conv_windows(1)->mutable_data()->pop_back();
  refused = client_->Import(imp);
  EXPECT_NE(refused.status().message().find("conv_windows[1]"), std::string::npos)
      << refused.status();
  *imp.mutable_conv_windows() = exported->conv_windows();
  auto state = client_->Import(imp);
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->seq_len(), 9);
  EXPECT_EQ(state->write_pos(), 0);
  // The same inputs into both slots give the same outputs, bit for bit, through a fold.
  for (int i = 0; i < model().ring_len() + 1; ++i) {
    auto layers = Layers(1);
    auto oa = client_->Decode(DecodeRequest({a}, layers));
    auto ob = client_->Decode(DecodeRequest({b}, layers));
    ASSERT_TRUE(oa.ok() && ob.ok()) << oa.status() << ob.status();
    for (int l = 0; l < num_layers(); ++l) {
      EXPECT_EQ(oa->layers(l).out().data(), ob->layers(l).out().data()) << "layer " << l;
    }
  }
  auto ea = client_->Export(a), eb = client_->Export(b);
  ASSERT_TRUE(ea.ok() && eb.ok());
  for (int l = 0; l < num_layers(); ++l) {
    EXPECT_EQ(ea->checkpoints(l).data(), eb->checkpoints(l).data()) << "layer " << l;
    EXPECT_EQ(ea->conv_windows(l).data(), eb->conv_windows(l).data()) << "layer " << l;
  }
}

TEST_F(ApiTest, VerifyDraftsEqualDecodeStepsAndAcceptAdvancesByTheAcceptedCount) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  Prefill(a, sa, 5);
  DecodeStep({a}, {sa});
  const int t = 3;
  auto layers = Layers(t);  // one row, t drafts: (row, draft) order
  v1::VerifyRequest req;
  req.add_slots(a);
  req.set_num_draft(t);
  for (int i = 0; i < t; ++i) req.add_draft_tokens(500 + i);
  for (const auto& l : layers) *req.add_layers() = l;
  auto got = client_->Verify(req);
  ASSERT_TRUE(got.ok()) << got.status();
  auto before = client_->GetSlot(a);
  ASSERT_TRUE(before.ok());
  EXPECT_EQ(before->seq_len(), 6);
  EXPECT_EQ(before->pending_drafts(), t);
  // Expected: t plain decode steps on a copy of the reference state.
  auto fork = ref_->Fork(sa);
  ASSERT_TRUE(fork.ok());
  std::vector<std::vector<v1::Tensor>> per_draft;
  for (int d = 0; d < t; ++d) {
    std::vector<v1::LayerInput> step;
    for (const auto& l : layers) step.push_back(client::SliceTokens(l, d, 1));
    per_draft.push_back(*ref_->Decode({*fork}, step));
    if (d < 2) {  // the 2 drafts to be accepted
      ASSERT_TRUE(ref_->Decode({sa}, step).ok());
    }
  }
  for (int l = 0; l < num_layers(); ++l) {
    std::vector<v1::Tensor> parts;
    for (int d = 0; d < t; ++d) parts.push_back(per_draft[d][l]);
    ExpectClose(got->layers(l).out(), client::ConcatTokens(parts));
  }
  auto accepted = client_->Accept(a, 2);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_EQ(accepted->seq_len(), 8);
  EXPECT_EQ(accepted->pending_drafts(), 0);
  DecodeStep({a}, {sa});  // continues from the accepted drafts
}

TEST_F(ApiTest, StreamPrefillOfSeveralSlotsEqualsUnaryPrefillBitForBit) {
  // Twins: the same prompt, then the same decode step (records in the ring).
  const auto pa = Layers(5), pb = Layers(3), step = Layers(2);
  const uint64_t a1 = PrefilledSlot(pa), a2 = PrefilledSlot(pa);
  const uint64_t b1 = PrefilledSlot(pb), b2 = PrefilledSlot(pb);
  for (const std::vector<uint64_t>& rows : {std::vector<uint64_t>{a1, b1}, {a2, b2}}) {
    v1::DecodeRequest req = DecodeRequest(rows, step);
    for (auto& row : *req.mutable_rows()) row.set_token_id(5);  // the twins' histories agree
    ASSERT_TRUE(client_->Decode(req).ok());
  }
  const int64_t nx = model().ring_len() + 3, ny = 1;  // x outruns the ring
  const auto lx = Layers(nx), ly = Layers(ny);
  std::vector<int32_t> x, y = {77};
  for (int64_t i = 0; i < nx; ++i) x.push_back(static_cast<int32_t>(60 + i));
  v1::PrefillRequest ux;
  ux.set_slot(a1);
  ux.mutable_tokens()->Assign(x.begin(), x.end());
  for (const auto& l : lx) *ux.add_layers() = l;
  ux.set_return_outputs(true);
  v1::PrefillRequest uy = ux;
  uy.set_slot(b1);
  uy.mutable_tokens()->Assign(y.begin(), y.end());
  uy.clear_layers();
  for (const auto& l : ly) *uy.add_layers() = l;
  auto ox = client_->Prefill(ux), oy = client_->Prefill(uy);
  ASSERT_TRUE(ox.ok() && oy.ok()) << ox.status() << oy.status();

  auto stream = client_->OpenStream();
  auto begun = stream->BeginPrefill({client::MakePrefillRow(a2, x), client::MakePrefillRow(b2, y)});
  ASSERT_TRUE(begun.ok()) << begun.status();
  EXPECT_EQ(begun->batch(), 2);
  EXPECT_EQ(begun->tokens(), nx + ny);
  const auto packed = PackRows({lx, ly});
  for (int l = num_layers() - 1; l >= 0; --l) {  // any layer order
    auto out = stream->RunLayer(packed[l]);
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(client::SliceTokens(out->out(), 0, nx).data(), ox->layers(l).out().data());
    EXPECT_EQ(client::SliceTokens(out->out(), nx, ny).data(), oy->layers(l).out().data());
  }
  auto committed = stream->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  ASSERT_EQ(committed->rows_size(), 2);
  EXPECT_EQ(committed->rows(0).seq_len(), 6 + nx);
  EXPECT_EQ(committed->rows(0).write_pos(), 0);
  EXPECT_EQ(committed->rows(1).seq_len(), 4 + ny);
  EXPECT_TRUE(stream->Finish().ok());
  EXPECT_EQ(Observe(a2), Observe(a1));
  EXPECT_EQ(Observe(b2), Observe(b1));
}

TEST_F(ApiTest, StreamVerifyEqualsUnaryVerifyBitForBitAndAcceptContinuesIt) {
  const auto prompt = Layers(6);
  const uint64_t a1 = PrefilledSlot(prompt), a2 = PrefilledSlot(prompt);
  const uint64_t b1 = PrefilledSlot(prompt), b2 = PrefilledSlot(prompt);
  const int t = 3;
  const std::vector<int32_t> drafts = {5, 6, 7, 8, 9, 10};
  const auto layers = Layers(2 * t);
  v1::VerifyRequest unary;
  unary.add_slots(a1);
  unary.add_slots(b1);
  unary.set_num_draft(t);
  unary.mutable_draft_tokens()->Assign(drafts.begin(), drafts.end());
  for (const auto& l : layers) *unary.add_layers() = l;
  auto want = client_->Verify(unary);
  ASSERT_TRUE(want.ok()) << want.status();
  auto stream = client_->OpenStream();
  const std::vector<uint64_t> slots = {a2, b2};
  auto got = stream->Verify(slots, t, drafts, layers);
  ASSERT_TRUE(got.ok()) << got.status();
  for (int l = 0; l < num_layers(); ++l) {
    EXPECT_EQ(got->layers(l).out().data(), want->layers(l).out().data()) << "layer " << l;
  }
  ASSERT_EQ(got->rows_size(), 2);
  EXPECT_EQ(got->rows(0).pending_drafts(), t);
  EXPECT_EQ(got->rows(0).seq_len(), 6) << "nothing advances before Accept";
  for (uint64_t s : {a1, a2}) ASSERT_TRUE(client_->Accept(s, 2).ok());
  for (uint64_t s : {b1, b2}) ASSERT_TRUE(client_->Accept(s, 0).ok());
  EXPECT_EQ(Observe(a2), Observe(a1));
  EXPECT_EQ(Observe(b2), Observe(b1));
  EXPECT_EQ(client_->GetSlot(a2)->seq_len(), 8);
  EXPECT_TRUE(stream->Finish().ok());
}

// The CPU reference checks what it is given: it read a short layer list or a short tensor past
// its end (an outside review), where a test would compare with garbage.
TEST_F(ApiTest, TheReferenceRefusesInputsTheModelDoesNotHave) {
  const int32_t s = *ref_->NewSequence();
  std::vector<v1::LayerInput> layers = Layers(1);
  const absl::Status few =
      ref_->Decode({s}, absl::MakeConstSpan(layers).subspan(0, layers.size() - 1)).status();
  EXPECT_EQ(few.code(), absl::StatusCode::kInvalidArgument) << few;
  EXPECT_NE(few.message().find("reference: layers: expected"), std::string::npos) << few;
  layers[1].mutable_a()->mutable_data()->resize(1);
  const absl::Status short_a = ref_->Decode({s}, layers).status();
  EXPECT_NE(short_a.message().find("reference: layers[1].a: expected"), std::string::npos)
      << short_a;
  const absl::Status two_rows = ref_->Decode({s, s}, Layers(1)).status();
  EXPECT_NE(two_rows.message().find("layers[0].mixed_qkv: expected"), std::string::npos)
      << two_rows;
}

TEST_F(ApiTest, DonatedRequestIsAPrefixHitForItsNextTurn) {
  const uint64_t a = NewSlot();
  const int32_t sa = *ref_->NewSequence();
  Prefill(a, sa, 7);
  for (int i = 0; i < 5; ++i) DecodeStep({a}, {sa});
  auto exported = client_->Export(a);
  ASSERT_TRUE(exported.ok());
  std::vector<int32_t> tokens(exported->tokens().begin(), exported->tokens().end());
  ASSERT_EQ(tokens.size(), 12u);
  ASSERT_TRUE(client_->Donate(a).ok());
  EXPECT_EQ(client_->GetSlot(a).status().code(), absl::StatusCode::kNotFound);
  // The same 12 tokens again (the same prompt, n samples, a recompute after preemption) matched
  // all of them: nothing was left to prefill, and the engine needs the last token's outputs for
  // its first generated token (a prefill of none is refused, decoding it again folds it twice)
  // — an outside review. A match leaves the prompt's last token.
  EXPECT_EQ(*client_->MatchPrefix(tokens), 0) << "the only snapshot holds all 12";
  auto whole = client_->AllocateFromPrefix(tokens);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ(whole->matched(), 0);
  EXPECT_EQ(client_->GetSlot(whole->slot())->seq_len(), 0);
  ASSERT_TRUE(client_->Free(whole->slot()).ok());
  tokens.push_back(42);  // one token more: the whole snapshot
  auto matched = client_->MatchPrefix(tokens);
  ASSERT_TRUE(matched.ok());
  EXPECT_EQ(*matched, 12);
  auto hits_before = client_->Stats()->snapshot_hits();
  auto b = client_->AllocateFromPrefix(tokens);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->matched(), 12);
  EXPECT_EQ(client_->Stats()->snapshot_hits(), hits_before + 1);
  auto state = client_->GetSlot(b->slot());
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->seq_len(), 12);
  DecodeStep({b->slot()}, {sa});
  auto miss = client_->AllocateFromPrefix(std::vector<int32_t>{9, 9, 9});
  ASSERT_TRUE(miss.ok());
  EXPECT_EQ(miss->matched(), 0);
}

TEST_F(ApiTest, DemoSchedulerRunsCleanAgainstTheServer) {
  std::ostringstream log;
  client::DemoOptions options;
  options.steps = 20;
  options.seed = 7;
  auto report = client::RunDemo(*client_, options, log);
  ASSERT_TRUE(report.ok()) << report.status() << "\n" << log.str();
  EXPECT_EQ(report->forwards, 20 + options.turn2_steps);
  EXPECT_EQ(report->prefix_matched, report->prefix_expected);
  EXPECT_GT(report->outputs_checked, 0);
}

}  // namespace
}  // namespace replayssm::testing
