// The demo scheduler behind `replayssm-cli demo`: a few requests are prefilled together in
// one layer-by-layer forward (each layer's inputs made from the previous layer's outputs, as
// a model does), decoded together in batched forwards over the same stream, donated, and a
// second turn of the first request hits the prefix cache; every output (and the final state)
// is checked against CpuReference. Used by the CLI, scripts/run.sh and the integration tests.
#ifndef REPLAYSSM_CLIENT_DEMO_H_
#define REPLAYSSM_CLIENT_DEMO_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/statusor.h"
#include "replayssm/client/client.h"

namespace replayssm::client {

struct DemoOptions {
  int32_t requests = 3;     // concurrent requests in turn 1
  int32_t steps = 0;        // decode steps in turn 1; 0 = track_interval + 8 (crosses a snapshot)
  int32_t turn2_steps = 8;  // decode steps after the prefix hit
  uint64_t seed = 0;        // 0 = from the clock (prompts differ between runs)
  // Disaggregated: prefill on the client's server, then move every request to this server
  // (host:port) with SlotTransfer and decode there. "" = one server does everything.
  std::string decode_address;
  std::shared_ptr<grpc::ChannelCredentials> credentials;  // for decode_address; null: insecure
  std::string token;  // the bearer token (--auth-tokens servers); "" = none
  // Set (say by SIGINT) while the demo runs: it stops before its next decode step, frees its
  // slots and fails CANCELLED. Null: never.
  const std::atomic<bool>* interrupted = nullptr;
};

struct DemoReport {
  int64_t forwards = 0;         // decode forwards committed
  int64_t outputs_checked = 0;  // layer outputs compared with the reference
  int64_t prefix_matched = 0;   // tokens the second turn found in the prefix cache
  int64_t prefix_expected = 0;
  double seconds = 0;
};

// Fails (with the first mismatch) when an output differs from the reference.
absl::StatusOr<DemoReport> RunDemo(Client& client, const DemoOptions& options, std::ostream& log);

}  // namespace replayssm::client

#endif  // REPLAYSSM_CLIENT_DEMO_H_
