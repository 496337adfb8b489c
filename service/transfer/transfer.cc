#include "transfer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"

namespace replayssm::transfer {
namespace {

// Landed chunks between the start of their copy and the end of their hash on a receiver (and
// pinned staging buffers per host-staged receive buffer), at least: enough for import_threads
// copies and the hash to run at once (Receiver::depth_: import_threads + 2, at least this).
constexpr int32_t kImportDepth = 6;

using checksum_v2::Mix;

// What a receiver answers when the payload's digest is not the sender's (every path).
absl::Status ChecksumMismatch() {
  return absl::DataLossError(
      "checksum: the received state does not match the sender's; the transfer is aborted");
}

// Tests only: flips the byte at `p` (backend memory), as if damaged in flight.
absl::Status FlipByte(const rssm_launch& l, uint8_t* p) {
  uint8_t b = 0;
  bool ok = rssm_memcpy(&l, &b, p, 1, RSSM_COPY_DEVICE_TO_HOST) == RSSM_OK &&
            rssm_synchronize(&l) == RSSM_OK;
  b ^= 0x5a;
  ok = ok && rssm_memcpy(&l, p, &b, 1, RSSM_COPY_HOST_TO_DEVICE) == RSSM_OK &&
       rssm_synchronize(&l) == RSSM_OK;
  if (ok) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("transfer: corrupting for a test: ", rssm_last_error()));
}

// The layer parameters' hash keeps the first checksum's definition (version 1), so that the
// format hash of a model does not change with the payload checksum.
uint64_t HashBytesV1(const void* data, size_t size) {
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

uint64_t HashFloats(uint64_t h, const std::vector<float>& v) {
  return Mix(HashBytesV1(v.data(), v.size() * sizeof(float)), h);
}

}  // namespace

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

// A registered receive buffer: host memory allocated by UCX (payload, then the doorbell on
// its own cache line), or device memory registered as is (device-direct). Pooled: fresh
// pages, registration and pinned staging cost more than a transfer's copies.
struct Receiver::Buffer {
  std::unique_ptr<UcxTransport::Region> region;
  int32_t backend = RSSM_BACKEND_CPU;
  void* device = nullptr;  // owned (rssm_alloc) when device-direct
  size_t payload = 0;
  StagingRing ring;  // host-staged import: pinned buffers + streams
  ~Buffer() {
    region.reset();
    if (device != nullptr) rssm_free(backend, device);
  }
  static size_t DoorbellOffset(size_t payload) { return (payload + 63) & ~size_t{63}; }
  const uint8_t* data() const { return region->data(); }
  uint8_t* mutable_data() { return region->data(); }
  uint64_t* doorbell() {
    return device != nullptr ? nullptr
                             : reinterpret_cast<uint64_t*>(region->data() + DoorbellOffset(payload));
  }
};

// The hand-over between a reservation's import thread and Commit / Abort.
struct Receiver::Importer {
  absl::Mutex mu;
  bool commit ABSL_GUARDED_BY(mu) = false;
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::vector<int32_t> tokens ABSL_GUARDED_BY(mu);
  uint64_t checksum ABSL_GUARDED_BY(mu) = 0;
  std::atomic<bool> ended{false};  // commit or stop: the thread stops waiting for bytes
  absl::Status result;             // set by the thread before it ends
  std::thread thread;
};

Receiver::Receiver(cache::StateCache* cache, UcxTransport* ucx, ReceiverOptions options)
    : cache_(cache),
      ucx_(ucx),
      options_(options),
      format_(StateFormat::Of(cache->model())),
      path_(options.force_path.value_or(
          SelectDataPath(cache->options().backend, ucx->cuda_memory()))),
      depth_(std::max(kImportDepth, options.import_threads + 2)),
      copiers_(options.import_threads) {}

cache::SlotId Receiver::ReservedSlotForTest(const std::string& transfer_id) const {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(transfer_id);
  return it == pending_.end() ? cache::kPaddingSlot : it->second.slot;
}

Receiver::~Receiver() {
  absl::MutexLock lock(&mu_);
  while (!pending_.empty()) DropLocked(pending_.begin());
}

void Receiver::Finish(Pending& p, bool abort) {
  if (p.importer != nullptr) {
    if (abort) {
      absl::MutexLock lock(&p.importer->mu);
      p.importer->stop = true;
      p.importer->ended = true;
    }
    if (p.importer->thread.joinable()) p.importer->thread.join();
  }
  if (abort) cache_->Free(p.slot).IgnoreError();  // a reservation's slot is never live
}

void Receiver::DropLocked(std::map<std::string, Pending>::iterator it) {
  Finish(it->second, /*abort=*/true);
  ReturnBufferLocked(std::move(it->second.buffer));
  pending_.erase(it);
}

absl::StatusOr<std::unique_ptr<Receiver::Buffer>> Receiver::TakeBufferLocked() {
  if (!spare_.empty()) {
    std::unique_ptr<Buffer> b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }
  auto b = std::make_unique<Buffer>();
  b->payload = static_cast<size_t>(format_.Bytes());
  b->backend = cache_->options().backend;
  if (path_ == DataPath::kDeviceDirect) {
    if (rssm_alloc(b->backend, b->payload, &b->device) != RSSM_OK) {
      return absl::ResourceExhaustedError(
          absl::StrCat("transfer: device receive buffer: ", rssm_last_error()));
    }
    absl::StatusOr<std::unique_ptr<UcxTransport::Region>> r = ucx_->Register(b->device, b->payload);
    if (!r.ok()) return r.status();
    b->region = std::move(*r);
    return b;
  }
  absl::StatusOr<std::unique_ptr<UcxTransport::Region>> r =
      ucx_->Allocate(Buffer::DoorbellOffset(b->payload) + 64);
  if (!r.ok()) return r.status();
  b->region = std::move(*r);
  return b;
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
                                              const StateFormat& format, int64_t seq_len,
                                              uint32_t checksum_version) {
  if (transfer_id.empty()) {
    return absl::InvalidArgumentError("transfer_id: expected a non-empty id, got \"\"");
  }
  if (seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len: expected >= 0, got ", seq_len));
  }
  if (checksum_version != kChecksumVersion && checksum_version != kChecksumV2 &&
      checksum_version != kChecksumNone) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checksum_version: expected ", kChecksumVersion, " (or ", kChecksumV2,
        " from an older sender, or ", kChecksumNone, " from an older device-direct sender), got ",
        checksum_version,
        checksum_version == 0 ? " (a sender from before the chunked protocol: upgrade it)" : ""));
  }
  absl::Status st = format_.CheckCompatible(format);  // before any byte moves
  if (!st.ok()) return st;
  ExpireLeases();
  absl::MutexLock lock(&mu_);
  auto reservation = [this](Buffer& b) {
    uint64_t* bell = b.doorbell();
    return Reservation{ucx_->address(), b.region->addr(), b.region->rkey(), format_.Bytes(),
                       bell == nullptr ? 0 : reinterpret_cast<uint64_t>(bell)};
  };
  if (auto it = pending_.find(transfer_id); it != pending_.end()) {  // a retried Reserve
    return reservation(*it->second.buffer);
  }
  if (committed_.count(transfer_id)) {
    return absl::AlreadyExistsError(absl::StrCat("transfer_id: ", transfer_id, " is committed"));
  }
  if (static_cast<int32_t>(pending_.size()) >= options_.max_open) {
    return absl::ResourceExhaustedError(absl::StrCat("transfers: ", options_.max_open,
                                                     " reservations are open already"));
  }
  // Not zeroed: the import writes every byte, and the cache refuses the slot to anything but
  // that import until it succeeded (at the commit).
  absl::StatusOr<cache::SlotId> slot = cache_->AllocateForImport();
  if (!slot.ok()) return slot.status();
  Pending p;
  p.slot = *slot;
  p.seq_len = seq_len;
  p.checksum_version = checksum_version;
  p.expires = absl::Now() + options_.lease;
  absl::StatusOr<std::unique_ptr<Buffer>> buffer = TakeBufferLocked();
  if (!buffer.ok()) {
    cache_->Free(p.slot).IgnoreError();
    return buffer.status();
  }
  p.buffer = std::move(*buffer);
  if (uint64_t* bell = p.buffer->doorbell()) __atomic_store_n(bell, 0, __ATOMIC_RELEASE);
  StartImporter(p);
  Reservation r = reservation(*p.buffer);
  pending_.emplace(transfer_id, std::move(p));
  return r;
}

void Receiver::StartImporter(Pending& p) {
  p.importer = std::make_unique<Importer>();
  Importer* in = p.importer.get();
  Buffer* buf = p.buffer.get();
  const cache::SlotId slot = p.slot;
  const uint32_t version = p.checksum_version;
  in->thread = std::thread([this, in, buf, slot, version] {
    std::vector<int32_t> tokens;
    absl::StatusOr<int64_t> r = cache_->WithCheckpoints(
        slot, cache::StateCache::CheckpointAccess::kImport,
        [&](const cache::StateCache::CheckpointMemory& m) {
          absl::Status st = path_ == DataPath::kDeviceDirect
                                ? ImportDirect(*buf, *in, m, version)
                                : ImportChunks(*buf, *in, m, version);
          if (!st.ok()) return st;
          absl::MutexLock lock(&in->mu);  // ImportChunks returned: the commit has come
          tokens = in->tokens;
          return absl::OkStatus();
        },
        &tokens);
    in->result = r.status();
  });
}

absl::Status Receiver::ImportChunks(Buffer& buf, Importer& in,
                                    const cache::StateCache::CheckpointMemory& m,
                                    uint32_t version) {
  const size_t total = buf.payload;
  const bool staged = path_ == DataPath::kHostStaged;
  const size_t chunk = std::min(options_.chunk_bytes, m.bytes_per_layer);
  if (staged) {
    absl::Status st = buf.ring.Ensure(m.backend, depth_, chunk);
    if (!st.ok()) return st;
  }
  // Piece i is copied by a pool thread into its destination (the slot, or pinned buffer
  // i % depth_ followed by a host -> device copy on that buffer's stream) and hashed from
  // that destination: what is hashed is what the slot gets, whatever happens to the receive
  // buffer meanwhile. Version 3: by the copier, fused with its copy (any order, several at
  // once); version 2: here, in order, once the copy is done. At most depth_ pieces are
  // between the start of a copy and the end of its hash.
  const std::unique_ptr<SegmentedChecksum> v3 =
      version == kChecksumVersion ? std::make_unique<SegmentedChecksum>(total) : nullptr;
  std::vector<Piece> pieces;
  auto target = [&](const Piece& p) { return static_cast<uint8_t*>(m.layers[p.layer]) + p.layer_offset; };
  auto hashed_from = [&](size_t i) -> const uint8_t* {
    return staged ? buf.ring.buffer(static_cast<int32_t>(i % static_cast<size_t>(depth_))) : target(pieces[i]);
  };
  auto copy = [&](size_t i) -> std::function<absl::Status()> {
    const Piece p = pieces[i];
    const uint8_t* src = buf.data() + p.offset;
    SegmentedChecksum* sum3 = v3.get();
    if (!staged) {
      return [src, dst = target(p), off = p.offset, n = p.size, sum3] {
        if (sum3 != nullptr) {
          sum3->CopyAndAdd(dst, src, off, n);
        } else {
          std::memcpy(dst, src, n);
        }
        return absl::OkStatus();
      };
    }
    return [&ring = buf.ring, k = static_cast<int32_t>(i % static_cast<size_t>(depth_)), src, dst = target(p),
            off = p.offset, n = p.size, sum3] {
      absl::Status st = ring.Sync(k);  // the last host -> device copy from buffer k is done
      if (!st.ok()) return st;
      if (sum3 != nullptr) {
        sum3->CopyAndAdd(ring.buffer(k), src, off, n);
      } else {
        std::memcpy(ring.buffer(k), src, n);
      }
      return ring.Copy(k, dst, ring.buffer(k), n, RSSM_COPY_HOST_TO_DEVICE);
    };
  };
  Checksummer sum;
  const uint64_t* bell = buf.doorbell();
  size_t landed = 0, submitted = 0, hashed = 0;
  int idle = 0;
  // On every way out, first (declared last) every copy task has ended, then every host ->
  // device copy they queued: nothing writes into the slot once it may be freed.
  struct DrainStreams {
    StagingRing* ring;
    ~DrainStreams() {
      for (int32_t k = 0; ring != nullptr && k < ring->count(); ++k) ring->Sync(k).IgnoreError();
    }
  } drain{staged ? &buf.ring : nullptr};
  TaskPool::Batch copies(&copiers_);
  while (landed < total || hashed < pieces.size()) {
    const size_t now = std::min<size_t>(__atomic_load_n(bell, __ATOMIC_ACQUIRE), total);
    if (now > landed) {
      for (const Piece& p : SplitRange(landed, now, m.bytes_per_layer, chunk)) {
        uint8_t* src = buf.mutable_data() + p.offset;
        if (p.offset <= total / 2 && total / 2 < p.offset + p.size && corrupt_next_.exchange(false)) {
          src[total / 2 - p.offset] ^= 0x5a;  // fault injection: damaged in flight
        }
        pieces.push_back(p);
      }
      landed = now;
    }
    bool progress = false;
    for (; submitted < pieces.size() && submitted < hashed + static_cast<size_t>(depth_); ++submitted) {
      copies.Submit(copy(submitted));
      progress = true;
    }
    absl::Status st;
    if (hashed < submitted &&
        copies.WaitFor(hashed, progress ? absl::ZeroDuration() : absl::Microseconds(50), &st)) {
      if (!st.ok()) return st;
      if (v3 == nullptr) sum.Update(hashed_from(hashed), pieces[hashed].size);
      ++hashed;
      idle = 0;
      continue;
    }
    if (progress || hashed < submitted) continue;
    if (in.ended.load(std::memory_order_acquire)) {
      // A commit comes after the sender's flush: every byte is here, or never will be.
      if (__atomic_load_n(bell, __ATOMIC_ACQUIRE) > landed) continue;
      return absl::DataLossError(absl::StrCat("payload: ", landed, " of ", total,
                                              " bytes arrived before the commit or abort"));
    }
    if (++idle < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  for (int32_t k = 0; staged && k < buf.ring.count(); ++k) {
    absl::Status st = buf.ring.Sync(k);
    if (!st.ok()) return st;
  }
  absl::MutexLock lock(&in.mu);
  in.mu.Await(absl::Condition(
      +[](Importer* i) ABSL_NO_THREAD_SAFETY_ANALYSIS { return i->commit || i->stop; }, &in));
  if (in.stop) return absl::AbortedError("transfer: aborted");
  const bool verified = version == kChecksumVersion || version == kChecksumV2;
  if (verified && (v3 != nullptr ? v3->Digest() : sum.Digest()) != in.checksum) {
    return ChecksumMismatch();
  }
  return absl::OkStatus();
}

// Device-direct: the bytes are in device memory already; after the commit they are copied
// into the slot device to device, and then the receive buffer is hashed on the device (one
// rssm_segment_digests call over it, on the same stream, so after the copies). Hashing after
// copying keeps "what is verified is what the slot got": a stray write into the buffer before
// the copy is in the hash too, one after the hash never reaches the slot.
absl::Status Receiver::ImportDirect(Buffer& buf, Importer& in,
                                    const cache::StateCache::CheckpointMemory& m,
                                    uint32_t version) {
  uint64_t want = 0;
  {
    absl::MutexLock lock(&in.mu);
    in.mu.Await(absl::Condition(
        +[](Importer* i) ABSL_NO_THREAD_SAFETY_ANALYSIS { return i->commit || i->stop; }, &in));
    if (in.stop) return absl::AbortedError("transfer: aborted");
    want = in.checksum;
  }
  const rssm_launch l{m.backend, nullptr};
  auto* data = static_cast<uint8_t*>(buf.device);
  if (buf.payload > 0 && corrupt_next_.exchange(false)) {
    absl::Status st = FlipByte(l, data + buf.payload / 2);
    if (!st.ok()) return st;
  }
  for (size_t layer = 0; layer < m.layers.size(); ++layer) {
    if (rssm_memcpy(&l, m.layers[layer], data + layer * m.bytes_per_layer, m.bytes_per_layer,
                    RSSM_COPY_DEVICE_TO_DEVICE) != RSSM_OK) {
      return absl::InternalError(absl::StrCat("transfer: import: ", rssm_last_error()));
    }
  }
  if (version != kChecksumVersion && version != kChecksumV2) {  // 100: an older device-direct sender
    if (rssm_synchronize(&l) != RSSM_OK) {
      return absl::InternalError(absl::StrCat("transfer: import: ", rssm_last_error()));
    }
    return absl::OkStatus();
  }
  absl::StatusOr<uint64_t> got = BackendChecksum(l, data, buf.payload, version);
  if (!got.ok()) {
    rssm_synchronize(&l);  // the copies end before the slot may be freed
    return got.status();
  }
  return *got == want ? absl::OkStatus() : ChecksumMismatch();
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
    if (static_cast<int64_t>(tokens.size()) != it->second.seq_len) {
      const int64_t want = it->second.seq_len;
      DropLocked(it);
      return absl::FailedPreconditionError(absl::StrCat("tokens: expected ", want,
                                                        " (the reserved seq_len), got ", tokens.size()));
    }
    p = std::move(it->second);
    pending_.erase(it);  // no retried Reserve or expiry touches it while it is checked
  }
  {
    absl::MutexLock lock(&p.importer->mu);
    p.importer->tokens = tokens;
    p.importer->checksum = checksum;
    p.importer->commit = true;
    p.importer->ended = true;
  }
  Finish(p, /*abort=*/false);
  const absl::Status st = p.importer->result;
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

absl::Status Sender::PutAll(Peer& peer, const cache::StateCache::CheckpointMemory& m,
                            const std::string& transfer_id, int64_t seq_len, DataPath path,
                            const SendOptions& options, SendResult& out, bool* reserved,
                            uint64_t* checksum) {
  using Clock = std::chrono::steady_clock;
  auto t = Clock::now();
  auto lap = [&t] {
    const auto now = Clock::now();
    const double s = std::chrono::duration<double>(now - t).count();
    t = now;
    return s;
  };
  const StateFormat format = StateFormat::Of(cache_->model());
  absl::StatusOr<Reservation> r = peer.Reserve(transfer_id, format, seq_len, kChecksumVersion);
  out.reserve_seconds = lap();
  if (!r.ok()) return r.status();
  *reserved = true;
  if (r->bytes != format.Bytes()) {
    return absl::FailedPreconditionError(
        absl::StrCat("reservation.bytes: expected ", format.Bytes(), ", got ", r->bytes));
  }
  const size_t chunk = std::min(options.chunk_bytes == 0 ? size_t{4 << 20} : options.chunk_bytes,
                                m.bytes_per_layer);
  const std::vector<Piece> pieces = SplitPayload(format.num_layers, m.bytes_per_layer, chunk);
  // A CUDA slot (device-direct or host-staged) is hashed on the device, beside the puts: the
  // host threads only stage and put (host hashing on the lanes' pool capped the staged send at
  // ~15 GB/s, transfer-h200-2026-11-30-v5.md); a host slot's pieces are hashed on the host as
  // they are put (PieceHasher).
  const bool hashed = !HashedOnDevice(path);
  std::optional<SlotHasher> on_device;
  if (!hashed) {
    absl::StatusOr<void*> stream = hash_stream_.Get(m.backend);
    if (!stream.ok()) return stream.status();
    on_device.emplace(&hashers_, *stream, m);
  }
  auto finish = [&](PieceHasher& hasher) -> absl::Status {
    if (hashed) {
      *checksum = hasher.Finish();
    } else {
      absl::StatusOr<uint64_t> d = on_device->Finish();
      if (!d.ok()) return d.status();
      *checksum = *d;
    }
    out.put_seconds = lap();
    return absl::OkStatus();
  };
  if (lanes_.size() > 1) {
    PieceHasher hasher(&hashers_, static_cast<size_t>(format.Bytes()));
    absl::Status st = PutLanes(*r, m, pieces, path, chunk, options, hasher);
    if (!st.ok()) return st;
    return finish(hasher);
  }
  absl::StatusOr<std::unique_ptr<UcxTransport::PutStream>> stream =
      ucx_->OpenPutStream(r->worker_address, r->rkey, options.timeout);
  if (!stream.ok()) return stream.status();
  UcxTransport::PutStream& put = **stream;
  auto source = [&](const Piece& p) {
    return static_cast<const uint8_t*>(m.layers[p.layer]) + p.layer_offset;
  };
  // Declared after `put`: destroyed first, so its tasks stop reading first.
  PieceHasher hasher(&hashers_, static_cast<size_t>(format.Bytes()));
  // Puts piece i from `src` and rings the doorbell; the ticket of the put.
  auto send = [&](size_t i, const uint8_t* src) -> absl::StatusOr<uint64_t> {
    const Piece& p = pieces[i];
    absl::StatusOr<uint64_t> ticket = put.Write(src, p.size, r->remote_addr + p.offset);
    if (!ticket.ok() || r->doorbell_addr == 0) return ticket;
    absl::Status st = put.Signal(r->doorbell_addr, p.offset + p.size);
    if (!st.ok()) return st;
    return ticket;
  };
  if (path != DataPath::kHostStaged) {
    for (size_t i = 0; i < pieces.size(); ++i) {
      if (hashed) hasher.Submit(pieces[i].offset, source(pieces[i]), pieces[i].size);
      absl::StatusOr<uint64_t> ticket = send(i, source(pieces[i]));
      if (!ticket.ok()) return ticket.status();
    }
  } else {
    constexpr int32_t kRing = 4;  // staging buffers: copy ahead while earlier chunks are put
    absl::Status st = ring_.Ensure(m.backend, kRing, chunk);
    if (!st.ok()) return st;
    uint64_t put_ticket[kRing] = {};
    auto stage = [&](size_t i) {
      const int32_t k = static_cast<int32_t>(i % kRing);
      absl::Status s = put.WaitFor(put_ticket[k]);  // the buffer's last put is done
      if (s.ok()) s = ring_.Copy(k, ring_.buffer(k), source(pieces[i]), pieces[i].size,
                                 RSSM_COPY_DEVICE_TO_HOST);
      return s;
    };
    if (!pieces.empty()) st = stage(0);
    for (size_t i = 0; st.ok() && i < pieces.size(); ++i) {
      const int32_t k = static_cast<int32_t>(i % kRing);
      if (i + 1 < pieces.size()) st = stage(i + 1);  // overlaps this chunk's put
      if (st.ok()) st = ring_.Sync(k);
      if (!st.ok()) break;
      absl::StatusOr<uint64_t> ticket = send(i, ring_.buffer(k));
      if (!ticket.ok()) st = ticket.status();
      else put_ticket[k] = *ticket;
    }
    if (!st.ok()) return st;
  }
  absl::Status st = put.Finish();
  if (!st.ok()) return st;
  return finish(hasher);
}

// One multi-lane send: which pieces are queued for their lane (their source) and which have
// landed (put and flushed), the doorbell's last value, the first failure.
struct Sender::Lanes {
  absl::Mutex mu;
  std::vector<const uint8_t*> src ABSL_GUARDED_BY(mu);  // per piece; nullptr: not queued yet
  std::vector<char> landed ABSL_GUARDED_BY(mu);         // per piece
  size_t prefix ABSL_GUARDED_BY(mu) = 0;                // pieces [0, prefix) all landed
  int32_t running ABSL_GUARDED_BY(mu) = 0;              // lane threads not ended
  absl::Status error ABSL_GUARDED_BY(mu);               // the first failure
  bool stop ABSL_GUARDED_BY(mu) = false;                // a failure: every lane ends
  absl::Mutex bell_mu;                                  // one ring at a time, flushed
  uint64_t rung ABSL_GUARDED_BY(bell_mu) = 0;           // the doorbell's last value

  void Fail(absl::Status st) {
    absl::MutexLock lock(&mu);
    if (error.ok()) error = std::move(st);
    stop = true;
  }
  // Waits until piece i landed or the send failed.
  absl::Status WaitLanded(size_t i) {
    absl::MutexLock lock(&mu);
    struct Arg {
      Lanes* l;
      size_t i;
    } arg{this, i};
    mu.Await(absl::Condition(
        +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->l->stop || a->l->landed[a->i] != 0; },
        &arg));
    return stop ? error : absl::OkStatus();
  }
};

absl::Status Sender::PutLanes(const Reservation& r, const cache::StateCache::CheckpointMemory& m,
                              const std::vector<Piece>& pieces, DataPath path, size_t chunk,
                              const SendOptions& options, PieceHasher& hasher) {
  const size_t n = lanes_.size();
  std::vector<std::unique_ptr<UcxTransport::PutStream>> streams;
  for (UcxTransport* lane : lanes_) {
    absl::StatusOr<std::unique_ptr<UcxTransport::PutStream>> s =
        lane->OpenPutStream(r.worker_address, r.rkey, options.timeout);
    if (!s.ok()) return s.status();
    streams.push_back(std::move(*s));
  }
  Lanes st;
  {
    absl::MutexLock lock(&st.mu);
    st.src.assign(pieces.size(), nullptr);
    st.landed.assign(pieces.size(), 0);
    st.running = static_cast<int32_t>(n);
  }
  const bool bell = r.doorbell_addr != 0;
  // Lane k puts pieces k, k + n, ... in order, each once the feeding thread queued it.
  auto lane = [&](size_t k) -> absl::Status {
    UcxTransport::PutStream& put = *streams[k];
    for (size_t i = k; i < pieces.size(); i += n) {
      const uint8_t* src;
      {
        absl::MutexLock lock(&st.mu);
        struct Arg {
          Lanes* l;
          size_t i;
        } arg{&st, i};
        st.mu.Await(absl::Condition(
            +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->l->stop || a->l->src[a->i] != nullptr; },
            &arg));
        if (st.stop) return absl::OkStatus();  // another lane's failure is the one reported
        src = st.src[i];
      }
      const Piece& p = pieces[i];
      if (options.fail_piece_for_test == i) {
        return absl::InternalError(absl::StrCat("transfer: lane ", k, ": piece ", i, " failed (test)"));
      }
      absl::StatusOr<uint64_t> ticket = put.Write(src, p.size, r.remote_addr + p.offset);
      if (!ticket.ok()) return ticket.status();
      // Landed = in the peer's memory (then a doorbell put from any lane comes after it), or,
      // with no doorbell, at least done with its source (the commit follows every Finish).
      absl::Status s = bell ? put.Flush() : put.WaitFor(*ticket);
      if (!s.ok()) return s;
      uint64_t value = 0;
      {
        absl::MutexLock lock(&st.mu);
        st.landed[i] = 1;
        const size_t before = st.prefix;
        while (st.prefix < pieces.size() && st.landed[st.prefix] != 0) ++st.prefix;
        if (st.prefix > before) {
          const Piece& last = pieces[st.prefix - 1];
          value = last.offset + last.size;
        }
      }
      if (bell && value != 0) {
        absl::MutexLock lock(&st.bell_mu);
        if (value > st.rung) {  // a later ring may have covered it already
          uint64_t v = value;  // the put's source: valid until the flush below
          absl::StatusOr<uint64_t> t = put.Write(&v, sizeof(v), r.doorbell_addr);
          s = t.ok() ? put.Flush() : t.status();
          if (!s.ok()) return s;
          st.rung = value;
        }
      }
      if (options.on_piece_landed_for_test) options.on_piece_landed_for_test(i);
    }
    return put.Finish();
  };
  std::vector<std::thread> threads;
  // On every way out: the lanes stop and are joined before anything they read (the slot, the
  // staging ring) or use (their streams) can go.
  struct Join {
    Lanes& st;
    std::vector<std::thread>& threads;
    ~Join() {
      {
        absl::MutexLock lock(&st.mu);
        st.stop = true;
      }
      for (std::thread& t : threads) t.join();
    }
  } join{st, threads};
  for (size_t k = 0; k < n; ++k) {
    threads.emplace_back([&st, &lane, k] {
      absl::Status s = lane(k);
      if (!s.ok()) st.Fail(std::move(s));
      absl::MutexLock lock(&st.mu);
      --st.running;
    });
  }
  auto queue = [&st](size_t i, const uint8_t* src) {
    absl::MutexLock lock(&st.mu);
    st.src[i] = src;
  };
  auto source = [&](const Piece& p) {
    return static_cast<const uint8_t*>(m.layers[p.layer]) + p.layer_offset;
  };
  const bool hashed = !HashedOnDevice(path);
  if (path != DataPath::kHostStaged) {
    if (hashed) {
      for (const Piece& p : pieces) hasher.Submit(p.offset, source(p), p.size);
    }
    absl::MutexLock lock(&st.mu);
    for (size_t i = 0; i < pieces.size(); ++i) st.src[i] = source(pieces[i]);
  } else {
    // A ring of 2n staging buffers: n chunks being put (one per lane) while the next n are
    // copied device -> host. A buffer is staged again once its chunk landed.
    const int32_t ring = static_cast<int32_t>(std::max<size_t>(4, 2 * n));
    const size_t ahead = static_cast<size_t>(ring) - n;
    absl::Status s = ring_.Ensure(m.backend, ring, chunk);
    if (!s.ok()) return s;
    auto stage = [&](size_t i) {
      const int32_t k = static_cast<int32_t>(i % ring);
      if (i >= static_cast<size_t>(ring)) {
        absl::Status w = st.WaitLanded(i - ring);
        if (!w.ok()) return w;
      }
      return ring_.Copy(k, ring_.buffer(k), source(pieces[i]), pieces[i].size,
                        RSSM_COPY_DEVICE_TO_HOST);
    };
    size_t staged = 0;
    for (size_t i = 0; s.ok() && i < pieces.size(); ++i) {
      for (; s.ok() && staged < pieces.size() && staged <= i + ahead; ++staged) s = stage(staged);
      const int32_t k = static_cast<int32_t>(i % ring);
      if (s.ok()) s = ring_.Sync(k);
      if (!s.ok()) break;
      queue(i, ring_.buffer(k));
    }
    if (!s.ok()) {
      st.Fail(s);
      return s;
    }
  }
  absl::MutexLock lock(&st.mu);
  st.mu.Await(absl::Condition(
      +[](Lanes* l) ABSL_NO_THREAD_SAFETY_ANALYSIS { return l->running == 0; }, &st));
  if (!st.error.ok()) return st.error;
  if (st.prefix != pieces.size()) {
    return absl::InternalError(absl::StrCat("transfer: ", st.prefix, " of ", pieces.size(),
                                            " chunks landed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SendResult> Sender::Send(Peer& peer, cache::SlotId slot,
                                        const std::string& transfer_id,
                                        const SendOptions& options) {
  using Clock = std::chrono::steady_clock;
  absl::MutexLock lock(&mu_);
  const auto t0 = Clock::now();
  SendResult out;
  out.path = options.force_path.value_or(
      SelectDataPath(cache_->options().backend, ucx_->cuda_memory()));
  absl::StatusOr<cache::SlotInfo> info = cache_->Info(slot);
  if (!info.ok()) return info.status();
  const int64_t seq_len = info->seq_len;
  uint64_t checksum = 0;
  bool reserved = false;
  std::vector<int32_t> tokens;
  // The guarded path: folds the slot (write_pos -> 0) or refuses, then streams its memory.
  absl::StatusOr<int64_t> exported = cache_->WithCheckpoints(
      slot, cache::StateCache::CheckpointAccess::kExport,
      [&](const cache::StateCache::CheckpointMemory& m) {
        out.export_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        return PutAll(peer, m, transfer_id, seq_len, out.path, options, out, &reserved, &checksum);
      },
      &tokens);
  absl::Status st = exported.status();
  if (st.ok() && *exported != seq_len) {
    st = absl::FailedPreconditionError(absl::StrCat(
        "slot: seq_len changed from ", seq_len, " to ", *exported, " while it was being sent"));
  }
  const auto t1 = Clock::now();
  absl::StatusOr<cache::SlotId> remote =
      st.ok() ? peer.Commit(transfer_id, tokens, checksum) : absl::StatusOr<cache::SlotId>(st);
  out.commit_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  if (!remote.ok()) {
    if (reserved) peer.Abort(transfer_id).IgnoreError();  // best effort; the lease covers a dead peer
    return remote.status();
  }
  if (!options.keep_source) cache_->Free(slot).IgnoreError();
  out.remote_slot = *remote;
  out.bytes = StateFormat::Of(cache_->model()).Bytes();
  out.seq_len = seq_len;
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return out;
}

}  // namespace replayssm::transfer
