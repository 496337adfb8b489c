// replayssm-server: serves replayssm.v1 over gRPC for one model. SIGTERM/SIGINT drain: new
// forwards are refused with UNAVAILABLE (health NOT_SERVING), open ones finish, then exit 0.
#include <signal.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "service/config.h"
#include "service/server.h"

namespace {

// Blocks SIGTERM/SIGINT in this thread and every thread started after it, so that only the
// sigwait below sees them (no async-signal-safety concerns).
sigset_t BlockStopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  return set;
}

bool WriteReadyFile(const std::string& path, const replayssm::service::Server& server) {
  const std::string tmp = path + ".tmp";
  bool written = false;
  {
    std::ofstream out(tmp);
    out << "grpc=" << server.grpc_address() << "\nmetrics=" << server.metrics_address() << "\n";
    written = static_cast<bool>(out);
  }
  if (written && std::rename(tmp.c_str(), path.c_str()) == 0) return true;
  std::remove(tmp.c_str());
  return false;
}

// Whether the ready file can be written where it goes: checked before the server starts (it
// used to be found out once serving, the port already announced).
bool CanWriteReadyFile(const std::string& path) {
  const std::string tmp = path + ".tmp";
  struct stat st {};
  if (stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return false;
  std::ofstream probe(tmp);
  const bool ok = static_cast<bool>(probe);
  probe.close();
  std::remove(tmp.c_str());
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  // Every kernel's module is loaded when CUDA starts, not at the kernel's first launch (CUDA's
  // default, LAZY): a first launch queued behind a doorbell wait (a fresh server's first
  // planned forward) loads its module by waiting for the device, so for that doorbell, and
  // the deadline's release of the doorbell then waited behind the load (the H200 runs of
  // PlannedIdle/PlannedWait, bench/results/gpu_tests.md). Before anything touches CUDA; an
  // operator's own setting is kept.
  setenv("CUDA_MODULE_LOADING", "EAGER", /*overwrite=*/0);
  // 32 hardware work queues (CUDA's default is 8), so that the lanes' streams share fewer of
  // them (the driver puts every stream on one; work on a queue runs in order). Doorbell waits
  // are kernels a host store releases, so no wait holds a queue for good (docs/data-plane.md).
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", /*overwrite=*/0);
  const sigset_t stop_signals = BlockStopSignals();
  absl::StatusOr<replayssm::service::ServerFlags> flags =
      replayssm::service::ParseServerFlags(argc, argv);
  if (!flags.ok()) {
    std::fprintf(stderr, "replayssm-server: %s\n(--help lists the flags)\n",
                 flags.status().ToString().c_str());
    return 2;
  }
  if (flags->help) {
    std::printf("%s", replayssm::service::ServerUsage().c_str());
    return 0;
  }
  // A flag's bound is a usage error like its syntax (exit 2; Start checks again for options
  // made in code).
  if (absl::Status s = replayssm::service::CheckServerBounds(flags->options); !s.ok()) {
    std::fprintf(stderr, "replayssm-server: %s\n", s.ToString().c_str());
    return 2;
  }
  if (!flags->ready_file.empty() && !CanWriteReadyFile(flags->ready_file)) {
    std::fprintf(stderr, "replayssm-server: --ready-file %s: cannot write it (or %s.tmp)\n",
                 flags->ready_file.c_str(), flags->ready_file.c_str());
    return 2;
  }
  auto server = replayssm::service::Server::Start(flags->options);
  if (!server.ok()) {
    std::fprintf(stderr, "replayssm-server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  const std::string metrics =
      (*server)->metrics_address().empty()
          ? "off"
          : absl::StrCat("http://", (*server)->metrics_address(), "/metrics");
  std::printf("replayssm-server: model %s on %s; gRPC %s; metrics %s\n",
              (*server)->model_name().c_str(), (*server)->backend_name().c_str(),
              (*server)->grpc_address().c_str(), metrics.c_str());
  if (!(*server)->kv_events_public_key().empty()) {
    std::printf("replayssm-server: ZMQ cache events: CURVE server key %s\n",
                (*server)->kv_events_public_key().c_str());
  }
  for (const std::string& w : (*server)->warnings()) {
    std::printf("replayssm-server: warning: %s\n", w.c_str());
  }
  if (absl::StartsWith((*server)->backend_name(), "cuda") && !(*server)->mps_active()) {
    std::printf(
        "replayssm-server: warning: MPS is off: an engine sharing this GPU time-slices with "
        "the server (~280 us per doorbell hand-over instead of ~5 us); start "
        "`nvidia-cuda-mps-control -d` before both (docs/data-plane.md)\n");
  }
  std::fflush(stdout);
  if (!flags->ready_file.empty() && !WriteReadyFile(flags->ready_file, **server)) {
    std::fprintf(stderr, "replayssm-server: cannot write %s\n", flags->ready_file.c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&stop_signals, &sig);
  std::printf("replayssm-server: signal %d: draining\n", sig);
  std::fflush(stdout);
  (*server)->Drain();
  std::printf("replayssm-server: stopped\n");
  return 0;
}
