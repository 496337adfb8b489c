// replayssm-bench-service: decode forwards per second and p50/p99 latency of the real server
// (in-process, loopback gRPC) at concurrency 1, 4, 16 with B in {1, 32}, next to EchoService
// — the same messages over the same transport with no work behind them — in the same run.
// The service's own overhead over the transport is the difference.
//   replayssm-bench-service [--model tiny-gdn] [--device auto] [--seconds 1.5] [--unary]
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "bench/echo_service.h"
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
};

bool ParseArgs(int argc, char** argv, Args* a) {
  a->server.grpc_address = "127.0.0.1:0";
  a->server.metrics_address = "";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--unary")
      a->unary = true;
    else if (arg == "--model" && has_value)
      a->server.model = argv[++i];
    else if (arg == "--device" && has_value)
      a->server.device = argv[++i];
    else if (arg == "--seconds" && has_value) {
      if (!absl::SimpleAtod(argv[++i], &a->seconds)) return false;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!ParseArgs(argc, argv, &args)) {
    std::fprintf(stderr,
                 "usage: replayssm-bench-service [--model M] [--device D] [--seconds S] "
                 "[--unary]\n");
    return 2;
  }
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
      std::printf("| %d | %d | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f | %.0f |\n", conc, batch,
                  s->forwards_per_second, s->p50_us, s->p99_us, e->forwards_per_second, e->p50_us,
                  e->p99_us, s->p50_us - e->p50_us);
      std::fflush(stdout);
    }
  }
  echo_server->Shutdown();
  (*server)->Drain();
  return 0;
}
