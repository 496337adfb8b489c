// The co-located data plane against a real server (CPU backend, POSIX shared memory): region
// register/status/unregister and every bad-region class; planned forwards of every kind
// (decode, prefill, verify) with doorbells, bit for bit against the inline forms; layer
// messages whose tensors name regions; a doorbell never rung; a client gone mid-forward; a
// region unregistered while a forward uses it.
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "service_fixture.h"

#ifdef REPLAYSSM_TEST_CUDA
#include <cuda_runtime.h>
#endif

namespace replayssm::testing {
namespace {

constexpr uint32_t kAlign = 64;

#ifdef REPLAYSSM_TEST_CUDA
// The engine's memory kind: a CUDA allocation registered by IPC handle when the servers run on
// the GPU (REPLAYSSM_TEST_DEVICE=cuda..., a build with CUDA), else POSIX shared memory.
bool EngineOnGpu() { return ServerProcess::Device() != "cpu"; }
#endif


// A shm object the test (the "engine") writes and the server maps. Layout: ready [L],
// done [L], then per layer qkv | a | b | out for up to `max_tokens` tokens.
class EngineMemory {
 public:
  EngineMemory(const v1::ModelInfo& m, int64_t max_tokens) : layers_(m.num_layers()) {
    const uint64_t es = m.act_dtype() == v1::DTYPE_F32 ? 4 : 2;
    const int64_t qkv = 2 * m.num_qk_heads() * m.head_k() + m.num_v_heads() * m.head_v();
    const int64_t a = m.gate() == v1::GATE_KDA ? m.num_v_heads() * m.head_k() : m.num_v_heads();
    const int64_t widths[4] = {qkv, a, m.num_v_heads(), m.num_v_heads() * m.head_v()};
    uint64_t at = Up(8ULL * layers_);
    for (int l = 0; l < layers_; ++l) {
      std::array<uint64_t, 4> off{};
      for (int i = 0; i < 4; ++i) {
        off[i] = at;
        at = Up(at + max_tokens * widths[i] * es);
      }
      offsets_.push_back(off);
    }
    bytes_ = at;
#ifdef REPLAYSSM_TEST_CUDA
    if (EngineOnGpu()) {
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, bytes_), cudaSuccess);
      EXPECT_EQ(cudaMemset(p, 0, bytes_), cudaSuccess);
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(cudaIpcGetMemHandle(&handle_, p), cudaSuccess);
      device_ = static_cast<uint8_t*>(p);
      return;
    }
#endif
    key_ = "/replayssm-dp-" + std::to_string(getpid()) + "-" + std::to_string(next_++);
    const int fd = CreateOwnShm(key_);
    EXPECT_GE(fd, 0) << key_;
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes_)), 0);
    base_ = static_cast<uint8_t*>(
        mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
  }
  ~EngineMemory() {
#ifdef REPLAYSSM_TEST_CUDA
    if (device_ != nullptr) {
      cudaFree(device_);
      return;
    }
#endif
    munmap(base_, bytes_);
    shm_unlink(key_.c_str());
  }
  // Registers the memory as region `name` (a CUDA region on the GPU, else a system one).
  absl::Status Register(Client& client, const std::string& name) const {
#ifdef REPLAYSSM_TEST_CUDA
    if (device_ != nullptr) {
      v1::RegisterCudaRegionRequest r;
      r.set_name(name);
      r.set_raw_handle(&handle_, sizeof(handle_));
      int device = 0;
      cudaGetDevice(&device);
      r.set_device_id(device);
      r.set_byte_size(bytes_);
      return client.RegisterCudaRegion(r);
    }
#endif
    return client.RegisterSystemRegion(Registration(name));
  }
  static uint64_t Up(uint64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

  v1::RegisterSystemRegionRequest Registration(const std::string& name) const {
    v1::RegisterSystemRegionRequest r;
    r.set_name(name);
    r.set_key(key_);
    r.set_byte_size(bytes_);
    return r;
  }
  v1::ForwardPlan Plan(const std::string& region, uint32_t value) const {
    v1::ForwardPlan p;
    p.mutable_ready()->set_region(region);
    p.mutable_done()->set_region(region);
    p.mutable_done()->set_offset(4ULL * layers_);
    p.set_value(value);
    for (const auto& off : offsets_) {
      v1::PlannedLayer* l = p.add_layers();
      v1::RegionRef* refs[4] = {l->mutable_mixed_qkv(), l->mutable_a(), l->mutable_b(),
                                l->mutable_out()};
      for (int i = 0; i < 4; ++i) {
        refs[i]->set_region(region);
        refs[i]->set_offset(off[i]);
      }
    }
    return p;
  }
  // Layer l's inputs into the region (what the engine's previous layer would have written).
  void Write(const v1::LayerInput& in, int l) {
    const v1::Tensor* t[3] = {&in.mixed_qkv(), &in.a(), &in.b()};
    for (int i = 0; i < 3; ++i) Put(offsets_[l][i], t[i]->data().data(), t[i]->data().size());
  }
  std::string Out(int l, size_t bytes) const {
    std::string out(bytes, '\0');
    Get(offsets_[l][3], out.data(), bytes);
    return out;
  }
  uint32_t* Ready(int l) { return reinterpret_cast<uint32_t*>(base_) + l; }
  uint32_t* Done(int l) { return reinterpret_cast<uint32_t*>(base_) + layers_ + l; }
  void Ring(int l, uint32_t v) {
    if (device_ != nullptr) return Put(4ULL * l, &v, 4);
    std::atomic_ref<uint32_t>(*Ready(l)).store(v);
  }
  bool WaitDone(int l, uint32_t v, absl::Duration timeout) {
    const absl::Time end = absl::Now() + timeout;
    while (DoneWord(l) != v) {
      if (absl::Now() > end) return false;
      std::this_thread::yield();
    }
    return true;
  }
  uint32_t DoneWord(int l) const {
    uint32_t w = 0;
    if (device_ != nullptr) {
      Get(4ULL * (layers_ + l), &w, 4);
      return w;
    }
    return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(base_ + 4ULL * (layers_ + l)))
        .load();
  }
  // The engine's loop: layer by layer, each layer's inputs written only after the previous
  // layer's outputs are done (as in a model).
  void Drive(const std::vector<v1::LayerInput>& layers, uint32_t v) {
    for (int l = 0; l < layers_; ++l) {
      Write(layers[l], l);
      Ring(l, v);
      ASSERT_TRUE(WaitDone(l, v, absl::Seconds(20))) << "layer " << l;
    }
  }
  // Layer l's message with every tensor in the region instead of inline.
  v1::LayerInput AsRegions(const v1::LayerInput& in, const std::string& region, int l) const {
    v1::LayerInput r = in;
    v1::Tensor* t[3] = {r.mutable_mixed_qkv(), r.mutable_a(), r.mutable_b()};
    for (int i = 0; i < 3; ++i) {
      t[i]->clear_data();
      t[i]->mutable_region()->set_region(region);
      t[i]->mutable_region()->set_offset(offsets_[l][i]);
    }
    r.mutable_out()->set_region(region);
    r.mutable_out()->set_offset(offsets_[l][3]);
    return r;
  }

 private:
  static inline int next_ = 0;
  int layers_;
  std::vector<std::array<uint64_t, 4>> offsets_;
  uint64_t bytes_ = 0;
  // Bytes into or out of the memory (a synchronous copy on the GPU: the server's queued waits
  // and kernels see it, and a ring after it is ordered behind it).
  void Put(uint64_t offset, const void* src, size_t n) {
#ifdef REPLAYSSM_TEST_CUDA
    if (device_ != nullptr) {
      EXPECT_EQ(cudaMemcpy(device_ + offset, src, n, cudaMemcpyHostToDevice), cudaSuccess);
      return;
    }
#endif
    std::memcpy(base_ + offset, src, n);
  }
  void Get(uint64_t offset, void* dst, size_t n) const {
#ifdef REPLAYSSM_TEST_CUDA
    if (device_ != nullptr) {
      EXPECT_EQ(cudaMemcpy(dst, device_ + offset, n, cudaMemcpyDeviceToHost), cudaSuccess);
      return;
    }
#endif
    std::memcpy(dst, base_ + offset, n);
  }

  std::string key_;
  uint8_t* base_ = nullptr;
  uint8_t* device_ = nullptr;  // the GPU's memory instead of base_
#ifdef REPLAYSSM_TEST_CUDA
  cudaIpcMemHandle_t handle_{};
#endif
};

class DataPlaneTest : public ServiceTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--forward-timeout=1"};
  }
  void SetUp() override {
    ServiceTest::SetUp();
    mem_ = std::make_unique<EngineMemory>(model(), 64);
    const absl::Status registered = mem_->Register(*client_, "engine");
    ASSERT_TRUE(registered.ok()) << registered;
  }
  std::vector<v1::DecodeRow> Rows(const std::vector<uint64_t>& slots) {
    std::vector<v1::DecodeRow> rows(slots.size());
    for (size_t i = 0; i < slots.size(); ++i) {
      rows[i].set_slot(slots[i]);
      rows[i].set_token_id(9);
    }
    return rows;
  }
  v1::DecodeStreamRequest PlannedDecode(const std::vector<uint64_t>& slots, uint32_t v) {
    v1::DecodeStreamRequest req;
    req.mutable_begin()->set_request_id(client::NewRequestId());
    for (const v1::DecodeRow& r : Rows(slots)) *req.mutable_begin()->add_rows() = r;
    *req.mutable_begin()->mutable_plan() = mem_->Plan("engine", v);
    return req;
  }
  size_t OutBytes(int64_t n) const {
    return n * model().num_v_heads() * model().head_v() *
           (model().act_dtype() == v1::DTYPE_F32 ? 4 : 2);
  }
  int64_t InUse(const std::string& name) {
    auto s = client_->RegionStatus(name);
    return s.ok() && s->regions_size() == 1 ? s->regions(0).in_use() : -1;
  }
  // Runs a planned forward opened by `begin` while the engine drives `layers`; returns the
  // commit's status.
  absl::Status RunPlanned(client::ForwardStream& stream, const v1::DecodeStreamRequest& begin,
                          const std::vector<v1::LayerInput>& layers, uint32_t v) {
    auto begun = stream.BeginWith(begin);
    if (!begun.ok()) return begun.status();
    std::thread engine([&] { mem_->Drive(layers, v); });
    auto committed = stream.Commit();
    engine.join();
    return committed.status();
  }

  // `forwards` planned decode forwards of two rows against the same inline forwards of two
  // other rows: outputs, cursors and states bit for bit; the region released after.
  void ExpectPlannedDecodeMatchesInline(uint32_t forwards) {
    const std::vector<uint64_t> planned = {NewSlot(), NewSlot()}, inl = {NewSlot(), NewSlot()};
    auto stream = client_->OpenStream();
    for (uint32_t f = 1; f <= forwards; ++f) {
      const std::vector<v1::LayerInput> layers = Layers(2);
      ASSERT_TRUE(RunPlanned(*stream, PlannedDecode(planned, f), layers, f).ok());
      auto want = stream->Forward(Rows(inl), layers);
      ASSERT_TRUE(want.ok()) << want.status();
      for (int l = 0; l < num_layers(); ++l) {
        EXPECT_EQ(mem_->Out(l, OutBytes(2)), want->layers(l).out().data()) << "forward " << f;
      }
    }
    for (int i = 0; i < 2; ++i) EXPECT_EQ(Observe(planned[i]), Observe(inl[i]));
    EXPECT_EQ(InUse("engine"), 0);
  }

  std::unique_ptr<EngineMemory> mem_;
};

// The tests' shm objects are named by pid: one left by a dead run whose pid this process now has
// (it was killed before its unlink) must not fail the test that reuses the name.
TEST(TestShm, ACreateReplacesAStaleObjectOfItsName) {
  const std::string key = "/replayssm-dp-stale-" + std::to_string(getpid());
  const int stale = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(stale, 0);
  close(stale);
  const int fd = CreateOwnShm(key);
  EXPECT_GE(fd, 0) << key;
  if (fd >= 0) close(fd);
  shm_unlink(key.c_str());
}

TEST_F(DataPlaneTest, PlannedDecodeMatchesInlineBitForBitAcrossFolds) {
  ExpectPlannedDecodeMatchesInline(6);  // past a ring fold (L = 4 for tiny-gdn)
}

// A TP = 2 server (one cache shard per rank): a planned decode forward, its region tensors
// rank-major as the inline ones, equals the inline forward bit for bit; the doorbells are one
// pair per layer for the group.
class TpDataPlaneTest : public DataPlaneTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--model=tiny-gdn-tp", "--tp-size=2", "--track-interval=16", "--forward-timeout=1"};
  }
};

TEST_F(TpDataPlaneTest, PlannedDecodeOfATpGroupMatchesInlineAcrossFolds) {
  ASSERT_EQ(model().tp_size(), 2);
  ASSERT_EQ(Layers(1)[0].mixed_qkv().shape(0), 2) << "rank-major";
  ExpectPlannedDecodeMatchesInline(10);  // past a ring fold (L = 8 for tiny-gdn-tp)
}

// A plan of per-rank parts (ForwardPlan.ranks): each rank's own tensors (here rank r's block of
// the engine region's rank-major tensors) and its own doorbells (rank 1's in a region of their
// own), as the engine's ranks on their own GPUs would register them. The engine rings both
// ranks' ready[l] and waits for both done[l]; outputs and states equal the inline forward's.
TEST_F(TpDataPlaneTest, APlanOfEachRanksOwnTensorsAndDoorbellsMatchesInline) {
  EngineMemory rank1_bells(model(), 1);
  ASSERT_TRUE(rank1_bells.Register(*client_, "rank1-bells").ok());
  const int64_t n = 2, tp = 2, es = model().act_dtype() == v1::DTYPE_F32 ? 4 : 2;
  const int64_t hv = model().num_v_heads();
  const int64_t widths[4] = {2 * model().num_qk_heads() * model().head_k() + hv * model().head_v(),
                             hv, hv, hv * model().head_v()};
  const std::vector<uint64_t> planned = {NewSlot(), NewSlot()}, inl = {NewSlot(), NewSlot()};
  auto stream = client_->OpenStream();
  for (uint32_t f = 1; f <= 10; ++f) {
    const v1::ForwardPlan whole = mem_->Plan("engine", f);
    v1::DecodeStreamRequest begin = PlannedDecode(planned, f);
    v1::ForwardPlan* plan = begin.mutable_begin()->mutable_plan();
    plan->Clear();
    plan->set_value(f);
    for (int64_t r = 0; r < tp; ++r) {
      v1::RankPlan* rank = plan->add_ranks();
      *rank->mutable_ready() = whole.ready();
      *rank->mutable_done() = whole.done();
      if (r == 1) {
        rank->mutable_ready()->set_region("rank1-bells");
        rank->mutable_done()->set_region("rank1-bells");
      }
      for (const v1::PlannedLayer& l : whole.layers()) {
        v1::PlannedLayer* mine = rank->add_layers();
        *mine = l;
        v1::RegionRef* refs[4] = {mine->mutable_mixed_qkv(), mine->mutable_a(), mine->mutable_b(),
                                  mine->mutable_out()};
        for (int i = 0; i < 4; ++i) refs[i]->set_offset(refs[i]->offset() + r * n * widths[i] / tp * es);
      }
    }
    const std::vector<v1::LayerInput> layers = Layers(n);
    auto begun = stream->BeginWith(begin);
    ASSERT_TRUE(begun.ok()) << begun.status();
    std::thread engine([&] {
      for (int l = 0; l < num_layers(); ++l) {
        mem_->Write(layers[l], l);
        mem_->Ring(l, f);
        rank1_bells.Ring(l, f);
        ASSERT_TRUE(mem_->WaitDone(l, f, absl::Seconds(20))) << "rank 0, layer " << l;
        ASSERT_TRUE(rank1_bells.WaitDone(l, f, absl::Seconds(20))) << "rank 1, layer " << l;
      }
    });
    auto committed = stream->Commit();
    engine.join();
    ASSERT_TRUE(committed.ok()) << committed.status();
    auto want = stream->Forward(Rows(inl), layers);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int l = 0; l < num_layers(); ++l) {
      EXPECT_EQ(mem_->Out(l, OutBytes(n)), want->layers(l).out().data()) << "forward " << f;
    }
  }
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Observe(planned[i]), Observe(inl[i]));
  // A plan of the wrong number of ranks is refused naming the field.
  v1::DecodeStreamRequest bad = PlannedDecode(planned, 11);
  bad.mutable_begin()->mutable_plan()->add_ranks();
  auto refused = client_->OpenStream()->BeginWith(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("begin.plan.ranks: expected 2"), std::string::npos)
      << refused.status();
}

// A planned forward whose engine neither rings nor commits, its stream left open: past
// --forward-timeout its doorbells are rung and it is abandoned, and once the stream has then
// been quiet for --stream-idle-timeout the stream ends and the rows and the region's lease go.
// They used to stay held for as long as the client kept the stream open (an outside review):
// Free refused, the region never reclaimed.
class PlannedIdleTest : public DataPlaneTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--forward-timeout=1", "--stream-idle-timeout=1"};
  }
};

TEST_F(PlannedIdleTest, APlannedForwardNeverCommittedIsEndedOnceQuietPastItsDeadline) {
  const uint64_t a = NewSlot();
  const std::string before = Observe(a);
  auto stream = client_->OpenStream();
  auto begun = stream->BeginWith(PlannedDecode({a}, 1));  // no doorbell is ever rung
  ASSERT_TRUE(begun.ok()) << begun.status();
  EXPECT_EQ(InUse("engine"), 1);
  EXPECT_EQ(client_->Free(a).code(), absl::StatusCode::kFailedPrecondition) << "held";
  for (int i = 0; i < 200 && client_->Stats()->open_forwards() > 0; ++i) {
    absl::SleepFor(absl::Milliseconds(50));  // 1 s deadline, then 1 s quiet, the sweep's period
  }
  EXPECT_EQ(client_->Stats()->open_forwards(), 0) << "still held";
  EXPECT_EQ(InUse("engine"), 0);
  EXPECT_EQ(Observe(a), before) << "nothing of it committed";
  const absl::Status ended = stream->Finish();
  EXPECT_EQ(ended.code(), absl::StatusCode::kDeadlineExceeded) << ended;
  EXPECT_NE(ended.message().find("--stream-idle-timeout"), std::string::npos) << ended;
  EXPECT_TRUE(client_->Free(a).ok());
}

// Commits of planned forwards whose doorbells the engines never ring: each waits out
// --forward-timeout on its stream's own thread. They used to wait on gRPC's callback threads,
// which every call of the server shares, and a few of them held every one: other clients'
// calls waited until the forwards' deadlines (an outside review: GetInfo answered after 9.5 s
// behind four such streams).
class PlannedWaitTest : public DataPlaneTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--forward-timeout=6"};
  }
};

TEST_F(PlannedWaitTest, CommitsWaitingOnDoorbellsDoNotHoldOtherClientsCalls) {
  constexpr int kStreams = 8;
  std::vector<uint64_t> slots;
  std::vector<std::string> before;
  std::vector<std::unique_ptr<EngineMemory>> engines;  // doorbells of its own each
  std::vector<std::unique_ptr<client::ForwardStream>> streams;
  for (int i = 0; i < kStreams; ++i) {
    slots.push_back(NewSlot());
    before.push_back(Observe(slots.back()));
    engines.push_back(std::make_unique<EngineMemory>(model(), 1));
    const std::string region = absl::StrCat("engine", i);
    ASSERT_TRUE(engines.back()->Register(*client_, region).ok());
    v1::DecodeStreamRequest begin = PlannedDecode({slots.back()}, 1);
    *begin.mutable_begin()->mutable_plan() = engines.back()->Plan(region, 1);
    streams.push_back(client_->OpenStream());
    auto begun = streams.back()->BeginWith(begin);
    ASSERT_TRUE(begun.ok()) << begun.status();
  }
  std::vector<absl::Status> committed(kStreams);
  std::vector<std::thread> committers;
  for (int i = 0; i < kStreams; ++i) {
    committers.emplace_back([&, i] { committed[i] = streams[i]->Commit().status(); });
  }
  absl::SleepFor(absl::Milliseconds(500));  // every commit read and waiting on its doorbells
  const absl::Time t0 = absl::Now();
  auto info = client_->Info();
  const absl::Duration took = absl::Now() - t0;
  for (std::thread& t : committers) t.join();
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_LT(took, absl::Seconds(2)) << "GetInfo waited behind the commits";
  for (int i = 0; i < kStreams; ++i) {
    EXPECT_EQ(committed[i].code(), absl::StatusCode::kDeadlineExceeded) << committed[i];
    EXPECT_TRUE(Observe(slots[i]) == before[i]) << "nothing of forward " << i << " committed";
    EXPECT_EQ(InUse(absl::StrCat("engine", i)), 0);
  }
}

// A client that cancels while its commit waits on doorbells it never rang: the forward is
// expired at once (rung, abandoned, nothing committed) and its rows go, not at
// --forward-timeout (an outside review: the slot could be freed only 7.8 s later with an 8 s
// timeout, and a drain waited as long).
TEST_F(PlannedWaitTest, ACancelledCommitEndsItsForwardAtOnce) {
  const uint64_t a = NewSlot();
  auto stream = client_->OpenStream();
  auto begun = stream->BeginWith(PlannedDecode({a}, 1));  // no doorbell is ever rung
  ASSERT_TRUE(begun.ok()) << begun.status();
  absl::Status committed;
  std::thread engine([&] { committed = stream->Commit().status(); });
  absl::SleepFor(absl::Milliseconds(300));  // the commit is read and waits
  const absl::Time t0 = absl::Now();
  stream->Cancel();
  absl::Status freed = client_->Free(a);
  for (int i = 0; i < 100 && !freed.ok(); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    freed = client_->Free(a);
  }
  const absl::Duration took = absl::Now() - t0;
  engine.join();
  EXPECT_TRUE(freed.ok()) << freed;
  EXPECT_LT(took, absl::Seconds(2)) << "the forward waited for --forward-timeout (6 s)";
  EXPECT_FALSE(committed.ok());
  EXPECT_EQ(InUse("engine"), 0);
  EXPECT_EQ(client_->Stats()->open_forwards(), 0);
}

// --max-planned-forwards: a planned begin past the bound is refused naming the flag and
// changes nothing; inline forwards are not bounded, and once the open planned forward ends the
// next one begins. (On CUDA an open planned forward can hold one of the GPU's work queues until
// its doorbells ring: past the queues the server's own work stopped behind an engine that never
// rang, docs/data-plane.md.)
class PlannedBoundTest : public DataPlaneTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--max-planned-forwards=1"};
  }
};

TEST_F(PlannedBoundTest, APlannedBeginPastTheBoundIsRefusedAndChangesNothing) {
  const uint64_t a = NewSlot(), b = NewSlot();
  const std::string before = Observe(b);
  auto first = client_->OpenStream();
  ASSERT_TRUE(first->BeginWith(PlannedDecode({a}, 1)).ok());
  EngineMemory other(model(), 1);
  ASSERT_TRUE(other.Register(*client_, "other").ok());
  v1::DecodeStreamRequest past = PlannedDecode({b}, 1);
  *past.mutable_begin()->mutable_plan() = other.Plan("other", 1);
  auto refused = client_->OpenStream()->BeginWith(past);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("--max-planned-forwards: expected at most 1"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(Observe(b), before);
  EXPECT_EQ(InUse("other"), 0);
  EXPECT_EQ(client_->Stats()->open_forwards(), 1);
  EXPECT_TRUE(client_->OpenStream()->Forward(Rows({b}), Layers(1)).ok()) << "inline: no bound";
  const std::vector<v1::LayerInput> layers = Layers(1);
  std::thread engine([&] { mem_->Drive(layers, 1); });
  const absl::Status committed = first->Commit().status();
  engine.join();
  ASSERT_TRUE(committed.ok()) << committed;
  auto next = client_->OpenStream();
  EXPECT_TRUE(RunPlanned(*next, PlannedDecode({b}, 2), Layers(1), 2).ok()) << "the bound freed";
}

TEST_F(DataPlaneTest, PlannedPrefillAndVerifyMatchTheInlineForms) {
  const std::vector<uint64_t> planned = {NewSlot(), NewSlot()}, inl = {NewSlot(), NewSlot()};
  auto stream = client_->OpenStream();
  // Prefill: 3 + 5 tokens packed in row order.
  std::vector<v1::PrefillRow> rows_p(2), rows_i(2);
  for (int i = 0; i < 2; ++i) {
    for (int t = 0; t < 3 + 2 * i; ++t) {
      rows_p[i].add_tokens(50 + t);
      rows_i[i].add_tokens(50 + t);
    }
    rows_p[i].set_slot(planned[i]);
    rows_i[i].set_slot(inl[i]);
  }
  std::vector<v1::LayerInput> layers = Layers(8);
  v1::DecodeStreamRequest begin;
  begin.mutable_prefill_begin()->set_request_id(client::NewRequestId());
  for (const auto& r : rows_p) *begin.mutable_prefill_begin()->add_rows() = r;
  *begin.mutable_prefill_begin()->mutable_plan() = mem_->Plan("engine", 1);
  ASSERT_TRUE(RunPlanned(*stream, begin, layers, 1).ok());
  auto want = stream->Prefill(rows_i, layers);
  ASSERT_TRUE(want.ok()) << want.status();
  for (int l = 0; l < num_layers(); ++l) EXPECT_EQ(mem_->Out(l, OutBytes(8)), want->layers(l).out().data());
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Observe(planned[i]), Observe(inl[i]));

  // Verify: 2 drafts per row, outputs only.
  layers = Layers(4);
  const std::vector<int32_t> drafts = {1, 2, 3, 4};
  begin.Clear();
  v1::VerifyBegin* vb = begin.mutable_verify_begin();
  vb->set_request_id(client::NewRequestId());
  for (uint64_t s : planned) vb->add_slots(s);
  vb->set_num_draft(2);
  for (int32_t d : drafts) vb->add_draft_tokens(d);
  *vb->mutable_plan() = mem_->Plan("engine", 2);
  ASSERT_TRUE(RunPlanned(*stream, begin, layers, 2).ok());
  auto vwant = stream->Verify(inl, 2, drafts, layers);
  ASSERT_TRUE(vwant.ok()) << vwant.status();
  for (int l = 0; l < num_layers(); ++l) EXPECT_EQ(mem_->Out(l, OutBytes(4)), vwant->layers(l).out().data());
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(client_->Accept(planned[i], 1).ok());
    ASSERT_TRUE(client_->Accept(inl[i], 1).ok());
    EXPECT_EQ(Observe(planned[i]), Observe(inl[i]));
  }
}

TEST_F(DataPlaneTest, UnaryFormsTakeRegionsAndMatchInline) {
  const uint64_t pa = NewSlot(), pb = NewSlot();  // through regions
  const uint64_t ia = NewSlot(), ib = NewSlot();  // inline
  // Every layer's inputs in the region at once, as the unary forms need them up front.
  const auto to_regions = [&](std::vector<v1::LayerInput> layers) {
    for (int l = 0; l < num_layers(); ++l) {
      mem_->Write(layers[l], l);
      layers[l] = mem_->AsRegions(layers[l], "engine", l);
    }
    return layers;
  };
  const auto same_outputs = [&](const auto& want, int64_t n, const auto& got) {
    for (int l = 0; l < num_layers(); ++l) {
      EXPECT_EQ(mem_->Out(l, OutBytes(n)), want.layers(l).out().data()) << "layer " << l;
      EXPECT_EQ(got.layers(l).out().region().region(), "engine");
      EXPECT_TRUE(got.layers(l).out().data().empty());
    }
  };
  // Prefill, 5 tokens, outputs returned.
  std::vector<v1::LayerInput> layers = Layers(5);
  v1::PrefillRequest pre;
  pre.set_slot(ia);
  for (int t = 0; t < 5; ++t) pre.add_tokens(70 + t);
  pre.set_return_outputs(true);
  *pre.mutable_layers() = {layers.begin(), layers.end()};
  auto want_pre = client_->Prefill(pre);
  ASSERT_TRUE(want_pre.ok()) << want_pre.status();
  pre.set_slot(pa);
  const std::vector<v1::LayerInput> pre_regions = to_regions(layers);
  *pre.mutable_layers() = {pre_regions.begin(), pre_regions.end()};
  auto got_pre = client_->Prefill(pre);
  ASSERT_TRUE(got_pre.ok()) << got_pre.status();
  same_outputs(*want_pre, 5, *got_pre);
  EXPECT_EQ(Observe(pa), Observe(ia));
  // Decode, 2 rows.
  layers = Layers(2);
  v1::DecodeRequest dec;
  for (uint64_t s : {ia, ib}) {
    v1::DecodeRow* r = dec.add_rows();
    r->set_slot(s);
    r->set_token_id(3);
  }
  *dec.mutable_layers() = {layers.begin(), layers.end()};
  auto want_dec = client_->Decode(dec);
  ASSERT_TRUE(want_dec.ok()) << want_dec.status();
  dec.mutable_rows(0)->set_slot(pa);
  dec.mutable_rows(1)->set_slot(pb);
  const std::vector<v1::LayerInput> dec_regions = to_regions(layers);
  *dec.mutable_layers() = {dec_regions.begin(), dec_regions.end()};
  dec.set_request_id("decode-into-regions");
  auto got_dec = client_->Decode(dec);
  ASSERT_TRUE(got_dec.ok()) << got_dec.status();
  same_outputs(*want_dec, 2, *got_dec);
  EXPECT_EQ(Observe(pa), Observe(ia));
  EXPECT_EQ(Observe(pb), Observe(ib));
  // A retry gets the original reply, naming the regions, and applies nothing again (it was
  // ALREADY_EXISTS "its outputs were too large to keep": an outside review).
  auto retried = client_->Decode(dec);
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->SerializeAsString(), got_dec->SerializeAsString());
  EXPECT_EQ(Observe(pa), Observe(ia)) << "not applied twice";
  dec.clear_request_id();
  // Verify, 2 drafts per row.
  layers = Layers(4);
  v1::VerifyRequest ver;
  for (uint64_t s : {ia, ib}) ver.add_slots(s);
  ver.set_num_draft(2);
  for (int32_t d : {5, 6, 7, 8}) ver.add_draft_tokens(d);
  *ver.mutable_layers() = {layers.begin(), layers.end()};
  auto want_ver = client_->Verify(ver);
  ASSERT_TRUE(want_ver.ok()) << want_ver.status();
  ver.set_slots(0, pa);
  ver.set_slots(1, pb);
  const std::vector<v1::LayerInput> ver_regions = to_regions(layers);
  *ver.mutable_layers() = {ver_regions.begin(), ver_regions.end()};
  auto got_ver = client_->Verify(ver);
  ASSERT_TRUE(got_ver.ok()) << got_ver.status();
  same_outputs(*want_ver, 4, *got_ver);
  EXPECT_EQ(InUse("engine"), 0);
  for (uint64_t s : {pa, pb}) ASSERT_TRUE(client_->Accept(s, 1).ok());
  // A region out of bounds is refused by field, and the slot does not move.
  const std::string before = Observe(pa);
  v1::DecodeRequest bad = dec;
  bad.clear_request_id();
  bad.mutable_rows(0)->set_slot(pa);
  bad.mutable_rows(1)->set_slot(pb);
  bad.mutable_layers(3)->mutable_a()->mutable_region()->set_offset(1ULL << 40);
  auto refused = client_->Decode(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("layers[3].a"), std::string::npos) << refused.status();
  EXPECT_EQ(Observe(pa), before);
}

TEST_F(DataPlaneTest, ImportAndExportTakeRegions) {
  const uint64_t a = NewSlot(), b = NewSlot();
  auto stream = client_->OpenStream();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(stream->Forward(Rows({a}), Layers(1)).ok());
  auto inl = client_->Export(a);  // folds a: the bytes every form must give
  ASSERT_TRUE(inl.ok()) << inl.status();
  // A region range holds a layer's checkpoint followed by its conv window.
  const uint64_t cp = inl->checkpoints(0).data().size() + inl->conv_windows(0).data().size();
  const uint64_t stride = EngineMemory::Up(cp);
  // A second shm object for the checkpoints.
  const std::string key = "/replayssm-dp-ckpt-" + std::to_string(getpid());
  const int fd = CreateOwnShm(key);
  ASSERT_GE(fd, 0) << key;
  const uint64_t bytes = stride * num_layers();
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
  auto* base =
      static_cast<uint8_t*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
  close(fd);
  v1::RegisterSystemRegionRequest reg;
  reg.set_name("ckpt");
  reg.set_key(key);
  reg.set_byte_size(bytes);
  ASSERT_TRUE(client_->RegisterSystemRegion(reg).ok());
  // Export into the region.
  v1::ExportRequest ex;
  ex.set_slot(a);
  for (int l = 0; l < num_layers(); ++l) {
    v1::RegionRef* r = ex.add_checkpoints_out();
    r->set_region("ckpt");
    r->set_offset(l * stride);
  }
  auto out = client_->Export(ex);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(out->seq_len(), inl->seq_len());
  for (int l = 0; l < num_layers(); ++l) {
    EXPECT_TRUE(out->checkpoints(l).data().empty());
    EXPECT_EQ(out->checkpoints(l).region().offset(), l * stride);
    EXPECT_EQ(std::string(reinterpret_cast<char*>(base) + l * stride, cp),
              inl->checkpoints(l).data() + inl->conv_windows(l).data())
        << "layer " << l;
  }
  // Import from it into b: b's state is a's.
  v1::ImportRequest im;
  im.set_slot(b);
  *im.mutable_tokens() = inl->tokens();
  for (int l = 0; l < num_layers(); ++l) {
    v1::Tensor* t = im.add_checkpoints();
    *t = inl->checkpoints(l);
    t->clear_data();
    *t->mutable_region() = ex.checkpoints_out(l);
  }
  ASSERT_TRUE(client_->Import(im).ok());
  EXPECT_EQ(Observe(b), Observe(a));
  // Bad ranges and mixed forms are refused by field, and nothing moves.
  const std::string before = Observe(b);
  v1::ImportRequest bad = im;
  bad.mutable_checkpoints(1)->mutable_region()->set_offset(bytes);
  auto refused = client_->Import(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("checkpoints[1].region"), std::string::npos)
      << refused.status();
  bad = im;
  *bad.mutable_checkpoints(2) = inl->checkpoints(2);  // inline among regions
  refused = client_->Import(bad);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("checkpoints[2].region"), std::string::npos)
      << refused.status();
  v1::ExportRequest short_ex = ex;
  short_ex.mutable_checkpoints_out()->RemoveLast();
  auto refused_ex = client_->Export(short_ex);
  EXPECT_EQ(refused_ex.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused_ex.status().message().find("checkpoints_out"), std::string::npos);
  EXPECT_EQ(Observe(b), before);
  EXPECT_EQ(InUse("ckpt"), 0);
  ASSERT_TRUE(client_->UnregisterRegion("ckpt").ok());
  munmap(base, bytes);
  shm_unlink(key.c_str());
}

TEST_F(DataPlaneTest, LayerMessagesNamingRegionsMatchInline) {
  const std::vector<uint64_t> a = {NewSlot()}, b = {NewSlot()};
  auto stream = client_->OpenStream();
  const std::vector<v1::LayerInput> layers = Layers(1);
  ASSERT_TRUE(stream->Begin(Rows(a)).ok());
  for (int l = 0; l < num_layers(); ++l) {
    mem_->Write(layers[l], l);
    auto out = stream->RunLayer(mem_->AsRegions(layers[l], "engine", l));
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_TRUE(out->out().data().empty());
    EXPECT_EQ(out->out().region().region(), "engine");
  }
  ASSERT_TRUE(stream->Commit().ok());
  auto want = stream->Forward(Rows(b), layers);
  ASSERT_TRUE(want.ok());
  for (int l = 0; l < num_layers(); ++l) EXPECT_EQ(mem_->Out(l, OutBytes(1)), want->layers(l).out().data());
  EXPECT_EQ(Observe(a[0]), Observe(b[0]));
}

TEST_F(DataPlaneTest, ADoorbellNeverRungFailsTheCommitAndMovesNoCursor) {
  const std::vector<uint64_t> s = {NewSlot()};
  const std::string before = Observe(s[0]);
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->BeginWith(PlannedDecode(s, 7)).ok());
  const std::vector<v1::LayerInput> layers = Layers(1);
  mem_->Write(layers[0], 0);
  mem_->Ring(0, 7);  // layer 0 only
  auto committed = stream->Commit();
  EXPECT_EQ(committed.status().code(), absl::StatusCode::kDeadlineExceeded) << committed.status();
  EXPECT_NE(committed.status().message().find("layer 1"), std::string::npos)
      << committed.status();
  EXPECT_EQ(Observe(s[0]), before);
  EXPECT_EQ(InUse("engine"), 0);
  // The slot takes the next forward.
  auto again = client_->OpenStream();
  EXPECT_TRUE(again->Forward(Rows(s), layers).ok());
}

TEST_F(DataPlaneTest, AClientGoneMidForwardChangesNothingAndReleasesTheRegion) {
  const std::vector<uint64_t> s = {NewSlot(), NewSlot()};
  const std::string before = Observe(s[0]);
  {
    auto stream = client_->OpenStream();
    ASSERT_TRUE(stream->BeginWith(PlannedDecode(s, 3)).ok());
    const std::vector<v1::LayerInput> layers = Layers(2);
    mem_->Write(layers[0], 0);
    mem_->Ring(0, 3);
    ASSERT_TRUE(mem_->WaitDone(0, 3, absl::Seconds(10)));
    stream->Cancel();  // what the server sees when the client's process dies
  }
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (InUse("engine") != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(InUse("engine"), 0);
  EXPECT_EQ(Observe(s[0]), before);
  auto again = client_->OpenStream();
  EXPECT_TRUE(again->Forward(Rows(s), Layers(2)).ok());
}

TEST_F(DataPlaneTest, UnregisteringARegionInUseWaitsForTheForward) {
  const std::vector<uint64_t> s = {NewSlot()};
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->BeginWith(PlannedDecode(s, 5)).ok());
  EXPECT_EQ(InUse("engine"), 1);
  ASSERT_TRUE(client_->UnregisterRegion("engine").ok());
  EXPECT_EQ(client_->RegionStatus("engine").status().code(), absl::StatusCode::kNotFound);
  std::thread engine([&] { mem_->Drive(Layers(1), 5); });
  EXPECT_TRUE(stream->Commit().ok());
  engine.join();
  EXPECT_EQ(client_->GetSlot(s[0])->seq_len(), 1);
  // A new forward naming it is refused by field, and nothing moves.
  auto refused = stream->BeginWith(PlannedDecode(s, 6));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(refused.status().message().find("begin.plan.ready.region"), std::string::npos)
      << refused.status();
}

// Unmapping a client's CUDA region waits for every running kernel (a planned forward's doorbell
// wait among them) and holds every other CUDA call of the server meanwhile (H100, 2026-12-07).
// So an unregistered CUDA region is unmapped once no planned forward is open; past 16 held, the
// oldest at once all the same (counted as forced). Shared memory is unmapped at once. Either
// way the open forward commits and the server serves on.
TEST_F(DataPlaneTest, UnregisteredRegionsAreUnmappedOnceNoPlannedForwardIsOpen) {
#ifdef REPLAYSSM_TEST_CUDA
  const bool cuda = EngineOnGpu();
#else
  const bool cuda = false;
#endif
  constexpr int kRegions = 20;  // the server holds 16 at most
  std::vector<std::unique_ptr<EngineMemory>> others;
  for (int i = 0; i < kRegions; ++i) {
    others.push_back(std::make_unique<EngineMemory>(model(), 1));
    ASSERT_TRUE(others.back()->Register(*client_, absl::StrCat("other", i)).ok()) << i;
  }
  const std::vector<uint64_t> s = {NewSlot()};
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->BeginWith(PlannedDecode(s, 5)).ok());  // its doorbell wait runs
  for (int i = 0; i < kRegions; ++i) {
    ASSERT_TRUE(client_->UnregisterRegion(absl::StrCat("other", i)).ok()) << i;
  }
  const double held = Scrape(*server_, "replayssm_region_unmaps_held");
  auto forced = [&] { return Scrape(*server_, "replayssm_region_unmaps_forced_total"); };
  if (cuda) {
    // The first past the bound unmaps at once and waits in the unmapping for the doorbell wait.
    EXPECT_GE(held, 16);
    EXPECT_LE(held, kRegions);
    const absl::Time end = absl::Now() + absl::Seconds(10);
    while (forced() < 1 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(10));
    absl::SleepFor(absl::Milliseconds(200));  // well inside the forward's 1 s deadline
    EXPECT_EQ(forced(), 1) << "the first forced unmapping still waits for the doorbell wait";
    EXPECT_EQ(Scrape(*server_, "replayssm_region_unmaps_held"), kRegions - 1)
        << "and the others stay held behind it";
  } else {
    EXPECT_EQ(held, 0) << "shared memory is unmapped at once";
    EXPECT_EQ(forced(), 0);
  }
  std::thread engine([&] { mem_->Drive(Layers(1), 5); });
  EXPECT_TRUE(stream->Commit().ok());
  engine.join();
  EXPECT_EQ(client_->GetSlot(s[0])->seq_len(), 1);
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (Scrape(*server_, "replayssm_region_unmaps_held") != 0 && absl::Now() < end) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Scrape(*server_, "replayssm_region_unmaps_held"), 0) << "quiet: every held one goes";
  if (cuda) {
    // Those past the bound after the first went as the forward ended: forced while it was
    // still open, not once it was closed.
    EXPECT_GE(forced(), 1);
    EXPECT_LE(forced(), kRegions - 16);
  } else {
    EXPECT_EQ(forced(), 0);
  }
  EXPECT_TRUE(RunPlanned(*stream, PlannedDecode(s, 6), Layers(1), 6).ok());
  EXPECT_EQ(client_->GetSlot(s[0])->seq_len(), 2);
}

TEST_F(DataPlaneTest, PipelinedBeginsCloseThePlannedForwardBeforeThem) {
  const std::vector<uint64_t> planned = {NewSlot(), NewSlot()}, inl = {NewSlot(), NewSlot()};
  auto stream = client_->OpenStream();
  auto reference = client_->OpenStream();
  for (uint32_t f = 1; f <= 6; ++f) {  // past a ring fold (L = 4 for tiny-gdn)
    const std::vector<v1::LayerInput> layers = Layers(2);
    // One message per forward: the begin is not awaited before the engine drives the layers.
    ASSERT_TRUE(stream->SendBegin(PlannedDecode(planned, f)).ok());
    mem_->Drive(layers, f);
    auto begun = stream->AwaitBegun();
    ASSERT_TRUE(begun.ok()) << begun.status();
    if (f == 1) {
      EXPECT_FALSE(begun->has_closed());
    } else {
      ASSERT_EQ(begun->closed().rows_size(), 2);
      EXPECT_EQ(begun->closed().rows(0).seq_len(), f - 1);
      EXPECT_EQ(begun->closed().rows(1).slot(), planned[1]);
    }
    auto want = reference->Forward(Rows(inl), layers);
    ASSERT_TRUE(want.ok()) << want.status();
    for (int l = 0; l < num_layers(); ++l) {
      EXPECT_EQ(mem_->Out(l, OutBytes(2)), want->layers(l).out().data()) << "forward " << f;
    }
  }
  // Until the last forward is closed, it holds its rows and the region, and so does the one
  // it continued (committed by its begin; its device work may still run on a GPU).
  EXPECT_EQ(InUse("engine"), 2);
  auto committed = stream->Commit();
  ASSERT_TRUE(committed.ok()) << committed.status();
  EXPECT_EQ(committed->rows(0).seq_len(), 6);
  for (int i = 0; i < 2; ++i) EXPECT_EQ(Observe(planned[i]), Observe(inl[i]));
  EXPECT_EQ(InUse("engine"), 0);
}

// A begin that would continue the open planned forward is a new forward: once a drain began
// it is refused like any other (the open forward committed first), and the server exits at once. It
// used to continue the chain, skipping the gate: an engine that kept sending begins kept the
// drain waiting its whole --drain-timeout (an outside review).
TEST_F(DataPlaneTest, APipelinedBeginAfterTheDrainBeganIsRefused) {
  const std::vector<uint64_t> s = {NewSlot(), NewSlot()};
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->SendBegin(PlannedDecode(s, 1)).ok());
  mem_->Drive(Layers(2), 1);
  ASSERT_TRUE(stream->AwaitBegun().ok());
  server_->Signal(SIGTERM);
  for (int i = 0; i < 500; ++i) {
    auto stats = client_->Stats();
    if (stats.ok() && stats->draining()) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(stream->SendBegin(PlannedDecode(s, 2)).ok());  // would continue forward 1
  auto begun = stream->AwaitBegun();
  EXPECT_EQ(begun.status().code(), absl::StatusCode::kUnavailable) << begun.status();
  EXPECT_NE(begun.status().message().find("draining"), std::string::npos) << begun.status();
  EXPECT_NE(begun.status().message().find("open before this begin was committed"),
            std::string::npos)
      << begun.status();
  stream->Finish().IgnoreError();  // nothing is open: the drain ends at once
  auto exit = server_->WaitExit(absl::Seconds(10));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(*exit, 0);
}

// Issue 31 §8 (docs/data-plane.md, "Continued forwards"): the engine is lost mid-way through
// a chain of continued planned forwards.
// - The engine stops ringing in forward f while f+1's begin continues it.
//   CPU backend (a doorbell wait blocks the queueing thread, so a begin continues f only once
//   f's layers all ran): past --forward-timeout f is abandoned (DEADLINE_EXCEEDED, "not
//   committed"), no cursor moved, the rows stay usable.
//   GPU (waits are queued, so f+1's begin commits f at once and queues behind it): at f's
//   deadline the server rings f's doorbells itself, f's rows are marked broken, f+1's commit
//   fails with DATA_LOSS naming f's unrung layer, and every later forward on the rows is
//   DATA_LOSS ("free it"); freeing them works.
// - The engine dies in f+1 after f ran whole: f was committed by f+1's begin, f+1 is abandoned;
//   the rows hold exactly f's token, on both backends.
// Either way the region is released. On the GPU it runs with REPLAYSSM_TEST_DEVICE=cuda
// against a CUDA-backend server under MPS, the engine's memory a CUDA region.
class ContinuedForwardFailureTest : public DataPlaneTest,
                                    public ::testing::WithParamInterface<bool> {};

TEST_P(ContinuedForwardFailureTest, AnEngineLostMidChainLeavesConsistentRows) {
  const bool dies_in_next = GetParam();
  const bool queued_waits = info_.backend() != "cpu";
  const std::vector<uint64_t> s = {NewSlot(), NewSlot()};
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->SendBegin(PlannedDecode(s, 1)).ok());
  const std::vector<v1::LayerInput> layers = Layers(2);
  if (dies_in_next) {
    mem_->Drive(layers, 1);  // forward 1 whole
  } else {
    mem_->Write(layers[0], 0);
    mem_->Ring(0, 1);  // forward 1's layer 0; then the engine stops ringing
    ASSERT_TRUE(mem_->WaitDone(0, 1, absl::Seconds(10)));
  }
  ASSERT_TRUE(stream->AwaitBegun().ok());
  ASSERT_TRUE(stream->SendBegin(PlannedDecode(s, 2)).ok());  // would continue forward 1
  auto begun = stream->AwaitBegun();
  int64_t seq_len = 0;
  bool broken = false;
  if (dies_in_next) {
    ASSERT_TRUE(begun.ok()) << begun.status();
    ASSERT_EQ(begun->closed().rows_size(), 2) << "forward 1 committed by the continuing begin";
    EXPECT_EQ(begun->closed().rows(0).seq_len(), 1);
    mem_->Write(layers[0], 0);
    mem_->Ring(0, 2);  // forward 2's layer 0, then the engine's process dies
    ASSERT_TRUE(mem_->WaitDone(0, 2, absl::Seconds(10)));
    stream->Cancel();
    seq_len = 1;
  } else if (queued_waits) {
    ASSERT_TRUE(begun.ok()) << begun.status();
    ASSERT_EQ(begun->closed().rows_size(), 2) << "forward 1 committed at once (queued)";
    auto committed = stream->Commit();  // forward 2: its predecessor never ran layer 1
    EXPECT_EQ(committed.status().code(), absl::StatusCode::kDataLoss) << committed.status();
    EXPECT_NE(committed.status().message().find("layer 1's doorbell of the forward before"),
              std::string::npos)
        << committed.status();
    seq_len = 1;
    broken = true;
  } else {
    EXPECT_EQ(begun.status().code(), absl::StatusCode::kDeadlineExceeded) << begun.status();
    EXPECT_NE(begun.status().message().find("layer 1"), std::string::npos) << begun.status();
    EXPECT_NE(begun.status().message().find("not committed"), std::string::npos)
        << begun.status();
  }
  const absl::Time end = absl::Now() + absl::Seconds(20);
  while (InUse("engine") != 0 && absl::Now() < end) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_EQ(InUse("engine"), 0) << "every forward released the region";
  auto again = client_->OpenStream();
  for (uint64_t slot : s) {
    auto info = client_->GetSlot(slot);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->seq_len(), seq_len);
    auto next = again->Forward(Rows({slot}), Layers(1));
    if (broken) {
      EXPECT_EQ(next.status().code(), absl::StatusCode::kDataLoss) << next.status();
      EXPECT_NE(next.status().message().find("free it"), std::string::npos) << next.status();
      again = client_->OpenStream();  // the error ended that stream
      EXPECT_TRUE(client_->Free(slot).ok()) << "a broken row can be freed";
    } else {
      EXPECT_TRUE(next.ok()) << "the row takes the next forward: " << next.status();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Engine, ContinuedForwardFailureTest, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& i) {
                           return i.param ? std::string("DiesInTheNextForward")
                                          : std::string("StopsRingingInTheContinuedOne");
                         });

TEST_F(DataPlaneTest, ARefusedPlannedBeginRingsItsDoneDoorbellsAndChangesNothing) {
  const std::vector<uint64_t> s = {NewSlot()};
  const std::string before = Observe(s[0]);
  // Refused at each stage: the begin's own fields, the plan, the cache (a freed slot).
  const uint64_t freed = NewSlot();
  ASSERT_TRUE(client_->Free(freed).ok());
  uint32_t v = 40;
  const std::vector<std::function<void(v1::DecodeStreamRequest&)>> mutations = {
      [](v1::DecodeStreamRequest& r) { r.mutable_begin()->clear_request_id(); },
      // The stream's own check, before the session (it did not ring: an outside review).
      [](v1::DecodeStreamRequest& r) { r.mutable_begin()->set_request_id(std::string(200, 'x')); },
      [](v1::DecodeStreamRequest& r) {
        r.mutable_begin()->mutable_plan()->mutable_layers(1)->mutable_a()->set_region("nope");
      },
      [&](v1::DecodeStreamRequest& r) { r.mutable_begin()->mutable_rows(0)->set_slot(freed); },
  };
  for (const auto& mutate : mutations) {
    ++v;
    v1::DecodeStreamRequest req = PlannedDecode(s, v);
    mutate(req);
    auto stream = client_->OpenStream();
    ASSERT_TRUE(stream->SendBegin(req).ok());
    // The engine queued its layers without the reply: every done word is rung for it.
    for (int l = 0; l < num_layers(); ++l) {
      mem_->Ring(l, v);
      EXPECT_TRUE(mem_->WaitDone(l, v, absl::Seconds(10))) << "layer " << l << ", value " << v;
    }
    auto begun = stream->AwaitBegun();
    EXPECT_FALSE(begun.ok());
    EXPECT_NE(begun.status().code(), absl::StatusCode::kOk);
  }
  EXPECT_EQ(Observe(s[0]), before);
  EXPECT_EQ(InUse("engine"), 0);
}

// A begin closes the planned forward open before it whatever the begin turns out to be: that
// forward's layers ran on the engine's doorbells, and the engine may have used its outputs. It
// used to be abandoned when the begin's own fields were refused and committed when the cache
// refused the begin (an outside review). Either way it is committed now, and the refusal rings
// last: its ring used to come first, and the open forward's remaining layers rang over it with
// their older value, so an engine waiting for the refusal hung (an earlier review).
TEST_F(DataPlaneTest, ARefusedPipelinedBeginCommitsTheForwardBeforeItThenRings) {
  const uint64_t freed = NewSlot();
  ASSERT_TRUE(client_->Free(freed).ok());
  const std::vector<std::function<void(v1::DecodeStreamRequest&)>> refusals = {
      [](v1::DecodeStreamRequest& r) { r.mutable_begin()->clear_request_id(); },
      [](v1::DecodeStreamRequest& r) {
        r.mutable_begin()->add_rows()->CopyFrom(r.begin().rows(0));  // a duplicate slot
      },
      [&](v1::DecodeStreamRequest& r) { r.mutable_begin()->mutable_rows(0)->set_slot(freed); },
  };
  uint32_t v = 60;
  for (size_t i = 0; i < refusals.size(); ++i) {
    SCOPED_TRACE(i);
    const std::vector<uint64_t> s = {NewSlot()};
    auto stream = client_->OpenStream();
    const uint32_t open = ++v;
    ASSERT_TRUE(stream->BeginWith(PlannedDecode(s, open)).ok());
    const std::vector<v1::LayerInput> layers = Layers(1);
    mem_->Write(layers[0], 0);
    mem_->Ring(0, open);  // layer 0 runs; the engine rings the others after its next begin
    ASSERT_TRUE(mem_->WaitDone(0, open, absl::Seconds(10)));
    const uint32_t refused = ++v;
    v1::DecodeStreamRequest bad = PlannedDecode(s, refused);
    refusals[i](bad);
    ASSERT_TRUE(stream->SendBegin(bad).ok());
    for (int l = 1; l < num_layers(); ++l) {
      mem_->Write(layers[l], l);
      mem_->Ring(l, open);
    }
    auto begun = stream->AwaitBegun();
    EXPECT_FALSE(begun.ok());
    EXPECT_NE(begun.status().message().find("open before this begin was committed"),
              std::string::npos)
        << begun.status();
    stream->Finish().IgnoreError();
    for (int l = 0; l < num_layers(); ++l) {
      EXPECT_EQ(mem_->DoneWord(l), refused) << "layer " << l << ": the refusal's value, last";
    }
    EXPECT_EQ(client_->GetSlot(s[0])->seq_len(), 1) << "the open forward committed";
    EXPECT_EQ(InUse("engine"), 0);
  }
}

// An id an inline forward used is no replay for a planned begin: its layers would run from the
// regions and nothing would write them (the commit then failed "layer 0 has not run").
TEST_F(DataPlaneTest, APlannedBeginOfAnAppliedIdIsRefusedNotReplayed) {
  const std::vector<uint64_t> s = {NewSlot()};
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->Forward(Rows(s), Layers(1), "applied-1").ok());
  const std::string before = Observe(s[0]);
  v1::DecodeStreamRequest again = PlannedDecode(s, 41);
  again.mutable_begin()->set_request_id("applied-1");
  auto planned = client_->OpenStream();
  ASSERT_TRUE(planned->SendBegin(again).ok());
  auto begun = planned->AwaitBegun();
  EXPECT_EQ(begun.status().code(), absl::StatusCode::kAlreadyExists) << begun.status();
  for (int l = 0; l < num_layers(); ++l) EXPECT_EQ(mem_->DoneWord(l), 41u) << "rung: refused";
  EXPECT_EQ(Observe(s[0]), before);
}

TEST_F(DataPlaneTest, ABeginClosesOnlyAPlannedForward) {
  const std::vector<uint64_t> s = {NewSlot()};
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->Begin(Rows(s)).ok());  // layer messages pending
  auto again = stream->Begin(Rows(s));
  EXPECT_EQ(again.status().code(), absl::StatusCode::kFailedPrecondition) << again.status();
  EXPECT_NE(again.status().message().find("send commit"), std::string::npos) << again.status();
  EXPECT_EQ(client_->GetSlot(s[0])->seq_len(), 0);
}

// Where waits block the queueing thread (CPU), a begin closes an unrung planned forward only by
// committing it, which fails at its deadline. Where waits are queued (GPU) the begin continues
// it instead: ContinuedForwardFailureTest covers that path.
TEST_F(DataPlaneTest, ABeginWhoseClosingCommitFailsIsRefusedAndMovesNoCursor) {
  if (info_.backend() != "cpu") GTEST_SKIP() << "queued waits: the begin continues the forward";
  const std::vector<uint64_t> s = {NewSlot()};
  const std::string before = Observe(s[0]);
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->BeginWith(PlannedDecode(s, 11)).ok());  // its doorbells never ring
  auto next = stream->BeginWith(PlannedDecode(s, 12));
  EXPECT_EQ(next.status().code(), absl::StatusCode::kDeadlineExceeded) << next.status();
  EXPECT_NE(next.status().message().find("not committed"), std::string::npos) << next.status();
  EXPECT_EQ(Observe(s[0]), before);
  for (int l = 0; l < num_layers(); ++l) EXPECT_EQ(mem_->DoneWord(l), 12u);  // rung for the refusal
  EXPECT_EQ(InUse("engine"), 0);
}

TEST_F(DataPlaneTest, BadRegionsAreRefusedByFieldAndChangeNothing) {
  // Registration.
  v1::RegisterSystemRegionRequest r = mem_->Registration("engine");
  EXPECT_EQ(client_->RegisterSystemRegion(r).code(), absl::StatusCode::kAlreadyExists);
  r.set_name("other");
  r.set_key("/replayssm-no-such-object");
  absl::Status st = client_->RegisterSystemRegion(r);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("key: expected"), std::string::npos) << st;
  r = mem_->Registration("other");
  r.set_byte_size(r.byte_size() + 1);
  EXPECT_EQ(client_->RegisterSystemRegion(r).code(), absl::StatusCode::kInvalidArgument);
  v1::RegisterCudaRegionRequest cuda;
  cuda.set_name("gpu");
  cuda.set_raw_handle(std::string(64, '\0'));
  cuda.set_byte_size(1024);
  st = client_->RegisterCudaRegion(cuda);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);  // a CPU server
  EXPECT_NE(st.message().find("CPU backend"), std::string::npos) << st;
  EXPECT_EQ(client_->UnregisterRegion("nope").code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->RegionStatus()->regions_size(), 1);

  // Plans: unknown region, out of bounds, misaligned, wrong layer count.
  const std::vector<uint64_t> s = {NewSlot()};
  const std::string before = Observe(s[0]);
  auto stream = client_->OpenStream();
  struct Case {
    std::function<void(v1::ForwardPlan&)> mutate;
    absl::StatusCode code;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](v1::ForwardPlan& p) { p.mutable_layers(0)->mutable_a()->set_region("nope"); },
       absl::StatusCode::kNotFound, "begin.plan.layers[0].a.region"},
      {[](v1::ForwardPlan& p) { p.mutable_layers(0)->mutable_out()->set_offset(1ULL << 40); },
       absl::StatusCode::kInvalidArgument, "begin.plan.layers[0].out"},
      {[](v1::ForwardPlan& p) { p.mutable_layers(0)->mutable_b()->set_offset(p.layers(0).b().offset() + 2); },
       absl::StatusCode::kInvalidArgument, "aligned"},
      {[](v1::ForwardPlan& p) { p.mutable_layers()->RemoveLast(); },
       absl::StatusCode::kInvalidArgument, "begin.plan.layers"},
  };
  for (const Case& c : cases) {
    v1::DecodeStreamRequest req = PlannedDecode(s, 9);
    c.mutate(*req.mutable_begin()->mutable_plan());
    auto stream2 = client_->OpenStream();
    auto begun = stream2->BeginWith(req);
    EXPECT_EQ(begun.status().code(), c.code) << begun.status();
    EXPECT_NE(begun.status().message().find(c.field), std::string::npos) << begun.status();
  }
  EXPECT_EQ(Observe(s[0]), before);
  EXPECT_EQ(InUse("engine"), 0);
  // A layer message mixing a region with inline bytes.
  ASSERT_TRUE(stream->Begin(Rows(s)).ok());
  v1::LayerInput mixed = mem_->AsRegions(Layers(1)[0], "engine", 0);
  mixed.clear_out();
  auto out = stream->RunLayer(mixed);
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("layer.out"), std::string::npos) << out.status();
}

class RegionLimitTest : public DataPlaneTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--max-regions=1"};
  }
};

// Regions cost mappings and table entries: --max-regions bounds them (issue 21).
TEST_F(RegionLimitTest, RegionsBeyondMaxRegionsAreResourceExhaustedUntilOneGoes) {
  const absl::Status refused = client_->RegisterSystemRegion(mem_->Registration("second"));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("the limit (--max-regions) is 1"), std::string::npos) << refused;
  ASSERT_TRUE(client_->UnregisterRegion("engine").ok());
  EXPECT_TRUE(client_->RegisterSystemRegion(mem_->Registration("second")).ok());
}

class RegionTtlTest : public DataPlaneTest {
 protected:
  std::vector<std::string> ServerFlags() const override {
    return {"--track-interval=16", "--forward-timeout=20", "--region-ttl=1"};
  }
  // The names of the registered regions (GetRegionStatus is no use of them).
  std::vector<std::string> Registered() {
    std::vector<std::string> names;
    auto all = client_->RegionStatus();
    if (all.ok()) {
      for (const auto& r : all->regions()) names.push_back(r.name());
    }
    return names;
  }
};

// Issue 31 §8: the regions of an engine that died stayed mapped until the server stopped. With
// --region-ttl a region that no forward or call used for the TTL is unregistered; one a
// forward holds stays however long that takes, and goes once idle after it.
TEST_F(RegionTtlTest, ADeadEnginesRegionsAreReclaimedButNeverMidForward) {
  EngineMemory other(model(), 1);
  ASSERT_TRUE(client_->RegisterSystemRegion(other.Registration("idle")).ok());
  const std::vector<uint64_t> s = {NewSlot()};
  auto stream = client_->OpenStream();
  ASSERT_TRUE(stream->BeginWith(PlannedDecode(s, 1)).ok());  // holds "engine"
  absl::SleepFor(absl::Milliseconds(2500));
  EXPECT_EQ(Registered(), std::vector<std::string>{"engine"})
      << "the idle one went; the one a forward holds stayed";
  std::thread engine([&] { mem_->Drive(Layers(1), 1); });
  EXPECT_TRUE(stream->Commit().ok());
  engine.join();
  // Its idle time starts when the forward lets go of it, not when it took it: it was reaped
  // within a sweep (250 ms) of the commit, the 2.5 s forward counted as idle (an outside
  // review); now it has the TTL from about the commit.
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_EQ(Registered(), std::vector<std::string>{"engine"}) << "just after its forward";
  const absl::Time end = absl::Now() + absl::Seconds(10);
  while (!Registered().empty() && absl::Now() < end) absl::SleepFor(absl::Milliseconds(100));
  EXPECT_TRUE(Registered().empty()) << "idle after the forward: reclaimed";
  auto refused = client_->OpenStream()->BeginWith(PlannedDecode(s, 2));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
}

}  // namespace
}  // namespace replayssm::testing
