#include "service/zmq_events.h"

#include <zmq.h>

#include <cstring>
#include <msgpack.hpp>

#include "absl/strings/str_cat.h"

namespace replayssm::service {

namespace {

std::string SeqBytes(int64_t seq) {
  std::string b(8, '\0');
  for (int i = 0; i < 8; ++i) b[i] = static_cast<char>(static_cast<uint64_t>(seq) >> (56 - 8 * i));
  return b;
}

// Sends the frames as one multipart message; false when the socket refused one.
bool SendFrames(void* socket, const std::vector<std::string>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    const int more = i + 1 < frames.size() ? ZMQ_SNDMORE : 0;
    if (zmq_send(socket, frames[i].data(), frames[i].size(), more) < 0) return false;
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

}  // namespace

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
  z->context_ = zmq_ctx_new();
  z->pub_ = zmq_socket(z->context_, ZMQ_PUB);
  const int linger = 0;
  zmq_setsockopt(z->pub_, ZMQ_LINGER, &linger, sizeof(linger));
  if (zmq_bind(z->pub_, z->options_.endpoint.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("--kv-events-endpoint ", z->options_.endpoint,
                                               ": cannot bind: ", zmq_strerror(zmq_errno())));
  }
  if (!z->options_.replay_endpoint.empty()) {
    z->replay_ = zmq_socket(z->context_, ZMQ_ROUTER);
    zmq_setsockopt(z->replay_, ZMQ_LINGER, &linger, sizeof(linger));
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
    zmq_pollitem_t item{replay_, 0, ZMQ_POLLIN, 0};
    if (replay_ == nullptr) {
      absl::SleepFor(absl::Milliseconds(5));
      continue;
    }
    if (zmq_poll(&item, 1, 5) > 0 && (item.revents & ZMQ_POLLIN) != 0) Replay(replay_);
  }
}

// One replay request: [identity, "", start] (a REQ client) or [identity, start] (DEALER).
void ZmqEventPublisher::Replay(void* socket) {
  std::vector<std::string> f = ReceiveFrames(socket);
  if (f.size() < 2) return;
  const std::string id = f.front();
  const std::string& start = f.back();
  const bool delimited = f.size() >= 3;
  auto reply = [&](std::vector<std::string> frames) {
    frames.insert(frames.begin(), id);
    if (delimited) frames.insert(frames.begin() + 1, std::string());
    SendFrames(socket, frames);
  };
  if (start.size() != 8) {
    reply({SeqBytes(-1), std::string()});  // not a sequence number: only the end marker
    return;
  }
  uint64_t from = 0;
  for (unsigned char c : start) from = (from << 8) | c;
  for (const KvEventBatch& b : log_->Replay(options_.tenant, from)) {
    reply({SeqBytes(static_cast<int64_t>(b.seq)), EncodeKvEventBatch(b, log_->block_size())});
  }
  reply({SeqBytes(-1), std::string()});
}

}  // namespace replayssm::service
