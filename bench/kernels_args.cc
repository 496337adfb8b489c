#include "bench/kernels_args.h"

#include "bench/flags.h"

namespace replayssm::bench {

std::string ParseKernelsArgs(int argc, const char* const* argv, KernelsArgs* args) {
  KernelsArgs parsed;
  Flags flags("replayssm-bench kernels", "[--json PATH] [--method graph|peer|both]");
  flags.String("json", &parsed.json);
  flags.Choice("method", {"graph", "peer", "both"}, &parsed.method);
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
