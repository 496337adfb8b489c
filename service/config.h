// Command line and config file of replayssm-server. Flags are `--name=value` or
// `--name value`; `--config FILE` reads `name = value` lines (same names, '#' comments).
// Command-line values win over the file's, whatever their order.
#ifndef REPLAYSSM_SERVICE_CONFIG_H_
#define REPLAYSSM_SERVICE_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "service/server.h"

namespace replayssm::service {

struct ServerFlags {
  ServerOptions options;
  std::string ready_file;  // when set: "grpc=HOST:PORT\nmetrics=HOST:PORT\n" once serving
  bool help = false;
};

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, const char* const* argv);
std::string ServerUsage();

// "1073741824", "512M", "1G", "1GiB", "64KiB" (binary units).
absl::StatusOr<int64_t> ParseBytes(absl::string_view text);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_CONFIG_H_
