#include "service/zmq_events.h"

#include <zmq.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <msgpack.hpp>
#include <optional>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"

namespace replayssm::service {

namespace {

std::string SeqBytes(int64_t seq) {
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(static_cast<uint64_t>(seq) >> (56 - 8 * i));
  return b;
}

// Sends the frames as one multipart message; false when the socket refused one. `flags`:
// ZMQ_DONTWAIT or 0.
bool SendFrames(void* socket, const std::vector<std::string>& frames, int flags = 0) {
  for (size_t i = 0; i < frames.size(); ++i) {
    const int more = i + 1 < frames.size() ? ZMQ_SNDMORE : 0;
    if (zmq_send(socket, frames[i].data(), frames[i].size(), more | flags) < 0) return false;
  }
  return true;
}

// The frames of one message; empty when none is waiting.
std::vector<std::string> ReceiveFrames(void* socket) {
  std::vector<std::string> frames;
  for (;;) {
    zmq_msg_t m;
    zmq_msg_init(&m);
    if (zmq_msg_recv(&m, socket, ZMQ_DONTWAIT) < 0) {
      zmq_msg_close(&m);
      return frames;
    }
    frames.emplace_back(static_cast<const char*>(zmq_msg_data(&m)), zmq_msg_size(&m));
    const bool more = zmq_msg_more(&m) != 0;
    zmq_msg_close(&m);
    if (!more) return frames;
  }
}

// The file's text, or INVALID_ARGUMENT naming `flag`.
absl::StatusOr<std::string> ReadFile(const std::string& path, const char* flag) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": expected a readable file, got \"", path, "\""));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// 32 key bytes from Z85 text (40 characters), or nullopt.
std::optional<std::string> DecodeKey(absl::string_view z85) {
  if (z85.size() != 40) return std::nullopt;
  std::string key(32, '\0');
  const std::string text(z85);
  if (zmq_z85_decode(reinterpret_cast<uint8_t*>(key.data()), text.c_str()) == nullptr) {
    return std::nullopt;
  }
  return key;
}

absl::StatusOr<std::string> ReadSecret(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path, "--kv-events-curve-secret-file");
  if (!text.ok()) return text.status();
  const std::string secret(absl::StripAsciiWhitespace(*text));
  if (!DecodeKey(secret).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-events-curve-secret-file: expected a CURVE secret key (40 Z85 characters), got ",
        secret.size(), " characters in \"", path, "\""));
  }
  return secret;
}

}  // namespace

absl::StatusOr<std::string> CurvePublicKey(const std::string& secret_file) {
  absl::StatusOr<std::string> secret = ReadSecret(secret_file);
  if (!secret.ok()) return secret.status();
  char pub[41] = {};
  if (zmq_curve_public(pub, secret->c_str()) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-events-curve-secret-file: expected a CURVE secret key, got one ZMQ refuses (",
        zmq_strerror(zmq_errno()), ")"));
  }
  return std::string(pub);
}

std::string EncodeKvEventBatch(const KvEventBatch& batch, int32_t block_size) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> p(buf);
  p.pack_array(2);
  p.pack_double(batch.ts);
  p.pack_array(static_cast<uint32_t>(batch.events.size()));
  for (const KvEvent& e : batch.events) {
    switch (e.type) {
      case KvEvent::Type::kStored:
        p.pack_array(7);
        p.pack(std::string("BlockStored"));
        p.pack_array(1);
        p.pack_uint64(e.block_hash);
        if (e.parent_hash.has_value()) {
          p.pack_uint64(*e.parent_hash);
        } else {
          p.pack_nil();
        }
        p.pack_array(static_cast<uint32_t>(e.token_ids.size()));
        for (int32_t t : e.token_ids) p.pack_int32(t);
        p.pack_int32(block_size);
        p.pack_nil();  // lora_id
        p.pack(std::string(MediumName(e.medium)));
        break;
      case KvEvent::Type::kRemoved:
        p.pack_array(3);
        p.pack(std::string("BlockRemoved"));
        p.pack_array(1);
        p.pack_uint64(e.block_hash);
        p.pack(std::string(MediumName(e.medium)));
        break;
      case KvEvent::Type::kAllCleared:
        p.pack_array(1);
        p.pack(std::string("AllBlocksCleared"));
        break;
    }
  }
  return std::string(buf.data(), buf.size());
}

absl::StatusOr<std::unique_ptr<ZmqEventPublisher>> ZmqEventPublisher::Start(
    CacheEventLog* log, ZmqEventsOptions options) {
  std::unique_ptr<ZmqEventPublisher> z(new ZmqEventPublisher(log, std::move(options)));
  const ZmqEventsOptions& o = z->options_;
  if (o.curve_secret_file.empty() != o.clients_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        o.clients_file.empty() ? "--kv-events-clients-file" : "--kv-events-curve-secret-file",
        ": expected it with ",
        o.clients_file.empty() ? "--kv-events-curve-secret-file" : "--kv-events-clients-file",
        " (CURVE needs the server's key and the routers' keys), got none"));
  }
  std::string secret;
  if (!o.curve_secret_file.empty()) {
    absl::StatusOr<std::string> s = ReadSecret(o.curve_secret_file);
    if (!s.ok()) return s.status();
    secret = *s;
    absl::StatusOr<std::string> text = ReadFile(o.clients_file, "--kv-events-clients-file");
    if (!text.ok()) return text.status();
    int line = 0;
    for (absl::string_view l : absl::StrSplit(*text, '\n')) {
      ++line;
      l = absl::StripAsciiWhitespace(l);
      if (l.empty() || l[0] == '#') continue;  // Z85 has '#': only whole-line comments
      std::optional<std::string> key = DecodeKey(l);
      if (!key.has_value()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--kv-events-clients-file: ", o.clients_file, ":", line,
            ": expected a CURVE public key (40 Z85 characters), got ", l.size(), " characters"));
      }
      z->clients_.push_back(*key);
    }
    if (z->clients_.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--kv-events-clients-file: expected at least one client public key in \"",
          o.clients_file, "\", got none"));
    }
  }
  z->context_ = zmq_ctx_new();
  const int linger = 0;
  if (!secret.empty()) {  // the ZAP handler first: CURVE handshakes consult it from then on
    z->zap_ = zmq_socket(z->context_, ZMQ_REP);
    zmq_setsockopt(z->zap_, ZMQ_LINGER, &linger, sizeof(linger));
    if (zmq_bind(z->zap_, "inproc://zeromq.zap.01") != 0) {
      return absl::InternalError(
          absl::StrCat("kv events: the ZAP handler cannot bind: ", zmq_strerror(zmq_errno())));
    }
  }
  const auto curve = [&](void* socket) {
    if (secret.empty()) return;
    const int on = 1;
    zmq_setsockopt(socket, ZMQ_CURVE_SERVER, &on, sizeof(on));
    zmq_setsockopt(socket, ZMQ_CURVE_SECRETKEY, secret.c_str(), secret.size());
  };
  z->pub_ = zmq_socket(z->context_, ZMQ_PUB);
  zmq_setsockopt(z->pub_, ZMQ_LINGER, &linger, sizeof(linger));
  curve(z->pub_);
  if (zmq_bind(z->pub_, z->options_.endpoint.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("--kv-events-endpoint ", z->options_.endpoint,
                                               ": cannot bind: ", zmq_strerror(zmq_errno())));
  }
  if (!z->options_.replay_endpoint.empty()) {
    z->replay_ = zmq_socket(z->context_, ZMQ_ROUTER);
    zmq_setsockopt(z->replay_, ZMQ_LINGER, &linger, sizeof(linger));
    curve(z->replay_);
    // A reply that finds the router's queue full fails (EAGAIN, retried) instead of being
    // dropped silently, and one for a router gone fails too (EHOSTUNREACH, dropped): a replay
    // longer than the queue (1000 messages past what the TCP buffers hold) lost batches and
    // its end marker, and the router waited for them.
    const int mandatory = 1;
    zmq_setsockopt(z->replay_, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof(mandatory));
    if (zmq_bind(z->replay_, z->options_.replay_endpoint.c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("--kv-events-replay-endpoint ",
                                                 z->options_.replay_endpoint, ": cannot bind: ",
                                                 zmq_strerror(zmq_errno())));
    }
  }
  log->Watch(z->options_.tenant, log->epoch(), 1, z.get());
  log->Clear(z->options_.tenant);  // a restarted server: routers drop what they knew of it
  z->thread_ = std::thread([p = z.get()] { p->Run(); });
  return z;
}

ZmqEventPublisher::~ZmqEventPublisher() {
  log_->Unwatch(this);
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (pub_ != nullptr) zmq_close(pub_);
  if (replay_ != nullptr) zmq_close(replay_);
  if (zap_ != nullptr) zmq_close(zap_);
  if (context_ != nullptr) zmq_ctx_term(context_);
}

void ZmqEventPublisher::OnBatch(TenantId, const KvEventBatch& batch) {
  std::string payload = EncodeKvEventBatch(batch, log_->block_size());
  absl::MutexLock lock(&mu_);
  outbox_.emplace_back(batch.seq, std::move(payload));
}

void ZmqEventPublisher::Run() {
  while (!stop_) {
    std::vector<std::pair<uint64_t, std::string>> out;
    {
      absl::MutexLock lock(&mu_);
      out.swap(outbox_);
    }
    for (auto& [seq, payload] : out) {
      if (SendFrames(pub_, {options_.topic, SeqBytes(static_cast<int64_t>(seq)), payload})) {
        ++published_;
      }
    }
    SendReplays();
    zmq_pollitem_t items[2];
    int n = 0;
    if (replay_ != nullptr) items[n++] = {replay_, 0, ZMQ_POLLIN, 0};
    if (zap_ != nullptr) items[n++] = {zap_, 0, ZMQ_POLLIN, 0};
    if (n == 0) {
      absl::SleepFor(absl::Milliseconds(5));
      continue;
    }
    // A replay waiting for its router to read: back soon to send more.
    if (zmq_poll(items, n, replays_.empty() ? 5 : 1) <= 0) continue;
    for (int i = 0; i < n; ++i) {
      if ((items[i].revents & ZMQ_POLLIN) == 0) continue;
      if (items[i].socket == replay_) Replay(replay_);
      if (items[i].socket == zap_) Authenticate(zap_);
    }
  }
}

// One ZAP request (RFC 27): [version, request id, domain, address, identity, mechanism,
// credentials...]; CURVE's credential is the client's 32-byte public key. 200 admits it.
void ZmqEventPublisher::Authenticate(void* zap) {
  const std::vector<std::string> f = ReceiveFrames(zap);
  if (f.size() < 2) return;
  bool admitted = false;
  if (f.size() >= 7 && f[5] == "CURVE") {
    for (const std::string& key : clients_) admitted = admitted || key == f[6];
  }
  SendFrames(zap, {"1.0", f[1], admitted ? "200" : "400",
                   admitted ? "OK" : "client key not admitted", "", ""});
}

// One replay request: [identity, "", start] (a REQ client) or [identity, start] (DEALER).
void ZmqEventPublisher::Replay(void* socket) {
  std::vector<std::string> f = ReceiveFrames(socket);
  if (f.size() < 2) return;
  PendingReplay r;
  r.id = f.front();
  r.delimited = f.size() >= 3;
  const std::string& start = f.back();
  if (start.size() == 8) {  // else not a sequence number: only the end marker
    uint64_t from = 0;
    for (unsigned char c : start) from = (from << 8) | c;
    r.batches = log_->Replay(options_.tenant, from);
  }
  // A router asking again gave up on its earlier answer; past the bound the oldest goes.
  for (auto it = replays_.begin(); it != replays_.end();) {
    it = it->id == r.id ? replays_.erase(it) : it + 1;
  }
  if (replays_.size() >= kMaxReplays) replays_.pop_front();
  r.progressed = absl::Now();
  replays_.push_back(std::move(r));
  SendReplays();
}

void ZmqEventPublisher::SendReplays() {
  for (auto it = replays_.begin(); it != replays_.end();) {
    PendingReplay& r = *it;
    bool gone = false;
    while (r.next <= r.batches.size()) {
      if (r.frames.empty()) {
        r.frames.push_back(r.id);
        if (r.delimited) r.frames.emplace_back();
        if (r.next < r.batches.size()) {
          std::shared_ptr<const KvEventBatch>& b = r.batches[r.next];
          r.frames.push_back(SeqBytes(static_cast<int64_t>(b->seq)));
          r.frames.push_back(EncodeKvEventBatch(*b, log_->block_size()));
          b.reset();  // encoded: the log may let it go
        } else {
          r.frames.push_back(SeqBytes(-1));
          r.frames.emplace_back();
        }
      }
      if (!SendFrames(replay_, r.frames, ZMQ_DONTWAIT)) {
        // EAGAIN: the router's queue is full, the rest waits. Else (EHOSTUNREACH) it is gone.
        gone = zmq_errno() != EAGAIN;
        break;
      }
      r.frames.clear();
      ++r.next;
      r.progressed = absl::Now();
    }
    gone = gone || absl::Now() - r.progressed > kReplayIdle;
    it = gone || r.next > r.batches.size() ? replays_.erase(it) : it + 1;
  }
}

}  // namespace replayssm::service
