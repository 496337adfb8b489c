// The fuzz targets over the server's parsers: flags and config files, config.json, safetensors.
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "fuzz/fuzz_targets.h"
#include "replayssm/cache/model.h"
#include "service/config.h"
#include "service/hf_config.h"
#include "service/safetensors.h"

namespace replayssm::fuzz {

void Check(bool ok, const char* what) {
  if (ok) return;
  std::fprintf(stderr, "fuzz: invariant broken: %s\n", what);
  std::abort();
}

int FuzzServerConfig(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string args = input.substr(0, nul);
  const std::string text = nul == std::string::npos ? "" : input.substr(nul + 1);
  std::vector<std::string> argv{"replayssm-server"};
  for (absl::string_view a : absl::StrSplit(args, '\n', absl::SkipEmpty())) {
    if (absl::StrContains(a, "config")) continue;  // --config reads a file: ApplyConfig below
    argv.emplace_back(a);
  }
  std::vector<const char*> ptrs;
  for (const std::string& a : argv) ptrs.push_back(a.c_str());
  absl::StatusOr<service::ServerFlags> flags =
      service::ParseServerFlags(static_cast<int>(ptrs.size()), ptrs.data());
  service::ServerFlags from_file;
  (void)service::ApplyConfig(text, "fuzz.conf", {}, &from_file);
  if (argv.size() > 1) (void)service::ParseBytes(argv[1]);
  (void)flags;
  return 0;
}

int FuzzHfConfig(const uint8_t* data, size_t size) {
  const std::string json(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<cache::ModelSpec> m = service::ModelFromHfConfigJson(json, "config.json", -1, 0);
  if (!m.ok()) return 0;
  Check(m->num_layers >= 1, "a parsed model has layers");
  Check(static_cast<int32_t>(m->layers.size()) == m->num_layers, "one LayerParams per layer");
  Check(m->SlotBytes() > 0, "a parsed model's shape passes the kernels' check");
  return 0;
}

int FuzzSafetensors(const uint8_t* data, size_t size) {
  const std::map<std::string, std::string> files{
      {"model.safetensors", std::string(reinterpret_cast<const char*>(data), size)}};
  for (const char* preset : {"tiny-gdn", "tiny-kda"}) {
    absl::StatusOr<cache::ModelSpec> m = cache::ModelPreset(preset);
    Check(m.ok(), "the preset exists");
    const cache::ModelSpec before = *m;
    absl::StatusOr<bool> loaded = service::LoadLayerParamsFromBuffers(files, ".", &*m);
    if (!loaded.ok() || !*loaded) {
      Check(m->params_from_seed && m->layers.size() == before.layers.size(),
            "a refused checkpoint changes nothing");
      continue;
    }
    Check(!m->params_from_seed, "loaded parameters are not the seed's");
    for (const cache::LayerParams& p : m->layers) {
      Check(p.a_log.size() == before.layers[0].a_log.size(), "A_log has HV values");
      Check(p.dt_bias.size() == before.layers[0].dt_bias.size(), "dt_bias has HV(*K) values");
    }
  }
  return 0;
}

}  // namespace replayssm::fuzz
