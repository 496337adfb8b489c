// Tensor parallelism (tp.h, tp_group.h): each rank's slices against the unsharded model, and a
// TP group of 2 or 4 shards on one backend against a TP = 1 cache — forwards of every kind
// bit-identical per head, and slots moved mid-sequence between every pair of TP degrees
// decoding on exactly as if they had never moved.
#include "replayssm/cache/tp.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "replayssm/cache/state_cache.h"
#include "test_model.h"
#include "tp_group.h"
#include "tp_slot_io.h"

namespace replayssm::cache {
namespace {

using testing::BackendBatch;
using testing::BackendWords;
using testing::Batch;
using testing::Oracle;
using testing::Tok;

// H = 8, HV = 16: splits 1, 2, 4 and 8 ways (the degrees the issue names); a convolution in
// bf16 so that windows are sliced in 2-byte channels.
ModelSpec TpModel(int32_t gate, int32_t state_dtype) {
  ModelSpec m;
  m.name = "tp-test";
  m.num_layers = 3;
  m.shape = {gate, 8, 16, 16, 16, 4, state_dtype, RSSM_DTYPE_BF16};
  m.conv_width = 4;
  m.round_beta = DefaultRoundBeta(gate);
  m.layers = SeededParams(m.shape, m.num_layers, 7, m.conv_width);
  for (LayerParams& p : m.layers) {  // a bias, so that its slicing is checked too
    p.conv_bias.resize(m.QkvWidth());
    for (size_t c = 0; c < p.conv_bias.size(); ++c) p.conv_bias[c] = 0.01f * (c % 7);
  }
  return m;
}

// A group's ranks spread over the backend's devices round-robin (on the H200 x2 machine: ranks
// on both GPUs; on the CPU: all on device 0, through the same per-rank device calls).
std::unique_ptr<StateCache> MakeCache(const ModelSpec& m, int32_t tp, CacheEventSink sink = nullptr,
                                      int64_t slots = 64, int64_t host_bytes = 0,
                                      bool ranks_at_once = false, int32_t track_interval = 0) {
  CacheOptions o;
  if (ranks_at_once) o.tp_ranks_at_once = CacheOptions::TpRanksAtOnce::kAlways;
  o.host_snapshot_bytes = host_bytes;
  o.event_sink = std::move(sink);
  o.backend = testing::TestBackend();
  o.memory_budget_bytes = slots * m.SlotBytes();
  o.track_interval = track_interval;
  o.tp_size = tp;
  if (tp > 1) {
    const int count = rssm_device_count(o.backend);
    for (int32_t r = 0; r < tp; ++r) o.devices.push_back(r % count);
  }
  absl::StatusOr<std::unique_ptr<StateCache>> c = StateCache::Create(m, o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? *std::move(c) : nullptr;
}

// The tensors of a batch of n tokens, [n, width] each, rearranged into the rank-major layout
// of a TP group (rank r's [n, width / tp] blocks one after another), or back.
void ToRankMajor(const ModelSpec& m, int32_t tp, int64_t n, Batch& b, bool back = false) {
  const int64_t es = rssm_dtype_size(m.shape.act_dtype);
  auto convert = [&](std::vector<uint8_t>& buf, int64_t width, auto runs_of) {
    std::vector<uint8_t> out(buf.size());
    int64_t at = 0;
    for (int32_t r = 0; r < tp; ++r) {
      const TpShard s = ShardOf(m, tp, r);
      const std::vector<SliceRun> runs = runs_of(s);
      int64_t w = 0;
      for (const SliceRun& x : runs) w += x.count;
      if (back) {
        CopyFromShard(buf.data() + at, w, out.data(), width, n, runs, es);
      } else {
        CopyToShard(buf.data(), width, out.data() + at, w, n, runs, es);
      }
      at += n * w * es;
    }
    buf = std::move(out);
  };
  for (int32_t l = 0; l < m.num_layers; ++l) {
    convert(b.qkv[l], m.QkvWidth(), [&](const TpShard& s) { return QkvColumns(m, s); });
    convert(b.a[l], m.AWidth(), [&](const TpShard& s) { return std::vector{AColumns(m, s)}; });
    convert(b.b[l], m.BWidth(), [&](const TpShard& s) { return std::vector{BColumns(m, s)}; });
    convert(b.out[l], m.OutWidth(),
            [&](const TpShard& s) { return std::vector{OutColumns(m, s)}; });
    b.io[l] =
        LayerIo{b.qkv[l].data(), b.a[l].data(), b.b[l].data(), b.out[l].data(), IoMemory::kHost};
  }
}

TEST(TpLayout, RefusesDegreesThatSplitAHead) {
  const ModelSpec m = TpModel(RSSM_GATE_GDN, RSSM_DTYPE_F32);
  for (int32_t tp : {0, 3, 6, 16, 17}) {
    const absl::Status st = CheckTpSize(m, tp);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << tp;
    EXPECT_NE(st.message().find("tp_size"), std::string::npos) << st;
    EXPECT_NE(st.message().find(absl::StrCat("got ", tp)), std::string::npos) << st;
  }
  CacheOptions o;
  o.tp_size = 3;
  EXPECT_EQ(StateCache::Create(m, o).status().code(), absl::StatusCode::kInvalidArgument);
  for (int32_t tp : {1, 2, 4, 8}) EXPECT_TRUE(CheckTpSize(m, tp).ok()) << tp;
}

TEST(TpLayout, DevicesAreOnePerRank) {
  const ModelSpec m = TpModel(RSSM_GATE_GDN, RSSM_DTYPE_F32);
  CacheOptions o;
  o.backend = testing::TestBackend();
  o.memory_budget_bytes = 8 * m.SlotBytes();
  o.tp_size = 2;
  o.devices = {0};
  absl::Status st = StateCache::Create(m, o).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("options.devices: expected 2 devices"), std::string::npos) << st;
  o.devices = {0, 64};
  st = StateCache::Create(m, o).status();
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("options.devices[1]"), std::string::npos) << st;
}

// Ranks overlap their work only on distinct devices: two or more, none shared.
TEST(TpLayout, RanksAreApartOnlyOnDistinctDevices) {
  EXPECT_TRUE(RanksOnDistinctDevices({0, 1}));
  EXPECT_TRUE(RanksOnDistinctDevices({3, 0, 2, 1}));
  EXPECT_FALSE(RanksOnDistinctDevices({0, 0}));
  EXPECT_FALSE(RanksOnDistinctDevices({0, 1, 0, 2}));
  EXPECT_FALSE(RanksOnDistinctDevices({1}));
  EXPECT_FALSE(RanksOnDistinctDevices({}));
}

// Every byte of a layer's unsharded state belongs to exactly one rank.
TEST(TpLayout, RanksTileTheLayerStateExactly) {
  for (int32_t tp : {1, 2, 4, 8}) {
    const ModelSpec m = TpModel(RSSM_GATE_KDA, RSSM_DTYPE_BF16);
    std::vector<int> owner(m.LayerStateBytes(), 0);
    for (int32_t r = 0; r < tp; ++r) {
      const TpShard s = ShardOf(m, tp, r);
      const ModelSpec sm = ShardModel(m, s);
      int64_t covered = 0;
      for (const SliceRun& x : LayerStateRuns(m, s)) {
        for (int64_t i = 0; i < x.count; ++i) ++owner[x.full + i];
        covered += x.count;
      }
      EXPECT_EQ(covered, sm.LayerStateBytes()) << tp << " " << r;
    }
    for (size_t i = 0; i < owner.size(); ++i)
      ASSERT_EQ(owner[i], 1) << "byte " << i << " tp " << tp;
  }
}

// The convolution's channels are sliced per section: rank r's q, k and v channels are the
// unsharded model's q heads, k heads and v heads of that rank — not one range of q|k|v.
TEST(TpLayout, ConvChannelsAreSlicedPerSection) {
  const ModelSpec m = TpModel(RSSM_GATE_GDN, RSSM_DTYPE_F32);
  const int64_t k = m.shape.head_k, v = m.shape.head_v, h = m.shape.num_qk_heads;
  const int64_t w = m.conv_width;
  for (int32_t tp : {2, 4, 8}) {
    for (int32_t r = 0; r < tp; ++r) {
      const TpShard s = ShardOf(m, tp, r);
      const ModelSpec sm = ShardModel(m, s);
      const int64_t hq = h / tp, hv = m.shape.num_v_heads / tp;
      // The unsharded channel of each of the rank's channels, written out per section.
      std::vector<int64_t> expect;
      for (int64_t c = 0; c < hq * k; ++c) expect.push_back(r * hq * k + c);              // q
      for (int64_t c = 0; c < hq * k; ++c) expect.push_back(h * k + r * hq * k + c);      // k
      for (int64_t c = 0; c < hv * v; ++c) expect.push_back(2 * h * k + r * hv * v + c);  // v
      ASSERT_EQ(static_cast<int64_t>(expect.size()), sm.QkvWidth());
      for (int32_t l = 0; l < m.num_layers; ++l) {
        for (size_t c = 0; c < expect.size(); ++c) {
          for (int64_t j = 0; j < w; ++j) {
            ASSERT_EQ(sm.layers[l].conv_weight[c * w + j],
                      m.layers[l].conv_weight[expect[c] * w + j])
                << "tp " << tp << " rank " << r << " channel " << c;
          }
          ASSERT_EQ(sm.layers[l].conv_bias[c], m.layers[l].conv_bias[expect[c]]);
        }
        for (int64_t i = 0; i < hv; ++i) {
          EXPECT_EQ(sm.layers[l].a_log[i], m.layers[l].a_log[r * hv + i]);
          EXPECT_EQ(sm.layers[l].dt_bias[i], m.layers[l].dt_bias[r * hv + i]);
        }
      }
    }
  }
}

struct Params {
  int32_t gate;
  int32_t state_dtype;
};

class TpGroupTest : public ::testing::TestWithParam<Params> {
 protected:
  TpGroupTest() : m_(TpModel(GetParam().gate, GetParam().state_dtype)), oracle_(m_) {}

  // One decode step of `slot` in `c` with token t at position pos; returns the outputs in the
  // unsharded layout.
  Batch Decode(StateCache& c, int32_t tp, SlotId slot, Tok t) {
    Batch b = oracle_.MakeBatch({t});
    ToRankMajor(m_, tp, 1, b);
    absl::StatusOr<std::unique_ptr<Forward>> f = c.BeginForward({{slot, t.id}});
    EXPECT_TRUE(f.ok()) << f.status();
    for (int32_t l = 0; l < m_.num_layers; ++l) EXPECT_TRUE((*f)->RunLayer(l, b.io[l]).ok());
    EXPECT_TRUE((*f)->Commit().ok());
    ToRankMajor(m_, tp, 1, b, /*back=*/true);
    return b;
  }
  absl::Status Prefill(StateCache& c, int32_t tp, SlotId slot, const std::vector<int32_t>& ids,
                       int64_t start) {
    std::vector<Tok> toks;
    for (int32_t id : ids) toks.push_back({id, start + static_cast<int64_t>(toks.size())});
    Batch b = oracle_.MakeBatch(toks);
    ToRankMajor(m_, tp, static_cast<int64_t>(toks.size()), b);
    return c.Prefill(slot, ids, b.io);
  }
  // A TP = 2 batch of `toks` whose q, k and v are +Inf (bf16 0x7f80) on rank 1, or on both
  // ranks: those heads' state turns not finite (the service refuses such inputs; an overflow
  // gets there through finite ones).
  Batch InfBatch(const std::vector<Tok>& toks, bool both_ranks) {
    const int64_t n = static_cast<int64_t>(toks.size());
    Batch b = oracle_.MakeBatch(toks);
    ToRankMajor(m_, 2, n, b);
    EXPECT_EQ(rssm_dtype_size(m_.shape.act_dtype), 2);
    const size_t rank1 = n * (m_.QkvWidth() / 2) * 2;  // rank 0's [n, C / 2] block, in bytes
    for (int32_t l = 0; l < m_.num_layers; ++l) {
      EXPECT_EQ(b.qkv[l].size(), 2 * rank1);
      for (size_t i = both_ranks ? 0 : rank1; i + 1 < b.qkv[l].size(); i += 2) {
        b.qkv[l][i] = 0x80;
        b.qkv[l][i + 1] = 0x7f;
      }
    }
    return b;
  }
  // Verify of drafts then Accept(n); the drafts' outputs, unsharded.
  Batch VerifyAccept(StateCache& c, int32_t tp, SlotId slot, const std::vector<Tok>& drafts,
                     int32_t n) {
    Batch b = oracle_.MakeBatch(drafts);
    ToRankMajor(m_, tp, static_cast<int64_t>(drafts.size()), b);
    std::vector<int32_t> ids;
    for (const Tok& t : drafts) ids.push_back(t.id);
    const SlotId slots[] = {slot};
    EXPECT_TRUE(c.Verify(slots, static_cast<int32_t>(drafts.size()), ids, b.io).ok());
    EXPECT_TRUE(c.Accept(slot, n).ok());
    ToRankMajor(m_, tp, static_cast<int64_t>(drafts.size()), b, /*back=*/true);
    return b;
  }

  ModelSpec m_;
  Oracle oracle_;
};

void ExpectSameOutputs(const Batch& got, const Batch& want, const std::string& where) {
  for (size_t l = 0; l < want.out.size(); ++l) {
    ASSERT_EQ(got.out[l], want.out[l]) << where << " layer " << l;
  }
}

void ExpectSameState(StateCache& a, SlotId sa, StateCache& b, SlotId sb, const std::string& where) {
  absl::StatusOr<ExportedState> ea = a.Export(sa), eb = b.Export(sb);
  ASSERT_TRUE(ea.ok() && eb.ok()) << ea.status() << eb.status();
  EXPECT_EQ(ea->seq_len, eb->seq_len) << where;
  EXPECT_EQ(ea->tokens, eb->tokens) << where;
  for (size_t l = 0; l < ea->checkpoints.size(); ++l) {
    ASSERT_EQ(ea->checkpoints[l], eb->checkpoints[l]) << where << " layer " << l;
  }
}

// Prefill, decode across folds, verify + accept: a TP group's outputs, cursors and exported
// (unsharded) states are those of a TP = 1 cache, bit for bit.
TEST_P(TpGroupTest, ForwardsAreBitIdenticalToOneRank) {
  std::unique_ptr<StateCache> one = MakeCache(m_, 1);
  for (int32_t tp : {2, 4, 8}) {
    std::unique_ptr<StateCache> group = MakeCache(m_, tp);
    ASSERT_NE(group, nullptr);
    EXPECT_EQ(group->model().shape.num_v_heads, m_.shape.num_v_heads);
    absl::StatusOr<SlotId> a = one->Allocate(), b = group->Allocate();
    ASSERT_TRUE(a.ok() && b.ok());
    const std::vector<int32_t> prompt = {5, 9, 2, 7, 1};
    ASSERT_TRUE(Prefill(*one, 1, *a, prompt, 0).ok());
    ASSERT_TRUE(Prefill(*group, tp, *b, prompt, 0).ok());
    int64_t pos = static_cast<int64_t>(prompt.size());
    for (int step = 0; step < 9; ++step, ++pos) {  // L = 4: folds every few steps
      const Tok t{static_cast<int32_t>(11 + step), pos};
      ExpectSameOutputs(Decode(*group, tp, *b, t), Decode(*one, 1, *a, t),
                        absl::StrCat("tp ", tp, " decode ", step));
      EXPECT_EQ(group->Info(*b)->write_pos, one->Info(*a)->write_pos);
    }
    const std::vector<Tok> drafts = {{40, pos}, {41, pos + 1}, {42, pos + 2}};
    ExpectSameOutputs(VerifyAccept(*group, tp, *b, drafts, 2), VerifyAccept(*one, 1, *a, drafts, 2),
                      absl::StrCat("tp ", tp, " verify"));
    EXPECT_EQ(group->Info(*b)->seq_len, one->Info(*a)->seq_len);
    ExpectSameState(*group, *b, *one, *a, absl::StrCat("tp ", tp));
    EXPECT_TRUE(one->Free(*a).ok());
    EXPECT_TRUE(group->Free(*b).ok());
    EXPECT_EQ(group->Info(*b).status().code(), absl::StatusCode::kNotFound);
  }
}

// Moves a slot mid-sequence (write_pos > 0) out of a cache of TP degree p into one of degree d
// through slot I/O, as a transfer does; both the moved slot and a TP = 1 twin that never moved
// go on decoding, bit for bit alike. (A move folds the state first; the twin is folded at the
// same token by the same guard, Export, so that both add the same records in the same order.)
// Each pair twice: the ranks' opens and commits in turn (as on one device), and at once on a
// thread each (as on distinct devices; forced, so that the threaded path runs on one GPU, on
// the CPU and under the sanitizers).
TEST_P(TpGroupTest, MovesBetweenEveryPairOfDegreesAreExact) {
  for (int32_t p : {1, 2, 4, 8}) {
    for (int32_t d : {1, 2, 4, 8}) {
      for (const bool at_once : {false, true}) {
        if (at_once && p == 1 && d == 1) continue;
        const std::string where =
            absl::StrCat("tp ", p, " -> ", d, at_once ? ", ranks at once" : "");
        std::unique_ptr<StateCache> src = MakeCache(m_, p, nullptr, 64, 0, at_once);
        std::unique_ptr<StateCache> dst = MakeCache(m_, d, nullptr, 64, 0, at_once);
        std::unique_ptr<StateCache> twin = MakeCache(m_, 1);
        absl::StatusOr<SlotId> s = src->Allocate(), t = twin->Allocate();
        ASSERT_TRUE(s.ok() && t.ok());
        const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9};
        ASSERT_TRUE(Prefill(*src, p, *s, prompt, 0).ok());
        ASSERT_TRUE(Prefill(*twin, 1, *t, prompt, 0).ok());
        int64_t pos = static_cast<int64_t>(prompt.size());
        for (int i = 0; i < 2; ++i, ++pos) {
          Decode(*src, p, *s, {20 + i, pos});
          Decode(*twin, 1, *t, {20 + i, pos});
        }
        ASSERT_GT(src->Info(*s)->write_pos, 0) << where;
        ASSERT_TRUE(twin->Export(*t).ok());  // the twin's fold at this token

        SlotIoOptions io;
        io.chunk_bytes = 1000;  // many chunks, none aligned to a rank's part
        absl::StatusOr<std::unique_ptr<SlotReader>> reader = src->OpenExport(*s, "move-1", io);
        ASSERT_TRUE(reader.ok()) << reader.status();
        EXPECT_EQ(src->Free(*s).code(), absl::StatusCode::kFailedPrecondition) << "moving";
        absl::StatusOr<std::unique_ptr<SlotWriter>> writer =
            dst->OpenImport((*reader)->seq_len(), io);
        ASSERT_TRUE(writer.ok()) << writer.status();
        ASSERT_EQ((*writer)->bytes(), (*reader)->bytes());
        for (size_t i = 0; i < (*reader)->num_chunks(); ++i) {
          absl::StatusOr<SlotChunk> c = (*reader)->Next();
          ASSERT_TRUE(c.ok()) << c.status();
          ASSERT_TRUE((*writer)->Write(c->offset, c->data, c->size, c->backend_memory).ok());
          (*reader)->Done(c->index);
        }
        absl::StatusOr<uint64_t> sum = (*reader)->Checksum();
        ASSERT_TRUE(sum.ok());
        absl::StatusOr<SlotId> moved = (*writer)->Commit((*reader)->tokens(), *sum);
        ASSERT_TRUE(moved.ok()) << where << ": " << moved.status();
        (*reader)->Finish(/*moved=*/true);
        EXPECT_EQ(src->Info(*s).status().code(), absl::StatusCode::kNotFound) << where;
        EXPECT_EQ(dst->Info(*moved)->write_pos, 0);
        EXPECT_EQ(dst->Info(*moved)->seq_len, pos);

        for (int i = 0; i < 6; ++i, ++pos) {  // across a fold
          ExpectSameOutputs(Decode(*dst, d, *moved, {30 + i, pos}),
                            Decode(*twin, 1, *t, {30 + i, pos}), absl::StrCat(where, " step ", i));
        }
        ExpectSameState(*dst, *moved, *twin, *t, where);
      }
    }
  }
}

// At Qwen3-Next's shape (2 MiB layers: checksum segments span layers and ranks), a group's
// reader yields the TP = 1 payload and checksum, in chunks of every size, and a group's writer
// takes it back.
TEST(TpSlotIo, AGroupMovesTheUnshardedPayloadWithItsChecksum) {
  absl::StatusOr<ModelSpec> m = ModelPreset("qwen3-next-80b-a3b");
  ASSERT_TRUE(m.ok());
  m->num_layers = 3;
  m->layers.resize(3);
  Oracle oracle(*m);
  const std::vector<int32_t> ids = {1, 2, 3};
  std::vector<uint8_t> want;
  for (int32_t tp : {1, 2, 4, 8}) {
    std::unique_ptr<StateCache> c = MakeCache(*m, tp);
    absl::StatusOr<SlotId> s = c->Allocate();
    ASSERT_TRUE(s.ok());
    Batch b = oracle.MakeBatch({{1, 0}, {2, 1}, {3, 2}});
    ToRankMajor(*m, tp, 3, b);
    ASSERT_TRUE(c->Prefill(*s, ids, b.io).ok());
    for (size_t chunk : {size_t{1000}, (size_t{1} << 20) + 17, size_t{1} << 30}) {
      // The ranks' readers staged too (the GPU's path: a few pinned buffers, given back in
      // any order by the group's copiers), on every backend.
      for (const bool staged : {false, true}) {
        SCOPED_TRACE(absl::StrCat("tp ", tp, ", chunk ", chunk, staged ? ", staged" : ""));
        SlotIoOptions read{.chunk_bytes = chunk};
        if (staged) read.path = SlotIoPath::kStaged;
        absl::StatusOr<std::unique_ptr<SlotReader>> r = c->OpenExport(*s, "read", read);
        ASSERT_TRUE(r.ok()) << r.status();
        std::vector<uint8_t> got((*r)->bytes());
        for (size_t i = 0; i < (*r)->num_chunks(); ++i) {
          absl::StatusOr<SlotChunk> ch = (*r)->Next();
          ASSERT_TRUE(ch.ok()) << ch.status();
          std::memcpy(got.data() + ch->offset, ch->data, ch->size);
          (*r)->Done(i);
        }
        absl::StatusOr<uint64_t> sum = (*r)->Checksum();
        ASSERT_TRUE(sum.ok()) << sum.status();
        EXPECT_EQ(*sum, PayloadChecksum(got.data(), got.size()));
        if (want.empty()) want = got;
        EXPECT_TRUE(got == want) << "the TP = 1 payload";
        (*r)->Finish(false);
        SlotIoOptions write{.chunk_bytes = chunk};
        if (staged) write.path = SlotIoPath::kStaged;  // the ranks hash through their staging
        absl::StatusOr<std::unique_ptr<SlotWriter>> w = c->OpenImport(3, write);
        ASSERT_TRUE(w.ok());
        for (size_t at = 0; at < got.size(); at += chunk) {  // back to front
          const size_t from = got.size() - std::min(got.size(), at + chunk);
          const size_t n = got.size() - at - from;
          ASSERT_TRUE((*w)->Write(from, got.data() + from, n).ok());
        }
        absl::StatusOr<SlotId> back = (*w)->Commit(ids, *sum);
        ASSERT_TRUE(back.ok()) << back.status();
        absl::StatusOr<ExportedState> e = c->Export(*back);
        ASSERT_TRUE(e.ok());
        for (int32_t l = 0; l < m->num_layers; ++l) {
          ASSERT_TRUE(std::memcmp(e->checkpoints[l].data(), want.data() + l * m->LayerStateBytes(),
                                  m->LayerStateBytes()) == 0);
        }
        ASSERT_TRUE(c->Free(*back).ok());
      }
    }
  }
}

// A corrupted payload is refused at the commit and nothing becomes live.
TEST_P(TpGroupTest, AMoveWithABadChecksumLeavesNothing) {
  std::unique_ptr<StateCache> dst = MakeCache(m_, 2);
  const int64_t live = dst->stats().slots_live, free = dst->stats().slots_free;
  absl::StatusOr<std::unique_ptr<SlotWriter>> w = dst->OpenImport(1, SlotIoOptions{});
  ASSERT_TRUE(w.ok());
  ASSERT_LT(dst->stats().slots_free, free) << "the import reserved its slots";
  std::vector<uint8_t> bytes((*w)->bytes(), 0);
  ASSERT_TRUE((*w)->Write(0, bytes.data(), bytes.size()).ok());
  const int32_t tokens[] = {1};
  const uint64_t sum = PayloadChecksum(bytes.data(), bytes.size());
  EXPECT_EQ((*w)->Commit(tokens, sum ^ 1).status().code(), absl::StatusCode::kDataLoss);
  // The failed commit ends the writer, as a rank's does: its reserved slots are back at once,
  // and neither a write nor a second commit with the right checksum makes anything live.
  EXPECT_EQ(dst->stats().slots_free, free);
  EXPECT_EQ((*w)->Write(0, bytes.data(), bytes.size()).code(),
            absl::StatusCode::kFailedPrecondition);
  const absl::StatusOr<SlotId> again = (*w)->Commit(tokens, sum);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  w->reset();
  EXPECT_EQ(dst->stats().slots_live, live);
  // A commit's fields are the group's: rank 0 answers first and names no rank (it said "tp rank
  // 0: tokens: ..." for a count every rank refuses alike).
  absl::StatusOr<std::unique_ptr<SlotWriter>> w2 = dst->OpenImport(2, SlotIoOptions{});
  ASSERT_TRUE(w2.ok());
  ASSERT_TRUE((*w2)->Write(0, bytes.data(), bytes.size()).ok());
  const absl::Status short_history =
      (*w2)->Commit(tokens, PayloadChecksum(bytes.data(), bytes.size())).status();
  EXPECT_EQ(short_history.code(), absl::StatusCode::kFailedPrecondition) << short_history;
  EXPECT_TRUE(absl::StartsWith(short_history.message(), "tokens: expected 2")) << short_history;
  w2->reset();
  EXPECT_EQ(dst->stats().slots_live, live);
}

// OnEachRank: ranks apart run at once, each on its own thread with its device made current
// there; ranks on one device run in turn on the caller's thread. Statuses come back by rank.
thread_local int current_rank = -1;  // the fake host's "device" of the calling thread

class FakeTpHost final : public TpSlotIoHost {
 public:
  explicit FakeTpHost(bool apart) : apart_(apart) {}
  void Use(size_t rank) const override { current_rank = static_cast<int>(rank); }
  bool ranks_at_once() const override { return apart_; }
  absl::Mutex& ops_mu() override { return mu_; }
  int32_t backend() const override { return RSSM_BACKEND_CPU; }
  SlotId Bind(std::vector<SlotId>) override { return 0; }
  void Unbind(SlotId) override {}
  absl::Status FreeAll(const std::vector<SlotId>&, absl::Status why) override { return why; }
  std::unique_ptr<uint8_t[]> TakePayloadBuffer() override { return nullptr; }
  void ReturnPayloadBuffer(std::unique_ptr<uint8_t[]>) override {}

 private:
  const bool apart_;
  absl::Mutex mu_;
};

TEST(TpSlotIo, OnEachRankRunsRanksApartAtOnce) {
  for (const bool apart : {false, true}) {
    FakeTpHost host(apart);
    std::vector<std::thread::id> threads(4);
    std::atomic<int> inside{0}, most{0};
    const std::vector<absl::Status> st = OnEachRank(host, 4, [&](size_t r) {
      threads[r] = std::this_thread::get_id();
      const int now = ++inside;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {
      }
      if (apart) {  // every rank waits until all four are inside: they must run at once
        while (most.load() < 4) std::this_thread::yield();
      }
      --inside;
      if (current_rank != static_cast<int>(r)) return absl::InternalError("wrong device");
      return r == 2 ? absl::UnavailableError("rank 2") : absl::OkStatus();
    });
    ASSERT_EQ(st.size(), 4u);
    for (size_t r = 0; r < 4; ++r) {
      EXPECT_EQ(st[r].code(), r == 2 ? absl::StatusCode::kUnavailable : absl::StatusCode::kOk)
          << st[r];
    }
    EXPECT_EQ(threads[0], std::this_thread::get_id());
    EXPECT_EQ(threads[3] == std::this_thread::get_id(), !apart);
    EXPECT_EQ(most.load(), apart ? 4 : 1);
  }
}
// A move a rank refuses leaves every rank as it was (the ranks open and commit together): a
// move out of a slot in an open forward, a commit with the wrong tokens, a move in with no
// free slot.
TEST_P(TpGroupTest, RefusedMovesLeaveEveryRankAsItWas) {
  for (const bool at_once : {false, true}) {
    SCOPED_TRACE(at_once ? "ranks at once" : "ranks in turn");
    std::unique_ptr<StateCache> c = MakeCache(m_, 2, nullptr, /*slots=*/4, 0, at_once);
    absl::StatusOr<SlotId> s = c->Allocate();
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(Prefill(*c, 2, *s, {1, 2, 3}, 0).ok());
    {
      absl::StatusOr<std::unique_ptr<Forward>> f = c->BeginForward({{*s, 4}});
      ASSERT_TRUE(f.ok()) << f.status();
      EXPECT_EQ(c->OpenExport(*s, "busy", SlotIoOptions{}).status().code(),
                absl::StatusCode::kFailedPrecondition);
    }  // abandoned
    {
      absl::StatusOr<std::unique_ptr<SlotReader>> r = c->OpenExport(*s, "now", SlotIoOptions{});
      ASSERT_TRUE(r.ok()) << r.status();  // no rank was left MOVING
      (*r)->Finish(false);
    }
    Decode(*c, 2, *s, {4, 3});
    absl::StatusOr<SlotInfo> info = c->Info(*s);
    ASSERT_TRUE(info.ok());
    EXPECT_EQ(info->seq_len, 4);

    const int64_t live = c->stats().slots_live;
    absl::StatusOr<std::unique_ptr<SlotWriter>> w = c->OpenImport(2, SlotIoOptions{});
    ASSERT_TRUE(w.ok()) << w.status();
    std::vector<uint8_t> bytes((*w)->bytes(), 0);
    ASSERT_TRUE((*w)->Write(0, bytes.data(), bytes.size()).ok());
    const int32_t one_token[] = {1};
    EXPECT_EQ((*w)->Commit(one_token, PayloadChecksum(bytes.data(), bytes.size())).status().code(),
              absl::StatusCode::kFailedPrecondition);
    w->reset();
    EXPECT_EQ(c->stats().slots_live, live);

    std::vector<SlotId> all;
    for (;;) {
      absl::StatusOr<SlotId> a = c->Allocate();
      if (!a.ok()) {
        ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
        break;
      }
      all.push_back(*a);
    }
    const int64_t full = c->stats().slots_live;
    EXPECT_EQ(c->OpenImport(1, SlotIoOptions{}).status().code(),
              absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(c->stats().slots_live, full);
    ASSERT_TRUE(c->Free(all.back()).ok());
    absl::StatusOr<std::unique_ptr<SlotWriter>> room = c->OpenImport(1, SlotIoOptions{});
    EXPECT_TRUE(room.ok()) << room.status();  // the refused one reserved nothing on any rank
  }
}

// A decode forward over `slot` whose every layer is queued (no doorbells), on `group`.
std::unique_ptr<Forward> QueuedDecode(StateCache& group, SlotId slot, const BackendBatch& dev,
                                      int32_t token) {
  absl::StatusOr<std::unique_ptr<Forward>> f = group.BeginForward({{slot, token}});
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return nullptr;
  for (int32_t l = 0; l < static_cast<int32_t>(dev.io.size()); ++l) {
    EXPECT_TRUE((*f)->RunLayer(l, dev.io[l]).ok());
  }
  return *std::move(f);
}

// A continuation tries the group's lock and never waits for it: its caller holds the planned
// forward's lock, which that forward's deadline needs to ring its doorbells, and the lock's
// holder may be waiting for the device (a begin that frees device memory waits for every
// stream), so for those doorbells: an outside review's cycle that hung every planned forward.
// Busy, it is not continued (the caller commits previous the usual way).
TEST_P(TpGroupTest, AContinuationNeverWaitsForTheGroupsLock) {
  std::unique_ptr<StateCache> group = MakeCache(m_, 2);
  ASSERT_NE(group, nullptr);
  const SlotId s = *group->Allocate();
  ASSERT_TRUE(Prefill(*group, 2, s, {5, 9}, 0).ok());
  Batch host = oracle_.MakeBatch({{7, 2}});
  ToRankMajor(m_, 2, 1, host);
  BackendBatch dev(group->options().backend, host);
  std::unique_ptr<Forward> f = QueuedDecode(*group, s, dev, 7);
  ASSERT_NE(f, nullptr);
  absl::Mutex& ops = dynamic_cast<TpSlotIoHost&>(*group).ops_mu();
  absl::Notification held, release;
  std::thread holder([&] {
    absl::MutexLock lock(&ops);
    held.Notify();
    release.WaitForNotification();
  });
  held.WaitForNotification();
  std::atomic<bool> returned{false};
  absl::StatusOr<std::unique_ptr<Forward>> next;
  std::thread caller([&] {
    next = group->ContinueForward(f, {{s, 8}});
    returned = true;
  });
  for (int i = 0; i < 200 && !returned; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_TRUE(returned) << "waited for the group's lock";
  release.Notify();
  holder.join();
  caller.join();
  ASSERT_TRUE(next.ok()) << next.status();
  EXPECT_EQ(*next, nullptr) << "the lock was busy: not continued";
  ASSERT_NE(f, nullptr) << "previous untouched";
  next = group->ContinueForward(f, {{s, 8}});  // free now: continued
  ASSERT_TRUE(next.ok()) << next.status();
  ASSERT_NE(*next, nullptr);
  for (int32_t l = 0; l < m_.num_layers; ++l) ASSERT_TRUE((*next)->RunLayer(l, dev.io[l]).ok());
  ASSERT_TRUE((*next)->Commit().ok());
  EXPECT_EQ(group->Info(s)->seq_len, 4);
}

// A group's ReleaseWaits names the earliest unrung wait of any rank, not rank 0's: rank 0's
// engine rang layers 0 and 1, rank 1's layer 0 only. Once every wait was issued (CPU: the
// queue goes on past the release, layer 2 unrung on both ranks), rank 0's first unrung wait
// is layer 2 and rank 1's layer 1: the group's is 1 (it was 2, the error naming a layer whose
// doorbell had rung).
TEST_P(TpGroupTest, ReleaseWaitsNamesTheEarliestUnrungWaitOfAnyRank) {
  std::unique_ptr<StateCache> group = MakeCache(m_, 2);
  ASSERT_NE(group, nullptr);
  const int32_t backend = group->options().backend;
  const int layers = m_.num_layers;
  ASSERT_EQ(layers, 3);
  const SlotId s = *group->Allocate();
  ASSERT_TRUE(Prefill(*group, 2, s, {5, 9}, 0).ok());
  Batch host = oracle_.MakeBatch({{7, 2}});
  ToRankMajor(m_, 2, 1, host);
  BackendBatch dev(backend, host);
  // Each rank's own bells, rank-major: ready[r][l] at r * 2L + l, done[r][l] after it.
  BackendWords words(backend, 4 * layers);
  std::vector<LayerDoorbells> bells;
  for (int r = 0; r < 2; ++r) {
    for (int l = 0; l < layers; ++l) {
      bells.push_back({words.at(r * 2 * layers + l), words.at(r * 2 * layers + layers + l)});
    }
  }
  words.Fill(3, 0, 2);                        // rank 0: layers 0 and 1
  words.Fill(3, 2 * layers, 2 * layers + 1);  // rank 1: layer 0
  absl::StatusOr<std::unique_ptr<Forward>> f = group->BeginForward({{s, 7}});
  ASSERT_TRUE(f.ok()) << f.status();
  absl::Status queued;
  std::thread driver([&] { queued = (*f)->RunLayers(dev.io, bells, 3); });  // CPU: blocks
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  (*f)->ReleaseWaits();
  driver.join();
  ASSERT_TRUE(queued.ok()) << queued;
  ASSERT_TRUE((*f)->Synchronize().ok());
  EXPECT_EQ((*f)->ReleaseWaits(), 1) << "rank 1's layer 1";
  f->reset();  // abandoned: nothing moved
  EXPECT_EQ(group->Info(s)->seq_len, 2);
}

// A group's prefill holds the slot on every rank from its start to its end: a Free or an
// export meanwhile is refused by rank 0 and touches no rank (before, the ranks prefilled one
// after another outside the group's lock, and a Free between them freed rank 0's half only).
TEST_P(TpGroupTest, APrefillHoldsTheSlotOnEveryRank) {
  std::unique_ptr<StateCache> c = MakeCache(m_, 2, nullptr, /*slots=*/4);
  absl::StatusOr<SlotId> s = c->Allocate();
  ASSERT_TRUE(s.ok());
  const std::vector<int32_t> ids = {1, 2, 3};
  std::vector<Tok> toks;
  for (int32_t id : ids) toks.push_back({id, static_cast<int64_t>(toks.size())});
  Batch b = oracle_.MakeBatch(toks);
  ToRankMajor(m_, 2, 3, b);
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = c->BeginPrefillInPlace(*s, ids);
    ASSERT_TRUE(f.ok()) << f.status();
    const absl::Status busy = c->Free(*s);
    EXPECT_EQ(busy.code(), absl::StatusCode::kFailedPrecondition) << busy;
    EXPECT_EQ(c->Donate(*s).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(c->OpenExport(*s, "m", SlotIoOptions{}).status().code(),
              absl::StatusCode::kFailedPrecondition);
    for (int32_t l = 0; l < m_.num_layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, b.io[l]).ok());
    ASSERT_TRUE((*f)->Commit().ok());
  }
  EXPECT_EQ(c->Info(*s)->seq_len, 3);
  // Prefills and Frees from two threads: whichever way each race goes, every rank agrees.
  std::vector<int32_t> many;
  std::vector<Tok> many_toks;
  for (int32_t i = 0; i < 48; ++i) {
    many.push_back(i % 7 + 1);
    many_toks.push_back({many.back(), static_cast<int64_t>(i)});
  }
  Batch mb = oracle_.MakeBatch(many_toks);
  ToRankMajor(m_, 2, static_cast<int64_t>(many.size()), mb);
  std::atomic<bool> freed{false};
  std::atomic<int> prefilled{0};
  std::thread prefills([&] {
    while (!freed.load() && prefilled.load() < 2000) {
      const absl::Status st = c->Prefill(*s, many, mb.io);
      if (!st.ok()) {  // only ever refused whole: busy, or freed
        EXPECT_TRUE(st.code() == absl::StatusCode::kFailedPrecondition ||
                    st.code() == absl::StatusCode::kNotFound)
            << st;
      }
      ++prefilled;
    }
  });
  while (prefilled.load() < 2) std::this_thread::yield();
  while (!freed.load() && prefilled.load() < 2000) {
    if (c->Free(*s).ok()) freed = true;
  }
  prefills.join();
  ASSERT_TRUE(freed.load() || c->Free(*s).ok());
  EXPECT_EQ(c->Info(*s).status().code(), absl::StatusCode::kNotFound);
  std::vector<SlotId> all;  // every rank freed its half: the group's every slot allocates
  for (int64_t i = 0; i < c->capacity(); ++i) {
    absl::StatusOr<SlotId> a = c->Allocate();
    ASSERT_TRUE(a.ok()) << "slot " << i << ": " << a.status();
    all.push_back(*a);
  }
  EXPECT_EQ(c->Allocate().status().code(), absl::StatusCode::kResourceExhausted);
}

// The prefix cache of a group: a donation is found by a later request, at the same length as
// on one rank, and the new slot continues the donated state.
TEST_P(TpGroupTest, DonatedPrefixIsFoundByTheGroup) {
  std::unique_ptr<StateCache> one = MakeCache(m_, 1), group = MakeCache(m_, 2);
  absl::StatusOr<SlotId> a = one->Allocate(), b = group->Allocate();
  ASSERT_TRUE(a.ok() && b.ok());
  const std::vector<int32_t> prompt = {8, 6, 7, 5, 3};
  ASSERT_TRUE(Prefill(*one, 1, *a, prompt, 0).ok());
  ASSERT_TRUE(Prefill(*group, 2, *b, prompt, 0).ok());
  ASSERT_TRUE(one->Donate(*a).ok());
  ASSERT_TRUE(group->Donate(*b).ok());
  const std::vector<int32_t> turn2 = {8, 6, 7, 5, 3, 0, 9};
  EXPECT_EQ(group->MatchPrefix(turn2), 5);
  absl::StatusOr<StateCache::PrefixAllocation> pa = one->AllocateFromPrefix(turn2);
  absl::StatusOr<StateCache::PrefixAllocation> pb = group->AllocateFromPrefix(turn2);
  ASSERT_TRUE(pa.ok() && pb.ok());
  EXPECT_EQ(pb->matched, 5);
  ExpectSameOutputs(Decode(*group, 2, pb->slot, {0, 5}), Decode(*one, 1, pa->slot, {0, 5}), "hit");
  ExpectSameState(*group, pb->slot, *one, pa->slot, "hit");
}

// Per-shard host tiers: a donation pushed out of every shard's backend memory is found by the
// group's prefix match on the host, and the slot it gives decodes as a TP = 1 host hit, bit for
// bit.
TEST_P(TpGroupTest, AGroupHitFromHostEqualsATp1Hit) {
  const int64_t host = 4 * m_.LayerStateBytes() * m_.num_layers;
  // Two backend slots each: a TP = 1 slot is twice a rank's.
  std::unique_ptr<StateCache> one = MakeCache(m_, 1, nullptr, 2, host),
                              group = MakeCache(m_, 2, nullptr, 1, host);
  const std::vector<int32_t> prompt = {8, 6, 7, 5, 3}, turn2 = {8, 6, 7, 5, 3, 0, 9};
  for (auto [c, tp] : {std::pair{one.get(), 1}, {group.get(), 2}}) {
    absl::StatusOr<SlotId> a = c->Allocate();
    ASSERT_TRUE(a.ok());
    ASSERT_TRUE(Prefill(*c, tp, *a, prompt, 0).ok());
    ASSERT_TRUE(c->Donate(*a).ok());
    absl::StatusOr<SlotId> x = c->Allocate(), y = c->Allocate();  // spills the donation
    ASSERT_TRUE(x.ok() && y.ok()) << x.status() << y.status();
    ASSERT_TRUE(c->Free(*x).ok() && c->Free(*y).ok());
    EXPECT_EQ(c->stats().slots_snapshot, 0) << tp;
    EXPECT_EQ(c->stats().snapshot_spills, 1) << tp;
    EXPECT_EQ(c->MatchPrefix(turn2), 5) << tp;
  }
  EXPECT_EQ(group->stats().host_bytes, one->stats().host_bytes) << "the ranks' halves add up";
  absl::StatusOr<StateCache::PrefixAllocation> pa = one->AllocateFromPrefix(turn2);
  absl::StatusOr<StateCache::PrefixAllocation> pb = group->AllocateFromPrefix(turn2);
  ASSERT_TRUE(pa.ok() && pb.ok()) << pa.status() << pb.status();
  EXPECT_EQ(pb->matched, 5);
  EXPECT_EQ(group->stats().host_hits, 1);
  EXPECT_EQ(one->stats().host_hits, 1);
  ExpectSameState(*group, pb->slot, *one, pa->slot, "host hit");
  ExpectSameOutputs(Decode(*group, 2, pb->slot, {0, 5}), Decode(*one, 1, pa->slot, {0, 5}),
                    "host hit");
  ExpectSameState(*group, pb->slot, *one, pa->slot, "host hit, then decode");
}

// A group reports a snapshot once, when every shard holds it, and its eviction once.
TEST_P(TpGroupTest, AGroupReportsEachSnapshotOnce) {
  std::vector<CacheEvent> events;
  std::unique_ptr<StateCache> group = MakeCache(
      m_, 2, [&](const CacheEvent& e) { events.push_back(e); },
      /*slots=*/1);  // each shard holds 2 half-size slots
  absl::StatusOr<SlotId> b = group->Allocate();
  ASSERT_TRUE(b.ok());
  const std::vector<int32_t> prompt = {8, 6, 7, 5, 3};
  ASSERT_TRUE(Prefill(*group, 2, *b, prompt, 0).ok());
  ASSERT_TRUE(group->Donate(*b).ok());
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].type, CacheEvent::Type::kStored);
  EXPECT_EQ(events[0].tokens, prompt);
  ASSERT_TRUE(group->Allocate().ok());
  ASSERT_TRUE(group->Allocate().ok());  // evicts the snapshot on both shards
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[1].type, CacheEvent::Type::kRemoved);
  EXPECT_EQ(events[1].tokens, prompt);
}

// A prefix the ranks hold to different lengths (a track snapshot one rank skipped: its state
// was not finite) is asked again at the shorter one; the group counts one lookup. It reported
// rank 0's counters, which counted both attempts (a hit and a miss for one lookup).
TEST_P(TpGroupTest, ALookupTheRanksAnswerDifferentlyIsCountedOnce) {
  std::unique_ptr<StateCache> c = MakeCache(m_, 2, nullptr, /*slots=*/8, /*host_bytes=*/0,
                                            /*ranks_at_once=*/false, /*track_interval=*/4);
  absl::StatusOr<SlotId> s = c->Allocate();
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(Prefill(*c, 2, *s, {1, 2, 3}, 0).ok());
  Batch b = InfBatch({{4, 3}}, /*both_ranks=*/false);  // the fourth token: a track boundary
  absl::StatusOr<std::unique_ptr<Forward>> f = c->BeginForward({{*s, 4}});
  ASSERT_TRUE(f.ok()) << f.status();
  for (int32_t l = 0; l < m_.num_layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, b.io[l]).ok());
  ASSERT_TRUE((*f)->Commit().ok());
  const CacheStats before = c->stats();
  absl::StatusOr<StateCache::PrefixAllocation> a = c->AllocateFromPrefix({1, 2, 3, 4, 5});
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->matched, 0) << "rank 1 holds no prefix";
  EXPECT_EQ(a->source, StateCache::PrefixAllocation::Source::kNone);
  const CacheStats after = c->stats();
  EXPECT_EQ(after.snapshot_hits, before.snapshot_hits) << "rank 0's first attempt, not counted";
  EXPECT_EQ(after.snapshot_misses, before.snapshot_misses + 1);
  ASSERT_TRUE(c->Free(a->slot).ok());
  ASSERT_TRUE(c->Free(*s).ok());
}

// A move out of a slot not finite on every rank is one refusal: the ranks check together and
// each counted its own (the group's count said 2 for one refused move).
TEST_P(TpGroupTest, AMoveEveryRankRefusesIsCountedOnce) {
  std::unique_ptr<StateCache> c = MakeCache(m_, 2, nullptr, /*slots=*/4);
  absl::StatusOr<SlotId> s = c->Allocate();
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(Prefill(*c, 2, *s, {1, 2, 3}, 0).ok());
  Batch b = InfBatch({{4, 3}, {5, 4}}, /*both_ranks=*/true);
  ASSERT_TRUE(c->Prefill(*s, {4, 5}, b.io).ok());
  const CacheStats before = c->stats();
  const absl::Status refused = c->OpenExport(*s, "move", SlotIoOptions{}).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("move out: the slot's state is not finite"), std::string::npos)
      << refused;
  EXPECT_EQ(c->stats().nonfinite_refusals, before.nonfinite_refusals + 1);
  EXPECT_EQ(c->stats().slots_live, 1) << "the slot stays, to be freed";
  ASSERT_TRUE(c->Free(*s).ok());
}

// A donation one rank refuses (its heads' state not finite) leaves the slot live on every
// rank, under its handle, to be freed: before, rank 0 had donated already (its half a
// snapshot, the handle dead) and rank 1's half stayed live with nothing able to free it.
TEST_P(TpGroupTest, ADonationOneRankRefusesLeavesTheSlotWhole) {
  std::unique_ptr<StateCache> c = MakeCache(m_, 2, nullptr, /*slots=*/4);
  absl::StatusOr<SlotId> s = c->Allocate();
  ASSERT_TRUE(s.ok());
  ASSERT_TRUE(Prefill(*c, 2, *s, {1, 2, 3}, 0).ok());
  // Two tokens whose q, k and v are +Inf on rank 1 only: rank 1's heads' state is not finite.
  Batch b = InfBatch({{4, 3}, {5, 4}}, /*both_ranks=*/false);
  ASSERT_TRUE(c->Prefill(*s, {4, 5}, b.io).ok());
  const CacheStats before = c->stats();
  const absl::Status refused = c->Donate(*s);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find("tp rank 1: donate: the slot's state is not finite"),
            std::string::npos)
      << refused;
  absl::StatusOr<SlotInfo> info = c->Info(*s);
  ASSERT_TRUE(info.ok()) << info.status() << ": the handle still names the slot";
  EXPECT_EQ(info->seq_len, 5);
  const CacheStats after = c->stats();
  EXPECT_EQ(after.slots_live, 1);
  EXPECT_EQ(after.slots_snapshot, 0) << "no rank donated";
  EXPECT_EQ(after.nonfinite_refusals, before.nonfinite_refusals + 1) << "rank 1's, counted";
  EXPECT_EQ(c->MatchPrefix({1, 2, 3, 4, 5}), 0);
  ASSERT_TRUE(c->Free(*s).ok());
  int64_t allocated = 0;
  while (c->Allocate().ok()) ++allocated;
  EXPECT_EQ(allocated, c->capacity()) << "every rank's slot came back";
}

// A group's commit checks every rank's part before any rank's cursors move, then moves every
// rank's. A fold that failed after the move (rank 0's, of a row reaching a track boundary) kept
// the ranks after it from committing: the batch's other row stood a token further on rank 0
// than on rank 1, usable, and its next outputs were wrong.
TEST_P(TpGroupTest, ACommitThatFailsAfterItsMoveMovesEveryRank) {
  if (testing::TestBackend() != RSSM_BACKEND_CPU) {
    GTEST_SKIP() << "the CPU backend's fault seam (REPLAYSSM_CPU_FAIL_CALLS)";
  }
  std::unique_ptr<StateCache> one = MakeCache(m_, 1, nullptr, 8, 0, false, /*track_interval=*/4);
  std::unique_ptr<StateCache> group = MakeCache(m_, 2, nullptr, 8, 0, false, 4);
  ASSERT_TRUE(one != nullptr && group != nullptr);
  const SlotId ga = *group->Allocate(), gb = *group->Allocate(), ob = *one->Allocate();
  ASSERT_TRUE(Prefill(*group, 2, ga, {1, 2, 3}, 0).ok());
  ASSERT_TRUE(Prefill(*group, 2, gb, {4, 5}, 0).ok());
  ASSERT_TRUE(Prefill(*one, 1, ob, {4, 5}, 0).ok());
  // One step of both rows: ga reaches the boundary (4 tokens) and folds; gb does not.
  Batch x = oracle_.MakeBatch({{7, 3}, {8, 2}});
  ToRankMajor(m_, 2, 2, x);
  {
    absl::StatusOr<std::unique_ptr<Forward>> f = group->BeginForward({{ga, 7}, {gb, 8}});
    ASSERT_TRUE(f.ok()) << f.status();
    for (int32_t l = 0; l < m_.num_layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, x.io[l]).ok());
    ASSERT_EQ(setenv("REPLAYSSM_CPU_FAIL_CALLS", "rssm_fold", 1), 0);
    const absl::Status st = (*f)->Commit();
    unsetenv("REPLAYSSM_CPU_FAIL_CALLS");
    EXPECT_NE(st.message().find("rssm_fold: cpu: a failure injected"), std::string::npos) << st;
  }
  Decode(*one, 1, ob, {8, 2});
  ExpectSameState(*group, gb, *one, ob, "the row beside the failed fold");
  ExpectSameOutputs(Decode(*group, 2, gb, {9, 3}), Decode(*one, 1, ob, {9, 3}), "its next step");
  EXPECT_FALSE(group->BeginForward({{ga, 9}}).ok()) << "the row whose fold failed is broken";
  EXPECT_TRUE(group->Free(ga).ok());
}

INSTANTIATE_TEST_SUITE_P(Gates, TpGroupTest,
                         ::testing::Values(Params{RSSM_GATE_GDN, RSSM_DTYPE_F32},
                                           Params{RSSM_GATE_GDN, RSSM_DTYPE_BF16},
                                           Params{RSSM_GATE_KDA, RSSM_DTYPE_F32}),
                         [](const ::testing::TestParamInfo<Params>& i) {
                           return absl::StrCat(i.param.gate == RSSM_GATE_GDN ? "gdn_" : "kda_",
                                               rssm_dtype_name(i.param.state_dtype));
                         });

// TpEventMerger: what a group reports from its shards' events, fed by hand (the shards' own
// spillers make the diverging cases below at random: an outside review saw one in ~100 runs).
class TpEventMergerTest : public ::testing::Test {
 protected:
  void Shard(int32_t rank, CacheEvent::Type type, Medium medium) {
    merger_.OnShardEvent(rank, CacheEvent{type, 7, medium, key_});
  }
  // The events reported since the last call, as "+gpu", "-host", ...
  std::vector<std::string> Told() {
    std::vector<std::string> out;
    for (const CacheEvent& e : told_) {
      EXPECT_EQ(e.ns, 7);
      EXPECT_EQ(e.tokens, key_);
      out.push_back(absl::StrCat(e.type == CacheEvent::Type::kStored ? "+" : "-",
                                 e.medium == Medium::kHost ? "host" : "gpu"));
    }
    told_.clear();
    return out;
  }
  using T = CacheEvent::Type;
  using V = std::vector<std::string>;
  const std::vector<int32_t> key_ = {1, 2, 3};
  std::vector<CacheEvent> told_;
  TpEventMerger merger_{2, [this](const CacheEvent& e) { told_.push_back(e); }};
};

TEST_F(TpEventMergerTest, AKeyIsHeldWhereEveryShardHoldsItInSomeTier) {
  Shard(0, T::kStored, Medium::kBackend);
  EXPECT_EQ(Told(), V{}) << "one shard of two";
  Shard(1, T::kStored, Medium::kBackend);
  EXPECT_EQ(Told(), V{"+gpu"});
  // Rank 0's spiller moves it to the host, rank 1's keeps it: the group still serves it (a hit
  // promotes rank 0's copy), on the host. It was reported removed, and never stored.
  Shard(0, T::kStored, Medium::kHost);
  EXPECT_EQ(Told(), V{});
  Shard(0, T::kRemoved, Medium::kBackend);
  EXPECT_EQ(Told(), (V{"+host", "-gpu"}));
  Shard(1, T::kStored, Medium::kHost);  // rank 1 follows: on the host everywhere
  Shard(1, T::kRemoved, Medium::kBackend);
  EXPECT_EQ(Told(), V{});
  // A promotion on both ranks: stored on the GPU, the host copies stay.
  Shard(0, T::kStored, Medium::kBackend);
  Shard(1, T::kStored, Medium::kBackend);
  EXPECT_EQ(Told(), V{"+gpu"});
  // Rank 1's host copy goes: on the GPU everywhere, on the host no more.
  Shard(1, T::kRemoved, Medium::kHost);
  EXPECT_EQ(Told(), V{"-host"});
  Shard(0, T::kRemoved, Medium::kBackend);  // rank 0 holds it on the host, rank 1 on the GPU
  EXPECT_EQ(Told(), (V{"+host", "-gpu"}));
  Shard(0, T::kRemoved, Medium::kHost);  // rank 0 holds it nowhere: the group neither
  EXPECT_EQ(Told(), V{"-host"});
  Shard(1, T::kRemoved, Medium::kBackend);
  EXPECT_EQ(Told(), V{});
  Shard(0, T::kStored, Medium::kBackend);  // forgotten, then told afresh
  Shard(1, T::kStored, Medium::kBackend);
  EXPECT_EQ(Told(), V{"+gpu"});
}

}  // namespace
}  // namespace replayssm::cache
