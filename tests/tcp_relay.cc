#include "tcp_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace replayssm::testing {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  at.sin_port = htons(static_cast<uint16_t>(port));
  return at;
}

bool WriteAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    const ssize_t n = send(fd, data, size, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data += n;
    size -= static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

std::unique_ptr<TcpRelay> TcpRelay::Start(const std::string& target, absl::Duration latency) {
  absl::string_view target_view = target;
  int target_port = 0;
  if (!absl::ConsumePrefix(&target_view, "127.0.0.1:") ||
      !absl::SimpleAtoi(target_view, &target_port)) {
    return nullptr;
  }
  const int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return nullptr;
  sockaddr_in at = Loopback(0);
  socklen_t len = sizeof(at);
  if (bind(listener, reinterpret_cast<sockaddr*>(&at), sizeof(at)) != 0 ||
      listen(listener, 16) != 0 ||
      getsockname(listener, reinterpret_cast<sockaddr*>(&at), &len) != 0) {
    close(listener);
    return nullptr;
  }
  std::unique_ptr<TcpRelay> relay(new TcpRelay(listener, target_port, latency));
  relay->address_ = absl::StrCat("127.0.0.1:", ntohs(at.sin_port));
  relay->acceptor_ = std::thread([r = relay.get()] { r->Accept(); });
  return relay;
}

TcpRelay::TcpRelay(int listener, int target_port, absl::Duration latency)
    : listener_(listener), target_port_(target_port), latency_(latency) {}

TcpRelay::~TcpRelay() {
  shutdown(listener_, SHUT_RDWR);  // ends accept()
  acceptor_.join();
  close(listener_);
  absl::MutexLock lock(&mu_);
  for (int fd : sockets_) shutdown(fd, SHUT_RDWR);  // ends every pump's recv()
  for (std::thread& t : pumps_) t.join();
  for (int fd : sockets_) close(fd);
}

void TcpRelay::Accept() {
  for (int client; (client = accept4(listener_, nullptr, nullptr, SOCK_CLOEXEC)) >= 0;) {
    const int server = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_in target = Loopback(target_port_);
    if (server < 0 ||
        connect(server, reinterpret_cast<const sockaddr*>(&target), sizeof(target)) != 0) {
      if (server >= 0) close(server);
      close(client);
      continue;
    }
    ++connections_;
    absl::MutexLock lock(&mu_);
    sockets_.push_back(client);
    sockets_.push_back(server);
    pumps_.emplace_back([this, client, server] { Pump(client, server); });
    pumps_.emplace_back([this, client, server] { Pump(server, client); });
  }
}

void TcpRelay::Pump(int from, int to) const {
  char chunk[64 * 1024];
  for (;;) {
    const ssize_t n = recv(from, chunk, sizeof(chunk), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    absl::SleepFor(latency_);
    if (!WriteAll(to, chunk, static_cast<size_t>(n))) break;
  }
  shutdown(to, SHUT_WR);  // the other side sees the EOF this side saw
}

}  // namespace replayssm::testing
