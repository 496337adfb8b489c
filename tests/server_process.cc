#include "server_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace replayssm::testing {

namespace {

bool ReadReady(const std::string& path, std::string* grpc, std::string* metrics) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "grpc=")) *grpc = line.substr(5);
    if (absl::StartsWith(line, "metrics=")) *metrics = line.substr(8);
  }
  return !grpc->empty();
}

}  // namespace

std::string ServerProcess::Device() {
  const char* d = std::getenv("REPLAYSSM_TEST_DEVICE");
  return d != nullptr && *d != '\0' ? d : "cpu";
}

absl::StatusOr<std::unique_ptr<ServerProcess>> ServerProcess::Start(
    std::vector<std::string> flags) {
  auto p = std::unique_ptr<ServerProcess>(new ServerProcess());
  char dir[] = "/tmp/replayssm-test-XXXXXX";
  if (mkdtemp(dir) == nullptr) return absl::InternalError("mkdtemp failed");
  p->dir_ = dir;
  const std::string ready = p->dir_ + "/ready";
  const char* binary = std::getenv("REPLAYSSM_SERVER_BINARY");
  std::vector<std::string> args = {binary != nullptr ? binary : REPLAYSSM_SERVER_BINARY,
                                   "--model=tiny-gdn",
                                   "--device=" + Device(),
                                   "--grpc-address=127.0.0.1:0",
                                   "--metrics-address=127.0.0.1:0",
                                   "--ready-file=" + ready};
  args.insert(args.end(), flags.begin(), flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const std::string log = p->dir_ + "/server.log";
  const pid_t parent = getpid();
  p->pid_ = fork();
  if (p->pid_ < 0) return absl::InternalError("fork failed");
  if (p->pid_ == 0) {
    // The server dies with the test process: a test that aborts (a failed CHECK, a crash)
    // left its servers running for good (seen after a StatusOr fetched on an error).
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(127);
    FILE* f = std::freopen(log.c_str(), "w", stdout);
    if (f != nullptr) dup2(fileno(f), STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    if (ReadReady(ready, &p->grpc_address_, &p->metrics_address_)) return p;
    int status = 0;
    if (waitpid(p->pid_, &status, WNOHANG) == p->pid_) {
      p->pid_ = -1;
      const std::string log = p->Log();  // what it said: the last lines
      const size_t tail = log.size() > 2000 ? log.size() - 2000 : 0;
      return absl::InternalError(absl::StrCat("replayssm-server exited early: status ", status,
                                              "; its log ends:\n", log.substr(tail)));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError("replayssm-server did not become ready");
}

std::string ServerProcess::Log() const {
  std::ifstream in(dir_ + "/server.log");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

namespace {

// "0100007F:1F90" (IPv4) or 32 hex digits of four little-endian words (IPv6) and a port.
std::string ProcAddress(const std::string& hex) {
  const size_t colon = hex.find(':');
  const std::string ip = hex.substr(0, colon);
  const int port = std::stoi(hex.substr(colon + 1), nullptr, 16);
  unsigned char bytes[16] = {};
  const size_t n = ip.size() / 2;
  for (size_t w = 0; w < n / 4; ++w) {  // each 32-bit word is little-endian
    const uint32_t word = static_cast<uint32_t>(std::stoul(ip.substr(w * 8, 8), nullptr, 16));
    std::memcpy(bytes + 4 * w, &word, 4);
  }
  char text[INET6_ADDRSTRLEN] = {};
  inet_ntop(n == 4 ? AF_INET : AF_INET6, bytes, text, sizeof(text));
  return n == 4 ? absl::StrCat(text, ":", port) : absl::StrCat("[", text, "]:", port);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ServerProcess::ListeningAddresses() const {
  std::vector<std::string> inodes;
  const std::string fds = absl::StrCat("/proc/", pid_, "/fd");
  for (int fd = 0; fd < 4096; ++fd) {
    char target[256] = {};
    const std::string link = absl::StrCat(fds, "/", fd);
    const ssize_t len = readlink(link.c_str(), target, sizeof(target) - 1);
    if (len > 0 && absl::StartsWith(target, "socket:[")) {
      inodes.push_back(std::string(target + 8, static_cast<size_t>(len) - 9));
    }
  }
  std::vector<std::string> out;
  for (const char* table : {"tcp", "tcp6"}) {
    std::ifstream in(absl::StrCat("/proc/", pid_, "/net/", table));
    if (!in) return absl::NotFoundError(absl::StrCat("/proc/", pid_, "/net/", table));
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (f.size() < 10 || f[3] != "0A") continue;  // 0A: LISTEN
      if (std::find(inodes.begin(), inodes.end(), f[9]) != inodes.end()) {
        out.push_back(ProcAddress(f[1]));
      }
    }
  }
  return out;
}

absl::StatusOr<int64_t> ServerProcess::ResidentBytes() const {
  std::ifstream in(absl::StrCat("/proc/", pid_, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (!absl::StartsWith(line, "VmRSS:")) continue;
    int64_t kib = 0;
    std::istringstream fields(line.substr(6));
    if (fields >> kib) return kib * 1024;
  }
  return absl::NotFoundError(absl::StrCat("/proc/", pid_, "/status: no VmRSS"));
}

ServerProcess::~ServerProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  if (!dir_.empty()) {
    std::remove((dir_ + "/ready").c_str());
    std::remove((dir_ + "/server.log").c_str());
    rmdir(dir_.c_str());
  }
}

void ServerProcess::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

absl::StatusOr<int> ServerProcess::WaitExit(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (pid_ > 0 && absl::Now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError("server still running");
}

absl::StatusOr<std::string> HttpGet(const std::string& address, const std::string& path) {
  std::vector<std::string> hp = absl::StrSplit(address, ':');
  int port = 0;
  if (hp.size() != 2 || !absl::SimpleAtoi(hp[1], &port)) {
    return absl::InvalidArgumentError(address);
  }
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  inet_pton(AF_INET, hp[0].c_str(), &addr.sin_addr);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("connect ", address));
  }
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", address, "\r\nConnection: close\r\n\r\n");
  if (write(fd, req.data(), req.size()) != static_cast<ssize_t>(req.size())) {
    close(fd);
    return absl::UnavailableError("write");
  }
  std::string response;
  char buf[8192];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) > 0;) response.append(buf, n);
  close(fd);
  const size_t body = response.find("\r\n\r\n");
  if (!absl::StartsWith(response, "HTTP/1.") || body == std::string::npos) {
    return absl::DataLossError("not an HTTP response");
  }
  return response.substr(body + 4);
}

int CreateOwnShm(const std::string& key) {
  int fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0 && errno == EEXIST) {  // no live process holds our pid: its creator is gone
    shm_unlink(key.c_str());
    fd = shm_open(key.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  }
  return fd;
}

double Sample(const std::string& text, const std::string& series) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, series + " ")) {
      double v = -1;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return -1;
}

double Scrape(const ServerProcess& p, const std::string& series) {
  absl::StatusOr<std::string> text = HttpGet(p.metrics_address(), "/metrics");
  return text.ok() ? Sample(*text, series) : -2;
}

}  // namespace replayssm::testing
