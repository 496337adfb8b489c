#include "bench/kernels_args.h"

#include "bench/flags.h"

namespace replayssm::bench {

std::string ParseKernelsArgs(int argc, const char* const* argv, KernelsArgs* args) {
  KernelsArgs parsed;
  Flags flags("replayssm-bench kernels", "[--json PATH] [--method graph|peer|both] [cases] "
                                         "[launch overrides]");
  flags.String("json", &parsed.json);
  flags.Choice("method", {"graph", "peer", "both"}, &parsed.method);
  flags.Choice("gate", {"GDN", "KDA"}, &parsed.gate);
  flags.Choice("state", {"f32", "f32+bf16", "bf16"}, &parsed.state);
  flags.Choice("op", {"baseline", "replay", "verify4"}, &parsed.op);
  flags.IntList("batches", 1, 1 << 16, &parsed.batches);
  flags.Switch("fold-first", &parsed.fold_first);
  flags.Switch("verbose", &parsed.verbose);
  flags.Choice("step", {"tiled", "bulk"}, &parsed.step);
  flags.Int("bulk-min-b", int64_t{1}, int64_t{1} << 24, &parsed.bulk_min_b);
  flags.Int("rpw", 16, 64, &parsed.rpw);
  flags.Int("nw", 1, 4, &parsed.nw);
  flags.Int("ns", 1, 8, &parsed.ns);
  flags.Int("bulk", 0, 15, &parsed.bulk);
  flags.Int("late-stage", 0, 1, &parsed.late_stage);
  flags.Int("baseline-nw", 1, 8, &parsed.baseline_nw);
  flags.Int("baseline-rpw", 2, 16, &parsed.baseline_rpw);
  flags.Int("baseline-cache", 1, 5, &parsed.baseline_cache);
  flags.Int("small-max-b", int64_t{-1}, int64_t{65535}, &parsed.small_max_b);
  flags.Int("small-rpw", 8, 16, &parsed.small_rpw);
  flags.Int("stream-min-b", int64_t{-1}, int64_t{65535}, &parsed.stream_min_b);
  flags.Int("stream-grid", 1, 1 << 20, &parsed.stream_grid);
  flags.Int("stream-ctas", 1, 3, &parsed.stream_ctas);
  flags.Int("stream-ns", 1, 8, &parsed.stream_ns);
  const absl::Status s = flags.Parse(argc, argv);
  if (!s.ok()) return std::string(s.message());
  if (!flags.help() && parsed.json.empty() && argc > 1) {
    // `--json ""` or `--json=`: a path is required.
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--json" || a.rfind("--json=", 0) == 0) return "--json: expected a path";
    }
  }
  parsed.help = flags.help();
  *args = parsed;
  return "";
}

}  // namespace replayssm::bench
