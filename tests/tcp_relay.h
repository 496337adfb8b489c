// Test support: a loopback TCP relay that stands for a long network link. It accepts on a
// free loopback port, dials its target for each connection, and passes every chunk on in
// both directions `latency` after it arrived, so a round trip through it takes at least
// 2 × latency. Nothing is parsed: TLS, HTTP/2 and the handshakes go through unchanged.
#ifndef REPLAYSSM_TESTS_TCP_RELAY_H_
#define REPLAYSSM_TESTS_TCP_RELAY_H_

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace replayssm::testing {

class TcpRelay {
 public:
  // `target` is a loopback "127.0.0.1:port"; nullptr when it is not one or no port opened.
  static std::unique_ptr<TcpRelay> Start(const std::string& target, absl::Duration latency);
  ~TcpRelay();  // closes every connection and joins its threads

  const std::string& address() const { return address_; }
  int connections() const { return connections_.load(); }

 private:
  TcpRelay(int listener, int target_port, absl::Duration latency);
  void Accept();
  // Copies `from` to `to`, each chunk `latency_` after it was read; ends on EOF or an error.
  void Pump(int from, int to) const;

  const int listener_;
  const int target_port_;
  const absl::Duration latency_;
  std::string address_;
  std::atomic<int> connections_{0};
  std::thread acceptor_;
  absl::Mutex mu_;
  std::vector<int> sockets_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> pumps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace replayssm::testing

#endif  // REPLAYSSM_TESTS_TCP_RELAY_H_
