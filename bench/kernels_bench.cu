// replayssm-bench kernels: the decode kernels of the CUDA backend on the benchmark shape of
// docs/gpu.md (HV=32, H=16, K=V=128, L=16, bf16 activations), state fp32 and bf16, GDN and KDA,
// B in {1, 16, 64, 128, 256}: baseline decode, replay decode, verify of T=4 drafts.
//
// Method: the pool holds several slot sets (the data is several times the 60 MB L2); step i
// uses set i % nsets, and every row's cursor advances each time its slot is used, spread over
// 0..L-1 across rows and sets (folds included, as in serving). 64 steps are captured into a
// CUDA graph through the public C ABI and replayed; the median of the replays is reported.
// The device copy bandwidth (D2D memcpy, read + write counted) is measured in the same run.
//
// Counted bytes per step (state and ring traffic only): baseline = read + write the state;
// replay = read S0 + the w records read (d, k per qk-head, g) + the record written, or the
// S0 write when the row folds; verify = read S0 + w records + T records written.
//
// The environment selects cases and overrides the launch planner (kernels/cuda/plan.h); a
// value it cannot parse, or a REPLAYSSM_BENCH_* / REPLAYSSM_CUDA_* variable it does not know,
// is an error. See Usage() below, or docs/gpu.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "replayssm/kernels.h"
#include "src/launch_overrides.h"

extern char** environ;

namespace {

using replayssm::kernels::cuda::KernelRoleName;
using replayssm::kernels::cuda::LaunchOverrides;
using replayssm::kernels::cuda::LaunchPlan;

constexpr char kUsage[] = R"(usage: replayssm-bench kernels [--json PATH]

Environment (each optional; a value out of its range is an error):
  REPLAYSSM_BENCH_GATE=GDN|KDA          one gate only
  REPLAYSSM_BENCH_STATE=f32|bf16        one state dtype only
  REPLAYSSM_BENCH_B=N[,N...]            these batches (default 1,16,64,128,256)
  REPLAYSSM_BENCH_OP=baseline|replay|verify4  one op only
  REPLAYSSM_BENCH_FOLD_FIRST=0|1        each step's folding rows first in the batch
Launch overrides (kernels/cuda/plan.h; default: planned):
  REPLAYSSM_CUDA_STEP=tiled|bulk        one step kernel for every op and batch
  REPLAYSSM_CUDA_BULK_MIN_B=N           verify takes the bulk kernel from batch N (16)
  REPLAYSSM_CUDA_RPW=16|32|48|64        bulk: state rows per warp
  REPLAYSSM_CUDA_NW=1..4                bulk: warps per CTA
  REPLAYSSM_CUDA_NS=1..8                bulk: S0 stages per warp
  REPLAYSSM_CUDA_BULK=0..15             bulk: pieces the copy engine fetches (1 S0, 2 ring d,
                                        4 ring k, 8 ring g; default 15)
  REPLAYSSM_CUDA_VERBOSE=0|1            print each case's launch plan
)";

// A bad command line or environment: the message and the usage, exit status 2.
[[noreturn]] void Fail(const std::string& message) {
  std::fprintf(stderr, "replayssm-bench: %s\n\n%s", message.c_str(), kUsage);
  std::exit(2);
}

// `text` as an integer in [lo, hi], or Fail naming `what`.
int64_t ParseInt(const char* what, const std::string& text, int64_t lo, int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0' || errno != 0 || v < lo || v > hi) {
    Fail(std::string(what) + ": expected an integer in [" + std::to_string(lo) + ", " +
         std::to_string(hi) + "], got \"" + text + "\"");
  }
  return v;
}

// `text` as one of `choices`, or Fail naming `what`.
std::string ParseChoice(const char* what, const std::string& text,
                        const std::vector<std::string>& choices) {
  std::string all;
  for (const std::string& c : choices) {
    if (text == c) return c;
    all += (all.empty() ? "" : "|") + c;
  }
  Fail(std::string(what) + ": expected " + all + ", got \"" + text + "\"");
}

// What the environment asks for.
struct Settings {
  std::string gate, state, op;  // empty: all
  std::vector<int> batches = {1, 16, 64, 128, 256};
  bool fold_first = false;
  bool verbose = false;
  LaunchOverrides overrides;
};

Settings FromEnvironment() {
  static const char* const kKnown[] = {
      "REPLAYSSM_BENCH_GATE",      "REPLAYSSM_BENCH_STATE",      "REPLAYSSM_BENCH_B",
      "REPLAYSSM_BENCH_OP",        "REPLAYSSM_BENCH_FOLD_FIRST", "REPLAYSSM_CUDA_STEP",
      "REPLAYSSM_CUDA_BULK_MIN_B", "REPLAYSSM_CUDA_RPW",         "REPLAYSSM_CUDA_NW",
      "REPLAYSSM_CUDA_NS",         "REPLAYSSM_CUDA_BULK",        "REPLAYSSM_CUDA_VERBOSE"};
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string var(*e, std::strcspn(*e, "="));
    if (var.rfind("REPLAYSSM_BENCH_", 0) != 0 && var.rfind("REPLAYSSM_CUDA_", 0) != 0) continue;
    if (std::find(std::begin(kKnown), std::end(kKnown), var) == std::end(kKnown)) {
      Fail(var + ": not a setting of replayssm-bench");
    }
  }
  Settings s;
  if (const char* v = std::getenv("REPLAYSSM_BENCH_GATE")) {
    s.gate = ParseChoice("REPLAYSSM_BENCH_GATE", v, {"GDN", "KDA"});
  }
  if (const char* v = std::getenv("REPLAYSSM_BENCH_STATE")) {
    s.state = ParseChoice("REPLAYSSM_BENCH_STATE", v, {"f32", "bf16"});
  }
  if (const char* v = std::getenv("REPLAYSSM_BENCH_OP")) {
    s.op = ParseChoice("REPLAYSSM_BENCH_OP", v, {"baseline", "replay", "verify4"});
  }
  if (const char* v = std::getenv("REPLAYSSM_BENCH_B")) {
    s.batches.clear();
    const std::string list = v;
    for (size_t at = 0;;) {
      const size_t comma = list.find(',', at);
      s.batches.push_back(
          static_cast<int>(ParseInt("REPLAYSSM_BENCH_B", list.substr(at, comma - at), 1, 1 << 16)));
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
  }
  if (const char* v = std::getenv("REPLAYSSM_BENCH_FOLD_FIRST")) {
    s.fold_first = ParseInt("REPLAYSSM_BENCH_FOLD_FIRST", v, 0, 1) == 1;
  }
  if (const char* v = std::getenv("REPLAYSSM_CUDA_VERBOSE")) {
    s.verbose = ParseInt("REPLAYSSM_CUDA_VERBOSE", v, 0, 1) == 1;
  }
  LaunchOverrides& o = s.overrides;
  if (const char* v = std::getenv("REPLAYSSM_CUDA_STEP")) {
    o.step_kernel = ParseChoice("REPLAYSSM_CUDA_STEP", v, {"tiled", "bulk"}) == "tiled"
                        ? LaunchOverrides::StepKernel::kTiled
                        : LaunchOverrides::StepKernel::kBulk;
  }
  if (const char* v = std::getenv("REPLAYSSM_CUDA_BULK_MIN_B")) {
    o.bulk_min_batch = ParseInt("REPLAYSSM_CUDA_BULK_MIN_B", v, 1, 1 << 24);
  }
  if (const char* v = std::getenv("REPLAYSSM_CUDA_RPW")) {
    o.rows_per_warp = static_cast<int>(ParseInt("REPLAYSSM_CUDA_RPW", v, 16, 64));
  }
  if (const char* v = std::getenv("REPLAYSSM_CUDA_NW")) {
    o.warps = static_cast<int>(ParseInt("REPLAYSSM_CUDA_NW", v, 1, 4));
  }
  if (const char* v = std::getenv("REPLAYSSM_CUDA_NS")) {
    o.stages = static_cast<int>(ParseInt("REPLAYSSM_CUDA_NS", v, 1, 8));
  }
  if (const char* v = std::getenv("REPLAYSSM_CUDA_BULK")) {
    o.bulk_copy = static_cast<int>(ParseInt("REPLAYSSM_CUDA_BULK", v, 0, 15));
  }
  const std::string bad = replayssm::kernels::cuda::CheckOverrides(o);
  if (!bad.empty()) Fail("launch overrides (REPLAYSSM_CUDA_*): " + bad);
  return s;
}

// A plan in one line (REPLAYSSM_CUDA_VERBOSE=1).
std::string Describe(const LaunchPlan& p) {
  char buf[256];
  if (p.role == replayssm::kernels::cuda::KernelRole::kBulkStep) {
    const auto& c = p.bulk;
    std::snprintf(buf, sizeof buf,
                  "bulk: TT %d KC %d RB %d, %d warps x %d rows, %d stages, %d chunks, "
                  "grid %u x %u, smem %zu B, copies s0/d/k/g %d%d%d%d, d %s",
                  c.tokens_per_pass, c.channels_per_lane, c.rows_per_batch, c.warps,
                  c.rows_per_warp, c.stages, c.chunks, p.grid_x, p.grid_y, p.smem_bytes, c.bulk_s0,
                  c.bulk_d, c.bulk_k, c.bulk_g, c.d_dense ? "dense" : "padded");
  } else {
    const auto& c = p.tiled;
    std::snprintf(buf, sizeof buf, "%s: KMAX %d TC %d, %d rows per CTA, grid %u, smem %zu B",
                  KernelRoleName(p.role), c.kmax, c.tokens_per_pass, c.tile_rows, p.grid_x,
                  p.smem_bytes);
  }
  return buf;
}

#define CHECK_CUDA(x)                                                                         \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CHECK_RSSM(x)                                                                    \
  do {                                                                                   \
    rssm_status s_ = (x);                                                                \
    if (s_ != RSSM_OK) {                                                                 \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, rssm_last_error()); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

constexpr int kH = 16, kHV = 32, kK = 128, kV = 128, kL = 16, kDraft = 4;
constexpr int kStepsPerGraph = 64;
constexpr int kReplays = 7;
constexpr double kPoolBytes = 1.5e9;  // >= 25x the L2

__device__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
// Uniform in [lo, hi), stored as fp32 / bf16 by `bytes_per` (4 or 2).
__global__ void FillRandom(void* p, int64_t n, int bytes_per, float lo, float hi, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float u = (Hash(seed * 0x9e3779b97f4a7c15ULL + i) >> 8) * (1.f / 16777216.f);
    const float x = lo + (hi - lo) * u;
    if (bytes_per == 4) {
      static_cast<float*>(p)[i] = x;
    } else {
      uint32_t b;
      std::memcpy(&b, &x, 4);
      static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>((b + 0x7fff + ((b >> 16) & 1)) >> 16);
    }
  }
}
void Fill(void* p, int64_t n, int bytes_per, float lo, float hi, uint64_t seed) {
  FillRandom<<<1024, 256>>>(p, n, bytes_per, lo, hi, seed);
  CHECK_CUDA(cudaGetLastError());
}

double CopyBandwidth() {
  const size_t bytes = size_t{1} << 30;
  void *a, *b;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int i = 0; i < 12; ++i) {
    CHECK_CUDA(cudaEventRecord(e0));
    CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
    CHECK_CUDA(cudaEventRecord(e1));
    CHECK_CUDA(cudaEventSynchronize(e1));
    float t;
    CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
    if (i >= 2) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaEventDestroy(e0));
  CHECK_CUDA(cudaEventDestroy(e1));
  return 2.0 * bytes / (ms[ms.size() / 2] * 1e-3);
}

enum Op { kBaseline = 0, kReplay = 1, kVerify = 2 };
const char* OpName(Op op) {
  return op == kBaseline ? "baseline" : op == kReplay ? "replay" : "verify4";
}

struct Result {
  std::string gate, state, op, kernel;
  int batch;
  double us, bytes, gbps, pct, speedup;
};

// One (gate, state dtype, B): a pool, inputs, and the three operations timed.
class Bench {
 public:
  Bench(rssm_gate gate, rssm_dtype st, int batch, double copy_bw)
      : gate_(gate), st_(st), B_(batch), copy_bw_(copy_bw) {
    shape_ = rssm_layer_shape{gate, kH, kHV, kK, kV, kL, st, RSSM_DTYPE_BF16};
    ts_ = static_cast<int>(rssm_dtype_size(st));
    per_g_ = gate == RSSM_GATE_KDA ? kK : 1;
    const double slot_bytes = static_cast<double>(rssm_slot_layer_bytes(&shape_));
    nsets_ = std::max(2, static_cast<int>(std::ceil(kPoolBytes / (slot_bytes * B_))));
    slots_ = int64_t{nsets_} * B_;
    Alloc(&ckpt_, slots_ * rssm_checkpoint_elems(&shape_) * ts_);
    Alloc(&rd_, slots_ * rssm_ring_d_elems(&shape_) * ts_);
    Alloc(&rk_, slots_ * rssm_ring_k_elems(&shape_) * ts_);
    Alloc(&rg_, slots_ * rssm_ring_g_elems(&shape_) * 4);
    Fill(ckpt_, slots_ * rssm_checkpoint_elems(&shape_), ts_, -0.3f, 0.3f, 1);
    Fill(rd_, slots_ * rssm_ring_d_elems(&shape_), ts_, -0.3f, 0.3f, 2);
    Fill(rk_, slots_ * rssm_ring_k_elems(&shape_), ts_, -0.1f, 0.1f, 3);
    Fill(rg_, slots_ * rssm_ring_g_elems(&shape_), 4, -0.5f, -0.01f, 4);
    Alloc(&a_log_, kHV * 4);
    Alloc(&dt_bias_, kHV * per_g_ * 4);
    Fill(a_log_, kHV, 4, -0.25f, 0.5f, 5);
    Fill(dt_bias_, kHV * per_g_, 4, -1.f, 1.f, 6);
    const int64_t n_tok = int64_t{B_} * kDraft;
    Alloc(&qkv_, n_tok * (2 * kH * kK + kHV * kV) * 2);
    Alloc(&a_, n_tok * kHV * per_g_ * 2);
    Alloc(&b_, n_tok * kHV * 2);
    Alloc(&o_, n_tok * kHV * kV * 2);
    Fill(qkv_, n_tok * (2 * kH * kK + kHV * kV), 2, -1.f, 1.f, 7);
    Fill(a_, n_tok * kHV * per_g_, 2, -2.f, 2.f, 8);
    Fill(b_, n_tok * kHV, 2, -2.f, 2.f, 9);
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CHECK_CUDA(cudaDeviceSynchronize());
  }
  ~Bench() {
    for (void* p : allocs_) cudaFree(p);
    cudaStreamDestroy(stream_);
  }

  // Median µs per step and the mean counted bytes per step of `op`; the launch plan it ran.
  void Run(Op op, const Settings& settings, double* us, double* bytes, LaunchPlan* plan) {
    const int window = op == kVerify ? kL - kDraft + 1 : kL;
    std::vector<int32_t> slot(int64_t{kStepsPerGraph} * B_), pos(slot.size());
    double total = 0;
    for (int i = 0; i < kStepsPerGraph; ++i) {
      const int set = i % nsets_, use = i / nsets_;
      for (int r = 0; r < B_; ++r) {
        const int64_t k = int64_t{i} * B_ + r;
        slot[k] = set * B_ + r;
        pos[k] = (r + set + use) % window;
        total += Bytes(op, pos[k]);
      }
    }
    *bytes = total / kStepsPerGraph;
    // Each step's rows whose ring is full (they fold) first: the order a scheduler that sees
    // the cursors can choose (measures the folding rows' tail).
    if (settings.fold_first) {
      for (int i = 0; i < kStepsPerGraph; ++i) {
        std::vector<int64_t> order(B_);
        for (int r = 0; r < B_; ++r) order[r] = r;
        const int64_t base = int64_t{i} * B_;
        std::stable_partition(order.begin(), order.end(),
                              [&](int64_t r) { return pos[base + r] == window - 1; });
        std::vector<int32_t> s2(B_), p2(B_);
        for (int r = 0; r < B_; ++r) s2[r] = slot[base + order[r]], p2[r] = pos[base + order[r]];
        std::copy(s2.begin(), s2.end(), slot.begin() + base);
        std::copy(p2.begin(), p2.end(), pos.begin() + base);
      }
    }
    int32_t *dslot, *dpos;
    Alloc(reinterpret_cast<void**>(&dslot), slot.size() * 4);
    Alloc(reinterpret_cast<void**>(&dpos), pos.size() * 4);
    CHECK_CUDA(cudaMemcpy(dslot, slot.data(), slot.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(dpos, pos.data(), pos.size() * 4, cudaMemcpyHostToDevice));
    auto launch = [&](int i, LaunchPlan* used) {
      using replayssm::kernels::BaselineDecodeWith;
      using replayssm::kernels::ReplayDecodeWith;
      using replayssm::kernels::VerifyWith;
      const LaunchOverrides& ov = settings.overrides;
      const rssm_launch l{RSSM_BACKEND_CUDA, stream_};
      const rssm_layer_params params{static_cast<float*>(a_log_), static_cast<float*>(dt_bias_),
                                     0.0883883f, 1};
      const rssm_state_pool pool{ckpt_, rd_, rk_, static_cast<float*>(rg_), slots_, 0, 0, 0, 0};
      const rssm_token_inputs in{qkv_, a_, b_, 0, 0, 0};
      const rssm_token_outputs out{o_, 0};
      if (op == kVerify) {
        rssm_verify_args v{
            l,  shape_, params, pool, B_, kDraft, dslot + int64_t{i} * B_, dpos + int64_t{i} * B_,
            in, out};
        CHECK_RSSM(VerifyWith(&v, ov, used));
      } else {
        rssm_decode_args d{
            l,       shape_, params, pool, B_, dslot + int64_t{i} * B_, dpos + int64_t{i} * B_,
            nullptr, in,     out};
        CHECK_RSSM(op == kReplay ? ReplayDecodeWith(&d, ov, used)
                                 : BaselineDecodeWith(&d, ov, used));
      }
    };
    for (int i = 0; i < kStepsPerGraph; ++i) launch(i, plan);  // warm-up, outside the graph
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kStepsPerGraph; ++i) launch(i, nullptr);
    CHECK_CUDA(cudaStreamEndCapture(stream_, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::vector<float> ms;
    CHECK_CUDA(cudaGraphLaunch(exec, stream_));
    for (int k = 0; k < kReplays; ++k) {
      CHECK_CUDA(cudaEventRecord(e0, stream_));
      CHECK_CUDA(cudaGraphLaunch(exec, stream_));
      CHECK_CUDA(cudaEventRecord(e1, stream_));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float t;
      CHECK_CUDA(cudaEventElapsedTime(&t, e0, e1));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    *us = ms[ms.size() / 2] * 1e3 / kStepsPerGraph;
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
  }

 private:
  void Alloc(void** p, int64_t bytes) {
    CHECK_CUDA(cudaMalloc(p, static_cast<size_t>(bytes)));
    allocs_.push_back(*p);
  }
  // Counted bytes of one row (all heads) at cursor w.
  double Bytes(Op op, int w) const {
    const double state = double{kHV} * kV * kK * ts_;
    const double rec_d = double{kHV} * kV * ts_, rec_k = double{kH} * kK * ts_,
                 rec_g = double{kHV} * per_g_ * 4;
    const double rec = rec_d + rec_k + rec_g;
    if (op == kBaseline) return 2 * state;
    if (op == kVerify) return state + w * rec + kDraft * rec;
    const bool fold = w + 1 >= kL;
    return state + w * rec + (fold ? state : rec);
  }

  rssm_gate gate_;
  rssm_dtype st_;
  int B_;
  double copy_bw_;
  rssm_layer_shape shape_{};
  int ts_ = 4, per_g_ = 1, nsets_ = 2;
  int64_t slots_ = 0;
  void *ckpt_ = nullptr, *rd_ = nullptr, *rk_ = nullptr, *rg_ = nullptr;
  void *a_log_ = nullptr, *dt_bias_ = nullptr, *qkv_ = nullptr, *a_ = nullptr, *b_ = nullptr,
       *o_ = nullptr;
  std::vector<void*> allocs_;
  cudaStream_t stream_{};
};

int Kernels(const char* json_path, const Settings& settings) {
  if (!rssm_backend_available(RSSM_BACKEND_CUDA)) {
    std::fprintf(stderr, "replayssm-bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const double copy_bw = CopyBandwidth();
  std::printf("device: %s, %d SMs, L2 %.0f MB; copy bandwidth %.1f GB/s (read+write)\n", prop.name,
              prop.multiProcessorCount, prop.l2CacheSize / 1e6, copy_bw / 1e9);
  std::vector<Result> results;
  std::printf("%-4s %-5s %-9s %5s %-6s %10s %12s %9s %7s %8s\n", "gate", "state", "op", "B",
              "kernel", "us/step", "bytes/step", "GB/s", "%copy", "speedup");
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    const std::string gate_name = gate == RSSM_GATE_GDN ? "GDN" : "KDA";
    if (!settings.gate.empty() && settings.gate != gate_name) continue;
    for (rssm_dtype st : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16}) {
      if (!settings.state.empty() && settings.state != rssm_dtype_name(st)) continue;
      for (int B : settings.batches) {
        Bench bench(gate, st, B, copy_bw);
        double base_us = 0;
        for (Op op : {kBaseline, kReplay, kVerify}) {
          if (!settings.op.empty() && settings.op != OpName(op)) continue;
          Result r;
          r.gate = gate_name;
          r.state = rssm_dtype_name(st);
          r.op = OpName(op);
          r.batch = B;
          LaunchPlan plan;
          bench.Run(op, settings, &r.us, &r.bytes, &plan);
          r.kernel = KernelRoleName(plan.role);
          r.gbps = r.bytes / (r.us * 1e-6) / 1e9;
          r.pct = 100.0 * r.gbps * 1e9 / copy_bw;
          if (op == kBaseline) base_us = r.us;
          // replay: baseline time / replay time; verify: 4 baseline steps / one verify; none
          // when the baseline did not run.
          r.speedup = op == kBaseline ? 1.0
                      : base_us == 0  ? -1.0
                      : op == kReplay ? base_us / r.us
                                      : kDraft * base_us / r.us;
          char speedup[16] = "       -";
          if (r.speedup >= 0) std::snprintf(speedup, sizeof speedup, "%7.2fx", r.speedup);
          std::printf("%-4s %-5s %-9s %5d %-6s %10.2f %12.0f %9.1f %6.1f%% %s\n", r.gate.c_str(),
                      r.state.c_str(), r.op.c_str(), B, r.kernel.c_str(), r.us, r.bytes, r.gbps,
                      r.pct, speedup);
          if (settings.verbose) std::printf("  %s\n", Describe(plan).c_str());
          std::fflush(stdout);
          results.push_back(r);
        }
      }
    }
  }
  if (json_path != nullptr) {
    FILE* f = std::fopen(json_path, "w");
    if (f == nullptr) {
      std::fprintf(stderr, "replayssm-bench: cannot write %s\n", json_path);
      return 1;
    }
    std::fprintf(f, "{\n  \"device\": \"%s\",\n  \"copy_bandwidth_gbps\": %.1f,\n", prop.name,
                 copy_bw / 1e9);
    std::fprintf(f,
                 "  \"shape\": {\"H\": %d, \"HV\": %d, \"K\": %d, \"V\": %d, \"L\": %d, "
                 "\"act\": \"bf16\", \"verify_T\": %d},\n  \"results\": [\n",
                 kH, kHV, kK, kV, kL, kDraft);
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      char speedup[16] = "null";
      if (r.speedup >= 0) std::snprintf(speedup, sizeof speedup, "%.3f", r.speedup);
      std::fprintf(f,
                   "    {\"gate\": \"%s\", \"state\": \"%s\", \"op\": \"%s\", \"batch\": %d, "
                   "\"kernel\": \"%s\", \"us_per_step\": %.3f, \"bytes_per_step\": %.0f, "
                   "\"gbps\": %.1f, \"pct_copy_bw\": %.1f, \"speedup_vs_baseline\": %s}%s\n",
                   r.gate.c_str(), r.state.c_str(), r.op.c_str(), r.batch, r.kernel.c_str(), r.us,
                   r.bytes, r.gbps, r.pct, speedup, i + 1 < results.size() ? "," : "");
    }
    std::fprintf(f, "  ]\n}\n");
    std::fclose(f);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "kernels") != 0) {
    Fail(argc < 2 ? "no command" : std::string("unknown command \"") + argv[1] + "\"");
  }
  const char* json = nullptr;
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0 && i + 1 < argc) {
      json = argv[++i];
    } else {
      Fail(std::strcmp(argv[i], "--json") == 0
               ? "--json: expected a path"
               : std::string("unknown argument \"") + argv[i] + "\"");
    }
  }
  return Kernels(json, FromEnvironment());
}
