// Bad parameters return a clear error naming the field, and touch nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <thread>

#include "harness.h"

namespace replayssm::kernels::testing {
namespace {

class Validation : public ::testing::Test {
 protected:
  Validation() : rng_(7), layer_(MakeConfig(), 4, rng_), tok_(layer_, 8, rng_) {
    for (int s = 0; s < 4; ++s) layer_.RandomCheckpoint(s, rng_);
    out_ = Buffer(RSSM_DTYPE_BF16, 8LL * 4 * 32);
    out_.FillNaN();
  }
  static Config MakeConfig() {
    Config c;
    c.h = 2;
    c.hv = 4;
    c.k = 32;
    c.v = 32;
    c.l = 4;
    return c;
  }
  rssm_decode_args Decode() { return layer_.DecodeArgs(2, slots_, pos_, tok_, out_); }
  // A two-row prefill over this layer, rows' lengths from cu_seqlens.
  rssm_prefill_args Prefill(const int32_t* cu_seqlens, int32_t max_seqlen) {
    return layer_.PrefillArgs(2, slots_, cu_seqlens, max_seqlen, tok_, out_);
  }
  // Calls fn and expects INVALID_ARGUMENT with `field` in the message, and no byte changed.
  void ExpectRejected(const std::function<rssm_status()>& fn, const std::string& field) {
    const auto cp = layer_.checkpoint.bytes(), rd = layer_.ring_d.bytes(), rk = layer_.ring_k.bytes();
    const auto rg = layer_.ring_g;
    const auto out = out_.bytes();
    EXPECT_EQ(fn(), RSSM_ERR_INVALID_ARGUMENT) << field;
    const std::string msg = rssm_last_error();
    EXPECT_NE(msg.find(field), std::string::npos) << "message '" << msg << "' lacks " << field;
    EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got"), std::string::npos) << msg;
    EXPECT_EQ(layer_.checkpoint.bytes(), cp);
    EXPECT_EQ(layer_.ring_d.bytes(), rd);
    EXPECT_EQ(layer_.ring_k.bytes(), rk);
    EXPECT_EQ(0, std::memcmp(layer_.ring_g.data(), rg.data(), rg.size() * 4));
    EXPECT_EQ(out_.bytes(), out);
  }
  void ExpectDecodeRejected(const std::function<void(rssm_decode_args&)>& mutate,
                            const std::string& field) {
    rssm_decode_args a = Decode();
    mutate(a);
    ExpectRejected([&] { return rssm_replay_decode(&a); }, field);
    ExpectRejected([&] { return rssm_baseline_decode(&a); }, field);
  }

  std::mt19937_64 rng_;
  Layer layer_;
  Tokens tok_;
  Buffer out_;
  int32_t slots_[2] = {1, 3};
  int32_t pos_[2] = {0, 2};
};

TEST_F(Validation, ValidCallSucceeds) {
  rssm_decode_args a = Decode();
  EXPECT_EQ(rssm_replay_decode(&a), RSSM_OK) << rssm_last_error();
  EXPECT_STREQ(rssm_last_error(), "");
}

TEST_F(Validation, BadShapesAreRejected) {
  ExpectDecodeRejected([](auto& a) { a.shape.head_k = 0; }, "shape.head_k");
  ExpectDecodeRejected([](auto& a) { a.shape.head_k = 40; }, "shape.head_k");
  ExpectDecodeRejected([](auto& a) { a.shape.head_v = 272; }, "shape.head_v");
  ExpectDecodeRejected([](auto& a) { a.shape.num_v_heads = 3; }, "shape.num_v_heads");
  ExpectDecodeRejected([](auto& a) { a.shape.num_qk_heads = 0; }, "shape.num_qk_heads");
  ExpectDecodeRejected([](auto& a) { a.shape.ring_len = 0; }, "shape.ring_len");
  ExpectDecodeRejected([](auto& a) { a.shape.ring_len = 65; }, "shape.ring_len");
  ExpectDecodeRejected([](auto& a) { a.shape.state_dtype = 9; },
                       "shape.state_dtype");
  ExpectDecodeRejected([](auto& a) { a.shape.act_dtype = -1; },
                       "shape.act_dtype");
  ExpectDecodeRejected([](auto& a) { a.shape.gate = 2; }, "shape.gate");
  // A plain rssm_dtype code is not a ring dtype code (16 + dtype): refused, not misread.
  ExpectDecodeRejected([](auto& a) { a.shape.ring_dtype = RSSM_DTYPE_BF16; }, "shape.ring_dtype");
  ExpectDecodeRejected([](auto& a) { a.shape.ring_dtype = 19; }, "shape.ring_dtype");
}

TEST_F(Validation, NullPointersAreRejected) {
  ExpectDecodeRejected([](auto& a) { a.pool.checkpoint = nullptr; }, "pool.checkpoint");
  ExpectDecodeRejected([](auto& a) { a.in.mixed_qkv = nullptr; }, "in.mixed_qkv");
  ExpectDecodeRejected([](auto& a) { a.in.b = nullptr; }, "in.b");
  ExpectDecodeRejected([](auto& a) { a.out.o = nullptr; }, "out.o");
  ExpectDecodeRejected([](auto& a) { a.slot_idx = nullptr; }, "slot_idx");
  ExpectDecodeRejected([](auto& a) { a.params.a_log = nullptr; }, "params.a_log");
  rssm_decode_args a = Decode();
  a.pool.ring_d = nullptr;  // the baseline needs no ring; replay does
  ExpectRejected([&] { return rssm_replay_decode(&a); }, "pool.ring_d");
  a = Decode();
  a.write_pos = nullptr;
  ExpectRejected([&] { return rssm_replay_decode(&a); }, "write_pos");
  ExpectRejected([] { return rssm_replay_decode(nullptr); }, "args");
}

TEST_F(Validation, BadIndicesAndStridesAreRejected) {
  ExpectDecodeRejected([](auto& a) { a.batch = -1; }, "batch");
  ExpectDecodeRejected([](auto& a) { a.pool.checkpoint_slot_stride = 5; },
                       "pool.checkpoint_slot_stride");
  ExpectDecodeRejected([](auto& a) { a.in.qkv_token_stride = 7; }, "in.qkv_token_stride");
  ExpectDecodeRejected([](auto& a) { a.out.token_stride = 1; }, "out.token_stride");
  slots_[1] = 4;  // the pool has 4 slots
  ExpectDecodeRejected([](auto&) {}, "slot_idx[1]");
  slots_[1] = 1;  // the same slot twice
  ExpectDecodeRejected([](auto&) {}, "slot_idx[1]");
  slots_[1] = 3;
  pos_[0] = 5;  // L = 4
  rssm_decode_args a = Decode();
  ExpectRejected([&] { return rssm_replay_decode(&a); }, "write_pos[0]");
  pos_[0] = 0;
  a.launch.stream = &a;  // the CPU backend takes no stream
  ExpectRejected([&] { return rssm_replay_decode(&a); }, "launch.stream");
  a = Decode();
  a.launch.backend = 5;
  ExpectRejected([&] { return rssm_replay_decode(&a); }, "launch.backend");
}

TEST_F(Validation, VerifyNeedsRoomForEveryDraft) {
  // Row 1 sits at w = 2, L = 4: 2 + 3 > 4.
  rssm_verify_args v = layer_.VerifyArgs(2, 3, slots_, pos_, tok_, out_);
  ExpectRejected([&] { return rssm_verify(&v); }, "write_pos[1]");
  v.num_draft = 5;
  ExpectRejected([&] { return rssm_verify(&v); }, "num_draft");
  v.num_draft = 2;
  EXPECT_EQ(rssm_verify(&v), RSSM_OK) << rssm_last_error();
}

TEST_F(Validation, PrefillChecksLengths) {
  const int32_t cu_bad[3] = {0, 5, 3};
  rssm_prefill_args p = Prefill(cu_bad, 8);
  ExpectRejected([&] { return rssm_prefill(&p); }, "cu_seqlens[2]");
  const int32_t cu_long[3] = {0, 5, 8};
  p.cu_seqlens = cu_long;
  p.max_seqlen = 4;
  ExpectRejected([&] { return rssm_prefill(&p); }, "cu_seqlens[1]");
  const uint8_t initial[2] = {1, 1};
  p.max_seqlen = 8;
  p.initial = initial;
  ExpectRejected([&] { return rssm_prefill(&p); }, "write_pos");
}

TEST_F(Validation, FlagsOtherThanZeroOrOneAreRefused) {
  const uint8_t force[2] = {0, 2};
  rssm_decode_args a = Decode();
  a.force_fold = force;
  ExpectRejected([&] { return rssm_replay_decode(&a); }, "force_fold[1]");
  const uint8_t ok[2] = {0, 1};
  a.force_fold = ok;
  EXPECT_EQ(rssm_replay_decode(&a), RSSM_OK) << rssm_last_error();
  const int32_t cu[3] = {0, 2, 4};
  const int32_t pos[2] = {0, 0};
  const uint8_t initial[2] = {255, 0};
  rssm_prefill_args p = Prefill(cu, 2);
  p.initial = initial;
  p.write_pos = pos;
  ExpectRejected([&] { return rssm_prefill(&p); }, "initial[0]");
  ExpectDecodeRejected([](auto& d) { d.params.use_qk_l2norm = 2; }, "params.use_qk_l2norm");
  ExpectDecodeRejected([](auto& d) { d.params.round_beta = -1; }, "params.round_beta");
}

TEST_F(Validation, FoldChecksCursors) {
  const int32_t slots[1] = {2}, bad[1] = {-1};
  rssm_fold_args f{{RSSM_BACKEND_CPU, nullptr}, layer_.shape, layer_.Pool(), 1, slots, bad};
  ExpectRejected([&] { return rssm_fold(&f); }, "write_pos[0]");
}

TEST_F(Validation, CudaWithoutTheBackendIsUnsupported) {
  if (rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "a GPU is present";
  rssm_decode_args a = Decode();
  a.launch.backend = RSSM_BACKEND_CUDA;
  EXPECT_EQ(rssm_replay_decode(&a), RSSM_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(rssm_last_error()).find("CUDA"), std::string::npos);
}

// A 16-bit state keeps its ring in its own dtype: every other pair is refused by name, on
// every call, before anything is written.
TEST_F(Validation, SixteenBitStateRefusesOtherRingDtypes) {
  for (int32_t state : {RSSM_DTYPE_BF16, RSSM_DTYPE_F16}) {
    for (int32_t ring : {RSSM_RING_DTYPE_F32, RSSM_RING_DTYPE_BF16, RSSM_RING_DTYPE_F16}) {
      if (ring - RSSM_RING_DTYPE_F32 == state) continue;
      SCOPED_TRACE(std::string(rssm_dtype_name(state)) + " state, ring code " +
                   std::to_string(ring));
      auto refused = [&](rssm_layer_shape& s) { s.state_dtype = state, s.ring_dtype = ring; };
      ExpectDecodeRejected([&](auto& a) { refused(a.shape); }, "shape.ring_dtype");
      rssm_verify_args v = layer_.VerifyArgs(2, 1, slots_, pos_, tok_, out_);
      refused(v.shape);
      ExpectRejected([&] { return rssm_verify(&v); }, "shape.ring_dtype");
      rssm_fold_args f{{RSSM_BACKEND_CPU, nullptr}, layer_.shape, layer_.Pool(), 2, slots_, pos_};
      refused(f.shape);
      ExpectRejected([&] { return rssm_fold(&f); }, "shape.ring_dtype");
      const int32_t cu[3] = {0, 1, 2};
      rssm_prefill_args p = Prefill(cu, 1);
      refused(p.shape);
      ExpectRejected([&] { return rssm_prefill(&p); }, "shape.ring_dtype");
      rssm_layer_shape shape = layer_.shape;
      refused(shape);
      EXPECT_EQ(rssm_check_shape(&shape), RSSM_ERR_INVALID_ARGUMENT);
      EXPECT_EQ(rssm_slot_layer_bytes(&shape), 0);
    }
  }
}

TEST(Helpers, RingDtypeResolves) {
  rssm_layer_shape s{RSSM_GATE_GDN, 16, 32, 128, 128, 16, RSSM_DTYPE_F32, RSSM_DTYPE_BF16};
  EXPECT_EQ(rssm_ring_storage_dtype(&s), RSSM_DTYPE_F32);  // zero-initialized: the state's
  s.state_dtype = RSSM_DTYPE_BF16;
  EXPECT_EQ(rssm_ring_storage_dtype(&s), RSSM_DTYPE_BF16);
  s.state_dtype = RSSM_DTYPE_F32;
  s.ring_dtype = RSSM_RING_DTYPE_F16;
  EXPECT_EQ(rssm_ring_storage_dtype(&s), RSSM_DTYPE_F16);
  EXPECT_EQ(rssm_check_shape(&s), RSSM_OK);
  s.ring_dtype = RSSM_DTYPE_BF16;  // a plain dtype code
  EXPECT_EQ(rssm_ring_storage_dtype(&s), -1);
  EXPECT_EQ(rssm_check_shape(&s), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(rssm_ring_storage_dtype(nullptr), -1);
}

TEST(Helpers, SlotBytesCountCheckpointAndRing) {
  const rssm_layer_shape s{RSSM_GATE_GDN, 16, 32, 128, 128, 16, RSSM_DTYPE_F32, RSSM_DTYPE_BF16};
  // 32*128*128*4 + (32*16*128 + 16*16*128)*4 + 32*16*4
  EXPECT_EQ(rssm_slot_layer_bytes(&s), 2097152 + 393216 + 2048);
  rssm_layer_shape bad = s;
  bad.head_k = 20;
  EXPECT_EQ(rssm_slot_layer_bytes(&bad), 0);
  EXPECT_EQ(rssm_check_shape(&bad), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(rssm_check_shape(&s), RSSM_OK);
  // An fp32 checkpoint with a bf16 ring: the ring's d and k at 2 bytes, g still fp32.
  rssm_layer_shape ring16 = s;
  ring16.ring_dtype = RSSM_RING_DTYPE_BF16;
  EXPECT_EQ(rssm_ring_d_elems(&ring16), 32 * 16 * 128);
  EXPECT_EQ(rssm_slot_layer_bytes(&ring16), 2097152 + 393216 / 2 + 2048);
  ring16.ring_dtype = RSSM_RING_DTYPE_F32;  // named explicitly: as the state's
  EXPECT_EQ(rssm_slot_layer_bytes(&ring16), rssm_slot_layer_bytes(&s));
}

}  // namespace
}  // namespace replayssm::kernels::testing

namespace replayssm::kernels::testing {
namespace {

TEST(Memory, CpuAllocCopySetFree) {
  void* a = nullptr;
  void* b = nullptr;
  ASSERT_EQ(rssm_alloc(RSSM_BACKEND_CPU, 1000, &a), RSSM_OK);
  ASSERT_EQ(rssm_alloc(RSSM_BACKEND_CPU, 1000, &b), RSSM_OK);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  const rssm_launch cpu{RSSM_BACKEND_CPU, nullptr};
  ASSERT_EQ(rssm_memset(&cpu, a, 7, 1000), RSSM_OK);
  ASSERT_EQ(rssm_memcpy(&cpu, b, a, 1000, RSSM_COPY_DEVICE_TO_DEVICE), RSSM_OK);
  ASSERT_EQ(rssm_synchronize(&cpu), RSSM_OK);
  EXPECT_EQ(static_cast<unsigned char*>(b)[999], 7);
  EXPECT_EQ(rssm_memcpy(&cpu, b, a, 10, 3), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("kind"), std::string::npos);
  int placeholder = 0;
  void* bad = &placeholder;
  EXPECT_EQ(rssm_alloc(9, 10, &bad), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bad, nullptr);
  EXPECT_EQ(rssm_free(RSSM_BACKEND_CPU, a), RSSM_OK);
  EXPECT_EQ(rssm_free(RSSM_BACKEND_CPU, b), RSSM_OK);
  EXPECT_EQ(rssm_free(RSSM_BACKEND_CPU, nullptr), RSSM_OK);
}

TEST(Memory, CpuHostMemoryAndStreams) {
  void* h = nullptr;
  ASSERT_EQ(rssm_alloc_host(RSSM_BACKEND_CPU, 100, &h), RSSM_OK);
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(h) % 64, 0u);
  static_cast<unsigned char*>(h)[99] = 3;
  EXPECT_EQ(rssm_free_host(RSSM_BACKEND_CPU, h), RSSM_OK);
  EXPECT_EQ(rssm_free_host(RSSM_BACKEND_CPU, nullptr), RSSM_OK);
  int placeholder = 0;
  void* bad = &placeholder;
  EXPECT_EQ(rssm_alloc_host(5, 10, &bad), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(bad, nullptr);
  EXPECT_NE(std::string(rssm_last_error()).find("backend"), std::string::npos);
  EXPECT_EQ(rssm_alloc_host(RSSM_BACKEND_CPU, 10, nullptr), RSSM_ERR_INVALID_ARGUMENT);
  // CPU streams are NULL: work runs at once.
  void* s = &placeholder;
  ASSERT_EQ(rssm_stream_create(RSSM_BACKEND_CPU, &s), RSSM_OK);
  EXPECT_EQ(s, nullptr);
  EXPECT_EQ(rssm_stream_destroy(RSSM_BACKEND_CPU, nullptr), RSSM_OK);
  EXPECT_EQ(rssm_stream_destroy(RSSM_BACKEND_CPU, &placeholder), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("stream"), std::string::npos);
  EXPECT_EQ(rssm_stream_create(7, &s), RSSM_ERR_INVALID_ARGUMENT);
}

// The calling thread's device: 0 on the CPU, on any thread; a null out or an unknown backend
// is a bad argument, named.
TEST(Memory, GetDeviceNamesTheCallingThreadsDevice) {
  int32_t device = -1;
  EXPECT_EQ(rssm_get_device(RSSM_BACKEND_CPU, &device), RSSM_OK);
  EXPECT_EQ(device, 0);
  std::thread([] {
    int32_t other = -1;
    EXPECT_EQ(rssm_get_device(RSSM_BACKEND_CPU, &other), RSSM_OK);
    EXPECT_EQ(other, 0);
  }).join();
  EXPECT_EQ(rssm_get_device(RSSM_BACKEND_CPU, nullptr), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(rssm_last_error()),
            "rssm_get_device: device: expected a pointer, got NULL");
  EXPECT_EQ(rssm_get_device(9, &device), RSSM_ERR_INVALID_ARGUMENT);
}

// The CPU device works unless a test injects a failure through REPLAYSSM_CPU_FAULT_FILE (the
// file's existence, checked on every call); a device out of range or an unknown backend is a
// bad argument.
TEST(Memory, DeviceCheckReportsAnInjectedFailure) {
  EXPECT_EQ(rssm_device_check(RSSM_BACKEND_CPU, 0), RSSM_OK);
  EXPECT_EQ(rssm_device_check(RSSM_BACKEND_CPU, 1), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(rssm_last_error()), "rssm_device_check: device: expected 0..0, got 1");
  EXPECT_EQ(rssm_device_check(9, 0), RSSM_ERR_INVALID_ARGUMENT);
  const std::string file =
      ::testing::TempDir() + "/replayssm_cpu_fault_" + std::to_string(getpid());
  std::remove(file.c_str());
  ASSERT_EQ(setenv("REPLAYSSM_CPU_FAULT_FILE", file.c_str(), 1), 0);
  EXPECT_EQ(rssm_device_check(RSSM_BACKEND_CPU, 0), RSSM_OK) << "the file does not exist yet";
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  EXPECT_EQ(rssm_device_check(RSSM_BACKEND_CPU, 0), RSSM_ERR_DEVICE);
  EXPECT_EQ(std::string(rssm_last_error()),
            "rssm_device_check: cpu: a device failure injected (" + file + " exists)");
  std::remove(file.c_str());
  EXPECT_EQ(rssm_device_check(RSSM_BACKEND_CPU, 0), RSSM_OK);
  unsetenv("REPLAYSSM_CPU_FAULT_FILE");
}

}  // namespace
}  // namespace replayssm::kernels::testing
