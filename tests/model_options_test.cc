// The model options that change the numbers, on a real server: --ring-dtype (ring d and k in
// bf16 beside an fp32 checkpoint) and --beta-rounding (beta = sigmoid(b) rounded to the bf16
// activations, or not). GetInfo reports each; the outputs and the exported state follow the
// CPU reference built from that info, and a reference built with the other choice does not
// match the exported state (so the comparison can tell the two apart).
#include <sys/stat.h>

#include <fstream>

#include "service_fixture.h"

namespace replayssm::testing {
namespace {

// A Gated DeltaNet config.json with bf16 activations (the tiny presets' are fp32).
std::string Bf16GdnConfig() {
  const std::string dir = ::testing::TempDir() + "/model-options-bf16-gdn";
  mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/config.json";
  std::ofstream(path) << R"({"model_type": "qwen3_next", "num_hidden_layers": 4,
      "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
      "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
      "torch_dtype": "bfloat16"})";
  return path;
}

class ModelOptionsTest : public ServiceTest {
 protected:
  // Prefill, then decode past two ring folds; every output against the reference, then the
  // exported checkpoints against the reference's state (fp32, so tight) and against `other`'s.
  void RunAndCompare(const v1::ModelInfo& other_model) {
    auto other = CpuReference::Create(other_model, 4);
    ASSERT_TRUE(other.ok()) << other.status();
    const uint64_t slot = NewSlot();
    const int32_t seq = *ref_->NewSequence(), other_seq = *(*other)->NewSequence();
    std::vector<v1::LayerInput> layers;
    Prefill(slot, seq, 5, &layers);  // outputs checked against ref_
    ASSERT_FALSE(HasFatalFailure());
    ASSERT_TRUE((*other)->Prefill(other_seq, layers).ok());
    for (int step = 0; step < 2 * model().ring_len() + 3; ++step) {
      DecodeStep({slot}, {seq}, &layers);
      ASSERT_FALSE(HasFatalFailure());
      ASSERT_TRUE((*other)->Decode({other_seq}, layers).ok());
    }
    auto exported = client_->Export(slot);
    ASSERT_TRUE(exported.ok()) << exported.status();
    ASSERT_EQ(model().state_dtype(), v1::DTYPE_F32);
    const std::vector<int64_t> shape = {model().num_v_heads(), model().head_v(), model().head_k()};
    int unlike_other = 0;
    for (int l = 0; l < num_layers(); ++l) {
      std::string why;
      const v1::Tensor want_t = client::MakeTensor(v1::DTYPE_F32, shape, ref_->State(seq, l));
      EXPECT_TRUE(client::AllClose(exported->checkpoints(l), want_t, kStateTol, kStateTol, &why))
          << "layer " << l << ": " << why;
      const v1::Tensor other_t =
          client::MakeTensor(v1::DTYPE_F32, shape, (*other)->State(other_seq, l));
      if (!client::AllClose(exported->checkpoints(l), other_t, kStateTol, kStateTol, &why)) {
        ++unlike_other;
      }
    }
    EXPECT_EQ(unlike_other, num_layers())
        << "a reference with the other option matched the server: the check cannot tell them apart";
  }
  static constexpr double kStateTol = 2e-5;  // fp32 state: replay vs the plain recurrence
};

class RingDtypeTest : public ModelOptionsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--ring-dtype=bf16"};
  }
};

TEST_F(RingDtypeTest, InfoReportsABf16RingAndTheStateFollowsItsRounding) {
  EXPECT_EQ(model().state_dtype(), v1::DTYPE_F32);
  EXPECT_EQ(model().ring_dtype(), v1::DTYPE_BF16);
  v1::ModelInfo fp32_ring = model();
  fp32_ring.set_ring_dtype(v1::DTYPE_F32);
  RunAndCompare(fp32_ring);
}

class BetaRoundingTest : public ModelOptionsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--model=" + Bf16GdnConfig()};
  }
};

TEST_F(BetaRoundingTest, GatedDeltaNetRoundsBetaToBf16ByDefaultAsHuggingFaceDoes) {
  // No weights beside the config: seeded parameters, said at start (an outside review: a
  // deployment that mounted the config and forgot the weights was told nothing).
  EXPECT_TRUE(model().params_from_seed());
  EXPECT_NE(server_->Log().find("warning: --model " + Bf16GdnConfig() +
                                ": no safetensors weights beside it: serving seeded parameters"),
            std::string::npos)
      << server_->Log();
  EXPECT_EQ(model().act_dtype(), v1::DTYPE_BF16);
  EXPECT_EQ(model().ring_dtype(), v1::DTYPE_F32);
  EXPECT_TRUE(model().round_beta());
  v1::ModelInfo fp32_beta = model();
  fp32_beta.set_round_beta(false);
  RunAndCompare(fp32_beta);
}

class Fp32BetaTest : public ModelOptionsTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--model=" + Bf16GdnConfig(), "--beta-rounding=f32"};
  }
};

TEST_F(Fp32BetaTest, TheFlagKeepsBetaInFp32) {
  EXPECT_FALSE(model().round_beta());
  v1::ModelInfo rounded = model();
  rounded.set_round_beta(true);
  RunAndCompare(rounded);
}

}  // namespace
}  // namespace replayssm::testing
