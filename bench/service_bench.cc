// replayssm-bench-service: decode forwards per second and p50/p99 latency of the real server
// (in-process, loopback gRPC) at concurrency 1, 4, 16 with B in {1, 32}, next to EchoService
// — the same messages over the same transport with no work behind them — in the same run.
// The service's own overhead over the transport is the difference.
//   replayssm-bench-service [--model tiny-gdn] [--device auto] [--seconds 1.5] [--unary]
//                           [--json PATH]
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/echo_service.h"
#include "bench/flags.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/client/bench.h"
#include "replayssm/client/client.h"
#include "service/server.h"

namespace {

using replayssm::client::DecodeBenchOptions;
using replayssm::client::DecodeBenchResult;

struct Args {
  replayssm::service::ServerOptions server;
  double seconds = 1.5;
  bool unary = false;
  std::string json;
};

struct Point {
  int concurrency, batch;
  DecodeBenchResult service, echo;
};

std::string JsonSide(const DecodeBenchResult& r) {
  return absl::StrCat("{\"forwards_per_s\": ", static_cast<int64_t>(r.forwards_per_second + 0.5),
                      ", \"p50_us\": ", static_cast<int64_t>(r.p50_us + 0.5),
                      ", \"p99_us\": ", static_cast<int64_t>(r.p99_us + 0.5), "}");
}

// The format of bench/results/service.json's runs.
bool WriteJson(const std::string& path, const Args& args,
               const replayssm::v1::GetInfoResponse& info, const std::vector<Point>& points) {
  FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  std::fprintf(f,
               "{\"bench\": \"service\", \"model\": \"%s\", \"backend\": \"%s\", \"forwards\": "
               "\"%s\", \"seconds\": %.1f, \"results\": [",
               info.model().name().c_str(), info.backend().c_str(), args.unary ? "unary" : "stream",
               args.seconds);
  for (size_t i = 0; i < points.size(); ++i) {
    const Point& p = points[i];
    std::fprintf(f,
                 "%s\n  {\"concurrency\": %d, \"batch\": %d, \"service\": %s, \"echo\": %s, "
                 "\"overhead_p50_us\": %.0f}",
                 i ? "," : "", p.concurrency, p.batch, JsonSide(p.service).c_str(),
                 JsonSide(p.echo).c_str(), p.service.p50_us - p.echo.p50_us);
  }
  std::fprintf(f, "\n]}\n");
  return std::fclose(f) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  args.server.grpc_address = "127.0.0.1:0";
  args.server.metrics_address = "";
  replayssm::bench::Flags flags("replayssm-bench-service",
                                "[--model M] [--device D] [--seconds S] [--unary] [--json PATH]");
  flags.String("model", &args.server.model);
  flags.String("device", &args.server.device);
  flags.PositiveSeconds("seconds", &args.seconds);
  flags.Switch("unary", &args.unary);
  flags.String("json", &args.json);
  if (const int code = flags.ParseOrExitCode(argc, argv); code >= 0) return code;

  auto server = replayssm::service::Server::Start(args.server);
  if (!server.ok()) {
    std::fprintf(stderr, "%s\n", server.status().ToString().c_str());
    return 1;
  }
  auto info = replayssm::client::Client::Connect((*server)->grpc_address())->Info();
  if (!info.ok()) {
    std::fprintf(stderr, "%s\n", info.status().ToString().c_str());
    return 1;
  }
  replayssm::bench::EchoService echo(*info);
  grpc::ServerBuilder builder;
  int echo_port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &echo_port);
  builder.RegisterService(&echo);
  std::unique_ptr<grpc::Server> echo_server = builder.BuildAndStart();
  const std::string echo_address = absl::StrCat("127.0.0.1:", echo_port);

  const auto& m = info->model();
  std::printf(
      "# replayssm-bench-service\n\nmodel %s (%d layers, H=%d HV=%d K=%d V=%d L=%d), "
      "backend %s, %s forwards, %.1f s per point, loopback gRPC, %u hardware threads\n\n",
      m.name().c_str(), m.num_layers(), m.num_qk_heads(), m.num_v_heads(), m.head_k(), m.head_v(),
      m.ring_len(), info->backend().c_str(), args.unary ? "unary" : "stream", args.seconds,
      std::thread::hardware_concurrency());
  std::printf(
      "| conc | B | service fwd/s | p50 us | p99 us | echo fwd/s | p50 us | p99 us | "
      "overhead p50 us |\n|---|---|---|---|---|---|---|---|---|\n");
  std::vector<Point> points;
  for (int conc : {1, 4, 16}) {
    for (int batch : {1, 32}) {
      DecodeBenchOptions o;
      o.concurrency = conc;
      o.batch = batch;
      o.unary = args.unary;
      o.duration = absl::Seconds(args.seconds);
      auto e = replayssm::client::RunDecodeBench(echo_address, o);
      auto s = replayssm::client::RunDecodeBench((*server)->grpc_address(), o);
      if (!s.ok() || !e.ok()) {
        std::fprintf(stderr, "bench failed: %s %s\n", s.status().ToString().c_str(),
                     e.status().ToString().c_str());
        return 1;
      }
      // With no forward measured the percentiles would read as 0 us: say so instead.
      if (s->forwards == 0 || e->forwards == 0) {
        std::fprintf(stderr,
                     "concurrency %d, B = %d: no forward to the %s started within the %.3g s "
                     "window; nothing to report (raise --seconds)\n",
                     conc, batch, s->forwards == 0 ? "service" : "echo", args.seconds);
        return 1;
      }
      std::printf("| %d | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n", conc, batch,
                  s->forwards_per_second, s->p50_us, s->p99_us, e->forwards_per_second, e->p50_us,
                  e->p99_us, s->p50_us - e->p50_us);
      std::fflush(stdout);
      points.push_back({conc, batch, *s, *e});
    }
  }
  echo_server->Shutdown();
  (*server)->Drain();
  if (!args.json.empty() && !WriteJson(args.json, args, *info, points)) {
    std::fprintf(stderr, "replayssm-bench-service: cannot write %s\n", args.json.c_str());
    return 1;
  }
  return 0;
}
