// Test support: the real replayssm-server binary started as a child process on free loopback
// ports (port 0; the server writes the bound addresses to a ready file), a plain HTTP GET for
// scraping /metrics, and a reader for one sample of the Prometheus text format.
#ifndef REPLAYSSM_TESTS_SERVER_PROCESS_H_
#define REPLAYSSM_TESTS_SERVER_PROCESS_H_

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace replayssm::testing {

class ServerProcess {
 public:
  // Starts replayssm-server --model tiny-gdn --device cpu plus `flags`, waits until serving.
  static absl::StatusOr<std::unique_ptr<ServerProcess>> Start(std::vector<std::string> flags);
  // The servers' --device: $REPLAYSSM_TEST_DEVICE, else cpu (CI has no GPU). The binary is
  // $REPLAYSSM_SERVER_BINARY when set (a bundle run elsewhere), else the one this build made.
  static std::string Device();
  ~ServerProcess();  // SIGKILL if still running

  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& metrics_address() const { return metrics_address_; }

  void Signal(int sig);
  // The exit status (WEXITSTATUS), or an error when it did not exit within `timeout`.
  absl::StatusOr<int> WaitExit(absl::Duration timeout);
  // What it printed so far (stdout and stderr).
  std::string Log() const;
  // The addresses its TCP sockets listen on ("127.0.0.1:50051", "[::1]:9400"), from
  // /proc/PID/fd and /proc/PID/net/tcp{,6}.
  absl::StatusOr<std::vector<std::string>> ListeningAddresses() const;
  // Its resident set size (VmRSS of /proc/PID/status) in bytes.
  absl::StatusOr<int64_t> ResidentBytes() const;

 private:
  pid_t pid_ = -1;
  std::string dir_;
  std::string grpc_address_;
  std::string metrics_address_;
};

// GET http://address/path over a plain socket; the body.
absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path);

// shm_open(key, O_CREAT | O_EXCL | O_RDWR, 0600) for a test's shm object whose key holds this
// process's pid: an object of that name left by a dead process that had the same pid (a run
// killed before its unlink) is unlinked first, so a recycled pid cannot collide. The fd, or -1.
int CreateOwnShm(const std::string& key);

// The value of the sample `series` (e.g. `replayssm_rpcs_total{code="OK",method="Decode"}`)
// in Prometheus text; -1 when absent.
double Sample(const std::string& text, const std::string& series);

// The value of the sample `series` on p's /metrics now; -1 when absent, -2 when /metrics could
// not be read.
double Scrape(const ServerProcess& p, const std::string& series);

}  // namespace replayssm::testing

#endif  // REPLAYSSM_TESTS_SERVER_PROCESS_H_
