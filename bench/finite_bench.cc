// replayssm-bench-finite: what the finiteness check (service/finite.h) costs on the host, per
// layer message of a Qwen3-Next decode (mixed_qkv [B, 8192], a and b [B, 32]), against what
// the server already does with the same bytes: parse the message (protobuf copies the bytes)
// and the rest of CheckLayerInput. Google Benchmark; results in bench/results/finite.md.
//   replayssm-bench-finite [--benchmark_format=json ...]
#include <cstring>
#include <string>

#include "benchmark/benchmark.h"
#include "replayssm/cache/model.h"
#include "replayssm/v1/replayssm.pb.h"
#include "service/finite.h"
#include "service/tensors.h"

namespace replayssm::service {
namespace {

constexpr int64_t kQkv = 8192, kHeads = 32;  // Qwen3-Next: 2*16*128 + 32*128; HV = 32

v1::Tensor Values(int64_t rows, int64_t width, int32_t dtype) {
  v1::Tensor t;
  t.set_dtype(ToWireDtype(dtype));
  t.add_shape(rows);
  t.add_shape(width);
  std::string& d = *t.mutable_data();
  d.resize(static_cast<size_t>(rows * width) * rssm_dtype_size(dtype));
  for (size_t i = 0; i < d.size(); ++i) d[i] = static_cast<char>((i * 131) & 0x3f);  // finite
  return t;
}

v1::LayerInput Layer(int64_t rows, int32_t dtype) {
  v1::LayerInput in;
  *in.mutable_mixed_qkv() = Values(rows, kQkv, dtype);
  *in.mutable_a() = Values(rows, kHeads, dtype);
  *in.mutable_b() = Values(rows, kHeads, dtype);
  return in;
}

int64_t LayerBytes(const v1::LayerInput& in) {
  return static_cast<int64_t>(in.mixed_qkv().data().size() + in.a().data().size() +
                              in.b().data().size());
}

// Args: rows (B), dtype.
void BM_CheckFinite(benchmark::State& state) {
  const int32_t dtype = static_cast<int32_t>(state.range(1));
  const v1::LayerInput in = Layer(state.range(0), dtype);
  for (auto _ : state) {
    absl::Status s = CheckFinite(in.mixed_qkv(), "mixed_qkv", dtype, RowDim::kFirst);
    if (s.ok()) s = CheckFinite(in.a(), "a", dtype, RowDim::kFirst);
    if (s.ok()) s = CheckFinite(in.b(), "b", dtype, RowDim::kFirst);
    benchmark::DoNotOptimize(s);
  }
  state.SetBytesProcessed(state.iterations() * LayerBytes(in));
}

// What the server does with the same message anyway: parse it from the wire.
void BM_ParseLayer(benchmark::State& state) {
  const v1::LayerInput in = Layer(state.range(0), static_cast<int32_t>(state.range(1)));
  const std::string wire = in.SerializeAsString();
  v1::LayerInput parsed;
  for (auto _ : state) {
    benchmark::DoNotOptimize(parsed.ParseFromString(wire));
  }
  state.SetBytesProcessed(state.iterations() * LayerBytes(in));
}

void BM_Memcpy(benchmark::State& state) {
  const v1::LayerInput in = Layer(state.range(0), static_cast<int32_t>(state.range(1)));
  const std::string& from = in.mixed_qkv().data();
  std::string to(from.size(), '\0');
  for (auto _ : state) {
    std::memcpy(to.data(), from.data(), from.size());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(from.size()));
}

void Shapes(benchmark::internal::Benchmark* b) {
  for (int64_t rows : {1, 64, 256}) {
    for (int64_t dtype : {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16}) b->Args({rows, dtype});
  }
  b->ArgNames({"B", "dtype"});
}

BENCHMARK(BM_CheckFinite)->Apply(Shapes);
BENCHMARK(BM_ParseLayer)->Apply(Shapes);
BENCHMARK(BM_Memcpy)->Apply(Shapes);

}  // namespace
}  // namespace replayssm::service

BENCHMARK_MAIN();
