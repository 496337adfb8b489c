// replayssm-bench-transfer: slots of a model shape moved from instance A to instance B
// (two processes on this host) over UCX, next to `ucx_perftest -t ucp_put_bw` with the same
// transport selection and message size, in the same run.
//
//   replayssm-bench-transfer [--model qwen3-next-80b-a3b] [--state-dtype f32|bf16]
//                            [--backend cpu|cuda] [--slots N] [--chunk BYTES]
//                            [--lanes N] [--import-threads N] [--put-thp]
//                            [--sender-tp N] [--receiver-tp N] [--json PATH]
//
// --sender-tp / --receiver-tp (default 1): A's and B's caches as tensor-parallel groups of that
// many ranks (on CUDA spread over the visible GPUs round-robin): the move then carries the
// unsharded payload, assembled from A's ranks and split over B's (resharding), to be set beside
// the same bench at 1 -> 1.
//
// B is a forked child with its own StateCache, UcxTransport and transfer::Receiver; the
// control messages (reserve, commit, free) go over a socketpair in place of gRPC, so what is
// timed is the whole move of a slot: A folds it through the cache's guard and streams it in
// chunks (CPU: straight from slot memory; CUDA: device -> pinned staging ring, the copy of
// chunk i+1 overlapping the put of chunk i), while the cache hashes the slot where it lies
// (CPU: on the backend's threads; CUDA: on the device); B reserves a slot without zeroing it,
// has each chunk written as its doorbell says it landed (CPU: into slot memory; CUDA: via
// pinned staging, host -> device) by --import-threads writers, each hashing what it wrote, and
// verifies at the commit.
// Reported: per-slot latency (median), GB/s over the payload, the phases (medians over the
// slots: fold, reserve, stage+hash+put, commit = the receiver's import tail + verify), the
// bare put of a host buffer of the same size (no staging, no hashing, no import), the
// staging overhead (whole move over bare put), and ucx_perftest ucp_put_bw at the size of
// each of our puts (min(--chunk, one layer's checkpoint): a piece never spans a layer — the
// same message size, the target's reference), at --chunk when that differs, and at the slot
// size, with the whole move's ratio to each against the target (>= 80%); a reference that
// cannot be measured (ucx_perftest missing or its output unreadable) is reported as such,
// with no ratio and no verdict.
// --lanes N (default 4, the service's --transfer-lanes): the sender's put lanes for the whole
// move (the real path, docs/transfer.md), and the bare put is also timed over the same N lanes
// at once (contiguous ranges, one thread each) next to the one-thread bare put.
// Every phase runs once per round, interleaved (whole move, bare put, bare put over the lanes,
// THP put, hash), so host drift weighs on all alike, and ucx_perftest runs first, before any
// thread, UCX context or buffer of ours exists; min..max are printed beside the medians.
// The checksum is timed too: the cache's hash of a slot where it lies (the sender's, beside
// the puts) and the payload on one host thread (a receiver's writer hashes its pieces so): if
// the first is near the whole move's time, the hash caps it.
// --put-thp (an experiment): the bare put once more from a source on transparent huge pages
// (madvise), as ucx_perftest's UCX-allocated source is where THP is "madvise".
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/flags.h"
#include "bench/stats.h"
#include "replayssm/cache/slot_io.h"
#include "replayssm/cache/state_cache.h"
#include "replayssm/cache/tp.h"
#include "replayssm/transfer/receiver.h"
#include "replayssm/transfer/sender.h"
#include "replayssm/transfer/ucx_transport.h"

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
                                      int64_t seq_len, uint32_t version, absl::Duration budget,
                                      absl::Time) override {
    std::string m = "R";
    PutStr(m, id);
    Put(m, f);
    Put(m, seq_len);
    Put(m, version);
    Put(m, absl::ToInt64Milliseconds(budget));
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
  absl::StatusOr<uint64_t> Commit(const std::string& id, const std::vector<int32_t>& tokens,
                                  uint64_t checksum, absl::Time) override {
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
  absl::StatusOr<Decision> Abort(const std::string& id, absl::Time) override {
    std::string m = "A";
    PutStr(m, id);
    SendMsg(fd_, m);
    const std::string r = RecvMsg(fd_);
    size_t off = 1;
    Decision d;
    d.committed = Take<bool>(r, off);
    d.slot = Take<uint64_t>(r, off);
    d.seq_len = Take<int64_t>(r, off);
    return d;
  }
  void Acknowledge(const std::string& id) override {
    std::string m = "N";
    PutStr(m, id);
    SendMsg(fd_, m);
    RecvMsg(fd_);
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
      const int64_t budget_ms = Take<int64_t>(m, off);
      absl::StatusOr<Reservation> r =
          rx.Reserve(id, f, seq_len, version, absl::Milliseconds(budget_ms));
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
      absl::StatusOr<Decision> s = rx.Commit(id, tokens, sum);
      if (!s.ok()) reply = absl::StrCat("E", s.status().ToString());
      else Put(reply, s->slot);
    } else if (m[0] == 'A') {
      const Decision d = *rx.Abort(TakeStr(m, off));  // no peer named: always decided
      Put(reply, d.committed);
      Put(reply, d.slot);
      Put(reply, d.seq_len);
    } else if (m[0] == 'N') {
      rx.Acknowledge(TakeStr(m, off), "");
    } else if (m[0] == 'F') {
      cache.Free(Take<uint64_t>(m, off)).IgnoreError();
    }
    SendMsg(fd, reply);
  }
}

using bench::Median;

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ucx_perftest ucp_put_bw at `size` bytes between two processes on loopback, in GB/s, or why
// it could not be measured (not on the PATH, or no "Final:" line in its output).
absl::StatusOr<double> PerftestGBs(size_t size, int iters) {
  const std::string port = std::to_string(20000 + static_cast<int>(getpid() % 20000));
  const std::string args = absl::StrCat(" -t ucp_put_bw -s ", size, " -n ", iters, " -w 3 -p ",
                                        port);
  std::vector<std::string> server_args = absl::StrSplit(absl::StrCat("ucx_perftest", args), ' ');
  std::vector<char*> server_argv;
  for (std::string& a : server_args) server_argv.push_back(a.data());
  server_argv.push_back(nullptr);
  posix_spawn_file_actions_t quiet;
  posix_spawn_file_actions_init(&quiet);
  posix_spawn_file_actions_addopen(&quiet, 1, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_adddup2(&quiet, 1, 2);
  pid_t server = -1;
  const int spawned =
      posix_spawnp(&server, "ucx_perftest", &quiet, nullptr, server_argv.data(), environ);
  posix_spawn_file_actions_destroy(&quiet);
  if (spawned != 0) {
    return absl::NotFoundError(absl::StrCat("cannot run ucx_perftest: ", std::strerror(spawned),
                                            spawned == ENOENT ? " (not on the PATH)" : ""));
  }
  usleep(500000);
  FILE* p = popen(("ucx_perftest 127.0.0.1" + args + " 2>&1").c_str(), "r");
  char line[512];
  std::string last;
  double gbs = -1;
  while (p != nullptr && std::fgets(line, sizeof(line), p) != nullptr) {
    double it, p50, avg, overall, bw_avg, bw_overall;
    if (std::sscanf(line, "Final: %lf %lf %lf %lf %lf %lf", &it, &p50, &avg, &overall, &bw_avg,
                    &bw_overall) == 6) {
      gbs = bw_overall / 1e3;  // MB/s
    }
    if (line[0] != '\n') last = std::string(absl::StripTrailingAsciiWhitespace(line));
  }
  const int client_status = p != nullptr ? pclose(p) : -1;
  if (waitpid(server, nullptr, WNOHANG) == 0) {  // the client never reached it
    kill(server, SIGTERM);
    waitpid(server, nullptr, 0);
  }
  if (gbs > 0) return gbs;
  return absl::UnavailableError(absl::StrCat(
      "ucx_perftest at ", size, " B printed no \"Final:\" bandwidth (exit status ",
      WIFEXITED(client_status) ? WEXITSTATUS(client_status) : -1, "; last line: '", last, "')"));
}

constexpr double kTarget = 0.8;  // the whole move against ucx_perftest at the same size

// One ucx_perftest figure the whole move is held against: its GB/s, or why there is none.
struct Reference {
  const char* name;  // put (each of our puts: min(chunk, a layer)), chunk, slot
  size_t bytes;
  absl::StatusOr<double> gbs;
};

// Each figure with the whole move's ratio to it and the verdict; a reference that could not be
// measured is reported as such, with no ratio and no verdict.
void PrintReferences(const std::vector<Reference>& refs, double whole_gbs) {
  std::printf("  ucx_perftest ucp_put_bw (same transport selection, this run, before ours); "
              "target: whole move >= %.0f%% of it at the same message size\n", 100 * kTarget);
  for (const Reference& r : refs) {
    std::printf("    %-5s size (%zu B): ", r.name, r.bytes);
    if (!r.gbs.ok()) {
      std::printf("reference not measured: %s; no verdict\n",
                  std::string(r.gbs.status().message()).c_str());
      continue;
    }
    const double of = whole_gbs / *r.gbs;
    std::printf("%.2f GB/s; whole move %.0f%% of it -> %s%s\n", *r.gbs, 100 * of,
                of >= kTarget ? "met" : "NOT met",
                std::string_view(r.name) == "put" ? " (the same message size)" : "");
  }
}

// "perftest_<name>_gbs" and "of_perftest_<name>" per reference (null when not measured), and
// "perftest_error": why the first missing one is missing (null when none is).
std::string JsonReferences(const std::vector<Reference>& refs, double whole_gbs) {
  std::string out, error = "null";
  for (const Reference& r : refs) {
    const bool ok = r.gbs.ok();
    absl::StrAppend(&out, out.empty() ? "" : ", ", "\"perftest_", r.name, "_gbs\": ",
                    ok ? absl::StrFormat("%.3f", *r.gbs) : "null", ", \"of_perftest_", r.name,
                    "\": ", ok ? absl::StrFormat("%.3f", whole_gbs / *r.gbs) : "null");
    if (!ok && error == "null") {
      error = absl::StrCat("\"", absl::CEscape(r.gbs.status().message()), "\"");
    }
  }
  return absl::StrCat(out, ", \"perftest_error\": ", error);
}

struct Stat {
  std::vector<double> v;
  void Add(double x) { v.push_back(x); }
  double Median() const { return bench::Median(v); }
  double Min() const { return v.empty() ? 0 : *std::min_element(v.begin(), v.end()); }
  double Max() const { return v.empty() ? 0 : *std::max_element(v.begin(), v.end()); }
};

int Run(int argc, char** argv) {
  std::string model = "qwen3-next-80b-a3b", dtype = "f32", backend_name = "cpu", json;
  int32_t slots = 8;
  int64_t chunk_flag = 4 << 20;
  int32_t import_threads = ReceiverOptions{}.import_threads;
  int32_t lanes = 4;  // the service's --transfer-lanes default
  int64_t sender_tp = 1, receiver_tp = 1;
  bool put_thp = false, verbose = false;
  bench::Flags flags("replayssm-bench-transfer",
                     "[--model M] [--state-dtype f32|bf16] [--backend cpu|cuda] [--slots N] "
                     "[--chunk BYTES] [--lanes N] [--import-threads N] [--put-thp] [--verbose] "
                     "[--sender-tp N] [--receiver-tp N] [--json PATH]");
  flags.Choice("model", cache::ModelPresetNames(), &model);
  flags.Choice("state-dtype", {"f32", "bf16"}, &dtype);
  flags.Choice("backend", {"cpu", "cuda"}, &backend_name);
  flags.Int("slots", 1, 1 << 16, &slots);
  flags.Int("chunk", 1, int64_t{1} << 30, &chunk_flag);
  flags.Int("lanes", 1, 16, &lanes);  // the service's --transfer-lanes range
  flags.Int("import-threads", 1, 32, &import_threads);
  flags.Switch("put-thp", &put_thp);
  flags.Switch("verbose", &verbose);  // every round's phases
  flags.Int("sender-tp", int64_t{1}, int64_t{cache::kMaxTpSize}, &sender_tp);
  flags.Int("receiver-tp", int64_t{1}, int64_t{cache::kMaxTpSize}, &receiver_tp);
  flags.String("json", &json);
  if (const int code = flags.ParseOrExitCode(argc, argv); code >= 0) return code;
  const size_t chunk = static_cast<size_t>(chunk_flag);
  const int32_t sd = dtype == "bf16" ? RSSM_DTYPE_BF16 : RSSM_DTYPE_F32;
  const int32_t backend = backend_name == "cuda" ? RSSM_BACKEND_CUDA : RSSM_BACKEND_CPU;
  absl::StatusOr<cache::ModelSpec> m = cache::ModelPreset(model, sd);
  CHECK_OK(m.status());
  const StateFormat format = StateFormat::Of(*m);
  const size_t payload_bytes = cache::SlotPayloadBytes(*m);
  const double bytes = static_cast<double>(payload_bytes);
  // Each put is one piece: at most --chunk bytes and never across a layer (SplitRange in
  // cache/slot_io.cc), so the message size of our puts is min(chunk, one layer's checkpoint
  // bytes).
  const size_t put_bytes =
      std::min(chunk, payload_bytes / static_cast<size_t>(std::max(format.num_layers, 1)));
  // ucx_perftest first, before any thread, context or buffer of ours exists. Once it is found
  // missing, the other sizes are not tried.
  std::vector<Reference> refs = {{"put", put_bytes, PerftestGBs(put_bytes, 50)}};
  auto measure = [&refs](size_t size, int iters) {
    return absl::IsNotFound(refs[0].gbs.status()) ? refs[0].gbs : PerftestGBs(size, iters);
  };
  refs.push_back({"chunk", chunk, put_bytes == chunk ? refs[0].gbs : measure(chunk, 50)});
  const size_t slot_bytes = payload_bytes;
  refs.push_back({"slot", slot_bytes, measure(slot_bytes, 10)});
  cache::CacheOptions o;
  o.backend = backend;
  o.memory_budget_bytes = 3 * m->SlotBytes();
  auto group = [&](int64_t tp) {  // a TP group's options, its ranks over the GPUs round-robin
    cache::CacheOptions g = o;
    g.tp_size = static_cast<int32_t>(tp);
    if (tp > 1 && backend == RSSM_BACKEND_CUDA) {
      for (int32_t r = 0; r < tp; ++r) g.devices.push_back(r % rssm_device_count(backend));
    }
    return g;
  };
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 1;
  const pid_t child = fork();
  if (child == 0) {  // instance B
    close(sv[0]);
    auto cache = cache::StateCache::Create(*m, group(receiver_tp));
    CHECK_OK(cache.status());
    auto ucx = UcxTransport::Create();
    CHECK_OK(ucx.status());
    ServeReceiver(sv[1], **cache, **ucx, chunk, import_threads);
    std::_Exit(0);
  }
  close(sv[1]);
  auto cache = cache::StateCache::Create(*m, group(sender_tp));
  CHECK_OK(cache.status());
  auto ucx = UcxTransport::Create();
  CHECK_OK(ucx.status());
  // The sender's lanes as the service makes them (--transfer-lanes): its transport, then
  // lanes - 1 of their own without a progress thread.
  std::vector<std::unique_ptr<UcxTransport>> extra;
  std::vector<UcxTransport*> lane_ptrs = {ucx->get()};
  for (int k = 1; k < lanes; ++k) {
    auto t = UcxTransport::Create(/*progress_thread=*/false);
    CHECK_OK(t.status());
    lane_ptrs.push_back(t->get());
    extra.push_back(std::move(*t));
  }
  SocketPeer peer(sv[0]);
  Sender sender(cache->get(), std::vector<PutLane*>(lane_ptrs.begin(), lane_ptrs.end()));
  std::mt19937_64 rng(5);
  std::vector<uint8_t> layer(payload_bytes / m->num_layers);
  std::vector<uint8_t> payload(payload_bytes, 1);  // the bare puts' host source
  uint8_t* thp = nullptr;
  if (put_thp) {
    constexpr size_t kHuge = 2 << 20;
    const size_t n = (payload_bytes + kHuge - 1) / kHuge * kHuge;
    thp = static_cast<uint8_t*>(std::aligned_alloc(kHuge, n));
    if (thp == nullptr) return 1;
    madvise(thp, n, MADV_HUGEPAGE);
    std::memset(thp, 1, n);
  }
  // One bare put (no staging, hashing, doorbell or import) of `src` into a reservation on B,
  // over the first `n` lanes at once (contiguous ranges, one thread each); aborted after.
  auto bare_put = [&](const std::string& id, const uint8_t* src, int n) {
    absl::StatusOr<Reservation> r = peer.Reserve(id, format, 0, cache::kChecksumVersion,
                                                 absl::Seconds(60), absl::InfiniteFuture());
    CHECK_OK(r.status());
    const size_t total = payload_bytes, per = (total / n + 63) & ~size_t{63};
    std::vector<absl::Status> st(n);
    const auto t0 = std::chrono::steady_clock::now();
    auto one = [&](int k) {
      const size_t b = std::min(total, k * per), e = k + 1 == n ? total : std::min(total, b + per);
      if (e > b) {
        st[k] = lane_ptrs[k]->Put(r->worker_address, src + b, e - b, r->remote_addr + b, r->rkey,
                                  chunk, absl::Seconds(60));
      }
    };
    if (n == 1) {
      one(0);
    } else {
      std::vector<std::thread> th;
      for (int k = 0; k < n; ++k) th.emplace_back(one, k);
      for (auto& t : th) t.join();
    }
    const double t = Seconds(t0);
    for (const absl::Status& s : st) CHECK_OK(s);
    CHECK_OK(peer.Abort(id, absl::InfiniteFuture()).status());
    return t;
  };
  // Rounds: every phase once per round, interleaved, so that whatever drifts on the host
  // (other work, frequency, placement) weighs on all of them alike; round 0 warms up.
  Stat total, fold, reserve, put, commit, put1, putn, putthp, hash, hash_slot;
  // The cache's hash of slot `s` where it lies (the sender's, here alone): an export opened,
  // its checksum taken, the slot released.
  auto hash_in_cache = [&](cache::SlotId s) {
    const auto h0 = std::chrono::steady_clock::now();
    auto r = (*cache)->OpenExport(s, "hash", {.chunk_bytes = chunk});
    CHECK_OK(r.status());
    CHECK_OK((*r)->Checksum().status());
    (*r)->Finish(/*moved=*/false);
    return Seconds(h0);
  };
  for (int i = 0; i < slots + 1; ++i) {
    absl::StatusOr<cache::SlotId> s = (*cache)->Allocate();
    CHECK_OK(s.status());
    for (auto& b : layer) b = static_cast<uint8_t>(rng() & 0x3f);  // finite, never zeros
    std::vector<absl::Span<const uint8_t>> cps(m->num_layers, absl::MakeConstSpan(layer));
    std::vector<int32_t> tokens(100 + i, 7);
    CHECK_OK((*cache)->Import(*s, tokens, cps));
    const double hs3 = hash_in_cache(*s);
    const auto t0 = std::chrono::steady_clock::now();
    const std::string id = "x" + std::to_string(i);
    absl::StatusOr<SendResult> r =
        sender
            .Send(peer, *s, id, id,
                  {.chunk_bytes = chunk, .deadline = absl::Now() + absl::Seconds(60)})
            .result;
    const double t = Seconds(t0);
    CHECK_OK(r.status());
    peer.FreeRemote(r->remote_slot);
    const double p1 = bare_put("p" + std::to_string(i), payload.data(), 1);
    const double pn = lanes > 1 ? bare_put("l" + std::to_string(i), payload.data(), lanes) : p1;
    const double ph = put_thp ? bare_put("h" + std::to_string(i), thp, 1) : 0;
    const auto th0 = std::chrono::steady_clock::now();
    volatile uint64_t sink = cache::PayloadChecksum(payload.data(), payload.size());
    (void)sink;
    const double hs = Seconds(th0);
    if (i == 0) continue;
    total.Add(t);
    fold.Add(r->export_seconds);
    reserve.Add(r->reserve_seconds);
    put.Add(r->put_seconds);
    commit.Add(r->commit_seconds);
    put1.Add(p1);
    putn.Add(pn);
    putthp.Add(ph);
    hash.Add(hs);
    hash_slot.Add(hs3);
    if (verbose) {
      std::printf("  round %d (%s, %d lanes): whole %.2f ms (fold %.2f, reserve %.2f, "
                  "stage+hash+put %.2f, commit %.2f); bare put %.2f ms, over %d lanes %.2f ms; "
                  "hash on one thread %.2f ms, the slot in the cache %.2f ms\n", i,
                  cache::SlotIoPathName(r->path), lanes, 1e3 * t, 1e3 * r->export_seconds,
                  1e3 * r->reserve_seconds, 1e3 * r->put_seconds, 1e3 * r->commit_seconds,
                  1e3 * p1, lanes, 1e3 * pn, 1e3 * hs, 1e3 * hs3);
    }
  }
  std::free(thp);
  close(sv[0]);
  waitpid(child, nullptr, 0);
  const double t_med = total.Median(), p_med = put1.Median(), pn_med = putn.Median();
  const char* path =
      cache::SlotIoPathName(cache::SelectSlotIoPath(backend, (*ucx)->takes_device_memory()));
  const double whole = bytes / t_med / 1e9;
  auto gbs = [bytes](double s) { return bytes / s / 1e9; };
  std::printf("transfer bench: %s, state %s, backend %s (%s), %.1f MB per slot, %d slots, "
              "chunk %zu, %d lanes, %d import threads, sender hash in the cache on the %s "
              "(phases interleaved per round), TP %lld -> %lld\n",
              m->name.c_str(), dtype.c_str(), backend_name.c_str(), path, bytes / 1e6, slots,
              chunk, lanes, import_threads, backend == RSSM_BACKEND_CPU ? "host" : "device",
              static_cast<long long>(sender_tp), static_cast<long long>(receiver_tp));
  std::printf("  whole move over %d lanes (fold+reserve+stage/hash/put+import+commit): median %.2f ms "
              "= %.2f GB/s (%.2f..%.2f ms)\n", lanes, t_med * 1e3, whole, total.Min() * 1e3,
              total.Max() * 1e3);
  std::printf("    phases (medians): fold %.2f ms, reserve %.2f ms, stage+hash+put %.2f ms, "
              "commit (import tail + verify) %.2f ms\n", fold.Median() * 1e3,
              reserve.Median() * 1e3, put.Median() * 1e3, commit.Median() * 1e3);
  std::printf("  bare put of a host buffer, 1 thread:                 median %.2f ms = %.2f GB/s "
              "(%.2f..%.2f ms)\n", p_med * 1e3, gbs(p_med), put1.Min() * 1e3, put1.Max() * 1e3);
  if (lanes > 1) {
    std::printf("  bare put over the %d lanes (contiguous ranges):      median %.2f ms = %.2f GB/s "
                "(%.2f..%.2f ms)\n", lanes, pn_med * 1e3, gbs(pn_med), putn.Min() * 1e3,
                putn.Max() * 1e3);
  }
  if (put_thp) {
    std::printf("  bare put from a THP source, 1 thread (an experiment): median %.2f ms = %.2f GB/s\n",
                putthp.Median() * 1e3, gbs(putthp.Median()));
  }
  std::printf("  checksum of the slot by the cache, where it lies (the sender's): median %.2f ms "
              "= %.2f GB/s (%.2f..%.2f ms)\n", hash_slot.Median() * 1e3,
              gbs(hash_slot.Median()), hash_slot.Min() * 1e3, hash_slot.Max() * 1e3);
  std::printf("  checksum of the payload on one host thread: median %.2f ms = %.2f GB/s\n",
              hash.Median() * 1e3, gbs(hash.Median()));
  std::printf("  staging overhead (whole move over the bare put over the same %d lanes): %+.0f%%\n",
              lanes, 100 * (t_med / pn_med - 1));
  PrintReferences(refs, whole);
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "replayssm-bench-transfer: cannot write %s\n", json.c_str());
      return 1;
    }
    std::fprintf(f,
                 "{\"model\": \"%s\", \"state\": \"%s\", \"backend\": \"%s\", \"slot_bytes\": %.0f, "
                 "\"slots\": %d, \"chunk\": %zu, \"lanes\": %d, \"import_threads\": %d, "
                 "\"transfer_ms\": %.3f, \"transfer_min_ms\": %.3f, \"transfer_max_ms\": %.3f, "
                 "\"transfer_gbs\": %.3f, \"fold_ms\": %.3f, \"reserve_ms\": %.3f, "
                 "\"stage_hash_put_ms\": %.3f, \"commit_ms\": %.3f, "
                 "\"put_ms\": %.3f, \"put_gbs\": %.3f, \"put_lanes_ms\": %.3f, \"put_lanes_gbs\": %.3f, "
                 "\"put_thp_ms\": %s, \"hash_host_ms\": %.3f, \"hash_slot_ms\": %.3f, "
                 "\"put_bytes\": %zu, %s, \"target\": %.2f, \"path\": \"%s\", "
                 "\"sender_tp\": %lld, \"receiver_tp\": %lld}\n",
                 m->name.c_str(), dtype.c_str(), backend_name.c_str(), bytes, slots, chunk, lanes,
                 import_threads, t_med * 1e3, total.Min() * 1e3, total.Max() * 1e3, whole,
                 fold.Median() * 1e3, reserve.Median() * 1e3, put.Median() * 1e3,
                 commit.Median() * 1e3, p_med * 1e3, gbs(p_med), pn_med * 1e3, gbs(pn_med),
                 put_thp ? absl::StrFormat("%.3f", putthp.Median() * 1e3).c_str() : "null",
                 hash.Median() * 1e3, hash_slot.Median() * 1e3, put_bytes,
                 JsonReferences(refs, whole).c_str(), kTarget, path,
                 static_cast<long long>(sender_tp), static_cast<long long>(receiver_tp));
    std::fclose(f);
  }
  return 0;
}

}  // namespace
}  // namespace replayssm::transfer

int main(int argc, char** argv) { return replayssm::transfer::Run(argc, argv); }
