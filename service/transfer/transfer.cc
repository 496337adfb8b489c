#include "transfer.h"

#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace replayssm::transfer {
namespace {

uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v * 0x9E3779B97F4A7C15ULL;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 32);
}

uint64_t HashFloats(uint64_t h, const std::vector<float>& v) {
  return Mix(Checksum(v.data(), v.size() * sizeof(float)), h);
}

}  // namespace

uint64_t Checksum(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t lane[4] = {1, 2, 3, 4};
  size_t i = 0;
  for (; i + 32 <= size; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * k, 8);
      lane[k] = Mix(lane[k], v);
    }
  }
  uint64_t h = Mix(Mix(lane[0], lane[1]), Mix(lane[2], lane[3]));
  for (; i < size; ++i) h = Mix(h, p[i]);
  return Mix(h, size);
}

StateFormat StateFormat::Of(const cache::ModelSpec& m) {
  StateFormat f;
  f.num_layers = m.num_layers;
  f.gate = m.shape.gate;
  f.num_qk_heads = m.shape.num_qk_heads;
  f.num_v_heads = m.shape.num_v_heads;
  f.head_k = m.shape.head_k;
  f.head_v = m.shape.head_v;
  f.state_dtype = m.shape.state_dtype;
  uint64_t h = 0x5eed;
  for (const cache::LayerParams& p : m.layers) {
    h = HashFloats(HashFloats(h, p.a_log), p.dt_bias);
    h = Mix(h, static_cast<uint64_t>(p.scale * 1e6)) ^ p.use_qk_l2norm;
  }
  f.params_hash = h;
  return f;
}

int64_t StateFormat::Bytes() const {
  return int64_t{num_layers} * num_v_heads * head_v * head_k *
         static_cast<int64_t>(rssm_dtype_size(state_dtype));
}

absl::Status StateFormat::CheckCompatible(const StateFormat& s) const {
  const std::pair<const char*, std::pair<int64_t, int64_t>> fields[] = {
      {"num_layers", {num_layers, s.num_layers}},
      {"gate", {gate, s.gate}},
      {"num_qk_heads", {num_qk_heads, s.num_qk_heads}},
      {"num_v_heads", {num_v_heads, s.num_v_heads}},
      {"head_k", {head_k, s.head_k}},
      {"head_v", {head_v, s.head_v}},
      {"state_dtype", {state_dtype, s.state_dtype}},
  };
  for (const auto& [name, v] : fields) {
    if (v.first != v.second) {
      return absl::FailedPreconditionError(absl::StrCat(
          "format.", name, ": expected ", v.first, " (this server's model), got ", v.second));
    }
  }
  if (params_hash != s.params_hash) {
    return absl::FailedPreconditionError(
        "format.params_hash: the sender's layer parameters differ from this server's model");
  }
  return absl::OkStatus();
}

Receiver::Receiver(cache::StateCache* cache, UcxTransport* ucx, ReceiverOptions options)
    : cache_(cache), ucx_(ucx), options_(options), format_(StateFormat::Of(cache->model())) {}

Receiver::~Receiver() {
  absl::MutexLock lock(&mu_);
  while (!pending_.empty()) DropLocked(pending_.begin());
}

void Receiver::DropLocked(std::map<std::string, Pending>::iterator it) {
  cache_->Free(it->second.slot).IgnoreError();  // a reservation's slot is never live
  ReturnBufferLocked(std::move(it->second.buffer));
  pending_.erase(it);
}

absl::StatusOr<std::unique_ptr<Receiver::Buffer>> Receiver::TakeBufferLocked() {
  if (!spare_.empty()) {
    std::unique_ptr<Buffer> b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }
  return ucx_->Allocate(static_cast<size_t>(format_.Bytes()));
}

void Receiver::ReturnBufferLocked(std::unique_ptr<Buffer> b) {
  if (b != nullptr && static_cast<int32_t>(spare_.size()) < options_.max_open) {
    spare_.push_back(std::move(b));
  }
}

int Receiver::ExpireLeases() {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  int n = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second.expires <= now) {
      DropLocked(it++);
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

int Receiver::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(pending_.size());
}

absl::StatusOr<Reservation> Receiver::Reserve(const std::string& transfer_id,
                                              const StateFormat& format, int64_t seq_len) {
  if (transfer_id.empty()) {
    return absl::InvalidArgumentError("transfer_id: expected a non-empty id, got \"\"");
  }
  if (seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len: expected >= 0, got ", seq_len));
  }
  absl::Status st = format_.CheckCompatible(format);  // before any byte moves
  if (!st.ok()) return st;
  ExpireLeases();
  absl::MutexLock lock(&mu_);
  if (auto it = pending_.find(transfer_id); it != pending_.end()) {  // a retried Reserve
    const UcxTransport::Region& region = *it->second.buffer;
    return Reservation{ucx_->address(), region.addr(), region.rkey(), format_.Bytes()};
  }
  if (committed_.count(transfer_id)) {
    return absl::AlreadyExistsError(absl::StrCat("transfer_id: ", transfer_id, " is committed"));
  }
  if (static_cast<int32_t>(pending_.size()) >= options_.max_open) {
    return absl::ResourceExhaustedError(absl::StrCat("transfers: ", options_.max_open,
                                                     " reservations are open already"));
  }
  absl::StatusOr<cache::SlotId> slot = cache_->Allocate();
  if (!slot.ok()) return slot.status();
  Pending p;
  p.slot = *slot;
  p.seq_len = seq_len;
  p.expires = absl::Now() + options_.lease;
  absl::StatusOr<std::unique_ptr<Buffer>> buffer = TakeBufferLocked();
  if (!buffer.ok()) {
    cache_->Free(p.slot).IgnoreError();
    return buffer.status();
  }
  p.buffer = std::move(*buffer);
  Reservation r{ucx_->address(), p.buffer->addr(), p.buffer->rkey(), format_.Bytes()};
  pending_.emplace(transfer_id, std::move(p));
  return r;
}

absl::StatusOr<cache::SlotId> Receiver::Commit(const std::string& transfer_id,
                                               const std::vector<int32_t>& tokens,
                                               uint64_t checksum) {
  Pending p;
  {
    absl::MutexLock lock(&mu_);
    if (auto done = committed_.find(transfer_id); done != committed_.end()) return done->second;
    auto it = pending_.find(transfer_id);
    if (it == pending_.end()) {
      return absl::NotFoundError(absl::StrCat("transfer_id: ", transfer_id,
                                              " has no open reservation (expired or aborted)"));
    }
    p = std::move(it->second);
    pending_.erase(it);  // no retried Reserve hands this buffer out while it is checked
    if (corrupt_next_) {
      p.buffer->data()[p.buffer->size() / 2] ^= 0x5a;
      corrupt_next_ = false;
    }
  }
  const absl::Span<const uint8_t> bytes(p.buffer->data(), p.buffer->size());
  absl::Status st = absl::OkStatus();
  if (static_cast<int64_t>(tokens.size()) != p.seq_len) {
    st = absl::FailedPreconditionError(absl::StrCat("tokens: expected ", p.seq_len,
                                                    " (the reserved seq_len), got ", tokens.size()));
  } else if (Checksum(bytes.data(), bytes.size()) != checksum) {
    st = absl::DataLossError("checksum: the received state does not match the sender's; "
                             "the transfer is aborted");
  }
  std::vector<absl::Span<const uint8_t>> layers;
  const size_t per = bytes.size() / format_.num_layers;
  for (int32_t l = 0; st.ok() && l < format_.num_layers; ++l) {
    layers.emplace_back(bytes.data() + l * per, per);
  }
  if (st.ok()) st = cache_->Import(p.slot, tokens, layers);
  absl::MutexLock lock(&mu_);
  ReturnBufferLocked(std::move(p.buffer));
  if (!st.ok()) {
    cache_->Free(p.slot).IgnoreError();
    return st;
  }
  if (committed_.size() > 4096) committed_.clear();  // a bounded memory of retries
  committed_[transfer_id] = p.slot;
  return p.slot;
}

absl::Status Receiver::Abort(const std::string& transfer_id) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(transfer_id);
  if (it != pending_.end()) DropLocked(it);
  return absl::OkStatus();  // aborting twice, or after expiry, is fine
}

absl::StatusOr<SendResult> Sender::Send(Peer& peer, cache::SlotId slot,
                                        const std::string& transfer_id,
                                        const SendOptions& options) {
  using Clock = std::chrono::steady_clock;
  absl::MutexLock lock(&mu_);
  SendResult out;
  auto lap = [t = Clock::now()]() mutable {
    const auto now = Clock::now();
    const double s = std::chrono::duration<double>(now - t).count();
    t = now;
    return s;
  };
  const StateFormat format = StateFormat::Of(cache_->model());
  payload_.resize(static_cast<size_t>(format.Bytes()));
  std::vector<int32_t> tokens;
  // The guarded path: folds the slot (write_pos -> 0) or refuses; never a raw read.
  absl::StatusOr<int64_t> seq_len = cache_->ExportTo(slot, absl::MakeSpan(payload_), &tokens);
  if (!seq_len.ok()) return seq_len.status();
  const uint64_t checksum = Checksum(payload_.data(), payload_.size());
  out.export_seconds = lap();
  absl::StatusOr<Reservation> r = peer.Reserve(transfer_id, format, *seq_len);
  if (!r.ok()) return r.status();
  out.reserve_seconds = lap();
  absl::Status st = r->bytes == static_cast<int64_t>(payload_.size())
                        ? absl::OkStatus()
                        : absl::FailedPreconditionError(absl::StrCat(
                              "reservation.bytes: expected ", payload_.size(), ", got ", r->bytes));
  if (st.ok()) {
    st = ucx_->Put(r->worker_address, payload_.data(), payload_.size(), r->remote_addr, r->rkey,
                   options.chunk_bytes, options.timeout);
  }
  out.put_seconds = lap();
  absl::StatusOr<cache::SlotId> remote =
      st.ok() ? peer.Commit(transfer_id, tokens, checksum) : absl::StatusOr<cache::SlotId>(st);
  out.commit_seconds = lap();
  if (!remote.ok()) {
    peer.Abort(transfer_id).IgnoreError();  // best effort; the lease covers a dead peer
    return remote.status();
  }
  if (!options.keep_source) cache_->Free(slot).IgnoreError();
  out.remote_slot = *remote;
  out.bytes = static_cast<int64_t>(payload_.size());
  out.seq_len = *seq_len;
  out.seconds = out.export_seconds + out.reserve_seconds + out.put_seconds + out.commit_seconds;
  return out;
}

}  // namespace replayssm::transfer
