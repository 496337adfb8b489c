// The command line of `replayssm-bench kernels`, parsed by bench/flags.h on the host compiler
// (kernels_bench.cu includes no Abseil header): the same strict rules as every bench binary.
#ifndef REPLAYSSM_BENCH_KERNELS_ARGS_H_
#define REPLAYSSM_BENCH_KERNELS_ARGS_H_

#include <string>

namespace replayssm::bench {

struct KernelsArgs {
  std::string json;             // --json PATH; empty: no JSON
  std::string method = "both";  // --method graph|peer|both
  bool help = false;            // --help / -h
};

// argv[0] is the command ("kernels"); argv[1..argc) its arguments. Empty when they parse,
// else what is wrong (an unknown flag, a stray argument, a missing or bad value).
std::string ParseKernelsArgs(int argc, const char* const* argv, KernelsArgs* args);

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_KERNELS_ARGS_H_
