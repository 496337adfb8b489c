#include "service/config.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "replayssm/cache/model.h"
#include "replayssm/cache/tp.h"

namespace replayssm::service {

namespace {

using Setter = std::function<absl::Status(ServerFlags&, const std::string&)>;

// What a flag sets: how (set), what it holds as the flag would spell it (show; the usage's
// "[default]" comes from a default ServerOptions), and its bounds or words when it has any
// (check, run by Server::Start over the options however they were made: CheckServerBounds).
struct Value {
  Setter set;
  std::function<std::string(const ServerOptions&)> show;
  std::function<absl::Status(const ServerOptions&)> check;
  std::string range;  // "min..max" in the usage, when it says more than the type's limits
};

struct Flag {
  const char* name;
  const char* help;
  Value value;
};

// "expected min..max, got v": a bound's message (CheckServerBounds names the flag).
template <typename T>
std::function<absl::Status(const ServerOptions&)> Within(T ServerOptions::*field, int64_t min,
                                                         int64_t max) {
  return [field, min, max](const ServerOptions& o) -> absl::Status {
    const int64_t v = o.*field;
    if (v >= min && v <= max) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("expected ", min, "..", max, ", got ", v));
  };
}

template <typename T>
Value Int(T ServerOptions::*field, int64_t min = std::numeric_limits<T>::min(),
          int64_t max = std::numeric_limits<T>::max()) {
  Value v;
  v.set = [field](ServerFlags& f, const std::string& text) -> absl::Status {
    T x = 0;  // SimpleAtoi refuses what T cannot hold: no silent truncation
    if (!absl::SimpleAtoi(text, &x)) {
      return absl::InvalidArgumentError(absl::StrCat("expected an integer in ",
                                                     std::numeric_limits<T>::min(), "..",
                                                     std::numeric_limits<T>::max()));
    }
    f.options.*field = x;
    return absl::OkStatus();
  };
  v.show = [field](const ServerOptions& o) { return absl::StrCat(o.*field); };
  if (min != std::numeric_limits<T>::min() || max != std::numeric_limits<T>::max()) {
    v.check = Within(field, min, max);
    if (max < std::numeric_limits<int32_t>::max()) v.range = absl::StrCat(min, "..", max);
  }
  return v;
}

// --ring-length: 0 (the preset's) or 2..64, checked with the other bounds (exit 2). L = 1 used
// to pass here and be refused by the cache later (exit 1, naming ring_len).
Value RingLength() {
  Value v = Int(&ServerOptions::ring_length, 0, 64);
  v.check = [](const ServerOptions& o) -> absl::Status {
    if (o.ring_length == 0 || (o.ring_length >= 2 && o.ring_length <= 64)) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        absl::StrCat("expected 0 (the preset's) or 2..64 (a ring holds L-1 decode records), got ",
                     o.ring_length));
  };
  v.range = "0, 2..64";
  return v;
}

// 1G, 64M, 4M: the largest binary unit that divides it.
std::string ShowBytes(int64_t bytes) {
  for (const auto& [shift, unit] : {std::pair{40, "T"}, {30, "G"}, {20, "M"}, {10, "K"}}) {
    const int64_t u = int64_t{1} << shift;
    if (bytes != 0 && bytes % u == 0) return absl::StrCat(bytes / u, unit);
  }
  return absl::StrCat(bytes);
}

Value Bytes(int64_t ServerOptions::*field, int64_t min = 0,
            int64_t max = std::numeric_limits<int64_t>::max()) {
  Value v;
  v.set = [field](ServerFlags& f, const std::string& text) -> absl::Status {
    absl::StatusOr<int64_t> x = ParseBytes(text);
    if (!x.ok()) return x.status();
    f.options.*field = *x;
    return absl::OkStatus();
  };
  v.show = [field](const ServerOptions& o) { return ShowBytes(o.*field); };
  v.check = Within(field, min, max);
  if (min > 0 || max < std::numeric_limits<int64_t>::max()) {
    v.range = max < std::numeric_limits<int64_t>::max()
                  ? absl::StrCat(ShowBytes(min), "..", ShowBytes(max))
                  : absl::StrCat(">= ", ShowBytes(min));
  }
  return v;
}

// `positive`: 0 is refused too (a bound that every forward would pass at once).
Value Seconds(absl::Duration ServerOptions::*field, bool positive = false) {
  Value v;
  v.set = [field, positive](ServerFlags& f, const std::string& text) -> absl::Status {
    double s = 0;
    // Decimal seconds only (SimpleAtod also reads 0x10, inf, nan); a bound > 0 must stay one
    // once made a duration (1e-300 s is zero), and none may be infinite (1e400).
    const bool decimal =
        !text.empty() && text.find_first_not_of("0123456789.eE+-") == std::string::npos;
    if (!decimal || !absl::SimpleAtod(text, &s) || !std::isfinite(s) || s > 1e9 ||
        !(positive ? absl::Seconds(s) > absl::ZeroDuration() : s >= 0)) {
      return absl::InvalidArgumentError(positive ? "expected decimal seconds > 0 (at most 1e9)"
                                                 : "expected decimal seconds >= 0 (at most 1e9)");
    }
    f.options.*field = absl::Seconds(s);
    return absl::OkStatus();
  };
  v.show = [field](const ServerOptions& o) {
    return absl::StrCat(absl::ToDoubleSeconds(o.*field));
  };
  return v;
}

Value Bool(bool ServerOptions::*field) {
  Value v;
  v.set = [field](ServerFlags& f, const std::string& text) -> absl::Status {
    if (text != "true" && text != "false") {
      return absl::InvalidArgumentError("expected true or false");
    }
    f.options.*field = text == "true";
    return absl::OkStatus();
  };
  v.show = [field](const ServerOptions& o) { return o.*field ? "true" : "false"; };
  return v;
}

Value Str(std::string ServerOptions::*field) {
  Value v;
  v.set = [field](ServerFlags& f, const std::string& text) {
    f.options.*field = text;
    return absl::OkStatus();
  };
  v.show = [field](const ServerOptions& o) { return o.*field; };
  return v;
}

// "a, b or c".
std::string OneOf(const std::vector<std::string>& words) {
  if (words.size() < 2) return absl::StrJoin(words, "");
  return absl::StrCat(absl::StrJoin(words.begin(), words.end() - 1, ", "), " or ", words.back());
}

// A string flag of a few words, refused like a bound (exit 2) naming them and what came.
// Start used to refuse them (exit 1) while --forward-graphs=yes was a usage error.
Value Words(std::string ServerOptions::*field, std::vector<std::string> words) {
  Value v = Str(field);
  v.check = [field, words](const ServerOptions& o) -> absl::Status {
    const std::string& x = o.*field;
    if (std::find(words.begin(), words.end(), x) != words.end()) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("expected ", OneOf(words), ", got ", x));
  };
  return v;
}

// --model: a preset's name or a HF config.json (read by Start).
Value Model() {
  Value v = Str(&ServerOptions::model);
  v.check = [](const ServerOptions& o) -> absl::Status {
    const std::vector<std::string> presets = cache::ModelPresetNames();
    if (absl::EndsWith(o.model, ".json") ||
        std::find(presets.begin(), presets.end(), o.model) != presets.end()) {
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(absl::StrCat("expected a preset (",
                                                   absl::StrJoin(presets, ", "),
                                                   ") or a HF config.json, got ", o.model));
  };
  return v;
}

// A string flag whose words are those of `parse` (DeviceWord, DtypeWord, BetaRoundingWord: the
// server reads the flag through the same function). Whether a --device exists is Start's to
// find.
Value ParsedWords(std::string ServerOptions::*field,
                  absl::StatusOr<int32_t> (*parse)(absl::string_view)) {
  Value v = Str(field);
  v.check = [field, parse](const ServerOptions& o) { return parse(o.*field).status(); };
  return v;
}

// A flag with a parser of its own and no default to show.
Value Custom(Setter set) { return Value{std::move(set), nullptr, nullptr, ""}; }

const std::vector<Flag>& Flags() {
  static const std::vector<Flag> kFlags = {
      {"grpc-address", "gRPC listen address (port 0 = any free port)",
       Str(&ServerOptions::grpc_address)},
      {"metrics-address", "Prometheus /metrics listen address, empty = off",
       Str(&ServerOptions::metrics_address)},
      {"model",
       "preset (tiny-gdn, tiny-kda, qwen3-next-80b-a3b, kimi-linear-48b-a3b) or a HF config.json",
       Model()},
      {"device", "auto | cpu | cuda | cuda:N", ParsedWords(&ServerOptions::device, DeviceWord)},
      {"tp-size",
       "tensor-parallel ranks of the engine served: one cache shard per rank, each with "
       "HV/tp-size v heads and --memory-budget of its own; activations rank-major",
       Int(&ServerOptions::tp_size, 1, cache::kMaxTpSize)},
      {"devices",
       "CUDA devices of the TP ranks, one per rank, e.g. 0,1,2,3 (sets --tp-size when it is 1); "
       "empty: every rank on --device's GPU",
       Str(&ServerOptions::devices)},
      {"memory-budget", "bytes for slots and snapshots (per TP rank), e.g. 512M, 4G",
       Bytes(&ServerOptions::memory_budget_bytes)},
      {"ring-length", "replay ring length L (0 = the preset's)", RingLength()},
      {"track-interval", "snapshot every N decoded tokens, 0 = never",
       Int(&ServerOptions::track_interval, 0, std::numeric_limits<int32_t>::max())},
      {"state-dtype", "f32 | bf16 | f16 (empty = the preset's)",
       ParsedWords(&ServerOptions::state_dtype, DtypeWord)},
      {"ring-dtype",
       "ring d, k: f32 | bf16 | f16 (empty = the state dtype; a 16-bit state takes only its own)",
       ParsedWords(&ServerOptions::ring_dtype, DtypeWord)},
      {"beta-rounding",
       "act | f32: beta = sigmoid(b) rounded to the act dtype or kept fp32 (empty = the "
       "model's: act for Gated DeltaNet, f32 for KDA)",
       ParsedWords(&ServerOptions::beta_rounding, BetaRoundingWord)},
      {"max-batch", "rows per decode / verify (a CUDA launch's grid holds 65535)",
       Int(&ServerOptions::max_batch, 1, 65535)},
      {"forward-graphs",
       "true | false: a planned decode forward that repeats runs as one CUDA graph",
       Bool(&ServerOptions::forward_graphs)},
      {"max-prefill-tokens", "tokens per prefill call",
       Int(&ServerOptions::max_prefill_tokens, 1, std::numeric_limits<int32_t>::max())},
      {"max-message-bytes", "largest request accepted (gRPC's limit is an int)",
       Bytes(&ServerOptions::max_message_bytes, int64_t{4} << 10,
             std::numeric_limits<int32_t>::max())},
      {"dedup-entries", "request ids remembered for retries",
       Int(&ServerOptions::dedup_entries, 1, std::numeric_limits<int64_t>::max())},
      {"dedup-bytes",
       "bytes of remembered replies (0 would remember none: retries not deduplicated)",
       Bytes(&ServerOptions::dedup_bytes, 1)},
      {"max-request-id-bytes", "longest request id accepted",
       Int(&ServerOptions::max_request_id_bytes, 1, 65536)},
      {"max-import-tokens", "tokens an Import (or an incoming transfer) may bring",
       Int(&ServerOptions::max_import_tokens, 1, std::numeric_limits<int32_t>::max())},
      {"max-streams", "DecodeStream streams open at once",
       Int(&ServerOptions::max_streams, 1, std::numeric_limits<int32_t>::max())},
      {"max-planned-forwards",
       "planned forwards open at once; 0 = 24 per GPU over the TP ranks sharing it on CUDA, "
       "none on the CPU",
       Int(&ServerOptions::max_planned_forwards, 0, std::numeric_limits<int32_t>::max())},
      {"tenant-max-streams",
       "DecodeStream streams one tenant may hold open (with --auth-tokens; past it: "
       "RESOURCE_EXHAUSTED), 0 = only --max-streams",
       Int(&ServerOptions::tenant_max_streams, 0, std::numeric_limits<int32_t>::max())},
      {"tenant-max-watchers",
       "WatchCache streams one tenant may hold open (with --auth-tokens; past it: "
       "RESOURCE_EXHAUSTED), 0 = only --max-watchers",
       Int(&ServerOptions::tenant_max_watchers, 0, std::numeric_limits<int32_t>::max())},
      {"tenant-max-slots",
       "live slots one tenant may hold (with --auth-tokens; allocations and incoming transfers "
       "past it: RESOURCE_EXHAUSTED), 0 = no bound",
       Int(&ServerOptions::tenant_max_slots, 0, std::numeric_limits<int64_t>::max())},
      {"tenant-max-snapshots",
       "prefix snapshots one tenant (prefix namespace) may hold; a new one past it evicts that "
       "tenant's own oldest, never another's; 0 = no bound",
       Int(&ServerOptions::tenant_max_snapshots, 0, std::numeric_limits<int64_t>::max())},
      {"cache-events-retain",
       "cache event batches kept per tenant for a router that reconnects (WatchCache, ZMQ "
       "replay)",
       Int(&ServerOptions::cache_events_retain, 1, 1 << 20)},
      {"max-watchers", "WatchCache streams open at once",
       Int(&ServerOptions::max_watchers, 1, std::numeric_limits<int32_t>::max())},
      {"kv-events-endpoint",
       "ZMQ PUB endpoint of the cache events in vLLM's KV-events format, e.g. "
       "tcp://127.0.0.1:5557; empty = off (unauthenticated: one tenant, a private interface)",
       Str(&ServerOptions::kv_events_endpoint)},
      {"kv-events-replay-endpoint",
       "ZMQ ROUTER endpoint answering replay requests for missed batches; empty = none",
       Str(&ServerOptions::kv_events_replay_endpoint)},
      {"kv-events-topic", "topic frame of the ZMQ cache events",
       Str(&ServerOptions::kv_events_topic)},
      {"kv-events-curve-secret-file",
       "file of the ZMQ sockets' CURVE secret key (Z85, 40 characters): encrypted, and only the "
       "keys of --kv-events-clients-file admitted; empty = open sockets",
       Str(&ServerOptions::kv_events_curve_secret_file)},
      {"kv-events-clients-file",
       "file of the CURVE public keys (Z85, one per line; # starts a comment line) of the "
       "routers admitted to the ZMQ sockets; with --kv-events-curve-secret-file",
       Str(&ServerOptions::kv_events_clients_file)},
      {"kv-events-tenant",
       "tenant (of --auth-tokens) whose cache events ZMQ carries; empty = the implicit one",
       Str(&ServerOptions::kv_events_tenant)},
      {"host-snapshot-bytes",
       "pinned host memory for snapshots evicted from the GPU (per TP rank), e.g. 64G; a prefix "
       "hit there is copied back; 0 = off (evicted snapshots are dropped)",
       Bytes(&ServerOptions::host_snapshot_bytes)},
      {"host-snapshot-policy",
       "lru | value: which host snapshot goes first when the host tier is full: the least "
       "recently used, or the one saving the fewest tokens per byte (by its hits, aged)",
       Words(&ServerOptions::host_snapshot_policy, {"lru", "value"})},
      {"host-spill-ahead",
       "with the host tier: GPU slots kept obtainable without loss (free, or snapshots the host "
       "holds too) by copying the least recently used snapshots to the host in the background, "
       "so decode-time evictions move snapshots instead of dropping them; 0 = spill only when a "
       "slot-taking call needs room",
       Int(&ServerOptions::host_spill_ahead, 0, 1 << 16)},
      {"host-pin-at-start",
       "true | false: pin all of --host-snapshot-bytes when the server starts (seconds per tens "
       "of GiB) instead of each entry at its first spill, where the allocation stalls the "
       "decode steps beside it",
       Bool(&ServerOptions::host_pin_at_start)},
      {"slot-ttl", "seconds a live slot may go unused before it is freed, 0 = never",
       Seconds(&ServerOptions::slot_ttl)},
      {"region-ttl",
       "seconds a registered region may go unused (no forward, no call naming it) before it is "
       "unregistered: a dead engine's regions, 0 = never",
       Seconds(&ServerOptions::region_ttl)},
      {"max-regions", "memory regions clients may register at once (0: none)",
       Int(&ServerOptions::max_regions, 0, std::numeric_limits<int32_t>::max())},
      {"max-region-bytes", "bytes of all registered regions together",
       Bytes(&ServerOptions::max_region_bytes)},
      {"forward-timeout",
       "seconds a doorbell forward may take from begin to commit before it is abandoned (> 0)",
       Seconds(&ServerOptions::forward_timeout, /*positive=*/true)},
      {"stream-idle-timeout",
       "seconds a streamed forward may wait for its next layer message before it is "
       "abandoned (> 0; the time a large message takes to arrive counts)",
       Seconds(&ServerOptions::stream_idle_timeout, /*positive=*/true)},
      {"drain-timeout", "seconds to wait for open forwards on SIGTERM",
       Seconds(&ServerOptions::drain_timeout)},
      {"drain-wait-slots",
       "true | false: after the open forwards, the drain also waits (within --drain-timeout) "
       "until no live slot is left, so that schedulers can move their requests off "
       "(TransferSlot) or free them",
       Bool(&ServerOptions::drain_wait_slots)},
      {"device-check-interval",
       "seconds between checks that the devices still take work (0: never); once one has "
       "failed (a sticky CUDA error) the server reports NOT_SERVING and refuses all new work",
       Seconds(&ServerOptions::device_check_interval)},
      {"transfer-chunk-bytes", "UCX put granularity of slot transfers",
       Bytes(&ServerOptions::transfer_chunk_bytes, 1, int64_t{1} << 30)},
      {"transfer-lanes", "sender threads putting a slot's chunks at once",
       Int(&ServerOptions::transfer_lanes, 1, 16)},
      {"transfer-import-threads",
       "receiver threads copying (and hashing) landed chunks into the slot",
       Int(&ServerOptions::transfer_import_threads, 1, 32)},
      {"transfer-timeout",
       "seconds an outgoing slot transfer may take, commit and abort included (> 0)",
       Seconds(&ServerOptions::transfer_timeout, /*positive=*/true)},
      {"transfer-lease", "seconds an incoming transfer's reservation lives uncommitted (> 0)",
       Seconds(&ServerOptions::transfer_lease, /*positive=*/true)},
      {"transfer-max-concurrent", "outgoing slot transfers running at once",
       Int(&ServerOptions::transfer_max_concurrent, 1, 64)},
      {"transfer-peers",
       "comma-separated host:port of the servers TransferSlot/PullSlot may dial, empty = any",
       Custom([](ServerFlags& f, const std::string& v) {
         f.options.transfer_peers.clear();
         for (absl::string_view p : absl::StrSplit(v, ',', absl::SkipEmpty())) {
           const size_t colon = p.rfind(':');
           int port = 0;
           if (colon == absl::string_view::npos || colon == 0 ||
               !absl::SimpleAtoi(p.substr(colon + 1), &port) || port < 1 || port > 65535 ||
               p.substr(colon + 1).find_first_not_of("0123456789") != absl::string_view::npos) {
             return absl::InvalidArgumentError(absl::StrCat(
                 "expected host:port entries with a port in 1..65535, got \"", p, "\""));
           }
           f.options.transfer_peers.emplace_back(p);
         }
         return absl::OkStatus();
       })},
      {"transfer-reservations-per-peer",
       "incoming transfer reservations one peer (mTLS identity, else host) may hold",
       Int(&ServerOptions::transfer_reservations_per_peer, 1, 64)},
      {"transfer-interface",
       "network interface UCX transfers use and listen on (e.g. eth1), empty = the interface of "
       "--grpc-address",
       Str(&ServerOptions::transfer_interface)},
      {"tls-cert", "PEM certificate chain: serve gRPC over TLS (with --tls-key); empty = off",
       Str(&ServerOptions::tls_cert_file)},
      {"tls-key", "PEM private key of --tls-cert", Str(&ServerOptions::tls_key_file)},
      {"tls-client-ca",
       "PEM CA: require client certificates it signed (mTLS; also verifies transfer peers)",
       Str(&ServerOptions::tls_client_ca_file)},
      {"auth-tokens",
       "file of `tenant token` lines: every client call needs `authorization: Bearer <token>` "
       "and sees its tenant's slots only (re-read when it changes); empty = off",
       Str(&ServerOptions::auth_tokens_file)},
      {"peer-token",
       "file of the cluster's peer token: transfer peers must prove it (a client's token "
       "or certificate never suffices) and this server proves it; empty = off",
       Str(&ServerOptions::peer_token_file)},
      {"ready-file", "write the bound addresses here once serving (for tests and scripts)",
       Custom([](ServerFlags& f, const std::string& v) {
         f.ready_file = v;
         return absl::OkStatus();
       })},
  };
  return kFlags;
}

// A flag that means nothing without another: given (away from its default) while `needs` is
// at its own (off), it is refused naming both, like a bound (exit 2). --kv-events-topic alone
// was taken and never used; the others stopped the start (exit 1).
struct Companion {
  const char* flag;
  const char* needs;
  const char* why;
};

const std::vector<Companion>& Companions() {
  static const std::vector<Companion> kCompanions = {
      {"kv-events-topic", "kv-events-endpoint", "the ZMQ publisher whose topic it names"},
      {"kv-events-replay-endpoint", "kv-events-endpoint",
       "the ZMQ publisher whose batches it replays"},
      {"kv-events-tenant", "kv-events-endpoint", "the ZMQ publisher of that tenant's events"},
      {"kv-events-curve-secret-file", "kv-events-endpoint", "the ZMQ events it secures"},
      {"kv-events-clients-file", "kv-events-endpoint", "the ZMQ events it secures"},
      {"kv-events-curve-secret-file", "kv-events-clients-file",
       "CURVE needs the server's key and the routers' keys"},
      {"kv-events-clients-file", "kv-events-curve-secret-file",
       "CURVE needs the server's key and the routers' keys"},
      {"tenant-max-streams", "auth-tokens",
       "without tokens there is one tenant, bounded by the server's own limits"},
      {"tenant-max-watchers", "auth-tokens",
       "without tokens there is one tenant, bounded by the server's own limits"},
      {"tenant-max-slots", "auth-tokens",
       "without tokens there is one tenant, bounded by the server's own limits"},
      {"tls-cert", "tls-key", "the certificate's private key"},
      {"tls-key", "tls-cert", "the certificate of the key"},
      {"tls-client-ca", "tls-cert", "mTLS is TLS with client certificates"},
  };
  return kCompanions;
}

const Flag& FlagNamed(absl::string_view name) {
  return *std::find_if(Flags().begin(), Flags().end(),
                       [&](const Flag& f) { return name == f.name; });
}

absl::Status CheckCompanions(const ServerOptions& options) {
  const ServerOptions defaults;
  for (const Companion& c : Companions()) {
    const auto& show = FlagNamed(c.flag).value.show;
    const auto& needed = FlagNamed(c.needs).value.show;
    if (show(options) == show(defaults) || needed(options) != needed(defaults)) continue;
    return absl::InvalidArgumentError(absl::StrCat("--", c.flag, ": expected it with --", c.needs,
                                                   " (", c.why, "), got ", show(options),
                                                   " alone"));
  }
  return absl::OkStatus();
}

absl::Status Set(ServerFlags& flags, const std::string& name, const std::string& value,
                 absl::string_view where) {
  for (const Flag& f : Flags()) {
    if (name != f.name) continue;
    absl::Status s = f.value.set(flags, value);
    if (s.ok()) return s;
    return absl::InvalidArgumentError(
        absl::StrCat(where, "--", name, "=", value, ": ", s.message()));
  }
  return absl::InvalidArgumentError(absl::StrCat(where, "unknown flag --", name));
}

absl::Status ApplyConfigFile(ServerFlags& flags, const std::string& path,
                             const std::map<std::string, std::string>& command_line) {
  // A directory opens and reads as nothing (a Kubernetes ConfigMap is mounted as one): the
  // server started on defaults, its TLS and tokens with them (an outside review).
  struct stat st {};
  if (stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--config ", path, ": expected a file of `name = value` lines, got ",
                     S_ISDIR(st.st_mode) ? "a directory (a ConfigMap's mount: name its file in it)"
                                         : "something else"));
  }
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--config ", path, ": cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  return ApplyConfig(text.str(), path, command_line, &flags);
}

}  // namespace

absl::Status ApplyConfig(absl::string_view text, const std::string& path,
                         const std::map<std::string, std::string>& command_line,
                         ServerFlags* flags_out) {
  ServerFlags& flags = *flags_out;
  std::istringstream in{std::string(text)};
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (n == 1 && absl::StartsWith(line, "\xEF\xBB\xBF")) line.erase(0, 3);  // a UTF-8 BOM
    // A comment: # at the line's start or after a space, so that values may hold one (a
    // topic "a#b", a path).
    size_t hash = 0;
    while ((hash = line.find('#', hash)) != std::string::npos &&
           !(hash == 0 || line[hash - 1] == ' ' || line[hash - 1] == '\t')) {
      ++hash;
    }
    const std::string uncommented = line.substr(0, hash);
    const absl::string_view text = absl::StripAsciiWhitespace(uncommented);
    if (text.empty()) continue;
    const size_t eq = text.find('=');
    if (eq == absl::string_view::npos) {
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": expected name = value"));
    }
    const std::string name(absl::StripAsciiWhitespace(text.substr(0, eq)));
    const std::string value(absl::StripAsciiWhitespace(text.substr(eq + 1)));
    // The command line wins, but a bad line is refused all the same: it would be the value the
    // day the command line no longer sets it.
    ServerFlags scratch;
    ServerFlags& into = command_line.contains(name) ? scratch : flags;
    absl::Status s = Set(into, name, value, absl::StrCat(path, ":", n, ": "));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> ParseBytes(absl::string_view text) {
  const std::string upper = absl::AsciiStrToUpper(absl::StripAsciiWhitespace(text));
  absl::string_view t = upper;
  absl::ConsumeSuffix(&t, "IB") || absl::ConsumeSuffix(&t, "B");
  int64_t unit = 1;
  if (!t.empty()) {
    const size_t p = absl::string_view("KMGT").find(t.back());
    if (p != absl::string_view::npos) {
      unit = int64_t{1} << (10 * (p + 1));
      t.remove_suffix(1);
    }
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(t, &value) || value < 0 ||
      value > std::numeric_limits<int64_t>::max() / unit) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected bytes like 512M (less than 2^63), got ", text));
  }
  return value * unit;
}

absl::StatusOr<ServerFlags> ParseServerFlags(int argc, const char* const* argv) {
  std::map<std::string, std::string> given;
  std::string config;
  ServerFlags flags;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      flags.help = true;
      return flags;
    }
    if (!absl::ConsumePrefix(&arg, "--")) {
      return absl::InvalidArgumentError(
          absl::StrCat("unexpected argument '", arg, "' (flags are --name=value)"));
    }
    std::string name(arg), value;
    const size_t eq = arg.find('=');
    if (eq != absl::string_view::npos) name = std::string(arg.substr(0, eq));
    const bool known =
        name == "config" ||
        std::any_of(Flags().begin(), Flags().end(), [&](const Flag& f) { return name == f.name; });
    if (!known) return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (eq != absl::string_view::npos) {
      value = std::string(arg.substr(eq + 1));
    } else if (i + 1 < argc && !absl::StartsWith(argv[i + 1], "--")) {
      value = argv[++i];
    } else {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
    }
    if (name == "config") {
      // One file: a second one silently replaced the first, and an empty one was no file.
      if (value.empty()) {
        return absl::InvalidArgumentError("--config: expected a file, got an empty value");
      }
      if (!config.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat("--config: expected one file, got \"", config, "\" and \"", value, "\""));
      }
      config = value;
      continue;
    }
    absl::Status s = Set(flags, name, value, "");
    if (!s.ok()) return s;
    given[name] = value;
  }
  if (!config.empty()) {
    absl::Status s = ApplyConfigFile(flags, config, given);
    if (!s.ok()) return s;
  }
  return flags;
}

std::string ServerUsage() {
  std::string usage =
      "usage: replayssm-server [--name=value ...] [--config FILE]\n"
      "  --config FILE  `name = value` lines with the flag names below\n";
  const ServerOptions defaults;
  for (const Flag& f : Flags()) {
    absl::StrAppend(&usage, "  --", f.name, "  ", f.help);
    if (!f.value.range.empty()) absl::StrAppend(&usage, ", ", f.value.range);
    if (f.value.show) absl::StrAppend(&usage, " [", f.value.show(defaults), "]");
    absl::StrAppend(&usage, "\n");
  }
  return usage;
}

absl::StatusOr<int32_t> DeviceWord(absl::string_view name) {
  if (name == "auto") return kDeviceAuto;
  if (name == "cpu") return kDeviceCpu;
  if (name == "cuda") return 0;
  absl::string_view d = name;
  int32_t index = -1;
  if (absl::ConsumePrefix(&d, "cuda:") && !d.empty() &&
      d.find_first_not_of("0123456789") == absl::string_view::npos && absl::SimpleAtoi(d, &index)) {
    return index;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("expected auto, cpu, cuda or cuda:N (N >= 0), got ", name));
}

absl::StatusOr<int32_t> DtypeWord(absl::string_view name) {
  if (name.empty()) return -1;
  if (name == "f32" || name == "fp32" || name == "float32") return RSSM_DTYPE_F32;
  if (name == "bf16" || name == "bfloat16") return RSSM_DTYPE_BF16;
  if (name == "f16" || name == "fp16" || name == "float16") return RSSM_DTYPE_F16;
  return absl::InvalidArgumentError(absl::StrCat("expected f32, bf16 or f16, got ", name));
}

absl::StatusOr<int32_t> BetaRoundingWord(absl::string_view name) {
  if (name.empty()) return -1;
  if (name == "act") return 1;
  if (name == "f32" || name == "fp32") return 0;
  return absl::InvalidArgumentError(absl::StrCat("expected act or f32, got ", name));
}

absl::Status CheckServerBounds(const ServerOptions& options) {
  for (const Flag& f : Flags()) {
    if (!f.value.check) continue;
    if (absl::Status s = f.value.check(options); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", f.name, ": ", s.message()));
    }
  }
  return CheckCompanions(options);
}

}  // namespace replayssm::service
