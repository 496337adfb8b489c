// The command line of `replayssm-bench kernels`, parsed by bench/flags.h on the host compiler
// (kernels_bench.cu includes no Abseil header): the same strict rules as every bench binary.
// The cases to run and the launch overrides (kernels/cuda/plan.h LaunchOverrides, for
// experiments; the serving path always plans with none) are flags too.
#ifndef REPLAYSSM_BENCH_KERNELS_ARGS_H_
#define REPLAYSSM_BENCH_KERNELS_ARGS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace replayssm::bench {

struct KernelsArgs {
  std::string json;             // --json PATH; empty: no JSON
  std::string method = "both";  // --method graph|peer|both
  bool help = false;            // --help / -h
  // The cases: one gate, storage, op (empty: all), the batches, the folding rows first.
  std::string gate, state, op;
  std::vector<int64_t> batches = {1, 16, 64, 128, 256};
  bool fold_first = false;
  bool verbose = false;  // print each case's launch plan
  // Launch overrides, each 0 (or empty) for the planner's choice; LaunchOverrides's fields.
  std::string step;             // --step tiled|bulk: step_kernel
  int64_t bulk_min_b = 0;       // bulk_min_batch
  int32_t rpw = 0, nw = 0, ns = 0;  // rows_per_warp, warps, stages
  int32_t bulk = 15;            // bulk_copy
  int32_t late_stage = 1;
  int32_t baseline_nw = 0, baseline_rpw = 0, baseline_cache = 0;
  int64_t small_max_b = 0;      // small_replay_max_batch (-1: never, 0: planned)
  int32_t small_rpw = 0;        // small_replay_rows
  int64_t stream_min_b = 0;     // stream_min_batch (-1: never, 0: planned)
  int32_t stream_grid = 0, stream_ctas = 0, stream_ns = 0;
};

// argv[0] is the command ("kernels"); argv[1..argc) its arguments. Empty when they parse,
// else what is wrong (an unknown flag, a stray argument, a missing or bad value).
std::string ParseKernelsArgs(int argc, const char* const* argv, KernelsArgs* args);

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_KERNELS_ARGS_H_
