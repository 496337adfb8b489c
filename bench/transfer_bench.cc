// replayssm-bench-transfer: slots of a model shape moved from instance A to instance B
// (two processes on this host) over UCX, next to `ucx_perftest -t ucp_put_bw` with the same
// transport selection and message size, in the same run.
//
//   replayssm-bench-transfer [--model qwen3-next-80b-a3b] [--state-dtype f32|bf16]
//                            [--backend cpu|cuda] [--slots N] [--chunk BYTES]
//                            [--import-threads N] [--put-lanes N] [--json PATH]
//
// B is a forked child with its own StateCache, UcxTransport and transfer::Receiver; the
// control messages (reserve, commit, free) go over a socketpair in place of gRPC, so what is
// timed is the whole move of a slot: A folds it through the cache's guard and streams it in
// chunks (CPU: straight from slot memory; CUDA: device -> pinned staging ring, the copy of
// chunk i+1 overlapping the put of chunk i), hashing beside the puts; B reserves a slot
// without zeroing it, has each chunk copied as its doorbell says it landed (CPU: into slot
// memory; CUDA: via pinned staging, host -> device) by --import-threads copiers while its
// import thread hashes them in order, and verifies at the commit.
// Reported: per-slot latency (median), GB/s over the payload, the phases (medians over the
// slots: fold, reserve, stage+hash+put, commit = the receiver's import tail + verify), the
// bare put of a host buffer of the same size (no staging, no hashing, no import), the
// staging overhead (whole move over bare put), and ucx_perftest ucp_put_bw at the chunk size
// (the size of each of our puts) and at the slot size, with the whole move's ratio to both
// against the target (>= 80%).
// --put-lanes N (an experiment, not the transfer's path): the bare put again, its bytes split
// into N contiguous ranges put at once by N threads, each through a UcxTransport (context,
// worker, endpoint) of its own — whether one sender thread's copy into the peer's memory is
// what caps the put (on loopback UCX puts by memcpy into the peer's mapped segment, inline).
// --put-thp (an experiment): the bare put once more from a source on transparent huge pages
// (madvise), as ucx_perftest's UCX-allocated source is where THP is "madvise".
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "replayssm/cache/state_cache.h"
#include "transfer.h"
#include "ucx_transport.h"

namespace replayssm::transfer {
namespace {

#define CHECK_OK(x)                                                                    \
  do {                                                                                 \
    const absl::Status s_ = (x);                                                       \
    if (!s_.ok()) {                                                                    \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, s_.ToString().c_str());   \
      std::_Exit(1);                                                                   \
    }                                                                                  \
  } while (0)

// Length-prefixed byte messages over a socket.
void SendMsg(int fd, const std::string& m) {
  const uint64_t n = m.size();
  if (write(fd, &n, 8) != 8 || write(fd, m.data(), n) != static_cast<ssize_t>(n)) std::_Exit(3);
}
std::string RecvMsg(int fd) {
  uint64_t n = 0;
  if (read(fd, &n, 8) != 8) return "";
  std::string m(n, '\0');
  for (size_t got = 0; got < n;) {
    const ssize_t r = read(fd, m.data() + got, n - got);
    if (r <= 0) std::_Exit(4);
    got += static_cast<size_t>(r);
  }
  return m;
}
template <typename T>
void Put(std::string& s, const T& v) {
  s.append(reinterpret_cast<const char*>(&v), sizeof(v));
}
template <typename T>
T Take(const std::string& s, size_t& off) {
  T v;
  std::memcpy(&v, s.data() + off, sizeof(v));
  off += sizeof(v);
  return v;
}
void PutStr(std::string& s, const std::string& v) {
  Put<uint64_t>(s, v.size());
  s += v;
}
std::string TakeStr(const std::string& s, size_t& off) {
  const uint64_t n = Take<uint64_t>(s, off);
  std::string v = s.substr(off, n);
  off += n;
  return v;
}

// A's view of B: each call is one message and one reply on the socket.
class SocketPeer : public Peer {
 public:
  explicit SocketPeer(int fd) : fd_(fd) {}
  absl::StatusOr<Reservation> Reserve(const std::string& id, const StateFormat& f,
                                      int64_t seq_len, uint32_t version) override {
    std::string m = "R";
    PutStr(m, id);
    Put(m, f);
    Put(m, seq_len);
    Put(m, version);
    SendMsg(fd_, m);
    const std::string r = RecvMsg(fd_);
    size_t off = 1;
    if (r.empty() || r[0] != 'K') return absl::InternalError("reserve failed: " + r);
    Reservation out;
    out.worker_address = TakeStr(r, off);
    out.rkey = TakeStr(r, off);
    out.remote_addr = Take<uint64_t>(r, off);
    out.bytes = Take<int64_t>(r, off);
    out.doorbell_addr = Take<uint64_t>(r, off);
    return out;
  }
  absl::StatusOr<cache::SlotId> Commit(const std::string& id, const std::vector<int32_t>& tokens,
                                       uint64_t checksum) override {
    std::string m = "C";
    PutStr(m, id);
    PutStr(m, std::string(reinterpret_cast<const char*>(tokens.data()), tokens.size() * 4));
    Put(m, checksum);
    SendMsg(fd_, m);
    const std::string r = RecvMsg(fd_);
    size_t off = 1;
    if (r.empty() || r[0] != 'K') return absl::InternalError("commit failed: " + r);
    return Take<uint64_t>(r, off);
  }
  absl::Status Abort(const std::string& id) override {
    std::string m = "A";
    PutStr(m, id);
    SendMsg(fd_, m);
    RecvMsg(fd_);
    return absl::OkStatus();
  }
  void FreeRemote(cache::SlotId slot) {
    std::string m = "F";
    Put(m, slot);
    SendMsg(fd_, m);
    RecvMsg(fd_);
  }

 private:
  int fd_;
};

void ServeReceiver(int fd, cache::StateCache& cache, UcxTransport& ucx, size_t chunk,
                   int32_t import_threads) {
  Receiver rx(&cache, &ucx, {.chunk_bytes = chunk, .import_threads = import_threads});
  for (std::string m = RecvMsg(fd); !m.empty(); m = RecvMsg(fd)) {
    size_t off = 1;
    std::string reply = "K";
    if (m[0] == 'R') {
      const std::string id = TakeStr(m, off);
      const StateFormat f = Take<StateFormat>(m, off);
      const int64_t seq_len = Take<int64_t>(m, off);
      const uint32_t version = Take<uint32_t>(m, off);
      absl::StatusOr<Reservation> r = rx.Reserve(id, f, seq_len, version);
      if (!r.ok()) {
        reply = absl::StrCat("E", r.status().ToString());
      } else {
        PutStr(reply, r->worker_address);
        PutStr(reply, r->rkey);
        Put(reply, r->remote_addr);
        Put(reply, r->bytes);
        Put(reply, r->doorbell_addr);
      }
    } else if (m[0] == 'C') {
      const std::string id = TakeStr(m, off);
      const std::string tok = TakeStr(m, off);
      const uint64_t sum = Take<uint64_t>(m, off);
      std::vector<int32_t> tokens(tok.size() / 4);
      std::memcpy(tokens.data(), tok.data(), tok.size());
      absl::StatusOr<cache::SlotId> s = rx.Commit(id, tokens, sum);
      if (!s.ok()) reply = absl::StrCat("E", s.status().ToString());
      else Put(reply, *s);
    } else if (m[0] == 'A') {
      rx.Abort(TakeStr(m, off)).IgnoreError();
    } else if (m[0] == 'F') {
      cache.Free(Take<uint64_t>(m, off)).IgnoreError();
    }
    SendMsg(fd, reply);
  }
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ucx_perftest ucp_put_bw at `size` bytes between two processes on loopback: MB/s.
double PerftestMBs(size_t size, int iters) {
  const int port = 20000 + static_cast<int>(getpid() % 20000);
  const std::string args = " -t ucp_put_bw -s " + std::to_string(size) + " -n " +
                           std::to_string(iters) + " -w 3 -p " + std::to_string(port);
  const std::string server = "ucx_perftest" + args + " >/dev/null 2>&1 &";
  if (std::system(server.c_str()) != 0) return -1;
  usleep(500000);
  FILE* p = popen(("ucx_perftest 127.0.0.1" + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return -1;
  char line[512];
  double mbs = -1;
  while (std::fgets(line, sizeof(line), p) != nullptr) {
    if (std::strncmp(line, "Final:", 6) == 0) {
      double it, p50, avg, overall, bw_avg, bw_overall;
      if (std::sscanf(line + 6, "%lf %lf %lf %lf %lf %lf", &it, &p50, &avg, &overall, &bw_avg,
                      &bw_overall) == 6) {
        mbs = bw_overall;
      }
    }
  }
  pclose(p);
  return mbs;
}

int Run(int argc, char** argv) {
  std::string model = "qwen3-next-80b-a3b", dtype = "f32", backend_name = "cpu";
  const char* json = nullptr;
  int slots = 8;
  size_t chunk = 4 << 20;
  int32_t import_threads = ReceiverOptions{}.import_threads;
  int put_lanes = 1;
  bool put_thp = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string(); };
    if (a == "--model") model = next();
    else if (a == "--state-dtype") dtype = next();
    else if (a == "--backend") backend_name = next();
    else if (a == "--slots") slots = std::atoi(next().c_str());
    else if (a == "--chunk") chunk = std::strtoull(next().c_str(), nullptr, 10);
    else if (a == "--import-threads") import_threads = std::atoi(next().c_str());
    else if (a == "--put-lanes") put_lanes = std::max(1, std::atoi(next().c_str()));
    else if (a == "--put-thp") put_thp = true;
    else if (a == "--json") json = argv[++i];
    else {
      std::fprintf(stderr, "usage: replayssm-bench-transfer [--model M] [--state-dtype f32|bf16] "
                           "[--backend cpu|cuda] [--slots N] [--chunk BYTES] "
                           "[--import-threads N] [--put-lanes N] [--put-thp] [--json PATH]\n");
      return 2;
    }
  }
  const int32_t sd = dtype == "bf16" ? RSSM_DTYPE_BF16 : RSSM_DTYPE_F32;
  const int32_t backend = backend_name == "cuda" ? RSSM_BACKEND_CUDA : RSSM_BACKEND_CPU;
  absl::StatusOr<cache::ModelSpec> m = cache::ModelPreset(model, sd);
  CHECK_OK(m.status());
  cache::CacheOptions o;
  o.backend = backend;
  o.memory_budget_bytes = 3 * m->SlotBytes();
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {  // instance B
    close(sv[0]);
    auto cache = cache::StateCache::Create(*m, o);
    CHECK_OK(cache.status());
    auto ucx = UcxTransport::Create();
    CHECK_OK(ucx.status());
    ServeReceiver(sv[1], **cache, **ucx, chunk, import_threads);
    std::_Exit(0);
  }
  close(sv[1]);
  auto cache = cache::StateCache::Create(*m, o);
  CHECK_OK(cache.status());
  auto ucx = UcxTransport::Create();
  CHECK_OK(ucx.status());
  SocketPeer peer(sv[0]);
  Sender sender(cache->get(), ucx->get());
  const StateFormat format = StateFormat::Of(*m);
  std::mt19937_64 rng(5);
  std::vector<uint8_t> layer(format.Bytes() / m->num_layers);
  std::vector<double> total, put_only;
  std::vector<double> fold, reserve, put, commit;  // the phases, per slot
  for (int i = 0; i < slots + 1; ++i) {  // the first one warms up
    absl::StatusOr<cache::SlotId> s = (*cache)->Allocate();
    CHECK_OK(s.status());
    for (auto& b : layer) b = static_cast<uint8_t>(rng() & 0x3f);  // finite, never zeros
    std::vector<absl::Span<const uint8_t>> cps(m->num_layers, absl::MakeConstSpan(layer));
    std::vector<int32_t> tokens(100 + i, 7);
    CHECK_OK((*cache)->Import(*s, tokens, cps));
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<SendResult> r = sender.Send(peer, *s, "x" + std::to_string(i), {.chunk_bytes = chunk});
    const double t = Seconds(t0);
    CHECK_OK(r.status());
    peer.FreeRemote(r->remote_slot);
    if (i > 0) {
      total.push_back(t);
      fold.push_back(r->export_seconds);
      reserve.push_back(r->reserve_seconds);
      put.push_back(r->put_seconds);
      commit.push_back(r->commit_seconds);
    }
    if (i > 0 && std::getenv("REPLAYSSM_BENCH_VERBOSE") != nullptr) {
      std::printf("  slot %d (%s): fold %.1f ms, reserve %.1f ms, stage+hash+put %.1f ms, "
                  "commit %.1f ms\n", i, DataPathName(r->path),
                  1e3 * r->export_seconds, 1e3 * r->reserve_seconds, 1e3 * r->put_seconds,
                  1e3 * r->commit_seconds);
    }
  }
  // The put alone, for the breakdown: A's payload into a reservation on B, aborted after.
  {
    std::vector<uint8_t> payload(format.Bytes(), 1);
    for (int i = 0; i < slots; ++i) {
      absl::StatusOr<Reservation> r =
          peer.Reserve("p" + std::to_string(i), format, 0, kChecksumVersion);
      CHECK_OK(r.status());
      const auto t0 = std::chrono::steady_clock::now();
      CHECK_OK((*ucx)->Put(r->worker_address, payload.data(), payload.size(), r->remote_addr,
                           r->rkey, chunk, absl::Seconds(60)));
      put_only.push_back(Seconds(t0));
      CHECK_OK(peer.Abort("p" + std::to_string(i)));
    }
  }
  // The bare put from a source on transparent huge pages (an experiment).
  std::vector<double> put_thp_t;
  if (put_thp) {
    constexpr size_t kHuge = 2 << 20;
    const size_t n = (format.Bytes() + kHuge - 1) / kHuge * kHuge;
    uint8_t* src = static_cast<uint8_t*>(std::aligned_alloc(kHuge, n));
    if (src == nullptr) return 1;
    madvise(src, n, MADV_HUGEPAGE);
    std::memset(src, 1, n);
    for (int i = 0; i < slots; ++i) {
      absl::StatusOr<Reservation> r =
          peer.Reserve("h" + std::to_string(i), format, 0, kChecksumVersion);
      CHECK_OK(r.status());
      const auto t0 = std::chrono::steady_clock::now();
      CHECK_OK((*ucx)->Put(r->worker_address, src, format.Bytes(), r->remote_addr, r->rkey,
                           chunk, absl::Seconds(60)));
      put_thp_t.push_back(Seconds(t0));
      CHECK_OK(peer.Abort("h" + std::to_string(i)));
    }
    std::free(src);
  }
  // The bare put over put_lanes threads and transports at once (an experiment).
  std::vector<double> put_lanes_t;
  if (put_lanes > 1) {
    std::vector<uint8_t> payload(format.Bytes(), 1);
    std::vector<std::unique_ptr<UcxTransport>> lanes;
    for (int k = 0; k < put_lanes; ++k) {
      auto t = UcxTransport::Create();
      CHECK_OK(t.status());
      lanes.push_back(std::move(*t));
    }
    const size_t n = payload.size(), per = (n / put_lanes + 63) & ~size_t{63};
    for (int i = 0; i < slots + 1; ++i) {  // the first one maps the peer's segment per lane
      absl::StatusOr<Reservation> r =
          peer.Reserve("l" + std::to_string(i), format, 0, kChecksumVersion);
      CHECK_OK(r.status());
      std::vector<absl::Status> st(put_lanes);
      std::vector<std::thread> th;
      const auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < put_lanes; ++k) {
        th.emplace_back([&, k] {
          const size_t b = std::min(n, k * per), e = std::min(n, b + per);
          if (e > b) {
            st[k] = lanes[k]->Put(r->worker_address, payload.data() + b, e - b,
                                  r->remote_addr + b, r->rkey, chunk, absl::Seconds(60));
          }
        });
      }
      for (auto& t : th) t.join();
      if (i > 0) put_lanes_t.push_back(Seconds(t0));
      for (const absl::Status& s : st) CHECK_OK(s);
      CHECK_OK(peer.Abort("l" + std::to_string(i)));
    }
  }
  close(sv[0]);
  waitpid(child, nullptr, 0);
  const double bytes = static_cast<double>(format.Bytes());
  const double t_med = Median(total), p_med = Median(put_only);
  const double perf_chunk = PerftestMBs(chunk, 50) / 1e3;  // GB/s
  const double perf_slot = PerftestMBs(static_cast<size_t>(bytes), 10) / 1e3;
  const char* path = DataPathName(SelectDataPath(backend, (*ucx)->cuda_memory()));
  const double whole = bytes / t_med / 1e9;
  const double of_chunk = whole / perf_chunk, of_slot = whole / perf_slot;
  constexpr double kTarget = 0.8;
  auto verdict = [](double r) { return r >= kTarget ? "met" : "NOT met"; };
  std::printf("transfer bench: %s, state %s, backend %s (%s), %.1f MB per slot, %d slots, "
              "chunk %zu, %d import threads\n", m->name.c_str(), dtype.c_str(),
              backend_name.c_str(), path, bytes / 1e6, slots, chunk, import_threads);
  std::printf("  whole move (fold+reserve+stage/hash/put+import+commit): median %.2f ms = %.2f GB/s\n",
              t_med * 1e3, whole);
  std::printf("    phases (medians): fold %.2f ms, reserve %.2f ms, stage+hash+put %.2f ms, "
              "commit (import tail + verify) %.2f ms\n", Median(fold) * 1e3,
              Median(reserve) * 1e3, Median(put) * 1e3, Median(commit) * 1e3);
  std::printf("  bare put of a host buffer:                              median %.2f ms = %.2f GB/s\n",
              p_med * 1e3, bytes / p_med / 1e9);
  if (put_thp) {
    std::printf("  bare put from a THP source (an experiment):            median %.2f ms = %.2f GB/s\n",
                Median(put_thp_t) * 1e3, bytes / Median(put_thp_t) / 1e9);
  }
  if (put_lanes > 1) {
    std::printf("  bare put over %d lanes (threads + transports, an experiment): median %.2f ms = %.2f GB/s\n",
                put_lanes, Median(put_lanes_t) * 1e3, bytes / Median(put_lanes_t) / 1e9);
  }
  std::printf("  staging overhead (whole move over bare put): %+.0f%%\n", 100 * (t_med / p_med - 1));
  std::printf("  ucx_perftest ucp_put_bw (same transport selection, this run): %.2f GB/s at %zu B "
              "(our chunk: the size of each put), %.2f GB/s at %.0f B (one put of a whole slot)\n",
              perf_chunk, chunk, perf_slot, bytes);
  std::printf("  target: whole move >= %.0f%% of ucx_perftest at the same message size\n",
              100 * kTarget);
  std::printf("    vs the chunk-size figure (%zu B): %.0f%% -> %s\n", chunk, 100 * of_chunk,
              verdict(of_chunk));
  std::printf("    vs the slot-size figure  (%.0f B): %.0f%% -> %s\n", bytes, 100 * of_slot,
              verdict(of_slot));
  if (json != nullptr) {
    FILE* f = std::fopen(json, "w");
    if (f == nullptr) return 1;
    std::fprintf(f,
                 "{\"model\": \"%s\", \"state\": \"%s\", \"backend\": \"%s\", \"slot_bytes\": %.0f, "
                 "\"slots\": %d, \"chunk\": %zu, \"import_threads\": %d, \"transfer_ms\": %.3f, "
                 "\"transfer_gbs\": %.3f, \"fold_ms\": %.3f, \"reserve_ms\": %.3f, "
                 "\"stage_hash_put_ms\": %.3f, \"commit_ms\": %.3f, "
                 "\"put_ms\": %.3f, \"put_gbs\": %.3f, \"perftest_chunk_gbs\": %.3f, "
                 "\"perftest_slot_gbs\": %.3f, \"of_perftest_chunk\": %.3f, "
                 "\"of_perftest_slot\": %.3f, \"target\": %.2f, \"path\": \"%s\", "
                 "\"put_lanes\": %d, \"put_lanes_ms\": %.3f}\n",
                 m->name.c_str(), dtype.c_str(), backend_name.c_str(), bytes, slots, chunk,
                 import_threads, t_med * 1e3, whole, Median(fold) * 1e3, Median(reserve) * 1e3,
                 Median(put) * 1e3, Median(commit) * 1e3, p_med * 1e3, bytes / p_med / 1e9,
                 perf_chunk, perf_slot, of_chunk, of_slot, kTarget, path, put_lanes,
                 put_lanes > 1 ? Median(put_lanes_t) * 1e3 : p_med * 1e3);
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace replayssm::transfer

int main(int argc, char** argv) { return replayssm::transfer::Run(argc, argv); }
