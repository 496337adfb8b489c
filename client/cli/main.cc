// replayssm-cli: talk to a replayssm-server.
//   replayssm-cli [--address HOST:PORT] COMMAND [ARGS] [OPTIONS]
// --address may stand before or after the command; every other option belongs to its command.
// An unknown option, a missing or malformed value and a stray argument are errors (exit 2).
#include <signal.h>

#include <atomic>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"
#include "replayssm/client/bench.h"
#include "replayssm/client/client.h"
#include "replayssm/client/demo.h"

namespace {

using replayssm::client::Client;

constexpr char kUsage[] =
    "usage: replayssm-cli [--address HOST:PORT] COMMAND [ARGS] [OPTIONS]\n"
    "  info                 model, shapes, dtypes, capacity, backend\n"
    "  stats                cache counters (slots, folds, snapshots)\n"
    "  health               grpc.health.v1 status of the server\n"
    "  alloc [TOKEN...]     allocate a slot (from the longest matching prefix when tokens)\n"
    "  free SLOT            free a slot\n"
    "                       alloc, free, transfer and pull take --request-id ID: a retry\n"
    "                       with the same ID is answered once (default: a new ID each run)\n"
    "  transfer SLOT PEER [--keep]\n"
    "                       move a slot to the server at PEER (host:port) over UCX; prints\n"
    "                       its handle there; --keep leaves the source slot in place\n"
    "  pull SLOT PEER [--keep] [--self HOST:PORT]\n"
    "                       the receiver's form: this server asks PEER to move its slot SLOT\n"
    "                       here; prints the slot's handle here. --self: this server's\n"
    "                       address as PEER reaches it (default: the address it listens on)\n"
    "  demo [--requests N] [--steps N] [--seed N] [--disaggregated DECODE_HOST:PORT]\n"
    "                       batched layer-by-layer prefill, batched decode, prefix hit;\n"
    "                       checked against the CPU reference; exits 1 on a mismatch.\n"
    "                       --requests: at most the server's --max-batch; --seed 0 (the\n"
    "                       default) seeds from the clock, and the demo prints the seed\n"
    "                       --disaggregated: prefill here, move the requests to\n"
    "                       DECODE_HOST:PORT over UCX, decode there. A TP server\n"
    "                       (--tp-size > 1) is refused: its activations are rank-major\n"
    "  bench [--concurrency N] [--batch N] [--seconds S] [--unary]\n"
    "                       closed-loop decode forwards: forwards/s, p50/p99 latency,\n"
    "                       timed once every worker holds its slots. Ctrl-C stops a demo\n"
    "                       or bench at its next step and frees its slots\n"
    "Options are --name VALUE or --name=VALUE. --address may come before or after the\n"
    "command; it defaults to $REPLAYSSM_ADDRESS, else 127.0.0.1:50051. So may the TLS\n"
    "options: --tls-ca PEM (the server's CA; TLS on), --tls-cert PEM --tls-key PEM (this\n"
    "client's certificate, for a server that requires one) and --token-file FILE (the\n"
    "bearer token of a server with --auth-tokens; default $REPLAYSSM_TOKEN).\n";

// What a command accepts: its positional arguments and its options.
struct Command {
  const char* name;
  int min_args, max_args;             // positional arguments; max_args -1 = any number
  const char* arg_names;              // for the message when they are too few
  std::vector<std::string> options;   // take a value
  std::vector<std::string> switches;  // take none
};

const std::vector<Command>& Commands() {
  static const std::vector<Command> kCommands = {
      {"info", 0, 0, "", {}, {}},
      {"stats", 0, 0, "", {}, {}},
      {"health", 0, 0, "", {}, {}},
      {"alloc", 0, -1, "", {"request-id"}, {}},
      {"free", 1, 1, "SLOT", {"request-id"}, {}},
      {"transfer", 2, 2, "SLOT PEER", {"request-id"}, {"keep"}},
      {"pull", 2, 2, "SLOT PEER", {"self", "request-id"}, {"keep"}},
      {"demo", 0, 0, "", {"requests", "steps", "seed", "disaggregated"}, {}},
      {"bench", 0, 0, "", {"concurrency", "batch", "seconds"}, {"unary"}},
  };
  return kCommands;
}

bool Contains(const std::vector<std::string>& names, absl::string_view name) {
  for (const std::string& n : names) {
    if (n == name) return true;
  }
  return false;
}

// A parsed command line.
struct Invocation {
  std::string address;
  replayssm::client::ChannelSecurity security;  // --tls-ca, --tls-cert, --tls-key
  std::string token_file;                       // --token-file
  const Command* command = nullptr;
  std::vector<std::string> args;                          // positional
  absl::flat_hash_map<std::string, std::string> options;  // name -> value ("" for switches)
  bool help = false;
};

absl::Status Invalid(const std::string& message) { return absl::InvalidArgumentError(message); }

absl::StatusOr<Invocation> Parse(const std::vector<std::string>& argv, std::string address) {
  Invocation inv;
  inv.address = std::move(address);
  absl::flat_hash_set<std::string> seen;  // options and switches given
  for (size_t i = 0; i < argv.size(); ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      inv.help = true;
      return inv;
    }
    if (!absl::ConsumePrefix(&arg, "--")) {  // the command, then its positional arguments
      if (inv.command != nullptr) {
        inv.args.emplace_back(arg);
        continue;
      }
      for (const Command& c : Commands()) {
        if (arg == c.name) inv.command = &c;
      }
      if (inv.command == nullptr) return Invalid(absl::StrCat("unknown command '", arg, "'"));
      continue;
    }
    const size_t eq = arg.find('=');
    const std::string name(arg.substr(0, eq));
    const bool is_switch = inv.command != nullptr && Contains(inv.command->switches, name);
    const bool global = name == "address" || name == "tls-ca" || name == "tls-cert" ||
                        name == "tls-key" || name == "token-file";
    if (!global && !is_switch &&
        (inv.command == nullptr || !Contains(inv.command->options, name))) {
      return Invalid(inv.command == nullptr
                         ? absl::StrCat("unknown option --", name,
                                        " before the command (only --address, --tls-* and "
                                        "--token-file go there)")
                         : absl::StrCat(inv.command->name, ": unknown option --", name));
    }
    std::string value;
    if (is_switch) {
      if (eq != absl::string_view::npos) {
        return Invalid(absl::StrCat("--", name, " takes no value"));
      }
    } else if (eq != absl::string_view::npos) {
      value = std::string(arg.substr(eq + 1));
    } else if (i + 1 < argv.size() && !absl::StartsWith(argv[i + 1], "--")) {
      value = argv[++i];
    } else {
      return Invalid(absl::StrCat("--", name, ": missing value"));
    }
    // An empty value is a mistake, never "off": `--tls-ca "$CA"` with CA unset would connect
    // in plaintext and send the token in the clear. A second use would silently win.
    if (!is_switch && value.empty()) {
      return Invalid(absl::StrCat("--", name, ": expected a value, got an empty one"));
    }
    if (!seen.insert(name).second) {
      return Invalid(absl::StrCat("--", name, ": given twice"));
    }
    if (name == "address") {
      inv.address = value;
    } else if (name == "tls-ca") {
      inv.security.ca_file = value;
    } else if (name == "tls-cert") {
      inv.security.cert_file = value;
    } else if (name == "tls-key") {
      inv.security.key_file = value;
    } else if (name == "token-file") {
      inv.token_file = value;
    } else {
      inv.options[name] = value;
    }
  }
  if (inv.command == nullptr) return Invalid("missing command");
  const Command& c = *inv.command;
  const int n = static_cast<int>(inv.args.size());
  if (n < c.min_args || (c.max_args >= 0 && n > c.max_args)) {
    return Invalid(n > c.max_args && c.max_args >= 0
                       ? absl::StrCat(c.name, ": unexpected argument '", inv.args[c.max_args], "'")
                       : absl::StrCat(c.name, ": expected ", c.arg_names, ", got ", n,
                                      n == 1 ? " argument" : " arguments"));
  }
  return inv;
}

// The value of option `name` as an integer in [min, max], or `fallback` when it is absent.
template <typename T>
absl::StatusOr<T> IntOption(const Invocation& inv, const std::string& name, T min, T max,
                            T fallback) {
  auto it = inv.options.find(name);
  if (it == inv.options.end()) return fallback;
  T v = 0;
  if (!absl::SimpleAtoi(it->second, &v) || v < min || v > max) {
    return Invalid(absl::StrCat("--", name, ": expected an integer in ", min, "..", max, ", got '",
                                it->second, "'"));
  }
  return v;
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "replayssm-cli: %s\n", s.ToString().c_str());
  return 1;
}

int PrintJson(const google::protobuf::Message& m) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  google::protobuf::util::MessageToJsonString(m, &json, options);
  std::printf("%s", json.c_str());
  return 0;
}

int Info(Client& c) {
  auto info = c.Info();
  if (!info.ok()) return Fail(info.status());
  info->mutable_model()->clear_layer_params();  // large and not for humans
  return PrintJson(*info);
}

// A command line checked and converted, before any server is contacted: a bad value is
// refused without a call.
struct Request {
  std::string command, address;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string token;            // the bearer token ("" = none)
  std::vector<int32_t> tokens;  // alloc
  uint64_t slot = 0;            // free, transfer, pull
  std::string peer, self;       // transfer, pull
  bool keep = false;
  std::string request_id;  // alloc, free, transfer, pull ("" = a new one)
  replayssm::client::DemoOptions demo;
  replayssm::client::DecodeBenchOptions bench;
};

absl::Status SetDemoOptions(const Invocation& inv, replayssm::client::DemoOptions& o) {
  absl::StatusOr<int32_t> requests = IntOption<int32_t>(inv, "requests", 1, 1 << 16, o.requests);
  absl::StatusOr<int32_t> steps = IntOption<int32_t>(inv, "steps", 0, 1 << 20, o.steps);
  absl::StatusOr<uint64_t> seed = IntOption<uint64_t>(inv, "seed", 0, UINT64_MAX, o.seed);
  for (const absl::Status& s : {requests.status(), steps.status(), seed.status()}) {
    if (!s.ok()) return s;
  }
  o.requests = *requests;
  o.steps = *steps;
  o.seed = *seed;
  if (auto it = inv.options.find("disaggregated"); it != inv.options.end()) {
    o.decode_address = it->second;
  }
  return absl::OkStatus();
}

absl::Status SetBenchOptions(const Invocation& inv, replayssm::client::DecodeBenchOptions& o) {
  absl::StatusOr<int32_t> conc = IntOption<int32_t>(inv, "concurrency", 1, 1024, o.concurrency);
  absl::StatusOr<int32_t> batch = IntOption<int32_t>(inv, "batch", 1, 1 << 16, o.batch);
  for (const absl::Status& s : {conc.status(), batch.status()}) {
    if (!s.ok()) return s;
  }
  o.concurrency = *conc;
  o.batch = *batch;
  o.unary = inv.options.contains("unary");
  if (auto it = inv.options.find("seconds"); it != inv.options.end()) {
    double s = 0;
    if (!absl::SimpleAtod(it->second, &s) || !(s > 0 && s < 1e6)) {
      return Invalid(absl::StrCat("--seconds: expected seconds > 0, got '", it->second, "'"));
    }
    o.duration = absl::Seconds(s);
  }
  return absl::OkStatus();
}

absl::StatusOr<Request> Prepare(const Invocation& inv) {
  Request r;
  r.command = inv.command->name;
  r.address = inv.address;
  if (r.address.empty()) return Invalid("--address: expected HOST:PORT, got ''");
  absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> creds =
      replayssm::client::ChannelCredentialsFor(inv.security);
  if (!creds.ok()) {  // "tls_key: ... of tls_cert, ..." -> "--tls-key: ... of --tls-cert, ..."
    std::string m(creds.status().message());
    for (size_t i = 0; i < m.size() && m[i] != ':'; ++i) {
      if (m[i] == '_') m[i] = '-';
    }
    // A field named again inside the message (after a blank: never a path, which is quoted).
    m = absl::StrReplaceAll(
        m, {{" tls_ca", " --tls-ca"}, {" tls_cert", " --tls-cert"}, {" tls_key", " --tls-key"}});
    return Invalid("--" + m);
  }
  r.credentials = *std::move(creds);
  if (!inv.token_file.empty()) {
    absl::StatusOr<std::string> token =
        replayssm::client::ReadTokenFile(inv.token_file, "--token-file");
    if (!token.ok()) return token.status();
    r.token = *std::move(token);
  } else if (const char* env = std::getenv("REPLAYSSM_TOKEN"); env != nullptr) {
    r.token = std::string(absl::StripAsciiWhitespace(env));  // as a token file's
    if (absl::Status s = replayssm::client::CheckToken(r.token, "REPLAYSSM_TOKEN"); !s.ok()) {
      return s;
    }
  }
  const std::vector<std::string>& args = inv.args;
  if (r.command == "alloc") {
    for (const std::string& a : args) {
      int32_t t = 0;
      if (!absl::SimpleAtoi(a, &t)) {
        return Invalid(absl::StrCat("alloc: expected token ids (integers), got '", a, "'"));
      }
      r.tokens.push_back(t);
    }
  }
  if (r.command == "free" || r.command == "transfer" || r.command == "pull") {
    if (!absl::SimpleAtoi(args[0], &r.slot)) {
      return Invalid(absl::StrCat("SLOT: expected a slot handle (a number), got '", args[0], "'"));
    }
  }
  if (args.size() > 1) r.peer = args[1];
  r.keep = inv.options.contains("keep");
  if (auto it = inv.options.find("self"); it != inv.options.end()) r.self = it->second;
  if (auto it = inv.options.find("request-id"); it != inv.options.end()) r.request_id = it->second;
  if (r.command == "demo") {
    if (absl::Status s = SetDemoOptions(inv, r.demo); !s.ok()) return s;
  }
  if (r.command == "bench") {
    if (absl::Status s = SetBenchOptions(inv, r.bench); !s.ok()) return s;
  }
  r.demo.credentials = r.credentials;
  r.bench.credentials = r.credentials;
  r.demo.token = r.token;
  r.bench.token = r.token;
  return r;
}

// SIGINT or SIGTERM during demo or bench: the run stops at its next step and frees the slots
// it took (the server keeps a live slot until it is freed). The handler is reset by the first
// signal, so a second one ends the process at once.
std::atomic<bool> g_interrupted{false};

void StopOnSignals() {
  struct sigaction sa = {};
  sa.sa_handler = [](int) { g_interrupted.store(true); };
  sa.sa_flags = SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

int Demo(Client& c, replayssm::client::DemoOptions options) {
  StopOnSignals();
  options.interrupted = &g_interrupted;
  auto report = replayssm::client::RunDemo(c, options, std::cout);
  if (!report.ok()) return Fail(report.status());
  std::printf("demo: OK: %lld forwards, %lld outputs checked, %.2f s\n",
              static_cast<long long>(report->forwards),
              static_cast<long long>(report->outputs_checked), report->seconds);
  return 0;
}

int Bench(const std::string& address, replayssm::client::DecodeBenchOptions options) {
  StopOnSignals();
  options.interrupted = &g_interrupted;
  auto r = replayssm::client::RunDecodeBench(address, options);
  if (!r.ok()) return Fail(r.status());
  if (r->forwards == 0) {  // the percentiles of nothing would read as 0 us
    return Fail(absl::DeadlineExceededError(absl::StrCat(
        "bench: no forward started within the ", absl::FormatDuration(options.duration),
        " window; nothing to report (raise --seconds)")));
  }
  std::printf("bench: concurrency %d, batch %d, %s: %.0f forwards/s, p50 %.0f us, p99 %.0f us\n",
              options.concurrency, options.batch, options.unary ? "unary" : "stream",
              r->forwards_per_second, r->p50_us, r->p99_us);
  return 0;
}

// Runs a prepared command: 0 on success, 1 when the server's answer is an error.
int Run(const Request& r) {
  if (r.command == "bench") return Bench(r.address, r.bench);
  auto client = Client::Connect(r.address, int64_t{256} << 20, r.credentials);
  Client& c = *client;
  c.set_token(r.token);
  if (r.command == "info") return Info(c);
  if (r.command == "stats") {
    auto stats = c.Stats();
    return stats.ok() ? PrintJson(*stats) : Fail(stats.status());
  }
  if (r.command == "health") {
    auto h = c.Health();
    if (!h.ok()) return Fail(h.status());
    std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*h).c_str());
    return *h == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
  }
  if (r.command == "alloc") {
    auto a =
        r.tokens.empty() ? c.Allocate(r.request_id) : c.AllocateFromPrefix(r.tokens, r.request_id);
    return a.ok() ? PrintJson(*a) : Fail(a.status());
  }
  if (r.command == "free") {
    absl::Status s = c.Free(r.slot, r.request_id);
    return s.ok() ? 0 : Fail(s);
  }
  if (r.command == "transfer") {
    auto t = c.TransferSlot(r.slot, r.peer, r.keep, r.request_id);
    return t.ok() ? PrintJson(*t) : Fail(t.status());
  }
  if (r.command == "pull") {
    auto p = c.PullSlot(r.slot, r.peer, r.keep, r.self, r.request_id);
    return p.ok() ? PrintJson(*p) : Fail(p.status());
  }
  return Demo(c, r.demo);
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("REPLAYSSM_ADDRESS");
  absl::StatusOr<Invocation> inv = Parse(std::vector<std::string>(argv + 1, argv + argc),
                                         env != nullptr ? env : "127.0.0.1:50051");
  if (inv.ok() && inv->help) {
    std::printf("%s", kUsage);
    return 0;
  }
  absl::StatusOr<Request> request = inv.ok() ? Prepare(*inv) : inv.status();
  if (!request.ok()) {
    std::fprintf(stderr, "replayssm-cli: %s\n%s", std::string(request.status().message()).c_str(),
                 kUsage);
    return 2;
  }
  return Run(*request);
}
