// Tensor parallelism through the real server (--tp-size): GetInfo's head ranges, rank-major
// activations, and slots moved between servers of every pair of TP degrees in {1, 2, 4} —
// by TransferSlot and by PullSlot — decoding on bit for bit as on a TP = 1 server that never
// moved (folded at the same token, as a move folds).
#include "replayssm/cache/tp.h"

#include <sys/stat.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "replayssm/client/client.h"
#include "replayssm/client/tensor.h"
#include "server_process.h"

namespace replayssm::testing {
namespace {

using client::Client;

struct Node {
  int32_t tp = 1;
  std::unique_ptr<ServerProcess> proc;
  std::unique_ptr<Client> client;
};

Node StartNode(int32_t tp, const std::string& model = "tiny-gdn-tp") {
  Node n;
  n.tp = tp;
  // Up to six servers share one GPU here: under MPS its clients share one pool of work queues
  // and each holds its own, so at the server's 32 the fifth could not allocate (the H100 run
  // of 2026-12-06). CUDA's own 8 each, for these servers only.
  const bool shared_gpu =
      ServerProcess::Device() != "cpu" && std::getenv("CUDA_DEVICE_MAX_CONNECTIONS") == nullptr;
  if (shared_gpu) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8", 1);
  auto p = ServerProcess::Start({"--model=" + model, absl::StrCat("--tp-size=", tp),
                                 "--memory-budget=64M", "--track-interval=0"});
  if (shared_gpu) unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return n;
  n.proc = *std::move(p);
  n.client = Client::Connect(n.proc->grpc_address());
  return n;
}

// The shape that the tp.h maps need, from what GetInfo says.
cache::ModelSpec SpecOf(const v1::ModelInfo& m) {
  cache::ModelSpec s;
  s.num_layers = m.num_layers();
  s.shape.gate = m.gate() == v1::GATE_KDA ? RSSM_GATE_KDA : RSSM_GATE_GDN;
  s.shape.num_qk_heads = m.num_qk_heads();
  s.shape.num_v_heads = m.num_v_heads();
  s.shape.head_k = m.head_k();
  s.shape.head_v = m.head_v();
  s.shape.act_dtype = m.act_dtype() == v1::DTYPE_BF16  ? RSSM_DTYPE_BF16
                      : m.act_dtype() == v1::DTYPE_F16 ? RSSM_DTYPE_F16
                                                       : RSSM_DTYPE_F32;
  return s;
}

// An unsharded [N, width...] tensor's bytes as tp ranks' blocks, rank-major, or back.
std::string Rearrange(const std::string& bytes, const cache::ModelSpec& m, int32_t tp, int64_t n,
                      int64_t width, cache::SliceRun (*cols)(const cache::ModelSpec&,
                                                             const cache::TpShard&),
                      bool qkv, bool back) {
  const int64_t es = rssm_dtype_size(m.shape.act_dtype);
  std::string out(bytes.size(), '\0');
  int64_t at = 0;
  for (int32_t r = 0; r < tp; ++r) {
    const cache::TpShard s = cache::ShardOf(m, tp, r);
    const std::vector<cache::SliceRun> runs =
        qkv ? cache::QkvColumns(m, s) : std::vector<cache::SliceRun>{cols(m, s)};
    const int64_t w = width / tp;
    if (back) {
      cache::CopyFromShard(bytes.data() + at, w, out.data(), width, n, runs, es);
    } else {
      cache::CopyToShard(bytes.data(), width, out.data() + at, w, n, runs, es);
    }
    at += n * w * es;
  }
  return out;
}

void ToRanks(v1::Tensor* t, const cache::ModelSpec& m, int32_t tp, int64_t n, int64_t width,
             cache::SliceRun (*cols)(const cache::ModelSpec&, const cache::TpShard&), bool qkv) {
  *t->mutable_data() = Rearrange(t->data(), m, tp, n, width, cols, qkv, false);
  std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
  shape[1] /= tp;  // [N, heads or width, ...]: each rank's share
  t->clear_shape();
  t->add_shape(tp);
  for (int64_t d : shape) t->add_shape(d);
}

// A TP server's layers: each tensor rank-major [tp, N, ...].
std::vector<v1::LayerInput> Sharded(std::vector<v1::LayerInput> layers, const cache::ModelSpec& m,
                                    int32_t tp) {
  if (tp == 1) return layers;
  const int64_t n = layers[0].mixed_qkv().shape(0);
  const int64_t hv = m.shape.num_v_heads;
  for (v1::LayerInput& l : layers) {
    ToRanks(l.mutable_mixed_qkv(), m, tp, n,
            2LL * m.shape.num_qk_heads * m.shape.head_k + hv * m.shape.head_v, nullptr, true);
    ToRanks(l.mutable_a(), m, tp, n, hv, cache::AColumns, false);
    ToRanks(l.mutable_b(), m, tp, n, hv, cache::BColumns, false);
  }
  return layers;
}

// A TP server's output of layer l, as the unsharded [N, HV, V] bytes.
std::string Unsharded(const v1::Tensor& out, const cache::ModelSpec& m, int32_t tp) {
  if (tp == 1) return out.data();
  const int64_t n = out.shape(1);
  return Rearrange(out.data(), m, tp, n, int64_t{m.shape.num_v_heads} * m.shape.head_v,
                   cache::OutColumns, false, true);
}

// A Qwen3-Next-style checkpoint (config.json + model.safetensors, 2 linear-attention layers,
// 4 qk and 8 v heads of 32) whose parameters differ per head and per convolution channel, so
// that a rank given another rank's slice computes other outputs.
std::string CheckpointWithDistinctParams() {
  const std::string dir = ::testing::TempDir() + "/tp-checkpoint";
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/config.json") << R"({"model_type": "qwen3_next", "num_hidden_layers": 4,
      "full_attention_interval": 2, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
      "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
      "torch_dtype": "bfloat16"})";
  const int channels = 2 * 4 * 32 + 8 * 32, width = 4;
  std::vector<std::pair<std::string, std::vector<float>>> tensors;
  for (int layer : {0, 2}) {  // the linear-attention layers (every second is full attention)
    const std::string p = absl::StrCat("model.layers.", layer, ".linear_attn.");
    std::vector<float> a_log, dt_bias, conv;
    for (int h = 0; h < 8; ++h) {
      a_log.push_back(-0.5f + 0.15f * h + 0.01f * layer);
      dt_bias.push_back(0.3f - 0.07f * h);
    }
    for (int c = 0; c < channels; ++c) {
      for (int j = 0; j < width; ++j) conv.push_back(0.1f + 0.003f * (c % 89) + 0.05f * j);
    }
    tensors.push_back({p + "A_log", a_log});
    tensors.push_back({p + "dt_bias", dt_bias});
    tensors.push_back({p + "conv1d.weight", conv});
  }
  std::string header = "{", data;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t begin = data.size();
    data.append(reinterpret_cast<const char*>(tensors[i].second.data()),
                tensors[i].second.size() * sizeof(float));
    absl::StrAppend(&header, i ? "," : "", "\"", tensors[i].first,
                    "\":{\"dtype\":\"F32\",\"shape\":[", tensors[i].second.size(),
                    "],\"data_offsets\":[", begin, ",", data.size(), "]}");
  }
  header += "}";
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  const uint64_t n = header.size();
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << header << data;
  return dir + "/config.json";
}

class TpServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    twin_ = StartNode(1);
    ASSERT_NE(twin_.client, nullptr);
    auto info = twin_.client->Info();
    ASSERT_TRUE(info.ok()) << info.status();
    info_ = *info;
    spec_ = SpecOf(info_.model());
  }

  std::vector<v1::LayerInput> Layers(int64_t n) {
    return client::SyntheticLayers(info_.model(), n, seed_++);
  }
  // One decode step of `slot` on `node` with token `token`; the outputs, unsharded.
  std::vector<std::string> Decode(Node& node, uint64_t slot, int32_t token,
                                  const std::vector<v1::LayerInput>& layers) {
    v1::DecodeRequest req;
    v1::DecodeRow* row = req.add_rows();
    row->set_slot(slot);
    row->set_token_id(token);
    for (const auto& l : Sharded(layers, spec_, node.tp)) *req.add_layers() = l;
    auto got = node.client->Decode(req);
    EXPECT_TRUE(got.ok()) << "tp " << node.tp << ": " << got.status();
    std::vector<std::string> out;
    if (!got.ok()) return out;
    for (const auto& l : got->layers()) out.push_back(Unsharded(l.out(), spec_, node.tp));
    return out;
  }
  void Prefill(Node& node, uint64_t slot, const std::vector<v1::LayerInput>& layers) {
    v1::PrefillRequest req;
    req.set_slot(slot);
    for (int64_t i = 0; i < layers[0].mixed_qkv().shape(0); ++i) {
      req.add_tokens(static_cast<int32_t>(100 + i));
    }
    for (const auto& l : Sharded(layers, spec_, node.tp)) *req.add_layers() = l;
    auto got = node.client->Prefill(req);
    ASSERT_TRUE(got.ok()) << "tp " << node.tp << ": " << got.status();
  }
  uint64_t NewSlot(Node& node) {
    auto a = node.client->Allocate();
    EXPECT_TRUE(a.ok()) << a.status();
    return a.ok() ? a->slot() : 0;
  }

  Node twin_;  // TP = 1, never moves
  v1::GetInfoResponse info_;
  cache::ModelSpec spec_;
  int seed_ = 1;
};

TEST_F(TpServiceTest, InfoNamesEachRanksHeads) {
  Node four = StartNode(4);
  ASSERT_NE(four.client, nullptr);
  auto info = four.client->Info();
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->model().tp_size(), 4);
  ASSERT_EQ(info->model().shards_size(), 4);
  EXPECT_EQ(info->model().num_v_heads(), 8) << "the model, unsharded";
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(info->model().shards(r).rank(), r);
    EXPECT_EQ(info->model().shards(r).qk_head_begin(), r);
    EXPECT_EQ(info->model().shards(r).qk_heads(), 1);
    EXPECT_EQ(info->model().shards(r).v_head_begin(), 2 * r);
    EXPECT_EQ(info->model().shards(r).v_heads(), 2);
  }
  EXPECT_EQ(info_.model().tp_size(), 1);
}

TEST_F(TpServiceTest, UnshardedActivationsAreRefusedNamingTheShape) {
  Node two = StartNode(2);
  ASSERT_NE(two.client, nullptr);
  const uint64_t s = NewSlot(two);
  v1::DecodeRequest req;
  req.add_rows()->set_slot(s);
  for (const auto& l : Layers(1)) *req.add_layers() = l;  // [1, width]: a TP = 1 shape
  auto got = two.client->Decode(req);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(got.status().message().find("layers[0].mixed_qkv.shape"), std::string::npos)
      << got.status();
  EXPECT_NE(got.status().message().find("[2, 1, "), std::string::npos) << got.status();
  EXPECT_EQ(two.client->GetSlot(s)->seq_len(), 0) << "nothing applied";
}

TEST_F(TpServiceTest, TpServersDecodeAsOneRank) {
  for (int32_t tp : {2, 4}) {
    Node node = StartNode(tp);
    ASSERT_NE(node.client, nullptr);
    const uint64_t a = NewSlot(twin_), b = NewSlot(node);
    const std::vector<v1::LayerInput> prompt = Layers(6);
    Prefill(twin_, a, prompt);
    Prefill(node, b, prompt);
    for (int i = 0; i < 10; ++i) {  // L = 8: across a fold
      const std::vector<v1::LayerInput> step = Layers(1);
      EXPECT_EQ(Decode(node, b, 50 + i, step), Decode(twin_, a, 50 + i, step))
          << "tp " << tp << " step " << i;
    }
    auto ea = twin_.client->Export(a), eb = node.client->Export(b);
    ASSERT_TRUE(ea.ok() && eb.ok()) << ea.status() << eb.status();
    EXPECT_EQ(eb->SerializeAsString(), ea->SerializeAsString()) << "tp " << tp;
  }
}

// A checkpoint's parameters (safetensors) reach each rank sliced as the reference models slice
// them: a TP = 2 and a TP = 4 server decode bit for bit as a TP = 1 server of the same files.
TEST_F(TpServiceTest, ACheckpointsParametersAreSlicedPerRank) {
  const std::string config = CheckpointWithDistinctParams();
  Node one = StartNode(1, config);
  ASSERT_NE(one.client, nullptr);
  auto info = one.client->Info();
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_FALSE(info->model().params_from_seed()) << "the checkpoint's parameters";
  // Decode's head split is tiny-gdn-tp's: the checkpoint has the same heads, dims and dtype.
  const cache::ModelSpec spec = SpecOf(info->model());
  ASSERT_EQ(spec.QkvWidth(), spec_.QkvWidth());
  ASSERT_EQ(spec.shape.act_dtype, spec_.shape.act_dtype);
  for (int32_t tp : {2, 4}) {
    Node node = StartNode(tp, config);
    ASSERT_NE(node.client, nullptr);
    const uint64_t a = NewSlot(one), b = NewSlot(node);
    for (int i = 0; i < 6; ++i) {
      const std::vector<v1::LayerInput> step = client::SyntheticLayers(info->model(), 1, 90 + i);
      ASSERT_EQ(Decode(node, b, i, step), Decode(one, a, i, step)) << "tp " << tp << " step " << i;
    }
  }
}

// Every (P, D) pair in {1, 2, 4}: a slot prefilled and decoded on P (its ring not empty) moves
// to D — pushed by P (TransferSlot) or pulled by D (PullSlot) — and decodes on exactly as the
// twin, which is folded at the same token and never moves.
TEST_F(TpServiceTest, SlotsMoveBetweenEveryPairOfDegrees) {
  std::vector<Node> p_nodes, d_nodes;
  for (int32_t tp : {1, 2, 4}) {
    p_nodes.push_back(StartNode(tp));
    d_nodes.push_back(StartNode(tp));
    ASSERT_NE(p_nodes.back().client, nullptr);
    ASSERT_NE(d_nodes.back().client, nullptr);
  }
  int32_t token = 1;
  for (Node& p : p_nodes) {
    for (Node& d : d_nodes) {
      const bool pull = p.tp > d.tp;
      const std::string where = absl::StrCat("tp ", p.tp, " -> ", d.tp, pull ? " (pull)" : "");
      const uint64_t t = NewSlot(twin_), s = NewSlot(p);
      const std::vector<v1::LayerInput> prompt = Layers(5);
      Prefill(twin_, t, prompt);
      Prefill(p, s, prompt);
      for (int i = 0; i < 2; ++i, ++token) {
        const std::vector<v1::LayerInput> step = Layers(1);
        ASSERT_EQ(Decode(p, s, token, step), Decode(twin_, t, token, step)) << where;
      }
      ASSERT_GT(p.client->GetSlot(s)->write_pos(), 0) << where;
      ASSERT_TRUE(twin_.client->Export(t).ok());  // the twin folds at this token too

      uint64_t moved = 0;
      if (pull) {
        auto r = d.client->PullSlot(s, p.proc->grpc_address(), /*keep_source=*/false);
        ASSERT_TRUE(r.ok()) << where << ": " << r.status();
        moved = r->slot();
      } else {
        auto r = p.client->TransferSlot(s, d.proc->grpc_address(), /*keep_source=*/false);
        ASSERT_TRUE(r.ok()) << where << ": " << r.status();
        moved = r->remote_slot();
      }
      EXPECT_EQ(p.client->GetSlot(s).status().code(), absl::StatusCode::kNotFound) << where;
      auto info = d.client->GetSlot(moved);
      ASSERT_TRUE(info.ok()) << where << ": " << info.status();
      EXPECT_EQ(info->seq_len(), 7) << where;
      EXPECT_EQ(info->write_pos(), 0) << where;
      for (int i = 0; i < 8; ++i, ++token) {  // across a fold on the receiver
        const std::vector<v1::LayerInput> step = Layers(1);
        ASSERT_EQ(Decode(d, moved, token, step), Decode(twin_, t, token, step))
            << where << " step " << i;
      }
      auto ed = d.client->Export(moved), et = twin_.client->Export(t);
      ASSERT_TRUE(ed.ok() && et.ok());
      EXPECT_EQ(ed->SerializeAsString(), et->SerializeAsString()) << where;
      EXPECT_TRUE(d.client->Free(moved).ok());
      EXPECT_TRUE(twin_.client->Free(t).ok());
    }
  }
}

}  // namespace
}  // namespace replayssm::testing
