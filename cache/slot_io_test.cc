// Slot I/O: readers and writers on every path the backend allows (on CPU all three), the
// MOVING guard of a slot being exported, and an import's slot that is nobody's until it
// commits a complete, verified payload.
#include "replayssm/cache/slot_io.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "replayssm/cache/state_cache.h"
#include "test_model.h"

namespace replayssm::cache {
namespace {

using testing::Batch;
using testing::Oracle;

class SlotIoTest : public ::testing::Test {
 protected:
  void Make(const char* preset = "tiny-gdn", int32_t layers = 2, int64_t slots = 4) {
    absl::StatusOr<ModelSpec> m = ModelPreset(preset, RSSM_DTYPE_F32, 4);
    ASSERT_TRUE(m.ok()) << m.status();
    m->num_layers = layers;
    m->layers.resize(layers);
    CacheOptions o;
    o.backend = testing::TestBackend();
    o.memory_budget_bytes = slots * m->SlotBytes();
    absl::StatusOr<std::unique_ptr<StateCache>> c = StateCache::Create(*m, o);
    ASSERT_TRUE(c.ok()) << c.status();
    cache_ = std::move(*c);
    oracle_ = std::make_unique<Oracle>(cache_->model());
  }
  // The paths this backend runs (host-direct reads slot memory as host memory: CPU only).
  std::vector<SlotIoPath> Paths() const {
    std::vector<SlotIoPath> p = {SlotIoPath::kStaged, SlotIoPath::kDeviceDirect};
    if (cache_->options().backend == RSSM_BACKEND_CPU) p.push_back(SlotIoPath::kHostDirect);
    return p;
  }
  // A slot with a prefill and `steps` decode steps (its ring holds records).
  SlotId Prepared(int steps) {
    const SlotId s = *cache_->Allocate();
    Batch p = oracle_->MakeBatch({{1, 0}, {2, 1}, {3, 2}});
    EXPECT_TRUE(cache_->Prefill(s, {1, 2, 3}, p.io).ok());
    for (int t = 0; t < steps; ++t) {
      Batch b = oracle_->MakeBatch({{10 + t, 3 + t}});
      auto f = cache_->BeginForward({{s, 10 + t}});
      EXPECT_TRUE(f.ok()) << f.status();
      for (int l = 0; l < cache_->model().num_layers; ++l) {
        EXPECT_TRUE((*f)->RunLayer(l, b.io[l]).ok());
      }
      EXPECT_TRUE((*f)->Commit().ok());
    }
    return s;
  }
  std::vector<uint8_t> Payload(SlotId s) {
    absl::StatusOr<ExportedState> e = cache_->Export(s);
    EXPECT_TRUE(e.ok()) << e.status();
    std::vector<uint8_t> out;
    for (const auto& l : e->checkpoints) out.insert(out.end(), l.begin(), l.end());
    return out;
  }
  // A chunk's bytes, wherever they lie.
  void CopyOut(const SlotChunk& c, uint8_t* dst) {
    if (!c.backend_memory || cache_->options().backend == RSSM_BACKEND_CPU) {
      std::memcpy(dst, c.data, c.size);
      return;
    }
    const rssm_launch l{cache_->options().backend, nullptr};
    ASSERT_EQ(rssm_memcpy(&l, dst, c.data, c.size, RSSM_COPY_DEVICE_TO_HOST), RSSM_OK);
    ASSERT_EQ(rssm_synchronize(&l), RSSM_OK);
  }
  // A payload in the memory a writer's source must be in (backend memory when `backend`).
  struct Source {
    Source(int32_t b, const std::vector<uint8_t>& bytes, bool backend) : backend(b) {
      if (!backend) {
        host = bytes;
        data = host.data();
        return;
      }
      EXPECT_EQ(rssm_alloc(b, bytes.size(), &device), RSSM_OK);
      const rssm_launch l{b, nullptr};
      EXPECT_EQ(rssm_memcpy(&l, device, bytes.data(), bytes.size(), RSSM_COPY_HOST_TO_DEVICE),
                RSSM_OK);
      EXPECT_EQ(rssm_synchronize(&l), RSSM_OK);
      data = static_cast<const uint8_t*>(device);
    }
    ~Source() {
      if (device != nullptr) rssm_free(backend, device);
    }
    int32_t backend;
    std::vector<uint8_t> host;
    void* device = nullptr;
    const uint8_t* data = nullptr;
  };

  std::unique_ptr<StateCache> cache_;
  std::unique_ptr<Oracle> oracle_;
};

TEST(SlotIoPaths, FollowTheBackendAndWhatTheTransportTakes) {
  EXPECT_EQ(SelectSlotIoPath(RSSM_BACKEND_CPU, false), SlotIoPath::kHostDirect);
  EXPECT_EQ(SelectSlotIoPath(RSSM_BACKEND_CPU, true), SlotIoPath::kHostDirect)
      << "host memory never needs a transport that takes device memory";
  EXPECT_EQ(SelectSlotIoPath(RSSM_BACKEND_CUDA, false), SlotIoPath::kStaged);
  EXPECT_EQ(SelectSlotIoPath(RSSM_BACKEND_CUDA, true), SlotIoPath::kDeviceDirect);
  EXPECT_STREQ(SlotIoPathName(SlotIoPath::kStaged), "staged");
  // A tensor-parallel group's slot I/O is on the host: a receiver for it stages on CUDA.
  EXPECT_EQ(SelectCacheSlotIoPath(RSSM_BACKEND_CUDA, 1, true), SlotIoPath::kDeviceDirect);
  EXPECT_EQ(SelectCacheSlotIoPath(RSSM_BACKEND_CUDA, 2, true), SlotIoPath::kStaged);
  EXPECT_EQ(SelectCacheSlotIoPath(RSSM_BACKEND_CUDA, 2, false), SlotIoPath::kStaged);
  EXPECT_EQ(SelectCacheSlotIoPath(RSSM_BACKEND_CPU, 4, true), SlotIoPath::kHostDirect);
}

TEST_F(SlotIoTest, ReadersOnEveryPathYieldTheFoldedPayloadAndItsChecksum) {
  Make("qwen3-next-80b-a3b", 3);  // 6 MiB: several checksum segments, spanning layers
  const SlotId s = Prepared(2);
  for (SlotIoPath path : Paths()) {
    for (size_t chunk : {size_t{1000}, (size_t{1} << 20) + 17, size_t{1} << 30}) {
      SCOPED_TRACE(std::string(SlotIoPathName(path)) + ", chunk " + std::to_string(chunk));
      absl::StatusOr<std::unique_ptr<SlotReader>> r =
          cache_->OpenExport(s, "read", {.chunk_bytes = chunk, .path = path, .staging_buffers = 3});
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(cache_->Info(s)->write_pos, 0) << "folded before anything is read";
      EXPECT_EQ((*r)->seq_len(), 5);
      EXPECT_EQ((*r)->tokens().size(), 5u);
      std::vector<uint8_t> got((*r)->bytes());
      size_t covered = 0;
      for (size_t i = 0; i < (*r)->num_chunks(); ++i) {
        absl::StatusOr<SlotChunk> c = (*r)->Next();
        ASSERT_TRUE(c.ok()) << c.status();
        EXPECT_EQ(c->index, i);
        EXPECT_EQ(c->offset, covered);
        EXPECT_LE(c->size, chunk);
        const size_t per = (*r)->bytes() / 3;
        EXPECT_EQ(c->offset / per, (c->offset + c->size - 1) / per) << "within one layer";
        CopyOut(*c, got.data() + c->offset);
        covered += c->size;
        (*r)->Done(i);
      }
      EXPECT_EQ(covered, got.size());
      EXPECT_EQ((*r)->Next().status().code(), absl::StatusCode::kOutOfRange);
      absl::StatusOr<uint64_t> sum = (*r)->Checksum();
      ASSERT_TRUE(sum.ok()) << sum.status();
      (*r)->Finish(/*moved=*/false);
      const std::vector<uint8_t> want = Payload(s);
      EXPECT_TRUE(got == want) << "the chunks are the slot's payload";
      EXPECT_EQ(*sum, PayloadChecksum(want.data(), want.size()));
    }
  }
}

// SlotIoOptions::checksum = false (a mover that checks the bytes itself): the reader has no
// checksum to give, the writer commits what came whatever checksum it is told; the bytes are
// the same on every path.
TEST_F(SlotIoTest, WithoutAChecksumReadersAndWritersMoveTheSameBytes) {
  Make();
  const SlotId s = Prepared(2);
  const std::vector<uint8_t> want = Payload(s);
  for (SlotIoPath path : Paths()) {
    SCOPED_TRACE(SlotIoPathName(path));
    const SlotIoOptions o{.chunk_bytes = 1000, .path = path, .checksum = false};
    absl::StatusOr<std::unique_ptr<SlotReader>> r = cache_->OpenExport(s, "bare", o);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ((*r)->Checksum().status().code(), absl::StatusCode::kFailedPrecondition);
    absl::StatusOr<std::unique_ptr<SlotWriter>> w = cache_->OpenImport((*r)->seq_len(), o);
    ASSERT_TRUE(w.ok()) << w.status();
    for (size_t i = 0; i < (*r)->num_chunks(); ++i) {
      absl::StatusOr<SlotChunk> c = (*r)->Next();
      ASSERT_TRUE(c.ok()) << c.status();
      std::vector<uint8_t> bytes(c->size);
      CopyOut(*c, bytes.data());
      ASSERT_TRUE((*w)->Write(c->offset, bytes.data(), bytes.size()).ok());
      (*r)->Done(i);
    }
    absl::StatusOr<SlotId> moved = (*w)->Commit((*r)->tokens(), /*checksum=*/12345);
    ASSERT_TRUE(moved.ok()) << moved.status();
    (*r)->Finish(/*moved=*/false);
    EXPECT_TRUE(Payload(*moved) == want);
    ASSERT_TRUE(cache_->Free(*moved).ok());
  }
}

TEST_F(SlotIoTest, AStagedReaderHoldsNoMoreChunksThanItsBuffers) {
  Make();
  const SlotId s = Prepared(1);
  absl::StatusOr<std::unique_ptr<SlotReader>> r = cache_->OpenExport(
      s, "depth", {.chunk_bytes = 64, .path = SlotIoPath::kStaged, .staging_buffers = 2});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_GT((*r)->num_chunks(), 3u);
  EXPECT_EQ((*r)->depth(), 2u);
  ASSERT_TRUE((*r)->Next().ok());
  ASSERT_TRUE((*r)->Next().ok());
  absl::StatusOr<SlotChunk> third = (*r)->Next();
  EXPECT_EQ(third.status().code(), absl::StatusCode::kFailedPrecondition) << third.status();
  (*r)->Done(0);
  absl::StatusOr<SlotChunk> again = (*r)->Next();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->index, 2u);
}

TEST_F(SlotIoTest, AMovingSlotRefusesEveryMutationNamingTheMoveUntilFinished) {
  Make(/*preset=*/"tiny-gdn", 2, 6);
  const SlotId s = Prepared(2);
  absl::StatusOr<std::unique_ptr<SlotReader>> r = cache_->OpenExport(s, "move-7", {});
  ASSERT_TRUE(r.ok()) << r.status();
  Batch one = oracle_->MakeBatch({{5, 5}});
  std::vector<absl::Span<const uint8_t>> cps;
  std::vector<uint8_t> layer(cache::SlotPayloadBytes(cache_->model()) / 2);
  for (int l = 0; l < 2; ++l) cps.push_back(absl::MakeConstSpan(layer));
  const std::pair<const char*, absl::Status> refusals[] = {
      {"forward", cache_->BeginForward({{s, 5}}).status()},
      {"prefill", cache_->Prefill(s, {5}, one.io)},
      {"verify", cache_->Verify({s}, 1, {5}, one.io)},
      {"accept", cache_->Accept(s, 0)},
      {"import", cache_->Import(s, {1}, cps)},
      {"donate", cache_->Donate(s)},
      {"export", cache_->Export(s).status()},
      {"free", cache_->Free(s)},
      {"another move", cache_->OpenExport(s, "move-8", {}).status()},
  };
  for (const auto& [what, st] : refusals) {
    EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition) << what << ": " << st;
    EXPECT_NE(st.message().find("being transferred (request id move-7)"), std::string::npos)
        << what << ": " << st;
  }
  EXPECT_EQ(cache_->Info(s)->seq_len, 5) << "reading it is fine";
  (*r)->Finish(/*moved=*/false);
  EXPECT_TRUE(cache_->BeginForward({{s, 5}}).ok()) << "released as it was";
  absl::StatusOr<std::unique_ptr<SlotReader>> moved = cache_->OpenExport(s, "move-9", {});
  ASSERT_TRUE(moved.ok()) << moved.status();
  moved->reset();  // destroyed unfinished: released, not freed
  EXPECT_TRUE(cache_->Info(s).ok());
  moved = cache_->OpenExport(s, "move-10", {});
  ASSERT_TRUE(moved.ok()) << moved.status();
  (*moved)->Finish(/*moved=*/true);
  EXPECT_EQ(cache_->Info(s).status().code(), absl::StatusCode::kNotFound) << "moved: freed";
}

TEST_F(SlotIoTest, AnExportWithDraftsAwaitingAcceptIsRefusedAndChangesNothing) {
  Make();
  const SlotId s = Prepared(1);
  Batch drafts = oracle_->MakeBatch({{7, 4}, {8, 5}});
  ASSERT_TRUE(cache_->Verify({s}, 2, {7, 8}, drafts.io).ok());
  absl::StatusOr<std::unique_ptr<SlotReader>> r = cache_->OpenExport(s, "drafts", {});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
  EXPECT_NE(r.status().message().find("Accept"), std::string::npos) << r.status();
  EXPECT_TRUE(cache_->Accept(s, 0).ok()) << "not MOVING: the slot is as it was";
}

TEST_F(SlotIoTest, WritersOnEveryPathCommitOnlyACompleteVerifiedPayload) {
  Make("qwen3-next-80b-a3b", 3, 3);
  std::mt19937 rng(5);
  std::vector<uint8_t> payload(cache::SlotPayloadBytes(cache_->model()));
  for (auto& b : payload) b = static_cast<uint8_t>(rng() & 0x3f);
  const uint64_t sum = PayloadChecksum(payload.data(), payload.size());
  const std::vector<int32_t> tokens = {4, 5, 6};
  for (SlotIoPath path : Paths()) {
    for (bool backend_source : {false, true}) {
      if (backend_source && path == SlotIoPath::kStaged) continue;  // takes host memory only
      SCOPED_TRACE(std::string(SlotIoPathName(path)) + (backend_source ? ", backend" : ""));
      Source src(cache_->options().backend, payload, backend_source);
      auto write_all = [&](SlotWriter& w, size_t skip) {
        // Pieces of odd sizes in a shuffled order, from 3 threads; `skip` bytes left out.
        std::vector<std::pair<size_t, size_t>> pieces;
        for (size_t off = skip; off < payload.size(); off += 300007) {
          pieces.emplace_back(off, std::min<size_t>(300007, payload.size() - off));
        }
        std::shuffle(pieces.begin(), pieces.end(), rng);
        std::atomic<size_t> next{0};
        std::vector<std::thread> th;
        for (int t = 0; t < 3; ++t) {
          th.emplace_back([&] {
            for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
              const auto [off, n] = pieces[i];
              EXPECT_TRUE(w.Write(off, src.data + off, n, backend_source).ok());
            }
          });
        }
        for (auto& t : th) t.join();
      };
      const SlotIoOptions o{.chunk_bytes = 1 << 20, .path = path};
      const int64_t live = cache_->stats().slots_live;
      {
        absl::StatusOr<std::unique_ptr<SlotWriter>> w = cache_->OpenImport(3, o);
        ASSERT_TRUE(w.ok()) << w.status();
        EXPECT_EQ(cache_->stats().slots_live, live + 1) << "taken, but nobody's";
        write_all(**w, 0);
      }  // destroyed uncommitted
      EXPECT_EQ(cache_->stats().slots_live, live) << "freed";
      const struct {
        size_t skip;
        uint64_t checksum;
        size_t tokens;
        absl::StatusCode code;
      } bad[] = {{64, sum, 3, absl::StatusCode::kDataLoss},
                 {0, sum ^ 1, 3, absl::StatusCode::kDataLoss},
                 {0, sum, 2, absl::StatusCode::kFailedPrecondition}};
      for (const auto& b : bad) {
        absl::StatusOr<std::unique_ptr<SlotWriter>> w = cache_->OpenImport(3, o);
        ASSERT_TRUE(w.ok()) << w.status();
        write_all(**w, b.skip);
        absl::StatusOr<SlotId> c =
            (*w)->Commit(absl::MakeConstSpan(tokens).subspan(0, b.tokens), b.checksum);
        EXPECT_EQ(c.status().code(), b.code) << c.status();
        EXPECT_EQ(cache_->stats().slots_live, live) << "nothing became live: " << c.status();
      }
      absl::StatusOr<std::unique_ptr<SlotWriter>> w = cache_->OpenImport(3, o);
      ASSERT_TRUE(w.ok()) << w.status();
      EXPECT_EQ((*w)->Write(payload.size() - 10, src.data, 11, backend_source).code(),
                absl::StatusCode::kInvalidArgument);
      write_all(**w, 0);
      absl::StatusOr<SlotId> c = (*w)->Commit(tokens, sum);
      ASSERT_TRUE(c.ok()) << c.status();
      EXPECT_EQ(cache_->Info(*c)->seq_len, 3);
      EXPECT_EQ(cache_->Info(*c)->write_pos, 0);
      EXPECT_TRUE(Payload(*c) == payload) << "every byte, none stale";
      EXPECT_EQ((*w)->Commit(tokens, sum).status().code(), absl::StatusCode::kFailedPrecondition);
      ASSERT_TRUE(cache_->Free(*c).ok());
    }
  }
}

TEST_F(SlotIoTest, BadRequestsAreRefusedNamingTheFieldAndTakeNothing) {
  Make();
  const SlotId s = Prepared(1);
  const int64_t live = cache_->stats().slots_live;
  EXPECT_EQ(cache_->OpenExport(s, "", {}).status().code(), absl::StatusCode::kInvalidArgument);
  const std::pair<SlotIoOptions, const char*> bad[] = {
      {{.chunk_bytes = 0}, "chunk_bytes"},
      {{.staging_buffers = 1}, "staging_buffers"},
  };
  for (const auto& [o, field] : bad) {
    for (const absl::Status& st :
         {cache_->OpenExport(s, "x", o).status(), cache_->OpenImport(1, o).status()}) {
      EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
      EXPECT_NE(st.message().find(field), std::string::npos) << st;
    }
  }
  if (cache_->options().backend != RSSM_BACKEND_CPU) {
    EXPECT_EQ(cache_->OpenExport(s, "x", {.path = SlotIoPath::kHostDirect}).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_EQ(cache_->OpenImport(-1, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(cache_->OpenExport(s ^ 0x10000, "x", {}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(cache_->stats().slots_live, live);
  EXPECT_TRUE(cache_->BeginForward({{s, 1}}).ok()) << "not left MOVING";
}

}  // namespace
}  // namespace replayssm::cache
