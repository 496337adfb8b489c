// replayssm-bench-graph: a whole decode forward (every layer's replay step with its short
// convolution joined, as the cache runs it on device-resident inputs) launched layer by layer
// against the same launches captured once into a CUDA graph and replayed (issue 20: "the whole
// 36-layer decode forward as one CUDA graph per batch shape ... if it measures faster at small
// B"). Shape: Qwen3-Next (36 GDN layers, HV=32 H=16 K=V=128 L=16, W=4), fp32 state, bf16
// activations; rows in slots 0..B-1 of each layer's pool, cursors random in [0, L-2] (no row
// folds: the cache folds before its decode launches, outside what a graph would hold).
//
// Before timing, one eager forward and one graph replay from the same state must leave every
// layer's outputs, conv output and ring bytes identical (decode writes past the cursor only, so
// a forward repeated at the same cursors is the same work); the bench exits non-zero otherwise.
// Timed per B, alternating the two forms for --iters rounds after 20 warm-up ones:
//  - latency: host clock from the first launch to cudaStreamSynchronize returning (one forward
//    alone, as a caller that waits for its outputs sees it); median; and of it, the host's
//    time to enqueue the forward (the calls returning); median;
//  - back to back: --iters forwards launched without waiting, total / iters (the host ahead of
//    the GPU; launch costs hide behind kernels where the GPU is the slower side).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "bench/cuda_util.h"
#include "bench/flags.h"
#include "bench/stats.h"
#include "replayssm/kernels.h"

namespace {

using replayssm::bench::DeviceAlloc;
using replayssm::bench::Median;
using replayssm::bench::Upload;

// n bf16 values uniform in [-1, 1].
void* RandomBf16(size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  std::vector<uint16_t> h(n);
  for (uint16_t& x : h) {
    const float f = u(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x = static_cast<uint16_t>(bits >> 16);
  }
  void* p = DeviceAlloc(n * 2);
  CHECK_CUDA(cudaMemcpy(p, h.data(), n * 2, cudaMemcpyHostToDevice));
  return p;
}

double Seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

constexpr int kC = 2 * 16 * 128 + 32 * 128;  // mixed_qkv channels
constexpr int kW = 4;

struct Layer {
  void *checkpoint, *ring_d, *ring_k, *window, *ring_x;
  float *ring_g, *a_log, *dt_bias, *weight;
  void *x, *a, *b, *o;
};

// One batch shape's forward: every layer's pool, inputs and outputs, and its launches.
class Forward {
 public:
  Forward(const rssm_layer_shape& shape, int layers, int batch, cudaStream_t stream,
          std::mt19937& rng)
      : shape_(shape), batch_(batch), stream_(stream) {
    conv_shape_ = {kC, kW, shape.ring_len, shape.act_dtype};
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int l = 0; l < layers; ++l) {
      Layer y{};
      y.checkpoint = DeviceAlloc(batch * rssm_checkpoint_elems(&shape) * 4);
      y.ring_d = DeviceAlloc(batch * rssm_ring_d_elems(&shape) * 4);
      y.ring_k = DeviceAlloc(batch * rssm_ring_k_elems(&shape) * 4);
      y.ring_g = static_cast<float*>(DeviceAlloc(batch * rssm_ring_g_elems(&shape) * 4));
      y.window = RandomBf16(batch * rssm_conv_window_elems(&conv_shape_), rng);
      y.ring_x = RandomBf16(batch * rssm_conv_ring_elems(&conv_shape_), rng);
      std::vector<float> a_log(32), dt_bias(32), weight(size_t{kC} * kW);
      for (float& v : a_log) v = 0.125f + 0.375f * u(rng);
      for (float& v : dt_bias) v = 0.5f * u(rng);
      for (float& v : weight) v = 0.25f + 0.125f * u(rng);
      y.a_log = Upload(a_log);
      y.dt_bias = Upload(dt_bias);
      y.weight = Upload(weight);
      y.x = RandomBf16(size_t(batch) * kC, rng);
      y.a = RandomBf16(size_t(batch) * 32, rng);
      y.b = RandomBf16(size_t(batch) * 32, rng);
      y.o = DeviceAlloc(size_t(batch) * 32 * 128 * 2);
      layers_.push_back(y);
    }
    y_ = DeviceAlloc(size_t(batch) * kC * 2);  // the lane's conv scratch, shared by the layers
    std::vector<int32_t> idx(batch), pos(batch);
    for (int r = 0; r < batch; ++r) {
      idx[r] = r;
      pos[r] = static_cast<int32_t>(rng() % (shape.ring_len - 1));
    }
    idx_ = Upload(idx);
    pos_ = Upload(pos);
    // Checkpoints of the cursors' logical states: any values of a realistic size will do.
    for (Layer& y : layers_) {
      std::vector<float> h(batch * rssm_checkpoint_elems(&shape));
      for (float& v : h) v = 0.05f * u(rng);
      CHECK_CUDA(cudaMemcpy(y.checkpoint, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
    }
  }
  ~Forward() {
    for (Layer& y : layers_) {
      for (void* p :
           {y.checkpoint, y.ring_d, y.ring_k, y.window, y.ring_x, static_cast<void*>(y.ring_g),
            static_cast<void*>(y.a_log), static_cast<void*>(y.dt_bias),
            static_cast<void*>(y.weight), y.x, y.a, y.b, y.o}) {
        CHECK_CUDA(cudaFree(p));
      }
    }
    for (void* p : {y_, static_cast<void*>(idx_), static_cast<void*>(pos_)})
      CHECK_CUDA(cudaFree(p));
    if (exec_ != nullptr) CHECK_CUDA(cudaGraphExecDestroy(exec_));
  }
  Forward(const Forward&) = delete;
  Forward& operator=(const Forward&) = delete;

  // Every layer's joined conv + replay decode, launched on the stream.
  void LaunchEager() {
    for (const Layer& y : layers_) {
      rssm_decode_conv c{};
      c.width = kW;
      c.weight = y.weight;
      c.state = {y.window, y.ring_x, batch_, 0, 0};
      c.y = y_;
      rssm_decode_args d{};
      d.launch = {RSSM_BACKEND_CUDA, stream_};
      d.shape = shape_;
      d.params = {y.a_log, y.dt_bias, 1.f / std::sqrt(128.f), 1, 1};
      d.pool = {y.checkpoint, y.ring_d, y.ring_k, y.ring_g, batch_, 0, 0, 0, 0};
      d.batch = batch_;
      d.slot_idx = idx_;
      d.write_pos = pos_;
      d.in = {y.x, y.a, y.b, 0, 0, 0};
      d.out = {y.o, 0};
      d.conv = &c;
      CHECK_RSSM(rssm_replay_decode(&d));
    }
  }
  // The same launches captured once into a graph.
  void Capture() {
    cudaGraph_t graph;
    CHECK_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    LaunchEager();
    CHECK_CUDA(cudaStreamEndCapture(stream_, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec_, graph, 0));
    CHECK_CUDA(cudaGraphDestroy(graph));
  }
  void LaunchGraph() { CHECK_CUDA(cudaGraphLaunch(exec_, stream_)); }

  // Every byte a forward writes (outputs, conv output, rings), for the equality check.
  std::vector<char> Written() {
    CHECK_CUDA(cudaStreamSynchronize(stream_));
    std::vector<char> all;
    auto add = [&](const void* p, size_t bytes) {
      const size_t at = all.size();
      all.resize(at + bytes);
      CHECK_CUDA(cudaMemcpy(all.data() + at, p, bytes, cudaMemcpyDeviceToHost));
    };
    for (const Layer& y : layers_) {
      add(y.o, size_t(batch_) * 32 * 128 * 2);
      add(y.ring_d, batch_ * rssm_ring_d_elems(&shape_) * 4);
      add(y.ring_k, batch_ * rssm_ring_k_elems(&shape_) * 4);
      add(y.ring_g, batch_ * rssm_ring_g_elems(&shape_) * 4);
      add(y.ring_x, batch_ * rssm_conv_ring_elems(&conv_shape_) * 2);
    }
    add(y_, size_t(batch_) * kC * 2);
    return all;
  }
  void ClearOutputs() {
    for (const Layer& y : layers_) {
      CHECK_CUDA(cudaMemsetAsync(y.o, 0, size_t(batch_) * 32 * 128 * 2, stream_));
    }
    CHECK_CUDA(cudaMemsetAsync(y_, 0, size_t(batch_) * kC * 2, stream_));
  }

 private:
  rssm_layer_shape shape_;
  rssm_conv_shape conv_shape_{};
  int batch_;
  cudaStream_t stream_;
  std::vector<Layer> layers_;
  void* y_ = nullptr;
  int32_t *idx_ = nullptr, *pos_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

struct Row {
  int64_t batch;
  double eager_us, graph_us, eager_b2b_us, graph_b2b_us, eager_enqueue_us, graph_enqueue_us;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json;
  std::vector<int64_t> batches = {1, 4, 16, 64};
  int64_t iters = 200, layers = 36;
  replayssm::bench::Flags flags("replayssm-bench-graph",
                                "[--batch 1,4,...] [--layers N] [--iters N] [--json PATH]");
  flags.IntList("batch", 1, 1024, &batches);
  flags.Int("layers", 1, 96, &layers);
  flags.Int("iters", 10, 100000, &iters);
  flags.String("json", &json);
  if (const int code = flags.ParseOrExitCode(argc, argv); code >= 0) return code;

  const rssm_layer_shape shape{RSSM_GATE_GDN,  16, 32, 128, 128, 16, RSSM_DTYPE_F32,
                               RSSM_DTYPE_BF16};
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::mt19937 rng(11);
  std::vector<Row> rows;
  std::printf(
      "%lld-layer decode forward (joined conv + replay), eager launches vs one CUDA graph\n",
      static_cast<long long>(layers));
  std::printf("%6s %12s %12s %8s %14s %14s %8s %12s %12s\n", "B", "eager us", "graph us", "ratio",
              "eager b2b us", "graph b2b us", "ratio", "eager enq us", "graph enq us");
  for (const int64_t B : batches) {
    Forward f(shape, static_cast<int>(layers), static_cast<int>(B), stream, rng);
    // Equality first: eager and graph from the same state write the same bytes.
    f.ClearOutputs();
    f.LaunchEager();
    const std::vector<char> eager = f.Written();
    f.Capture();
    f.ClearOutputs();
    f.LaunchGraph();
    if (f.Written() != eager) {
      std::fprintf(stderr, "B=%lld: the graph's forward wrote other bytes than the eager one\n",
                   static_cast<long long>(B));
      return 1;
    }
    std::vector<double> eager_s, graph_s, enqueue_s[2];
    for (int64_t i = 0; i < iters + 20; ++i) {
      for (int form = 0; form < 2; ++form) {
        const double t0 = Seconds();
        if (form == 0) {
          f.LaunchEager();
        } else {
          f.LaunchGraph();
        }
        const double t1 = Seconds();
        CHECK_CUDA(cudaStreamSynchronize(stream));
        if (i >= 20) {
          (form == 0 ? eager_s : graph_s).push_back(Seconds() - t0);
          enqueue_s[form].push_back(t1 - t0);
        }
      }
    }
    double b2b[2];
    for (int form = 0; form < 2; ++form) {
      CHECK_CUDA(cudaStreamSynchronize(stream));
      const double t0 = Seconds();
      for (int64_t i = 0; i < iters; ++i) {
        if (form == 0) {
          f.LaunchEager();
        } else {
          f.LaunchGraph();
        }
      }
      CHECK_CUDA(cudaStreamSynchronize(stream));
      b2b[form] = (Seconds() - t0) / static_cast<double>(iters);
    }
    CHECK_CUDA(cudaGetLastError());
    Row r{B,
          Median(eager_s) * 1e6,
          Median(graph_s) * 1e6,
          b2b[0] * 1e6,
          b2b[1] * 1e6,
          Median(enqueue_s[0]) * 1e6,
          Median(enqueue_s[1]) * 1e6};
    rows.push_back(r);
    std::printf("%6lld %12.1f %12.1f %8.3f %14.1f %14.1f %8.3f %12.1f %12.1f\n",
                static_cast<long long>(B), r.eager_us, r.graph_us, r.graph_us / r.eager_us,
                r.eager_b2b_us, r.graph_b2b_us, r.graph_b2b_us / r.eager_b2b_us, r.eager_enqueue_us,
                r.graph_enqueue_us);
  }
  if (!json.empty()) {
    std::ofstream out(json);
    out << "{\n  \"device\": \"" << prop.name << "\",\n  \"layers\": " << layers
        << ",\n  \"iters\": " << iters
        << ",\n  \"shape\": \"GDN HV=32 H=16 K=V=128 L=16 W=4, fp32 state, bf16 act\",\n"
        << "  \"method\": \"latency: host clock, first launch to stream synchronized, median; "
           "b2b: iters forwards without waiting, mean\",\n  \"rows\": [\n";
    for (size_t i = 0; i < rows.size(); ++i) {
      const Row& r = rows[i];
      out << "    {\"batch\": " << r.batch << ", \"eager_us\": " << r.eager_us
          << ", \"graph_us\": " << r.graph_us << ", \"eager_b2b_us\": " << r.eager_b2b_us
          << ", \"graph_b2b_us\": " << r.graph_b2b_us
          << ", \"eager_enqueue_us\": " << r.eager_enqueue_us
          << ", \"graph_enqueue_us\": " << r.graph_enqueue_us << "}"
          << (i + 1 < rows.size() ? "," : "") << "\n";
    }
    out << "  ]\n}\n";
  }
  return 0;
}
