// A closed-loop decode benchmark against a running server: `concurrency` client threads, each
// with its own channel, stream and `batch` slots, send decode forwards back to back (begin,
// every layer, commit over the stream) and record each forward's latency. Used by
// `replayssm-cli bench` and by replayssm-bench-service (which adds the echo baseline).
#ifndef REPLAYSSM_CLIENT_BENCH_H_
#define REPLAYSSM_CLIENT_BENCH_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"

namespace replayssm::client {

struct DecodeBenchOptions {
  int32_t concurrency = 1;  // client threads (streams)
  int32_t batch = 1;        // rows per forward
  absl::Duration warmup = absl::Milliseconds(300);
  absl::Duration duration = absl::Seconds(2);
  bool unary = false;  // Decode (all layers in one call) instead of the stream
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // null: insecure
  std::string token;  // the bearer token (--auth-tokens servers); "" = none
  // Set (say by SIGINT) while the bench runs: every worker stops after its forward in flight,
  // frees its slots, and the run fails CANCELLED. Null: never.
  const std::atomic<bool>* interrupted = nullptr;
};

struct DecodeBenchResult {
  int64_t forwards = 0;
  double forwards_per_second = 0;
  double p50_us = 0, p99_us = 0, mean_us = 0;
};

absl::StatusOr<DecodeBenchResult> RunDecodeBench(const std::string& address,
                                                 const DecodeBenchOptions& options);

}  // namespace replayssm::client

#endif  // REPLAYSSM_CLIENT_BENCH_H_
