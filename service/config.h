// Command line and config file of replayssm-server. Flags are `--name=value` or
// `--name value`; `--config FILE` reads `name = value` lines (same names, '#' comments).
// Command-line values win over the file's, whatever their order.
#ifndef REPLAYSSM_SERVICE_CONFIG_H_
#define REPLAYSSM_SERVICE_CONFIG_H_

#include <cstdint>
#include <map>
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
// Every flag, its help, its bounds and its default (from a default ServerOptions).
std::string ServerUsage();
// The flags' bounds over `options` however they were made (Server::Start): INVALID_ARGUMENT
// naming the first flag out of bounds ("expected min..max, got v" as at parse time) or given a
// word outside its few ("--host-snapshot-policy: expected lru or value, got mru"), or given
// without the flag it needs ("--kv-events-topic: expected it with --kv-events-endpoint (...),
// got vllm alone").
absl::Status CheckServerBounds(const ServerOptions& options);
// The words of --state-dtype / --ring-dtype (an rssm_dtype; -1 for "", the preset's or the
// state's) and of --beta-rounding (1 act, 0 f32; -1 for "", the model's): one table for the
// flags' check above and for the server's reading of them. INVALID_ARGUMENT names the words and
// what came ("expected f32, bf16 or f16, got f8"), without the flag: the caller prefixes it.
absl::StatusOr<int32_t> DtypeWord(absl::string_view name);
// --device's words: kDeviceAuto, kDeviceCpu, or a CUDA device's index (cuda is cuda:0).
inline constexpr int32_t kDeviceAuto = -2, kDeviceCpu = -1;
absl::StatusOr<int32_t> DeviceWord(absl::string_view name);
absl::StatusOr<int32_t> BetaRoundingWord(absl::string_view name);

// The `name = value` lines of a config file's `text` over `flags` (what --config FILE does
// after reading FILE); names in `command_line` are skipped, as the command line wins. Errors
// name `path` and the line.
absl::Status ApplyConfig(absl::string_view text, const std::string& path,
                         const std::map<std::string, std::string>& command_line,
                         ServerFlags* flags);

// "1073741824", "512M", "1G", "1GiB", "64KiB" (binary units).
absl::StatusOr<int64_t> ParseBytes(absl::string_view text);

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_CONFIG_H_
