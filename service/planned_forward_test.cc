// The doorbell protocol on the CPU backend, with inputs, outputs and doorbells in POSIX shared
// memory: a planned forward gives the inline forward's outputs and state bit for bit; a
// doorbell that is never rung ends in DEADLINE_EXCEEDED naming its layer with no cursor moved;
// an abandoned forward changes nothing; a region unregistered in use stays mapped until the
// forward ends; a bad plan is refused by field and holds nothing.
#include "service/planned_forward.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "test_model.h"

namespace replayssm::service {
namespace {

using cache::testing::Batch;
using cache::testing::Oracle;
using cache::testing::Tok;

constexpr uint32_t kValue = 41;
constexpr int64_t kRows = 3;

uint64_t Align16(uint64_t x) { return (x + 15) / 16 * 16; }

class PlannedForwardTest : public ::testing::Test {
 protected:
  void SetUp() override {
    absl::StatusOr<cache::ModelSpec> m = cache::ModelPreset("tiny-gdn", RSSM_DTYPE_F32, 4);
    ASSERT_TRUE(m.ok()) << m.status();
    cache::CacheOptions o;
    o.backend = RSSM_BACKEND_CPU;
    o.memory_budget_bytes = 4 * kRows * m->SlotBytes();
    o.track_interval = 0;
    absl::StatusOr<std::unique_ptr<cache::StateCache>> c = cache::StateCache::Create(*m, o);
    ASSERT_TRUE(c.ok()) << c.status();
    cache_ = std::move(*c);
    oracle_ = std::make_unique<Oracle>(cache_->model());
    regions_ = std::make_unique<cache::RegionTable>(RSSM_BACKEND_CPU, cache::RegionLimits{});
    Layout();
    key_ = "/replayssm-pf-" + std::to_string(getpid());
    const int fd = shm_open(key_.c_str(), O_CREAT | O_RDWR | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes_)), 0);
    shm_ = static_cast<uint8_t*>(
        mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    cache::RegionSpec spec;
    spec.name = "engine";
    spec.shm_key = key_;
    spec.bytes = bytes_;
    ASSERT_TRUE(regions_->Register(spec).ok());
  }
  void TearDown() override {
    munmap(shm_, bytes_);
    shm_unlink(key_.c_str());
  }

  // ready [L] | done [L] | per layer: qkv | a | b | out, each 16-byte aligned.
  void Layout() {
    const cache::ModelSpec& m = cache_->model();
    const uint64_t es = rssm_dtype_size(m.shape.act_dtype);
    uint64_t at = Align16(8ULL * m.num_layers);
    for (int32_t l = 0; l < m.num_layers; ++l) {
      std::array<uint64_t, 4> off{};
      const int64_t widths[4] = {m.QkvWidth(), m.AWidth(), m.BWidth(), m.OutWidth()};
      for (int i = 0; i < 4; ++i) {
        off[i] = at;
        at = Align16(at + kRows * widths[i] * es);
      }
      offsets_.push_back(off);
    }
    bytes_ = at;
  }

  v1::ForwardPlan Plan() const {
    v1::ForwardPlan p;
    p.mutable_ready()->set_region("engine");
    p.mutable_done()->set_region("engine");
    p.mutable_done()->set_offset(4ULL * cache_->model().num_layers);
    p.set_value(kValue);
    for (const auto& off : offsets_) {
      v1::PlannedLayer* l = p.add_layers();
      v1::RegionRef* refs[4] = {l->mutable_mixed_qkv(), l->mutable_a(), l->mutable_b(),
                                l->mutable_out()};
      for (int i = 0; i < 4; ++i) {
        refs[i]->set_region("engine");
        refs[i]->set_offset(off[i]);
      }
    }
    return p;
  }

  uint32_t* Ready(int32_t l) { return reinterpret_cast<uint32_t*>(shm_) + l; }
  uint32_t* Done(int32_t l) { return Ready(cache_->model().num_layers + l); }
  void Ring(int32_t l) { std::atomic_ref<uint32_t>(*Ready(l)).store(kValue); }

  // The client's part of layer l: writes its inputs into the region, then rings.
  void WriteInputs(const Batch& b, int32_t l) {
    std::memcpy(shm_ + offsets_[l][0], b.qkv[l].data(), b.qkv[l].size());
    std::memcpy(shm_ + offsets_[l][1], b.a[l].data(), b.a[l].size());
    std::memcpy(shm_ + offsets_[l][2], b.b[l].data(), b.b[l].size());
  }

  std::vector<cache::SlotId> Alloc() {
    std::vector<cache::SlotId> s;
    for (int64_t i = 0; i < kRows; ++i) s.push_back(*cache_->Allocate());
    return s;
  }
  absl::StatusOr<std::unique_ptr<cache::Forward>> Begin(const std::vector<cache::SlotId>& s) {
    std::vector<cache::DecodeRow> rows;
    for (cache::SlotId id : s) rows.push_back({id, 5});
    return cache_->BeginForward(rows);
  }
  Batch MakeBatch() const {
    std::vector<Tok> toks(kRows, Tok{5, 0});
    return oracle_->MakeBatch(toks);
  }

  std::unique_ptr<cache::StateCache> cache_;
  std::unique_ptr<Oracle> oracle_;
  std::unique_ptr<cache::RegionTable> regions_;
  std::string key_;
  uint8_t* shm_ = nullptr;
  uint64_t bytes_ = 0;
  std::vector<std::array<uint64_t, 4>> offsets_;
};

TEST_F(PlannedForwardTest, MatchesTheInlineForwardBitForBit) {
  const cache::ModelSpec& m = cache_->model();
  Batch inline_batch = MakeBatch();
  const std::vector<cache::SlotId> a = Alloc(), b = Alloc();
  {
    auto f = Begin(a);
    ASSERT_TRUE(f.ok()) << f.status();
    for (int32_t l = 0; l < m.num_layers; ++l) ASSERT_TRUE((*f)->RunLayer(l, inline_batch.io[l]).ok());
    ASSERT_TRUE((*f)->Commit().ok());
  }
  auto f = Begin(b);
  ASSERT_TRUE(f.ok());
  absl::StatusOr<ResolvedPlan> plan = ResolvePlan(Plan(), "begin.plan", *regions_, m, kRows);
  ASSERT_TRUE(plan.ok()) << plan.status();
  PlannedForward pf(*std::move(f), *std::move(plan), absl::Seconds(10));
  // The client: one layer at a time, as an engine whose layer l+1 needs layer l's outputs.
  std::thread client([&] {
    for (int32_t l = 0; l < m.num_layers; ++l) {
      WriteInputs(inline_batch, l);
      Ring(l);
      while (std::atomic_ref<uint32_t>(*Done(l)).load() != kValue) std::this_thread::yield();
    }
  });
  ASSERT_TRUE(pf.Commit().ok());
  client.join();
  for (int32_t l = 0; l < m.num_layers; ++l) {
    EXPECT_EQ(std::memcmp(shm_ + offsets_[l][3], inline_batch.out[l].data(),
                          inline_batch.out[l].size()),
              0)
        << "layer " << l;
  }
  for (int64_t i = 0; i < kRows; ++i) {
    EXPECT_EQ(cache_->Info(b[i])->seq_len, 1);
    absl::StatusOr<cache::ExportedState> ea = cache_->Export(a[i]), eb = cache_->Export(b[i]);
    ASSERT_TRUE(ea.ok() && eb.ok());
    EXPECT_EQ(ea->checkpoints, eb->checkpoints) << "row " << i;
  }
}

TEST_F(PlannedForwardTest, AnUnrungDoorbellAbandonsTheForwardAndNamesItsLayer) {
  const cache::ModelSpec& m = cache_->model();
  ASSERT_GE(m.num_layers, 3);
  const std::vector<cache::SlotId> s = Alloc();
  auto f = Begin(s);
  ASSERT_TRUE(f.ok());
  Batch batch = MakeBatch();
  for (int32_t l = 0; l < 2; ++l) {
    WriteInputs(batch, l);
    Ring(l);
  }
  absl::StatusOr<ResolvedPlan> plan = ResolvePlan(Plan(), "begin.plan", *regions_, m, kRows);
  ASSERT_TRUE(plan.ok());
  absl::Status st;
  {
    PlannedForward pf(*std::move(f), *std::move(plan), absl::Milliseconds(200));
    st = pf.Commit();
  }
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_NE(st.message().find("layer 2"), std::string::npos) << st;
  for (cache::SlotId id : s) {
    EXPECT_EQ(cache_->Info(id)->seq_len, 0);
    EXPECT_EQ(cache_->Info(id)->write_pos, 0);
  }
  EXPECT_EQ(regions_->Status("engine")->at(0).leases, 0);  // released with the forward
  auto again = Begin(s);  // the slots are usable again
  EXPECT_TRUE(again.ok()) << again.status();
}

TEST_F(PlannedForwardTest, DestroyingMidForwardChangesNothing) {
  const cache::ModelSpec& m = cache_->model();
  const std::vector<cache::SlotId> s = Alloc();
  auto f = Begin(s);
  ASSERT_TRUE(f.ok());
  Batch batch = MakeBatch();
  WriteInputs(batch, 0);
  Ring(0);
  absl::StatusOr<ResolvedPlan> plan = ResolvePlan(Plan(), "begin.plan", *regions_, m, kRows);
  ASSERT_TRUE(plan.ok());
  {
    PlannedForward pf(*std::move(f), *std::move(plan), absl::Seconds(30));
    while (std::atomic_ref<uint32_t>(*Done(0)).load() != kValue) std::this_thread::yield();
  }  // the client went away after layer 0
  for (cache::SlotId id : s) EXPECT_EQ(cache_->Info(id)->seq_len, 0);
  EXPECT_TRUE(Begin(s).ok());
}

TEST_F(PlannedForwardTest, UnregisteringInUseKeepsTheRegionUntilTheForwardEnds) {
  const cache::ModelSpec& m = cache_->model();
  const std::vector<cache::SlotId> s = Alloc();
  auto f = Begin(s);
  ASSERT_TRUE(f.ok());
  absl::StatusOr<ResolvedPlan> plan = ResolvePlan(Plan(), "begin.plan", *regions_, m, kRows);
  ASSERT_TRUE(plan.ok());
  PlannedForward pf(*std::move(f), *std::move(plan), absl::Seconds(10));
  ASSERT_TRUE(regions_->Unregister("engine").ok());
  EXPECT_EQ(regions_->Status("engine").status().code(), absl::StatusCode::kNotFound);
  Batch batch = MakeBatch();
  for (int32_t l = 0; l < m.num_layers; ++l) {
    WriteInputs(batch, l);
    Ring(l);
  }
  EXPECT_TRUE(pf.Commit().ok());
  for (cache::SlotId id : s) EXPECT_EQ(cache_->Info(id)->seq_len, 1);
}

// A call that holds a region by name and meets it again after it was unregistered and
// registered anew is refused: the one hold per name would keep the old mapping while the
// layer's pointers went into the new one, unmapped under the kernel by the next Unregister.
TEST_F(PlannedForwardTest, ARegionRegisteredAnewMidCallIsRefused) {
  const cache::ModelSpec& m = cache_->model();
  v1::LayerInput in;
  auto ref = [&](v1::RegionRef* r, int i) {
    r->set_region("engine");
    r->set_offset(offsets_[0][i]);
  };
  ref(in.mutable_mixed_qkv()->mutable_region(), 0);
  ref(in.mutable_a()->mutable_region(), 1);
  ref(in.mutable_b()->mutable_region(), 2);
  ref(in.mutable_out(), 3);
  std::map<std::string, cache::RegionLease> leases;
  ASSERT_TRUE(ResolveLayerRegions(in, "layers[0]", *regions_, m, kRows, &leases).ok());
  ASSERT_EQ(leases.size(), 1u);
  EXPECT_TRUE(ResolveLayerRegions(in, "layers[1]", *regions_, m, kRows, &leases).ok())
      << "the same registration: one hold";
  ASSERT_TRUE(regions_->Unregister("engine").ok());
  cache::RegionSpec spec;
  spec.name = "engine";
  spec.shm_key = key_;
  spec.bytes = bytes_;
  ASSERT_TRUE(regions_->Register(spec).ok());
  const absl::StatusOr<cache::LayerIo> again =
      ResolveLayerRegions(in, "layers[2]", *regions_, m, kRows, &leases);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAborted) << again.status();
  EXPECT_NE(again.status().message().find("layers[2].mixed_qkv.region: region \"engine\" was "
                                          "unregistered and registered again"),
            std::string::npos)
      << again.status();
}

TEST_F(PlannedForwardTest, BadPlansAreRefusedByFieldAndHoldNothing) {
  const cache::ModelSpec& m = cache_->model();
  struct Case {
    std::function<void(v1::ForwardPlan&)> mutate;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](v1::ForwardPlan& p) { p.mutable_layers()->RemoveLast(); },
       absl::StatusCode::kInvalidArgument, "begin.plan.layers: expected"},
      {[](v1::ForwardPlan& p) { p.mutable_layers(1)->mutable_a()->set_region("nope"); },
       absl::StatusCode::kNotFound, "begin.plan.layers[1].a.region"},
      {[&](v1::ForwardPlan& p) { p.mutable_layers(0)->mutable_out()->set_offset(bytes_ - 16); },
       absl::StatusCode::kInvalidArgument, "begin.plan.layers[0].out"},
      {[](v1::ForwardPlan& p) { p.mutable_layers(0)->mutable_b()->set_offset(
                                    p.layers(0).b().offset() + 4); },
       absl::StatusCode::kInvalidArgument, "16-byte aligned"},
      {[](v1::ForwardPlan& p) { p.mutable_ready()->set_offset(2); },
       absl::StatusCode::kInvalidArgument, "begin.plan.ready"},
      {[](v1::ForwardPlan& p) { p.mutable_done()->clear_region(); },
       absl::StatusCode::kInvalidArgument, "begin.plan.done.region"},
  };
  for (const Case& c : cases) {
    v1::ForwardPlan p = Plan();
    c.mutate(p);
    absl::StatusOr<ResolvedPlan> r = ResolvePlan(p, "begin.plan", *regions_, m, kRows);
    EXPECT_EQ(r.status().code(), c.code) << r.status();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status();
    EXPECT_EQ(regions_->Status("engine")->at(0).leases, 0);
  }
}

}  // namespace
}  // namespace replayssm::service
