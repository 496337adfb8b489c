// replayssm-cli: talk to a replayssm-server.
//   replayssm-cli [--address HOST:PORT] info | stats | health | alloc [TOKEN...] |
//                 free SLOT | transfer SLOT PEER [--keep] |
//                 pull SLOT PEER [--keep] [--self HOST:PORT] | demo [--requests N] [--steps N] [--seed N]
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "google/protobuf/util/json_util.h"
#include "replayssm/client/bench.h"
#include "replayssm/client/client.h"
#include "replayssm/client/demo.h"

namespace {

using replayssm::client::Client;

constexpr char kUsage[] =
    "usage: replayssm-cli [--address HOST:PORT] COMMAND\n"
    "  info                 model, shapes, dtypes, capacity, backend\n"
    "  stats                cache counters (slots, folds, snapshots)\n"
    "  health               grpc.health.v1 status of the server\n"
    "  alloc [TOKEN...]     allocate a slot (from the longest matching prefix when tokens)\n"
    "  free SLOT            free a slot\n"
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
    "                       --disaggregated: prefill here, move the requests to\n"
    "                       DECODE_HOST:PORT over UCX, decode there\n"
    "  bench [--concurrency N] [--batch N] [--seconds S] [--unary]\n"
    "                       closed-loop decode forwards: forwards/s, p50/p99 latency\n"
    "The address defaults to 127.0.0.1:50051 (or $REPLAYSSM_ADDRESS).\n";

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

int Demo(Client& c, const std::vector<std::string>& args) {
  replayssm::client::DemoOptions options;
  for (size_t i = 0; i + 1 < args.size(); i += 2) {
    if (args[i] == "--disaggregated") {  // --disaggregated DECODE_SERVER
      options.decode_address = args[i + 1];
      continue;
    }
    int64_t v = 0;
    if (!absl::SimpleAtoi(args[i + 1], &v)) return Fail(absl::InvalidArgumentError(args[i + 1]));
    if (args[i] == "--requests")
      options.requests = static_cast<int32_t>(v);
    else if (args[i] == "--steps")
      options.steps = static_cast<int32_t>(v);
    else if (args[i] == "--seed")
      options.seed = static_cast<uint64_t>(v);
    else
      return Fail(absl::InvalidArgumentError("demo: unknown option " + args[i]));
  }
  auto report = replayssm::client::RunDemo(c, options, std::cout);
  if (!report.ok()) return Fail(report.status());
  std::printf("demo: OK: %lld forwards, %lld outputs checked, %.2f s\n",
              static_cast<long long>(report->forwards),
              static_cast<long long>(report->outputs_checked), report->seconds);
  return 0;
}

int Bench(const std::string& address, const std::vector<std::string>& args) {
  replayssm::client::DecodeBenchOptions options;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--unary") {
      options.unary = true;
      continue;
    }
    double v = 0;
    if (i + 1 >= args.size() || !absl::SimpleAtod(args[i + 1], &v)) {
      return Fail(absl::InvalidArgumentError("bench: " + args[i] + " needs a number"));
    }
    if (args[i] == "--concurrency")
      options.concurrency = static_cast<int32_t>(v);
    else if (args[i] == "--batch")
      options.batch = static_cast<int32_t>(v);
    else if (args[i] == "--seconds")
      options.duration = absl::Seconds(v);
    else
      return Fail(absl::InvalidArgumentError("bench: unknown option " + args[i]));
    ++i;
  }
  auto r = replayssm::client::RunDecodeBench(address, options);
  if (!r.ok()) return Fail(r.status());
  std::printf("bench: concurrency %d, batch %d, %s: %.0f forwards/s, p50 %.0f us, p99 %.0f us\n",
              options.concurrency, options.batch, options.unary ? "unary" : "stream",
              r->forwards_per_second, r->p50_us, r->p99_us);
  return 0;
}

int Run(Client& c, const std::string& cmd, const std::vector<std::string>& args) {
  if (cmd == "info") return Info(c);
  if (cmd == "stats") {
    auto stats = c.Stats();
    return stats.ok() ? PrintJson(*stats) : Fail(stats.status());
  }
  if (cmd == "health") {
    auto h = c.Health();
    if (!h.ok()) return Fail(h.status());
    std::printf("%s\n", grpc::health::v1::HealthCheckResponse::ServingStatus_Name(*h).c_str());
    return *h == grpc::health::v1::HealthCheckResponse::SERVING ? 0 : 1;
  }
  if (cmd == "alloc") {
    std::vector<int32_t> tokens;
    for (const std::string& a : args) {
      int32_t t = 0;
      if (!absl::SimpleAtoi(a, &t)) return Fail(absl::InvalidArgumentError("token " + a));
      tokens.push_back(t);
    }
    auto r = tokens.empty() ? c.Allocate() : c.AllocateFromPrefix(tokens);
    return r.ok() ? PrintJson(*r) : Fail(r.status());
  }
  if (cmd == "free" && args.size() == 1) {
    uint64_t slot = 0;
    if (!absl::SimpleAtoi(args[0], &slot)) return Fail(absl::InvalidArgumentError(args[0]));
    absl::Status s = c.Free(slot);
    return s.ok() ? 0 : Fail(s);
  }
  if (cmd == "transfer" && (args.size() == 2 || (args.size() == 3 && args[2] == "--keep"))) {
    uint64_t slot = 0;
    if (!absl::SimpleAtoi(args[0], &slot)) return Fail(absl::InvalidArgumentError(args[0]));
    auto r = c.TransferSlot(slot, args[1], args.size() == 3);
    return r.ok() ? PrintJson(*r) : Fail(r.status());
  }
  if (cmd == "pull" && args.size() >= 2) {
    uint64_t slot = 0;
    if (!absl::SimpleAtoi(args[0], &slot)) {
      return Fail(absl::InvalidArgumentError("SLOT: expected a slot handle (a number), got " + args[0]));
    }
    bool keep = false;
    std::string self;
    for (size_t i = 2; i < args.size(); ++i) {
      if (args[i] == "--keep") {
        keep = true;
      } else if (args[i] == "--self" && i + 1 < args.size()) {
        self = args[++i];
      } else {
        return Fail(absl::InvalidArgumentError("pull: expected --keep or --self HOST:PORT, got " + args[i]));
      }
    }
    auto r = c.PullSlot(slot, args[1], keep, self);
    return r.ok() ? PrintJson(*r) : Fail(r.status());
  }
  if (cmd == "demo") return Demo(c, args);
  std::fprintf(stderr, "%s", kUsage);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const char* env = std::getenv("REPLAYSSM_ADDRESS");
  std::string address = env != nullptr ? env : "127.0.0.1:50051";
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() >= 2 && args[0] == "--address") {
    address = args[1];
    args.erase(args.begin(), args.begin() + 2);
  } else if (!args.empty() && args[0].rfind("--address=", 0) == 0) {
    address = args[0].substr(10);
    args.erase(args.begin());
  }
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::fprintf(stderr, "%s", kUsage);
    return args.empty() ? 2 : 0;
  }
  auto client = Client::Connect(address);
  const std::string cmd = args[0];
  args.erase(args.begin());
  if (cmd == "bench") return Bench(address, args);
  return Run(*client, cmd, args);
}
