// The CUDA backend against the CPU backend (the reference): the same fresh random inputs go
// through rssm_* with RSSM_BACKEND_CPU on a host pool and RSSM_BACKEND_CUDA on a device copy
// of it; outputs (poisoned with NaN first, so an unwritten element fails) and the whole pool
// (checkpoints and rings, NaN where nothing was ever written) must agree within the harness's
// dtype-based tolerances. Needs a GPU: registered under the ctest label `gpu` (docs/gpu.md).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "replayssm/segment_hash.h"
#include "src/launch_overrides.h"
#include "tests/harness.h"

namespace replayssm::kernels::testing {
namespace {

#define CUDA_OK(x) ASSERT_EQ((x), cudaSuccess) << #x

// A device buffer holding a copy of host bytes.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0 && cudaMalloc(&p_, bytes_) != cudaSuccess) p_ = nullptr;
  }
  DevBuf(const void* host, size_t bytes) : DevBuf(bytes) { Upload(host); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DevBuf() {
    if (p_ != nullptr) cudaFree(p_);
  }
  void Upload(const void* host) {
    if (bytes_ > 0) cudaMemcpy(p_, host, bytes_, cudaMemcpyHostToDevice);
  }
  void Download(void* host) const {
    if (bytes_ > 0) cudaMemcpy(host, p_, bytes_, cudaMemcpyDeviceToHost);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(p_);
  }
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

template <typename T>
DevBuf ToDevice(const std::vector<T>& v) {
  return DevBuf(v.data(), v.size() * sizeof(T));
}
DevBuf ToDevice(const Buffer& b) { return DevBuf(b.data(), b.bytes().size()); }

// The device twin of a host Layer: its pool and parameters in device memory.
struct DevLayer {
  explicit DevLayer(const Layer& l)
      : cp(ToDevice(l.checkpoint)),
        rd(ToDevice(l.ring_d)),
        rk(ToDevice(l.ring_k)),
        rg(ToDevice(l.ring_g)),
        a_log(ToDevice(l.a_log)),
        dt_bias(ToDevice(l.dt_bias)) {}
  rssm_state_pool Pool(Layer& host) const {
    rssm_state_pool p = host.Pool();
    p.checkpoint = cp.get();
    p.ring_d = rd.get();
    p.ring_k = rk.get();
    p.ring_g = rg.as<float>();
    return p;
  }
  rssm_layer_params Params(const Layer& host) const {
    rssm_layer_params p = host.Params();
    p.a_log = a_log.as<float>();
    p.dt_bias = dt_bias.as<float>();
    return p;
  }
  // Replaces the host pool by the device one (to compare, or to resynchronize the twins).
  void DownloadInto(Layer& host) const {
    cp.Download(host.checkpoint.data());
    rd.Download(host.ring_d.data());
    rk.Download(host.ring_k.data());
    rg.Download(host.ring_g.data());
  }
  void UploadFrom(const Layer& host) {
    cp.Upload(host.checkpoint.data());
    rd.Upload(host.ring_d.data());
    rk.Upload(host.ring_k.data());
    rg.Upload(host.ring_g.data());
  }
  DevBuf cp, rd, rk, rg, a_log, dt_bias;
};

// Device copies of a batch's activations.
struct DevTokens {
  explicit DevTokens(const Tokens& t) : qkv(ToDevice(t.qkv)), a(ToDevice(t.a)), b(ToDevice(t.b)) {}
  rssm_token_inputs Inputs() const {
    return rssm_token_inputs{qkv.get(), a.get(), b.get(), 0, 0, 0};
  }
  DevBuf qkv, a, b;
};

// How far the CUDA backend may be from the CPU backend, element by element. Both run fp32
// arithmetic on the same stored inputs (the CPU pool is uploaded after every comparison, so no
// error carries into the next step); they differ in the order of their sums, and a value the
// two orders put on either side of a rounding boundary is stored one unit in the last place
// (ulp) apart. So an element may differ by
//   one ulp of its storage dtype at its magnitude, plus
//   `scale` times the buffer's largest reference magnitude, where `scale` is
//   - 4e-6 for a buffer made in one step from stored inputs (outputs, ring records): fp32 sums
//     of up to 256 terms reordered, whose size is the buffer's, not the element's (a small
//     output is the difference of large terms);
//   - for what a step builds on a record it made and stored itself (a fold's checkpoint takes
//     the token's own record; verify's later drafts, prefill's later tokens take the earlier
//     ones), also that record's one-ulp flip, carried: twice the unit roundoff of the ring's
//     dtype (f16 9.8e-4, bf16 7.8e-3) for checkpoints; a quarter of it for fp32 outputs
//     (16-bit outputs' own ulp covers it).
// Measured on an H100 (2026-12-06, bench/results/gpu_tests.md; SummarizeCloseness prints
// them): f32 rings put every buffer within 4.0e-7 x its largest magnitude; 16-bit outputs and
// records within one ulp; checkpoints over an f16 ring within 4.8e-4, over bf16 2.3e-3 (a
// bf16 state) and 6.2e-4 (an f32 one); f32 outputs over an f16 ring 2.2e-5.
// The relative L2 bounds of the fp64 harness (harness.h) stay as a second check.
constexpr double kOneStep = 4e-6;
double UnitRoundoff(rssm_dtype dt) {
  return dt == RSSM_DTYPE_F32 ? 0.0 : dt == RSSM_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
}
double CheckpointScale(const Config& c) { return std::max(kOneStep, 2 * UnitRoundoff(c.Ring())); }
double OutputScale(const Config& c) { return std::max(kOneStep, UnitRoundoff(c.Ring()) / 4); }

double Ulp(rssm_dtype dt, double x) {
  const int mant = dt == RSSM_DTYPE_F32 ? 23 : dt == RSSM_DTYPE_F16 ? 10 : 7;
  const int min_exp = dt == RSSM_DTYPE_F16 ? -14 : -126;  // below it: the subnormals' step
  int e = 0;
  std::frexp(std::max(std::fabs(x), 1e-300), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0, std::max(e - 1, min_exp) - mant);
}

// Per buffer kind, dtype and scale term, the worst element seen: its distance in storage ulps
// beyond the scale term, and in units of the buffer's largest magnitude.
struct Worst {
  double ulps = 0.0, scaled = 0.0;
  std::string where;
};
std::map<std::string, Worst>& Closeness() {
  static auto* m = new std::map<std::string, Worst>();
  return *m;
}

// Relative L2 distance of two buffers of one dtype, elementwise over entries where the
// reference is not NaN; an entry that is NaN in exactly one of them counts as a failure; and
// the elementwise bound above.
struct Diff {
  double rel = 0.0;
  int64_t nan_mismatch = 0;
  int64_t first_bad = -1;
  int64_t far = 0;  // elements past the elementwise bound
  int64_t first_far = -1;
  double worst_ulps = 0.0;    // max (|g - r| - scale * largest) / ulp over the elements
  double worst_scaled = 0.0;  // max |g - r| / largest
};
Diff Compare(const Buffer& got, const Buffer& ref, double scale) {
  Diff d;
  double num = 0.0, den = 0.0, largest = 1e-30;
  for (int64_t i = 0; i < ref.size(); ++i) {
    const double r = ref.Get(i);
    if (!std::isnan(r)) largest = std::max(largest, std::fabs(r));
  }
  for (int64_t i = 0; i < ref.size(); ++i) {
    const double r = ref.Get(i), g = got.Get(i);
    if (std::isnan(r) || std::isnan(g)) {
      if (std::isnan(r) != std::isnan(g)) {
        if (d.first_bad < 0) d.first_bad = i;
        ++d.nan_mismatch;
      }
      continue;
    }
    num += (g - r) * (g - r);
    den += r * r;
    const double err = std::fabs(g - r);
    const double ulp = std::max(Ulp(ref.dtype(), r), Ulp(ref.dtype(), g));
    d.worst_ulps = std::max(d.worst_ulps, (err - scale * largest) / ulp);
    d.worst_scaled = std::max(d.worst_scaled, err / largest);
    if (err > ulp + scale * largest) {
      if (d.first_far < 0) d.first_far = i;
      ++d.far;
    }
  }
  d.rel = std::sqrt(num) / std::max(std::sqrt(den), 1e-30);
  return d;
}
Buffer FromFloats(const std::vector<float>& v) {
  Buffer b(RSSM_DTYPE_F32, static_cast<int64_t>(v.size()));
  std::memcpy(b.data(), v.data(), v.size() * 4);
  return b;
}

void ExpectClose(const Buffer& got, const Buffer& ref, double tol, double scale,
                 const std::string& what) {
  const Diff d = Compare(got, ref, scale);
  EXPECT_EQ(d.nan_mismatch, 0) << what << ": NaN in one backend only, first at " << d.first_bad
                               << " (cuda " << got.Get(d.first_bad < 0 ? 0 : d.first_bad)
                               << ", cpu " << ref.Get(d.first_bad < 0 ? 0 : d.first_bad) << ")";
  EXPECT_LE(d.rel, tol) << what;
  EXPECT_EQ(d.far, 0) << what << ": " << d.far << " elements further than 1 ulp of "
                      << rssm_dtype_name(ref.dtype()) << " + " << scale
                      << " x the largest magnitude; first at " << d.first_far << " (cuda "
                      << got.Get(std::max<int64_t>(d.first_far, 0)) << ", cpu "
                      << ref.Get(std::max<int64_t>(d.first_far, 0)) << "); worst " << d.worst_ulps
                      << " ulp, " << d.worst_scaled << " x scale";
  // The kind is what follows the case's name: "checkpoint", "ring_d", "output", ...
  const std::string kind = what.substr(what.rfind(' ') + 1);
  Worst& w = Closeness()[kind + " " + rssm_dtype_name(ref.dtype()) + " at " +
                         std::to_string(scale).substr(0, 8)];
  if (d.worst_ulps > w.ulps || d.worst_scaled > w.scaled) {
    w.ulps = std::max(w.ulps, d.worst_ulps);
    w.scaled = std::max(w.scaled, d.worst_scaled);
    w.where = what;
  }
}

// Prints the worst elements seen, per buffer kind and dtype, when the tests end (the figures
// the bounds above were set from).
class SummarizeCloseness : public ::testing::Environment {
 public:
  void TearDown() override {
    if (Closeness().empty()) return;
    std::printf(
        "CUDA against CPU, worst element per buffer, dtype and scale term (bound: 1 ulp + "
        "that term x the largest magnitude):\n");
    for (const auto& [key, w] : Closeness()) {
      std::printf("  %-22s %8.3f ulp beyond the scale term, %10.3g x scale  (%s)\n", key.c_str(),
                  w.ulps, w.scaled, w.where.c_str());
    }
  }
};
[[maybe_unused]] ::testing::Environment* const kSummary =
    ::testing::AddGlobalTestEnvironment(new SummarizeCloseness);

// The elementwise bound catches what the relative L2 bound lets through: a bf16 output of a
// one-step buffer with every element 1% off (2.6 ulp of bf16) passes the harness's 1.5e-2 (a
// bf16 state's output bound is larger still) but not this; one element off by 2 ulp fails it
// too; the buffer itself passes.
TEST(CudaAgreement, TheElementwiseBoundCatchesWhatTheL2BoundLetsThrough) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> n(0.f, 1.f);
  Buffer ref(RSSM_DTYPE_BF16, 4096);
  for (int64_t i = 0; i < ref.size(); ++i) ref.Set(i, n(rng));
  Buffer off = ref;
  for (int64_t i = 0; i < off.size(); ++i) off.Set(i, ref.Get(i) * 1.01f);
  const Diff d = Compare(off, ref, kOneStep);
  EXPECT_LE(d.rel, StateTolerance(RSSM_DTYPE_BF16));
  EXPECT_GT(d.far, 0);
  Buffer one = ref;
  int64_t big = 0;  // an element whose ulp is far above the scale term
  while (std::fabs(ref.Get(big)) < 0.5f) ++big;
  const float x = ref.Get(big);
  one.Set(big, x + static_cast<float>(2 * Ulp(RSSM_DTYPE_BF16, x)));
  EXPECT_EQ(Compare(one, ref, kOneStep).far, 1);
  EXPECT_EQ(Compare(ref, ref, kOneStep).far, 0);
}

// Compares the device pool with the host pool, then copies the host pool to the device so
// that the next step starts from identical states (errors never compound across steps).
void ComparePools(Layer& host, DevLayer& dev, const std::string& what) {
  Layer got = host;  // same shape and strides; contents replaced below
  dev.DownloadInto(got);
  const double tol = StateTolerance(host.cfg);
  ExpectClose(got.checkpoint, host.checkpoint, tol, CheckpointScale(host.cfg),
              what + " checkpoint");
  ExpectClose(got.ring_d, host.ring_d, tol, kOneStep, what + " ring_d");
  ExpectClose(got.ring_k, host.ring_k, tol, kOneStep, what + " ring_k");
  ExpectClose(FromFloats(got.ring_g), FromFloats(host.ring_g), 1e-5, kOneStep, what + " ring_g");
  dev.UploadFrom(host);
}

void CompareOutputs(const Buffer& got, const Buffer& ref, const Config& c,
                    const std::string& what) {
  for (int64_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got.Get(i))) {
      ADD_FAILURE() << what << ": output element " << i << " not written";
      return;
    }
  }
  ExpectClose(got, ref, OutputTolerance(c), OutputScale(c), what + " output");
}

struct Request {
  int slot;
  int w = 0;
};

// One configuration: >= 3L + 2 replay steps with advancing cursors, forced folds and padding
// rows; then fold of some rows, verify of T drafts, and a prefill (some rows from their slot).
// With `forced`, replay and verify run on that step kernel (launch_overrides.h); `roles`, when
// given, receives each replay step's planned kernel.
void RunCase(const Config& cfg, int num_requests, uint64_t seed, int steps = -1,
             const cuda::LaunchOverrides* forced = nullptr,
             std::vector<cuda::KernelRole>* roles = nullptr) {
  SCOPED_TRACE("config " + cfg.Name() + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int num_slots = num_requests + 2;
  Layer host(cfg, num_slots, rng);
  std::vector<Request> reqs;
  for (int i = 0; i < num_requests; ++i) {
    host.RandomCheckpoint(i + 1, rng);
    reqs.push_back(Request{i + 1});
  }
  DevLayer dev(host);
  ASSERT_NE(dev.cp.get(), nullptr);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  const int nsteps = steps > 0 ? steps : 3 * cfg.l + 2;
  auto make_rows = [&]() {
    std::vector<int> rows;
    for (int r = 0; r < num_requests; ++r) {
      if (coin(rng) > 0.1) rows.push_back(r);
    }
    rows.push_back(-1);
    std::shuffle(rows.begin(), rows.end(), rng);
    return rows;
  };
  for (int step = 0; step < nsteps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const std::vector<int> rows = make_rows();
    const int B = static_cast<int>(rows.size());
    Tokens tok(host, B, rng);
    std::vector<int32_t> slot_idx(B), write_pos(B);
    std::vector<uint8_t> force(B);
    for (int i = 0; i < B; ++i) {
      slot_idx[i] = rows[i] < 0 ? -1 : reqs[rows[i]].slot;
      write_pos[i] = rows[i] < 0 ? 0 : reqs[rows[i]].w;
      force[i] = coin(rng) < 0.1 ? 1 : 0;
    }
    const int64_t out_n = int64_t{B} * cfg.hv * cfg.v;
    Buffer out_cpu(cfg.act_dtype, out_n), out_gpu(cfg.act_dtype, out_n);
    out_cpu.FillNaN();
    out_gpu.FillNaN();
    DevTokens dtok(tok);
    DevBuf dslot = ToDevice(slot_idx), dpos = ToDevice(write_pos), dforce = ToDevice(force);
    DevBuf dout = ToDevice(out_gpu);
    rssm_decode_args a{};
    a.launch = {RSSM_BACKEND_CPU, nullptr};
    a.shape = host.shape;
    a.params = host.Params();
    a.pool = host.Pool();
    a.batch = B;
    a.slot_idx = slot_idx.data();
    a.write_pos = write_pos.data();
    a.force_fold = force.data();
    a.in = tok.Inputs();
    a.out = rssm_token_outputs{out_cpu.data(), 0};
    ASSERT_EQ(rssm_replay_decode(&a), RSSM_OK) << rssm_last_error();
    a.launch = {RSSM_BACKEND_CUDA, nullptr};
    a.params = dev.Params(host);
    a.pool = dev.Pool(host);
    a.slot_idx = dslot.as<int32_t>();
    a.write_pos = dpos.as<int32_t>();
    a.force_fold = dforce.as<uint8_t>();
    a.in = dtok.Inputs();
    a.out = rssm_token_outputs{dout.get(), 0};
    cuda::LaunchPlan plan;
    ASSERT_EQ(ReplayDecodeWith(&a, forced != nullptr ? *forced : cuda::LaunchOverrides{}, &plan),
              RSSM_OK)
        << rssm_last_error();
    if (roles != nullptr) roles->push_back(plan.role);
    CUDA_OK(cudaDeviceSynchronize());
    dout.Download(out_gpu.data());
    CompareOutputs(out_gpu, out_cpu, cfg, "replay");
    ComparePools(host, dev, "replay");
    if (::testing::Test::HasFailure()) return;
    for (int i = 0; i < B; ++i) {
      if (rows[i] < 0) continue;
      Request& r = reqs[rows[i]];
      r.w = (r.w + 1 >= cfg.l || force[i]) ? 0 : r.w + 1;
    }
  }

  // Verify: T drafts; rows without room are folded first (through both backends' fold).
  const int T = 1 + static_cast<int>(coin(rng) * std::min(cfg.l, 4));
  {
    std::vector<int32_t> fslot, fpos;
    for (Request& r : reqs) {
      if (r.w + T > cfg.l || coin(rng) < 0.2) {
        fslot.push_back(r.slot);
        fpos.push_back(r.w);
        r.w = 0;
      }
    }
    fslot.push_back(-1);
    fpos.push_back(0);
    rssm_fold_args f{};
    f.launch = {RSSM_BACKEND_CPU, nullptr};
    f.shape = host.shape;
    f.pool = host.Pool();
    f.count = static_cast<int32_t>(fslot.size());
    f.slot_idx = fslot.data();
    f.write_pos = fpos.data();
    ASSERT_EQ(rssm_fold(&f), RSSM_OK) << rssm_last_error();
    DevBuf dslot = ToDevice(fslot), dpos = ToDevice(fpos);
    f.launch = {RSSM_BACKEND_CUDA, nullptr};
    f.pool = dev.Pool(host);
    f.slot_idx = dslot.as<int32_t>();
    f.write_pos = dpos.as<int32_t>();
    ASSERT_EQ(rssm_fold(&f), RSSM_OK) << rssm_last_error();
    CUDA_OK(cudaDeviceSynchronize());
    ComparePools(host, dev, "fold");
  }
  {
    const std::vector<int> rows = make_rows();
    const int B = static_cast<int>(rows.size());
    Tokens tok(host, B * T, rng);
    std::vector<int32_t> slot_idx(B), write_pos(B);
    for (int i = 0; i < B; ++i) {
      slot_idx[i] = rows[i] < 0 ? -1 : reqs[rows[i]].slot;
      write_pos[i] = rows[i] < 0 ? 0 : reqs[rows[i]].w;
    }
    const int64_t out_n = int64_t{B} * T * cfg.hv * cfg.v;
    Buffer out_cpu(cfg.act_dtype, out_n), out_gpu(cfg.act_dtype, out_n);
    out_cpu.FillNaN();
    out_gpu.FillNaN();
    DevTokens dtok(tok);
    DevBuf dslot = ToDevice(slot_idx), dpos = ToDevice(write_pos), dout = ToDevice(out_gpu);
    rssm_verify_args v{};
    v.launch = {RSSM_BACKEND_CPU, nullptr};
    v.shape = host.shape;
    v.params = host.Params();
    v.pool = host.Pool();
    v.batch = B;
    v.num_draft = T;
    v.slot_idx = slot_idx.data();
    v.write_pos = write_pos.data();
    v.in = tok.Inputs();
    v.out = rssm_token_outputs{out_cpu.data(), 0};
    ASSERT_EQ(rssm_verify(&v), RSSM_OK) << rssm_last_error();
    v.launch = {RSSM_BACKEND_CUDA, nullptr};
    v.params = dev.Params(host);
    v.pool = dev.Pool(host);
    v.slot_idx = dslot.as<int32_t>();
    v.write_pos = dpos.as<int32_t>();
    v.in = dtok.Inputs();
    v.out = rssm_token_outputs{dout.get(), 0};
    ASSERT_EQ(forced != nullptr ? VerifyWith(&v, *forced) : rssm_verify(&v), RSSM_OK)
        << rssm_last_error();
    CUDA_OK(cudaDeviceSynchronize());
    dout.Download(out_gpu.data());
    CompareOutputs(out_gpu, out_cpu, cfg, "verify T=" + std::to_string(T));
    ComparePools(host, dev, "verify");
    // Accept a random number of drafts.
    for (int i = 0; i < B; ++i) {
      if (rows[i] >= 0) reqs[rows[i]].w += static_cast<int>(coin(rng) * (T + 1));
    }
  }
  {
    // Prefill: varlen rows (some empty), some from their slot's logical state, a padding row.
    const std::vector<int> rows = make_rows();
    const int B = static_cast<int>(rows.size());
    std::vector<int32_t> slot_idx(B), write_pos(B), cu(B + 1, 0);
    std::vector<uint8_t> initial(B);
    int max_len = 0;
    for (int i = 0; i < B; ++i) {
      slot_idx[i] = rows[i] < 0 ? -1 : reqs[rows[i]].slot;
      write_pos[i] = rows[i] < 0 ? 0 : reqs[rows[i]].w;
      initial[i] = coin(rng) < 0.5 ? 1 : 0;
      const int len = static_cast<int>(coin(rng) * 7);
      cu[i + 1] = cu[i] + len;
      max_len = std::max(max_len, len);
    }
    const int N = std::max(cu[B], 1);
    Tokens tok(host, N, rng);
    const int64_t out_n = int64_t{N} * cfg.hv * cfg.v;
    Buffer out_cpu(cfg.act_dtype, out_n), out_gpu(cfg.act_dtype, out_n);
    out_cpu.FillNaN();
    out_gpu.FillNaN();
    DevTokens dtok(tok);
    DevBuf dslot = ToDevice(slot_idx), dpos = ToDevice(write_pos), dcu = ToDevice(cu),
           dinit = ToDevice(initial), dout = ToDevice(out_gpu);
    rssm_prefill_args p{};
    p.launch = {RSSM_BACKEND_CPU, nullptr};
    p.shape = host.shape;
    p.params = host.Params();
    p.pool = host.Pool();
    p.batch = B;
    p.slot_idx = slot_idx.data();
    p.cu_seqlens = cu.data();
    p.initial = initial.data();
    p.write_pos = write_pos.data();
    p.max_seqlen = max_len;
    p.in = tok.Inputs();
    p.out = rssm_token_outputs{out_cpu.data(), 0};
    ASSERT_EQ(rssm_prefill(&p), RSSM_OK) << rssm_last_error();
    p.launch = {RSSM_BACKEND_CUDA, nullptr};
    p.params = dev.Params(host);
    p.pool = dev.Pool(host);
    p.slot_idx = dslot.as<int32_t>();
    p.cu_seqlens = dcu.as<int32_t>();
    p.initial = dinit.as<uint8_t>();
    p.write_pos = dpos.as<int32_t>();
    p.in = dtok.Inputs();
    p.out = rssm_token_outputs{dout.get(), 0};
    ASSERT_EQ(rssm_prefill(&p), RSSM_OK) << rssm_last_error();
    CUDA_OK(cudaDeviceSynchronize());
    dout.Download(out_gpu.data());
    if (cu[B] > 0) CompareOutputs(out_gpu, out_cpu, cfg, "prefill");
    ComparePools(host, dev, "prefill");
  }
}

// `steps` baseline steps of a batch of every request in a fresh order plus a padding row, each
// through both backends (the CUDA one with `forced` overrides), outputs and pools compared.
// `plan` receives the launch of the last step.
void RunBaselineCase(const Config& cfg, int num_requests, uint64_t seed, int steps,
                     const cuda::LaunchOverrides& forced, cuda::LaunchPlan* plan) {
  SCOPED_TRACE("baseline, config " + cfg.Name() + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  Layer host(cfg, num_requests + 2, rng);
  for (int s = 1; s <= num_requests; ++s) host.RandomCheckpoint(s, rng);
  DevLayer dev(host);
  ASSERT_NE(dev.cp.get(), nullptr);
  for (int step = 0; step < steps; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    std::vector<int32_t> slot_idx;
    for (int s = 1; s <= num_requests; ++s) slot_idx.push_back(s);
    slot_idx.push_back(-1);
    std::shuffle(slot_idx.begin(), slot_idx.end(), rng);
    const int B = static_cast<int>(slot_idx.size());
    Tokens tok(host, B, rng);
    const int64_t out_n = int64_t{B} * cfg.hv * cfg.v;
    Buffer out_cpu(cfg.act_dtype, out_n), out_gpu(cfg.act_dtype, out_n);
    out_cpu.FillNaN();
    out_gpu.FillNaN();
    rssm_decode_args a = host.DecodeArgs(B, slot_idx.data(), nullptr, tok, out_cpu);
    ASSERT_EQ(rssm_baseline_decode(&a), RSSM_OK) << rssm_last_error();
    DevTokens dtok(tok);
    DevBuf dslot = ToDevice(slot_idx), dout = ToDevice(out_gpu);
    a.launch = {RSSM_BACKEND_CUDA, nullptr};
    a.params = dev.Params(host);
    a.pool = dev.Pool(host);
    a.slot_idx = dslot.as<int32_t>();
    a.in = dtok.Inputs();
    a.out = rssm_token_outputs{dout.get(), 0};
    ASSERT_EQ(BaselineDecodeWith(&a, forced, plan), RSSM_OK) << rssm_last_error();
    CUDA_OK(cudaDeviceSynchronize());
    dout.Download(out_gpu.data());
    CompareOutputs(out_gpu, out_cpu, cfg, "baseline");
    ComparePools(host, dev, "baseline");
    if (::testing::Test::HasFailure()) return;
  }
}

bool HaveGpu() { return rssm_backend_available(RSSM_BACKEND_CUDA) == 1; }
constexpr char kNoGpu[] = "no CUDA device: these tests (ctest label gpu) run on a GPU machine";

const rssm_dtype kDtypes[] = {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16};

// Every gate x (state, ring) dtype pair x act dtype, each with shapes rotated through the GQA
// ratios, ring lengths and head dims so that every value of each appears many times.
TEST(CudaKernels, SweepMatchesCpu) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  const int ratios[] = {1, 2, 4};
  const int ls[] = {1, 2, 8, 16, 64};
  const int dims[] = {16, 64, 128, 96};
  int i = 0;
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (auto [st, ring] : kStoragePairs) {
      for (rssm_dtype act : kDtypes) {
        for (int rep = 0; rep < 3; ++rep, ++i) {
          Config c;
          c.gate = gate;
          c.state_dtype = st;
          c.ring_dtype = ring;
          c.act_dtype = act;
          c.h = 2;
          c.hv = 2 * ratios[i % 3];
          c.l = ls[(i / 3 + i) % 5];
          c.k = dims[i % 4];
          c.v = dims[(i / 4 + i) % 4];
          c.l2norm = (i % 7) != 3;
          c.slot_pad = (i % 5 == 2) ? 3 : 0;  // unaligned slots: the scalar fallback
          c.round_beta = rep == 1;
          const int steps = c.l == 64 ? 40 : -1;
          RunCase(c, 3 + i % 3, 1000 + i, steps);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// Both step kernels on every gate and (state, ring) dtype pair, whatever the planner would choose:
// the tiled kernel for decode (the bulk kernel's fallback) and the bulk kernel for verify at small
// batches.
TEST(CudaKernels, EachStepKernelMatchesCpu) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  const int ls[] = {1, 4, 16};
  const int dims[] = {64, 128, 256};
  int i = 0;
  for (auto kernel :
       {cuda::LaunchOverrides::StepKernel::kTiled, cuda::LaunchOverrides::StepKernel::kBulk}) {
    cuda::LaunchOverrides forced;
    forced.step_kernel = kernel;
    for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
      for (auto [st, ring] : kStoragePairs) {
        for (int rep = 0; rep < 2; ++rep, ++i) {
          Config c;
          c.gate = gate;
          c.state_dtype = st;
          c.ring_dtype = ring;
          c.act_dtype = kDtypes[(i + 1) % 3];
          c.h = 2;
          c.hv = 2 * (1 + i % 2);
          c.l = ls[i % 3];
          c.k = dims[i % 3];
          c.v = dims[(i + 1) % 3];
          c.slot_pad = (i % 4 == 3) ? 3 : 0;
          c.round_beta = rep == 0;
          SCOPED_TRACE(kernel == cuda::LaunchOverrides::StepKernel::kTiled ? "tiled" : "bulk");
          RunCase(c, 3 + i % 2, 5000 + i, -1, &forced);
          if (::testing::Test::HasFailure()) return;
        }
      }
    }
  }
}

// The planner's choice is the forced kernel's (so the test above covers what it names).
TEST(CudaKernels, ForcedStepKernelIsTheOneThatRuns) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  Config c;
  std::mt19937_64 rng(3);
  Layer host(c, 2, rng);
  DevLayer dev(host);
  Tokens tok(host, 1, rng);
  DevTokens dtok(tok);
  const std::vector<int32_t> slots = {0}, pos = {2};
  DevBuf dslot = ToDevice(slots), dpos = ToDevice(pos);
  DevBuf dout(int64_t{c.hv} * c.v * rssm_dtype_size(c.act_dtype));
  rssm_decode_args a{};
  a.launch = {RSSM_BACKEND_CUDA, nullptr};
  a.shape = host.shape;
  a.params = dev.Params(host);
  a.pool = dev.Pool(host);
  a.batch = 1;
  a.slot_idx = dslot.as<int32_t>();
  a.write_pos = dpos.as<int32_t>();
  a.in = dtok.Inputs();
  a.out = rssm_token_outputs{dout.get(), 0};
  for (auto [kernel, role] :
       {std::pair{cuda::LaunchOverrides::StepKernel::kTiled, cuda::KernelRole::kTiledStep},
        std::pair{cuda::LaunchOverrides::StepKernel::kBulk, cuda::KernelRole::kBulkStep}}) {
    cuda::LaunchOverrides forced;
    forced.step_kernel = kernel;
    cuda::LaunchPlan plan;
    ASSERT_EQ(ReplayDecodeWith(&a, forced, &plan), RSSM_OK) << rssm_last_error();
    EXPECT_EQ(plan.role, role);
  }
  CUDA_OK(cudaDeviceSynchronize());
}

// The benchmark shape at large batch.
TEST(CudaKernels, LargeShapesMatchCpu) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  struct Case {
    rssm_gate gate;
    rssm_dtype st;
    int b;
    int32_t ring = -1;  // the state's
  };
  const Case cases[] = {{RSSM_GATE_GDN, RSSM_DTYPE_F32, 256},
                        {RSSM_GATE_KDA, RSSM_DTYPE_BF16, 128},
                        {RSSM_GATE_GDN, RSSM_DTYPE_BF16, 64},
                        {RSSM_GATE_KDA, RSSM_DTYPE_F32, 64},
                        {RSSM_GATE_GDN, RSSM_DTYPE_F32, 128, RSSM_DTYPE_BF16},
                        {RSSM_GATE_KDA, RSSM_DTYPE_F32, 256, RSSM_DTYPE_BF16}};
  int i = 0;
  for (const Case& k : cases) {
    Config c;
    c.gate = k.gate;
    c.state_dtype = k.st;
    c.ring_dtype = k.ring;
    c.act_dtype = RSSM_DTYPE_BF16;
    c.h = 16;
    c.hv = 32;
    c.k = c.v = 128;
    c.l = 16;
    RunCase(c, k.b, 77 + i++, k.b >= 128 ? 8 : 18);
    if (::testing::Test::HasFailure()) return;
  }
}

// The baseline decode on every gate x (state, ring) dtype pair x act dtype: head dims on both
// sides of 128 (4 and 8 channels per lane), V not a multiple of a CTA's rows, padding rows,
// unaligned slots; on the planned kernel (the baseline kernel), and on the bulk and tiled
// kernels forced (the benchmark's comparison).
TEST(CudaKernels, BaselineMatchesCpu) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  const int dims[] = {16, 64, 96, 128, 256};
  int i = 0;
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (auto [st, ring] : kStoragePairs) {
      for (rssm_dtype act : kDtypes) {
        for (int rep = 0; rep < 2; ++rep, ++i) {
          Config c;
          c.gate = gate;
          c.state_dtype = st;
          c.ring_dtype = ring;
          c.act_dtype = act;
          c.h = 2;
          c.hv = 2 * (1 + i % 2);
          c.l = 4;
          c.k = dims[i % 5];
          c.v = dims[(i / 5 + 2 * i + 1) % 5];
          c.l2norm = (i % 4) != 1;
          c.slot_pad = (i % 3 == 2) ? 3 : 0;  // unaligned slots: the scalar fallback
          c.round_beta = rep == 1;
          cuda::LaunchPlan plan;
          RunBaselineCase(c, 3 + i % 3, 9000 + i, 3, {}, &plan);
          if (::testing::Test::HasFailure()) return;
          EXPECT_EQ(plan.role, cuda::KernelRole::kBaseline);
          EXPECT_EQ(plan.baseline.vec, c.slot_pad == 0);
          cuda::LaunchOverrides forced;
          forced.step_kernel = i % 2 == 0 ? cuda::LaunchOverrides::StepKernel::kBulk
                                          : cuda::LaunchOverrides::StepKernel::kTiled;
          RunBaselineCase(c, 3, 9500 + i, 2, forced, &plan);
          if (::testing::Test::HasFailure()) return;
          EXPECT_EQ(plan.role,
                    i % 2 == 0 ? cuda::KernelRole::kBulkStep : cuda::KernelRole::kTiledStep);
        }
      }
    }
  }
}

// The baseline kernel's other CTA shapes (the benchmark's overrides) at the benchmark's dims.
TEST(CudaKernels, BaselineShapesMatchCpu) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  const int shapes[][3] = {{1, 8, 4}, {1, 16, 4}, {2, 8, 4},  {2, 16, 4}, {4, 8, 1},  {4, 4, 4},
                           {2, 8, 1}, {2, 16, 1}, {2, 16, 2}, {2, 16, 3}, {2, 16, 5}, {2, 8, 5}};
  constexpr int kBf16Shapes = 6;  // the first ones are built for a bf16 state too
  int i = 0;
  for (rssm_dtype st : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16}) {
    for (int j = 0; j < (st == RSSM_DTYPE_F32 ? int(std::size(shapes)) : kBf16Shapes); ++j) {
      const int* sh = shapes[j];
      Config c;
      c.gate = i % 2 == 0 ? RSSM_GATE_GDN : RSSM_GATE_KDA;
      c.state_dtype = st;
      c.act_dtype = RSSM_DTYPE_BF16;
      c.h = 2;
      c.hv = 4;
      c.k = 128;
      c.v = i % 3 == 0 ? 96 : 128;
      c.l = 4;
      cuda::LaunchOverrides ov;
      ov.baseline_warps = sh[0];
      ov.baseline_rows = sh[1];
      ov.baseline_cache = sh[2];
      SCOPED_TRACE("shape " + std::to_string(sh[0]) + " x " + std::to_string(sh[1]) + ", cache " +
                   std::to_string(sh[2]));
      cuda::LaunchPlan plan;
      RunBaselineCase(c, 4, 9900 + i++, 2, ov, &plan);
      if (::testing::Test::HasFailure()) return;
      EXPECT_EQ(plan.baseline.warps, sh[0]);
      EXPECT_EQ(plan.baseline.rows_per_warp, sh[1]);
    }
  }
}

// The small-batch replay kernel on every gate x fp32-state pair x act dtype: ring lengths from
// 1 (every step folds) to 64 (rings past 32 records), head dims on both sides of a warp's
// channels, forced folds, padding rows, strided (aligned) slots, round_beta; each replay step
// on that kernel (the planner's choice at these batches).
TEST(CudaKernels, SmallReplayMatchesCpu) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  const int ls[] = {1, 2, 8, 16, 64};
  const int dims[] = {16, 64, 96, 128};
  int i = 0;
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (auto [st, ring] : kStoragePairs) {
      if (st != RSSM_DTYPE_F32) continue;
      for (rssm_dtype act : kDtypes) {
        for (int rep = 0; rep < 2; ++rep, ++i) {
          Config c;
          c.gate = gate;
          c.state_dtype = st;
          c.ring_dtype = ring;
          c.act_dtype = act;
          c.h = 2;
          c.hv = 2 * (1 + i % 3);
          c.l = ls[(i / 2 + i) % 5];
          c.k = dims[i % 4];
          c.v = dims[(i / 4 + i + 1) % 4];
          c.l2norm = (i % 5) != 2;
          c.slot_pad = (i % 3 == 1) ? 8 : 0;  // strided slots, still 16-byte aligned
          c.round_beta = rep == 1;
          cuda::LaunchOverrides small;  // past the planned batches too (up to B * HV = 36)
          small.small_replay_max_batch = 64;
          std::vector<cuda::KernelRole> roles;
          RunCase(c, 2 + i % 3, 7000 + i, c.l == 64 ? 70 : -1, &small, &roles);
          if (::testing::Test::HasFailure()) return;
          for (cuda::KernelRole role : roles) {
            ASSERT_EQ(role, cuda::KernelRole::kSmallReplay) << c.Name();
          }
        }
      }
    }
  }
}

// One decode step of `a` (rows, cursors, tokens; its pool and outputs are set here) on two twin
// device layers: `run_x` launches it on `x`, `run_y` on `y`. The outputs and the checkpoints
// must agree byte for byte, and the rings too when `rings`. Failures are reported with `step`.
void ExpectTwinStepBitForBit(Layer& host, rssm_decode_args a, DevLayer& x, DevLayer& y,
                             const std::function<rssm_status(rssm_decode_args*)>& run_x,
                             const std::function<rssm_status(rssm_decode_args*)>& run_y, int step,
                             bool rings) {
  const Config& c = host.cfg;
  const int64_t out_n = int64_t{a.batch} * c.hv * c.v;
  Buffer o1(c.act_dtype, out_n), o2(c.act_dtype, out_n);
  DevBuf d1(out_n * rssm_dtype_size(c.act_dtype)), d2(out_n * rssm_dtype_size(c.act_dtype));
  a.pool = x.Pool(host);
  a.out = rssm_token_outputs{d1.get(), 0};
  ASSERT_EQ(run_x(&a), RSSM_OK) << rssm_last_error();
  a.pool = y.Pool(host);
  a.out = rssm_token_outputs{d2.get(), 0};
  ASSERT_EQ(run_y(&a), RSSM_OK) << rssm_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  d1.Download(o1.data());
  d2.Download(o2.data());
  ASSERT_EQ(o1.bytes(), o2.bytes()) << "outputs differ at step " << step;
  Layer s1 = host, s2 = host;
  x.DownloadInto(s1);
  y.DownloadInto(s2);
  ASSERT_EQ(s1.checkpoint.bytes(), s2.checkpoint.bytes()) << "states differ at step " << step;
  if (!rings) return;
  ASSERT_EQ(s1.ring_d.bytes(), s2.ring_d.bytes()) << "ring d differs at step " << step;
  ASSERT_EQ(s1.ring_k.bytes(), s2.ring_k.bytes()) << "ring k differs at step " << step;
  ASSERT_EQ(std::memcmp(s1.ring_g.data(), s2.ring_g.data(), s1.ring_g.size() * sizeof(float)), 0)
      << "ring g differs at step " << step;
}

// The small-batch replay kernel and the bulk kernel give the same bits (the same operations in
// the same order): outputs, checkpoints and rings after steps that advance every cursor through
// the ring, fold, and force folds.
TEST(CudaKernels, SmallReplayIsTheBulkKernelBitForBit) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  int n = 0;
  for (auto [st, ring] : kStoragePairs) {
    if (st != RSSM_DTYPE_F32) continue;
    for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
      Config c;
      c.gate = gate;
      c.state_dtype = st;
      c.ring_dtype = ring;
      c.act_dtype = RSSM_DTYPE_BF16;
      c.h = 2;
      c.hv = 4;
      c.k = c.v = 128;
      c.l = 16;
      c.round_beta = n % 2 == 1;
      SCOPED_TRACE(c.Name());
      std::mt19937_64 rng(515 + n++);
      const int B = 6;
      Layer host(c, B, rng);
      for (int s = 0; s < B; ++s) host.RandomCheckpoint(s, rng);
      DevLayer small(host), bulk(host);
      std::vector<int32_t> slots(B), pos(B);
      for (int s = 0; s < B; ++s) slots[s] = s, pos[s] = (5 * s) % c.l;
      DevBuf dslot = ToDevice(slots);
      cuda::LaunchOverrides forced_bulk;
      forced_bulk.step_kernel = cuda::LaunchOverrides::StepKernel::kBulk;
      for (int step = 0; step < c.l + 4; ++step) {
        std::vector<uint8_t> force(B);
        for (int s = 0; s < B; ++s) force[s] = (step + s) % 7 == 0 ? 1 : 0;
        DevBuf dpos = ToDevice(pos), dforce = ToDevice(force);
        Tokens tok(host, B, rng);
        DevTokens dtok(tok);
        rssm_decode_args a{};
        a.launch = {RSSM_BACKEND_CUDA, nullptr};
        a.shape = host.shape;
        a.params = small.Params(host);
        a.batch = B;
        a.slot_idx = dslot.as<int32_t>();
        a.write_pos = dpos.as<int32_t>();
        a.force_fold = dforce.as<uint8_t>();
        a.in = dtok.Inputs();
        cuda::LaunchPlan small_plan, bulk_plan;
        cuda::LaunchOverrides forced_small;
        forced_small.small_replay_max_batch = B;
        ExpectTwinStepBitForBit(
            host, a, small, bulk,
            [&](rssm_decode_args* x) { return ReplayDecodeWith(x, forced_small, &small_plan); },
            [&](rssm_decode_args* x) { return ReplayDecodeWith(x, forced_bulk, &bulk_plan); },
            step, /*rings=*/true);
        ASSERT_FALSE(HasFatalFailure());
        ASSERT_EQ(small_plan.role, cuda::KernelRole::kSmallReplay);
        ASSERT_EQ(bulk_plan.role, cuda::KernelRole::kBulkStep);
        for (int s = 0; s < B; ++s) pos[s] = (pos[s] + 1 >= c.l || force[s]) ? 0 : pos[s] + 1;
      }
    }
  }
}

// The stream replay kernel against the CPU: every gate x fp32-checkpoint ring dtype x act dtype,
// the head dims and ring lengths it takes, padding rows, forced folds, and few persistent CTAs
// (each walks many items, its stage rings and headers wrapping many times).
TEST(CudaKernels, StreamReplayMatchesCpu) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  const int ks[] = {128, 64, 16, 96};
  const int vs[] = {128, 32, 96, 64};
  const int ls[] = {16, 4, 32, 8};
  int i = 0;
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (auto [st, ring] : kStoragePairs) {
      if (st != RSSM_DTYPE_F32) continue;
      for (rssm_dtype act : kDtypes) {
        Config c;
        c.gate = gate;
        c.state_dtype = st;
        c.ring_dtype = ring;
        c.act_dtype = act;
        c.h = 2;
        c.hv = 2 * (1 + i % 2);
        c.k = ks[i % 4];
        c.v = vs[(i + 1) % 4];
        c.l = gate == RSSM_GATE_KDA && i % 3 == 0 ? 3 : ls[i % 4];
        c.round_beta = i % 2 == 0;
        cuda::LaunchOverrides forced;
        forced.stream_min_batch = 1;
        forced.stream_grid = 1 + i % 3;
        std::vector<cuda::KernelRole> roles;
        RunCase(c, 5 + i % 4, 9100 + i, -1, &forced, &roles);
        if (::testing::Test::HasFailure()) return;
        for (cuda::KernelRole r : roles) ASSERT_EQ(r, cuda::KernelRole::kStreamReplay) << c.Name();
        ++i;
      }
    }
  }
}

// The stream replay kernel and the bulk kernel give the same bits: outputs, checkpoints and
// rings after steps that advance every cursor through the ring, fold, force folds, with a
// padding row, on the planned grid, on one of 3 CTAs, and at 2 CTAs per SM (the other register
// budget).
TEST(CudaKernels, StreamReplayIsTheBulkKernelBitForBit) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  int n = 0;
  for (auto [st, ring] : kStoragePairs) {
    if (st != RSSM_DTYPE_F32) continue;
    for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
      for (auto [grid, ctas] : {std::pair{0, 0}, {3, 0}, {0, 2}}) {
        Config c;
        c.gate = gate;
        c.state_dtype = st;
        c.ring_dtype = ring;
        c.act_dtype = RSSM_DTYPE_BF16;
        c.h = 2;
        c.hv = 4;
        c.k = c.v = 128;
        c.l = 16;
        c.round_beta = n % 2 == 1;
        SCOPED_TRACE(c.Name() + " grid " + std::to_string(grid) + " CTAs per SM " +
                     std::to_string(ctas));
        std::mt19937_64 rng(615 + n++);
        const int B = 40;
        Layer host(c, B, rng);
        for (int s = 0; s < B; ++s) host.RandomCheckpoint(s, rng);
        DevLayer stream(host), bulk(host);
        std::vector<int32_t> slots(B), pos(B);
        for (int s = 0; s < B; ++s) slots[s] = s == 7 ? -1 : s, pos[s] = (5 * s) % c.l;
        DevBuf dslot = ToDevice(slots);
        cuda::LaunchOverrides forced_bulk, forced_stream;
        forced_bulk.step_kernel = cuda::LaunchOverrides::StepKernel::kBulk;
        forced_stream.stream_min_batch = 1;
        forced_stream.stream_grid = grid;
        forced_stream.stream_ctas_per_sm = ctas;
        for (int step = 0; step < c.l + 4; ++step) {
          std::vector<uint8_t> force(B);
          for (int s = 0; s < B; ++s) force[s] = (step + s) % 7 == 0 ? 1 : 0;
          DevBuf dpos = ToDevice(pos), dforce = ToDevice(force);
          Tokens tok(host, B, rng);
          DevTokens dtok(tok);
          rssm_decode_args a{};
          a.launch = {RSSM_BACKEND_CUDA, nullptr};
          a.shape = host.shape;
          a.params = stream.Params(host);
          a.batch = B;
          a.slot_idx = dslot.as<int32_t>();
          a.write_pos = dpos.as<int32_t>();
          a.force_fold = dforce.as<uint8_t>();
          a.in = dtok.Inputs();
          cuda::LaunchPlan stream_plan, bulk_plan;
          ExpectTwinStepBitForBit(
              host, a, stream, bulk,
              [&](rssm_decode_args* x) { return ReplayDecodeWith(x, forced_stream, &stream_plan); },
              [&](rssm_decode_args* x) { return ReplayDecodeWith(x, forced_bulk, &bulk_plan); },
              step, /*rings=*/true);
          ASSERT_FALSE(HasFatalFailure());
          ASSERT_EQ(stream_plan.role, cuda::KernelRole::kStreamReplay);
          ASSERT_EQ(bulk_plan.role, cuda::KernelRole::kBulkStep);
          for (int s = 0; s < B; ++s) pos[s] = (pos[s] + 1 >= c.l || force[s]) ? 0 : pos[s] + 1;
        }
      }
    }
  }
}

// L = 1: every replay step folds at w = 0, which must be the baseline bit for bit (the planned
// replay kernel's and the bulk kernel's against the baseline kernel in both its planned row
// counts).
TEST(CudaKernels, ReplayAtL1IsBaselineBitForBit) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  for (auto [st, ring] : kStoragePairs) {
    for (auto [gate, rows] : {std::pair{RSSM_GATE_GDN, 0},
                              {RSSM_GATE_KDA, 0},
                              {RSSM_GATE_GDN, cuda::kBaselineRowsPerWarpWide},
                              {RSSM_GATE_KDA, cuda::kBaselineRowsPerWarpWide}}) {
      Config c;
      c.gate = gate;
      c.state_dtype = st;
      c.ring_dtype = ring;
      c.act_dtype = RSSM_DTYPE_BF16;
      c.h = 4;
      c.hv = 8;
      c.k = c.v = 128;
      c.l = 1;
      c.round_beta = rows != 0;
      SCOPED_TRACE(c.Name() + (rows != 0 ? ", wide baseline CTAs" : ""));
      cuda::LaunchOverrides ov;
      ov.baseline_rows = rows;
      // Replay on the small-batch kernel (an fp32 state) and on the bulk one.
      for (auto replay_kernel :
           {cuda::LaunchOverrides::StepKernel::kAuto, cuda::LaunchOverrides::StepKernel::kBulk}) {
        cuda::LaunchOverrides replay_ov;
        replay_ov.step_kernel = replay_kernel;
        replay_ov.small_replay_max_batch = 16;  // kAuto: the small-batch kernel at B = 16 too
        std::mt19937_64 rng(4242);
        const int B = 16;
        Layer host(c, B, rng);
        for (int s = 0; s < B; ++s) host.RandomCheckpoint(s, rng);
        DevLayer replay(host), baseline(host);
        std::vector<int32_t> slots(B), pos(B, 0);
        for (int s = 0; s < B; ++s) slots[s] = s;
        DevBuf dslot = ToDevice(slots), dpos = ToDevice(pos);
        for (int step = 0; step < 5; ++step) {
          Tokens tok(host, B, rng);
          DevTokens dtok(tok);
          rssm_decode_args a{};
          a.launch = {RSSM_BACKEND_CUDA, nullptr};
          a.shape = host.shape;
          a.params = replay.Params(host);
          a.batch = B;
          a.slot_idx = dslot.as<int32_t>();
          a.write_pos = dpos.as<int32_t>();
          a.in = dtok.Inputs();
          ExpectTwinStepBitForBit(
              host, a, replay, baseline,
              [&](rssm_decode_args* x) { return ReplayDecodeWith(x, replay_ov); },
              [&](rssm_decode_args* x) { return BaselineDecodeWith(x, ov); }, step,
              /*rings=*/false);
          ASSERT_FALSE(HasFatalFailure());
        }
      }
    }
  }
}

// Out-of-range slot indices are padding and out-of-range cursors are clamped: no fault.
TEST(CudaKernels, BadDeviceIndicesAreHarmless) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  Config c;
  c.l = 8;
  std::mt19937_64 rng(9);
  Layer host(c, 4, rng);
  for (int s = 0; s < 4; ++s) host.RandomCheckpoint(s, rng);
  DevLayer dev(host);
  const int B = 4;
  std::vector<int32_t> slots = {7, -5, 1, 2}, pos = {0, 3, 99, -4};
  DevBuf dslot = ToDevice(slots), dpos = ToDevice(pos);
  Tokens tok(host, B, rng);
  DevTokens dtok(tok);
  const int64_t out_n = int64_t{B} * c.hv * c.v;
  DevBuf dout(out_n * rssm_dtype_size(c.act_dtype));
  rssm_decode_args a{};
  a.launch = {RSSM_BACKEND_CUDA, nullptr};
  a.shape = host.shape;
  a.params = dev.Params(host);
  a.pool = dev.Pool(host);
  a.batch = B;
  a.slot_idx = dslot.as<int32_t>();
  a.write_pos = dpos.as<int32_t>();
  a.in = dtok.Inputs();
  a.out = rssm_token_outputs{dout.get(), 0};
  ASSERT_EQ(rssm_replay_decode(&a), RSSM_OK) << rssm_last_error();
  CUDA_OK(cudaDeviceSynchronize());
  Buffer out(c.act_dtype, out_n);
  dout.Download(out.data());
  for (int64_t i = 0; i < int64_t{2} * c.hv * c.v; ++i) ASSERT_EQ(out.Get(i), 0.f);
}

// rssm_segment_digests_parts on `l` with its part table and digests in device memory, waited
// for on l's stream: the digests in out[0, n), n = ceil(count * part_bytes / segment); out[n]
// goes through the device too, so a write past the last segment shows.
rssm_status DeviceDigests(const rssm_launch& l, const void* const* parts, size_t count,
                          size_t part_bytes, size_t segment, uint64_t* out) {
  const size_t bytes = count * part_bytes;
  const size_t n = segment == 0 ? 0 : (bytes + segment - 1) / segment;
  DevBuf table(std::max<size_t>(count, 1) * sizeof(void*)), digests((n + 1) * sizeof(uint64_t));
  const bool up = (parts == nullptr || count == 0 ||
                   cudaMemcpy(table.get(), parts, count * sizeof(void*),
                              cudaMemcpyHostToDevice) == cudaSuccess) &&
                  cudaMemcpy(digests.get(), out, (n + 1) * sizeof(uint64_t),
                             cudaMemcpyHostToDevice) == cudaSuccess;
  if (!up) return RSSM_ERR_DEVICE;
  const rssm_status s = rssm_segment_digests_parts(
      &l, parts, static_cast<const void* const*>(table.get()), count, part_bytes, segment,
      digests.as<uint64_t>());
  if (s != RSSM_OK) return s;
  const bool down = cudaStreamSynchronize(static_cast<cudaStream_t>(l.stream)) == cudaSuccess &&
                    cudaMemcpy(out, digests.get(), (n + 1) * sizeof(uint64_t),
                               cudaMemcpyDeviceToHost) == cudaSuccess;
  return down ? RSSM_OK : RSSM_ERR_DEVICE;
}

// The same of one buffer (one part).
rssm_status DeviceDigests(const rssm_launch& l, const void* data, size_t bytes, size_t segment,
                          uint64_t* out) {
  const void* one[1] = {data};
  return DeviceDigests(l, one, 1, bytes, segment, out);
}

// rssm_segment_digests_parts of one buffer on the device against the CPU backend (the host's version 2 digest of
// each segment) on fresh random bytes: sizes around the block and segment edges, a Qwen3-Next
// slot (36 layers of [32, 128, 128], f32 = 75.5 MB and bf16) and odd tails, 1 MiB, 4 KiB and
// 192-byte segments, on a stream of its own, ordered after an upload queued on that stream.
TEST(CudaSegmentDigests, MatchCpuOnRandomDeviceData) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  constexpr size_t kMiB = size_t{1} << 20, kLayer = size_t{32} * 128 * 128;
  std::mt19937_64 rng(23);
  void* stream = nullptr;
  ASSERT_EQ(rssm_stream_create(RSSM_BACKEND_CUDA, &stream), RSSM_OK) << rssm_last_error();
  const rssm_launch cuda{RSSM_BACKEND_CUDA, stream}, cpu{RSSM_BACKEND_CPU, nullptr};
  const size_t sizes[] = {0,
                          1,
                          63,
                          64,
                          65,
                          4095,
                          4097,
                          kMiB - 1,
                          kMiB,
                          kMiB + 1,
                          3 * kMiB + kMiB / 2 + 17,
                          36 * kLayer * 4,
                          36 * kLayer * 4 + 100,
                          36 * kLayer * 2,
                          36 * kLayer * 2 + 33};
  for (size_t bytes : sizes) {
    void* host = nullptr;  // pinned: the upload is asynchronous on the stream
    ASSERT_EQ(rssm_alloc_host(RSSM_BACKEND_CUDA, bytes + 16, &host), RSSM_OK);
    auto* h = static_cast<uint8_t*>(host);
    for (size_t i = 0; i < bytes + 16; i += 8) {
      const uint64_t r = rng();
      std::memcpy(h + i, &r, std::min<size_t>(8, bytes + 16 - i));
    }
    DevBuf dev(bytes + 16);
    for (size_t seg : {kMiB, size_t{4096}, size_t{192}}) {
      if (seg == 192 && bytes > 4 * kMiB) continue;   // ~400k segments: the time goes elsewhere
      for (size_t shift : {size_t{0}, size_t{16}}) {  // a 16-byte aligned start inside a buffer
        SCOPED_TRACE("bytes " + std::to_string(bytes) + ", segment " + std::to_string(seg) +
                     ", shift " + std::to_string(shift));
        // Fresh device bytes each time, queued on the stream; the hash must come after them.
        ASSERT_EQ(rssm_memset(&cuda, dev.get(), 0, bytes + 16), RSSM_OK);
        ASSERT_EQ(rssm_memcpy(&cuda, dev.get(), h, bytes + 16, RSSM_COPY_HOST_TO_DEVICE), RSSM_OK);
        const size_t count = (bytes + seg - 1) / seg;
        std::vector<uint64_t> want(count), got(count + 1, 0x5a5a);
        ASSERT_EQ(DeviceDigests(cuda, dev.as<uint8_t>() + shift, bytes, seg, got.data()), RSSM_OK)
            << rssm_last_error();
        const void* host_part[1] = {h + shift};
        ASSERT_EQ(rssm_segment_digests_parts(&cpu, host_part, host_part, 1, bytes, seg,
                                             want.data()),
                  RSSM_OK);
        EXPECT_EQ(got.back(), 0x5a5au) << "written past the last segment";
        got.pop_back();
        size_t bad = 0;
        for (size_t i = 0; i < count; ++i) {
          if (got[i] != want[i] && ++bad <= 3) {
            ADD_FAILURE() << "segment " << i << " of " << count << ": cuda " << std::hex << got[i]
                          << ", cpu " << want[i];
          }
        }
        ASSERT_EQ(bad, 0u);
      }
    }
    ASSERT_EQ(rssm_free_host(RSSM_BACKEND_CUDA, host), RSSM_OK);
  }
  ASSERT_EQ(rssm_stream_destroy(RSSM_BACKEND_CUDA, stream), RSSM_OK);
}

// rssm_segment_digests_parts on the device against the host's version 2 digest of each segment
// of the parts' concatenation, on fresh random bytes in parts cudaMalloc'ed one by one (apart
// in memory; every other one 16 bytes into its allocation): parts smaller and larger than a
// segment and not multiples of 64, 16-byte parts (every block and the tail span parts), count
// 1 with odd sizes, a slot's worth of layers whose segments span them and Qwen3-Next's 36
// f32 layers; a flipped byte in one part changes its segment's digest only.
TEST(CudaSegmentDigests, PartsMatchTheHostDigestOfTheirConcatenation) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  constexpr size_t kMiB = size_t{1} << 20, kLayer = size_t{32} * 128 * 128;
  std::mt19937_64 rng(37);
  void* stream = nullptr;
  ASSERT_EQ(rssm_stream_create(RSSM_BACKEND_CUDA, &stream), RSSM_OK) << rssm_last_error();
  const rssm_launch cuda{RSSM_BACKEND_CUDA, stream};
  struct Case {
    size_t count, part_bytes, segment;
  };
  const Case cases[] = {{9, 1040, 4096},       {3, 10000, 4096},         {3, 8192, 4096},
                        {37, 16, 192},         {11, 16, 4096},           {5, 48, 64},
                        {300, 4112, 8192},     {1, 4097, 4096},          {1, 63, 64},
                        {1, 1, 192},           {1, 3 * kMiB + 17, kMiB}, {5, 700 * 1024 + 48, kMiB},
                        {36, kLayer * 4, kMiB}};
  for (const Case& k : cases) {
    SCOPED_TRACE("count " + std::to_string(k.count) + ", part_bytes " +
                 std::to_string(k.part_bytes) + ", segment " + std::to_string(k.segment));
    const size_t bytes = k.count * k.part_bytes;
    std::vector<uint8_t> whole(bytes);
    for (size_t i = 0; i < bytes; i += 8) {
      const uint64_t r = rng();
      std::memcpy(whole.data() + i, &r, std::min<size_t>(8, bytes - i));
    }
    std::vector<DevBuf> own;
    std::vector<const void*> parts;
    for (size_t j = 0; j < k.count; ++j) {
      const size_t shift = j % 2 == 1 ? 16 : 0;
      own.emplace_back(k.part_bytes + shift);
      ASSERT_NE(own.back().get(), nullptr);
      uint8_t* p = own.back().as<uint8_t>() + shift;
      ASSERT_EQ(rssm_memset(&cuda, own.back().get(), 0xa5, k.part_bytes + shift), RSSM_OK);
      ASSERT_EQ(rssm_memcpy(&cuda, p, whole.data() + j * k.part_bytes, k.part_bytes,
                            RSSM_COPY_HOST_TO_DEVICE),
                RSSM_OK);  // ordered before the hash
      parts.push_back(p);
    }
    const size_t n = (bytes + k.segment - 1) / k.segment;
    std::vector<uint64_t> want(n), got(n + 1, 0x5a5a);
    for (size_t i = 0; i < n; ++i) {
      const size_t off = i * k.segment;
      want[i] = segment_hash::Digest(whole.data() + off, std::min(k.segment, bytes - off));
    }
    ASSERT_EQ(DeviceDigests(cuda, parts.data(), k.count, k.part_bytes, k.segment, got.data()),
              RSSM_OK) << rssm_last_error();
    EXPECT_EQ(got.back(), 0x5a5au) << "written past the last segment";
    got.pop_back();
    size_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
      if (got[i] != want[i] && ++bad <= 3) {
        ADD_FAILURE() << "segment " << i << " of " << n << ": cuda " << std::hex << got[i]
                      << ", host " << want[i];
      }
    }
    ASSERT_EQ(bad, 0u);
    const size_t j = k.count / 2, at = k.part_bytes - 1, off = j * k.part_bytes + at;
    const uint8_t flipped = whole[off] ^ 0x10;
    ASSERT_EQ(rssm_memcpy(&cuda, static_cast<uint8_t*>(const_cast<void*>(parts[j])) + at,
                          &flipped, 1, RSSM_COPY_HOST_TO_DEVICE), RSSM_OK);
    std::vector<uint64_t> after(n + 1);
    ASSERT_EQ(DeviceDigests(cuda, parts.data(), k.count, k.part_bytes, k.segment, after.data()),
              RSSM_OK) << rssm_last_error();
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(after[i] != want[i], i == off / k.segment) << "segment " << i << " of " << n;
    }
  }
  // Refused before any work, nothing written: a part off 16-byte alignment, a part size that
  // is not a multiple of 16 with several parts.
  DevBuf a(256), b(256);
  const void* misaligned[2] = {a.get(), b.as<uint8_t>() + 8};
  const void* aligned[2] = {a.get(), b.get()};
  uint64_t d[2] = {7, 7};
  EXPECT_EQ(rssm_segment_digests_parts(&cuda, misaligned, aligned, 2, 128, 64, d),
            RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("parts[1]"), std::string::npos);
  EXPECT_EQ(rssm_segment_digests_parts(&cuda, aligned, aligned, 2, 120, 64, d),
            RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("part_bytes"), std::string::npos);
  EXPECT_EQ(d[0], 7u);
  EXPECT_EQ(d[1], 7u);
  ASSERT_EQ(rssm_stream_destroy(RSSM_BACKEND_CUDA, stream), RSSM_OK);
}

TEST(CudaSegmentDigests, BadArgumentsWriteNothingAndAFlipIsSeen) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  std::vector<uint8_t> x(5000);
  std::mt19937_64 rng(4);
  for (auto& b : x) b = static_cast<uint8_t>(rng());
  DevBuf dev(x.data(), x.size());
  const rssm_launch cuda{RSSM_BACKEND_CUDA, nullptr};
  uint64_t d[3] = {7, 7, 7};
  EXPECT_EQ(DeviceDigests(cuda, dev.as<uint8_t>() + 8, 4096, 4096, d),
            RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("parts[0]"), std::string::npos);
  EXPECT_EQ(DeviceDigests(cuda, dev.get(), 4096, 100, d), RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(rssm_last_error()).find("segment_bytes"), std::string::npos);
  EXPECT_EQ(d[0], 7u);
  EXPECT_EQ(d[1], 7u);
  ASSERT_EQ(DeviceDigests(cuda, dev.get(), x.size(), 4096, d), RSSM_OK);
  x[4500] ^= 1;
  dev.Upload(x.data());
  uint64_t e[3] = {};
  ASSERT_EQ(DeviceDigests(cuda, dev.get(), x.size(), 4096, e), RSSM_OK);
  EXPECT_EQ(e[0], d[0]);
  EXPECT_NE(e[1], d[1]) << "a flipped bit in the short last segment";
}

// Not a pass/fail check: the time of one call on a 75.5 MB slot (hash + digests copied back +
// sync), printed for the lead to read, as one buffer and as its 36 layers (parts into the same
// buffer: what the parts path costs over one part). The cache's call on a slot is timed in
// bench/results/transfer.md; why the slot takes about one segment's chain: checksum.cu.
TEST(CudaSegmentDigests, TimeOfA75MBSlot) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  const size_t layer = size_t{32} * 128 * 128 * 4, bytes = 36 * layer;
  DevBuf dev(bytes);
  CUDA_OK(cudaMemset(dev.get(), 0x3c, bytes));
  CUDA_OK(cudaDeviceSynchronize());
  const rssm_launch cuda{RSSM_BACKEND_CUDA, nullptr};
  std::vector<const void*> layers;
  for (size_t l = 0; l < 36; ++l) layers.push_back(dev.as<uint8_t>() + l * layer);
  const size_t n = (bytes + (1 << 20) - 1) >> 20;
  std::vector<uint64_t> d(n), e(n);
  const void* one[1] = {dev.get()};
  DevBuf one_table(one, sizeof(one)), layer_table(layers.data(), 36 * sizeof(void*));
  DevBuf digests(n * sizeof(uint64_t));
  // One call with its table already on the device, then the digests copied back.
  auto timed = [&](const void* const* parts, const DevBuf& table, size_t count, size_t part,
                   std::vector<uint64_t>& out) {
    const rssm_status s = rssm_segment_digests_parts(
        &cuda, parts, static_cast<const void* const*>(table.get()), count, part, 1 << 20,
        digests.as<uint64_t>());
    if (s != RSSM_OK) return s;
    return cudaMemcpy(out.data(), digests.get(), n * sizeof(uint64_t), cudaMemcpyDeviceToHost) ==
                   cudaSuccess
               ? RSSM_OK
               : RSSM_ERR_DEVICE;
  };
  auto whole = [&] { return timed(one, one_table, 1, bytes, d); };
  auto parts = [&] { return timed(layers.data(), layer_table, 36, layer, e); };
  for (const auto& [name, call] :
       {std::pair<const char*, std::function<rssm_status()>>{"one buffer", whole},
        {"36 layers", parts}}) {
    ASSERT_EQ(call(), RSSM_OK) << rssm_last_error();  // warm
    std::vector<double> ms;
    for (int rep = 0; rep < 10; ++rep) {
      const auto t0 = std::chrono::steady_clock::now();
      ASSERT_EQ(call(), RSSM_OK);
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    std::printf(
        "%s, %zu bytes in 1 MiB segments: median %.3f ms, min %.3f ms "
        "(%.0f GB/s at the median)\n",
        name, bytes, ms[ms.size() / 2], ms[0], bytes / ms[ms.size() / 2] / 1e6);
  }
  EXPECT_EQ(d, e) << "the same bytes as one buffer and as its layers";
}

// Makes a kernel fault (the digest kernel reads its parts through the device table: one part
// there points at device memory already freed, while the host array the call validates is
// sound), then checks the device from a thread that never used CUDA (as the server's check
// thread); exits 0 when the fault landed and the check reported it. A fixed address (1 << 40)
// did not fault on an H100 (2026-12-05: "landed cudaSuccess"): what is mapped there is the
// driver's business, a freed allocation's range is not mapped.
[[noreturn]] void FaultAKernelThenCheckTheDevice() {
  DevBuf data(64), table(sizeof(void*)), digests(sizeof(uint64_t));
  void* nowhere = nullptr;
  bool up = cudaMalloc(&nowhere, size_t{64} << 20) == cudaSuccess && cudaFree(nowhere) == cudaSuccess;
  up = up &&
       cudaMemcpy(table.get(), &nowhere, sizeof nowhere, cudaMemcpyHostToDevice) == cudaSuccess;
  const void* parts[1] = {data.get()};
  const rssm_launch l{RSSM_BACKEND_CUDA, nullptr};
  const rssm_status queued = rssm_segment_digests_parts(
      &l, parts, static_cast<const void* const*>(table.get()), 1, 64, 64, digests.as<uint64_t>());
  const cudaError_t landed = cudaDeviceSynchronize();
  rssm_status st = RSSM_OK;
  std::string why;
  std::thread([&st, &why] {
    st = rssm_device_check(RSSM_BACKEND_CUDA, 0);
    why = rssm_last_error();
  }).join();
  std::fprintf(stderr, "up %d, queued %s, landed %s, check %s: %s\n", up ? 1 : 0,
               rssm_status_name(queued), cudaGetErrorName(landed), rssm_status_name(st),
               why.c_str());
  std::exit(up && queued == RSSM_OK && landed != cudaSuccess && st == RSSM_ERR_DEVICE ? 0 : 1);
}

// A kernel that faults (an illegal address) leaves the CUDA context failed for good, a sticky
// error: rssm_device_check, which finds a working device fine, reports it. The fault runs in a
// child process (a re-executed death test), since it would fail every later test here. Not
// under MPS: there a client's fault ends the contexts of every client of the GPU, this
// process's included (the H100 run of 2026-12-06: every later test failed).
TEST(CudaDeviceCheck, ReportsTheContextAKernelFaultLeftFailed) {
  ASSERT_TRUE(HaveGpu()) << kNoGpu;
  if (rssm_mps_active() != 0) GTEST_SKIP() << "a fault under MPS ends every client's context";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  ASSERT_EQ(rssm_device_check(RSSM_BACKEND_CUDA, 0), RSSM_OK) << rssm_last_error();
  EXPECT_EQ(rssm_device_check(RSSM_BACKEND_CUDA, rssm_device_count(RSSM_BACKEND_CUDA)),
            RSSM_ERR_INVALID_ARGUMENT);
  EXPECT_EXIT(FaultAKernelThenCheckTheDevice(), ::testing::ExitedWithCode(0),
              "check DEVICE: rssm_device_check: cuda");
}

}  // namespace
}  // namespace replayssm::kernels::testing
