// The fixture of the integration tests: a real replayssm-server (tiny-gdn, CPU) on free
// loopback ports, a client, the model info and a CPU reference that the outputs must match.
#ifndef REPLAYSSM_TESTS_SERVICE_FIXTURE_H_
#define REPLAYSSM_TESTS_SERVICE_FIXTURE_H_

#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "replayssm/client/client.h"
#include "replayssm/client/reference.h"
#include "replayssm/client/tensor.h"
#include "server_process.h"

namespace replayssm::testing {

namespace v1 = ::replayssm::v1;
using client::Client;
using client::CpuReference;

class ServiceTest : public ::testing::Test {
 protected:
  // Flags for the server of each test; a small track interval makes snapshots cheap to reach.
  virtual std::vector<std::string> ServerFlags() const { return {"--track-interval=16"}; }
  // The bearer token the fixture's client sends ("" none: a server without --auth-tokens).
  virtual std::string ClientToken() const { return ""; }

  void SetUp() override {
    auto server = ServerProcess::Start(ServerFlags());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    client_ = Client::Connect(server_->grpc_address());
    client_->set_token(ClientToken());
    auto info = client_->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    info_ = *info;
    auto ref = CpuReference::Create(info_.model(), 16);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = *std::move(ref);
  }

  const v1::ModelInfo& model() const { return info_.model(); }
  int num_layers() const { return info_.model().num_layers(); }
  double tol() const { return client::OutputTolerance(info_.model().act_dtype()); }

  std::vector<v1::LayerInput> Layers(int64_t n) {
    return client::SyntheticLayers(info_.model(), n, next_seed_++);
  }

  uint64_t NewSlot() {
    auto a = client_->Allocate();
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->slot() : 0;
  }

  // Prefills `n` tokens into the server's slot and the reference's sequence.
  // `used` (optional) receives the layers' inputs, for feeding them elsewhere too.
  void Prefill(uint64_t slot, int32_t seq, int64_t n, std::vector<v1::LayerInput>* used = nullptr) {
    std::vector<v1::LayerInput> layers = Layers(n);
    if (used != nullptr) *used = layers;
    v1::PrefillRequest req;
    req.set_slot(slot);
    for (int64_t i = 0; i < n; ++i) req.add_tokens(static_cast<int32_t>(100 + i));
    for (const auto& l : layers) *req.add_layers() = l;
    req.set_return_outputs(true);
    auto got = client_->Prefill(req);
    ASSERT_TRUE(got.ok()) << got.status();
    auto want = ref_->Prefill(seq, layers);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int l = 0; l < num_layers(); ++l) ExpectClose(got->layers(l).out(), (*want)[l]);
  }

  v1::DecodeRequest DecodeRequest(const std::vector<uint64_t>& slots,
                                  const std::vector<v1::LayerInput>& layers) {
    v1::DecodeRequest req;
    for (uint64_t s : slots) {
      v1::DecodeRow* row = req.add_rows();
      row->set_slot(s);
      row->set_token_id(static_cast<int32_t>(7 + s % 1000));
    }
    for (const auto& l : layers) *req.add_layers() = l;
    return req;
  }

  // One decode step on the server (unary) and the reference; outputs must agree.
  void DecodeStep(const std::vector<uint64_t>& slots, const std::vector<int32_t>& seqs,
                  std::vector<v1::LayerInput>* used = nullptr) {
    std::vector<v1::LayerInput> layers = Layers(static_cast<int64_t>(slots.size()));
    if (used != nullptr) *used = layers;
    auto got = client_->Decode(DecodeRequest(slots, layers));
    ASSERT_TRUE(got.ok()) << got.status();
    auto want = ref_->Decode(seqs, layers);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int l = 0; l < num_layers(); ++l) ExpectClose(got->layers(l).out(), (*want)[l]);
  }

  void ExpectClose(const v1::Tensor& got, const v1::Tensor& want) {
    std::string why;
    EXPECT_TRUE(client::AllClose(got, want, tol(), tol(), &why)) << why;
  }

  // A new slot prefilled (unary) with `layers` (n tokens, ids 100 + i): two calls with the same
  // layers make twins, for comparing the forms of a call bit for bit.
  uint64_t PrefilledSlot(const std::vector<v1::LayerInput>& layers) {
    const uint64_t slot = NewSlot();
    v1::PrefillRequest req;
    req.set_slot(slot);
    for (int64_t i = 0; i < layers[0].mixed_qkv().shape(0); ++i) {
      req.add_tokens(static_cast<int32_t>(100 + i));
    }
    for (const auto& l : layers) *req.add_layers() = l;
    EXPECT_TRUE(client_->Prefill(req).ok());
    return slot;
  }

  // A slot's cursors (seq_len, write_pos, drafts waiting), read without folding it as an
  // export does: a bad call compared by these runs on the ring as it was.
  std::string Cursors(uint64_t slot) {
    auto info = client_->GetSlot(slot);
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->SerializeAsString() : "";
  }

  // Everything observable about a slot: its exported state and its cursors.
  std::string Observe(uint64_t slot) {
    auto state = client_->Export(slot);
    auto info = client_->GetSlot(slot);
    EXPECT_TRUE(state.ok()) << state.status();
    EXPECT_TRUE(info.ok()) << info.status();
    if (!state.ok() || !info.ok()) return "";
    return state->SerializeAsString() + "|" + std::to_string(info->seq_len());
  }

  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<Client> client_;
  v1::GetInfoResponse info_;
  std::unique_ptr<CpuReference> ref_;
  uint64_t next_seed_ = 1;
};

// Per-layer inputs of several rows joined along the tokens, in row order: the layer messages
// of a prefill forward over those rows.
inline std::vector<v1::LayerInput> PackRows(const std::vector<std::vector<v1::LayerInput>>& rows) {
  std::vector<v1::LayerInput> packed(rows[0].size());
  for (size_t l = 0; l < packed.size(); ++l) {
    std::vector<v1::Tensor> qkv, a, b;
    for (const auto& row : rows) {
      qkv.push_back(row[l].mixed_qkv());
      a.push_back(row[l].a());
      b.push_back(row[l].b());
    }
    packed[l].set_layer(static_cast<int32_t>(l));
    *packed[l].mutable_mixed_qkv() = client::ConcatTokens(qkv);
    *packed[l].mutable_a() = client::ConcatTokens(a);
    *packed[l].mutable_b() = client::ConcatTokens(b);
  }
  return packed;
}

}  // namespace replayssm::testing

#endif  // REPLAYSSM_TESTS_SERVICE_FIXTURE_H_
