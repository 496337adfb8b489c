#include "replayssm/transfer/receiver.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "task_pool.h"

namespace replayssm::transfer {
namespace {

// Landed chunks between the start and the end of their write, at least: enough for every
// writer thread and the next chunks to be in hand at once.
constexpr int32_t kImportDepth = 6;

}  // namespace

// A registered receive buffer: host memory allocated by UCX (the payload, then the doorbell
// on its own cache line), or backend memory registered as is (device-direct). Pooled: fresh
// pages and registration cost more than a transfer's copies.
struct Receiver::Buffer {
  std::unique_ptr<cache::BackendBuffer> device;  // device-direct only; outlives region
  std::unique_ptr<UcxTransport::Region> region;
  size_t payload = 0;

  static size_t DoorbellOffset(size_t payload) { return (payload + 63) & ~size_t{63}; }
  const uint8_t* data() const {
    return device != nullptr ? static_cast<const uint8_t*>(device->data()) : region->data();
  }
  uint64_t* doorbell() const {
    if (device != nullptr) return nullptr;
    return reinterpret_cast<uint64_t*>(region->data() + DoorbellOffset(payload));
  }
  Reservation Describe(const std::string& worker) const {
    const uint64_t* bell = doorbell();
    return Reservation{worker, region->addr(), region->rkey(), static_cast<int64_t>(payload),
                       bell == nullptr ? 0 : reinterpret_cast<uint64_t>(bell)};
  }
};

// The hand-over between a reservation's import thread and Commit / Abort.
struct Receiver::Importer {
  absl::Mutex mu;
  bool commit ABSL_GUARDED_BY(mu) = false;
  bool stop ABSL_GUARDED_BY(mu) = false;
  std::atomic<bool> ended{false};    // commit or stop: no byte comes after this
  std::atomic<bool> aborted{false};  // stop: the import ends at its next piece
  absl::Status result;             // set by the thread before it ends
  std::thread thread;

  void End(bool abort) {
    {
      absl::MutexLock lock(&mu);
      (abort ? stop : commit) = true;
      if (abort) aborted = true;
      ended = true;
    }
    if (thread.joinable()) thread.join();
  }
  // Waits for the commit (true) or the abort.
  bool AwaitCommit() {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](Importer* i) ABSL_NO_THREAD_SAFETY_ANALYSIS { return i->commit || i->stop; }, this));
    return !stop;
  }
};

Receiver::Receiver(cache::StateCache* cache, UcxTransport* ucx, ReceiverOptions options)
    : cache_(cache),
      ucx_(ucx),
      options_(options),
      format_(StateFormat::Of(cache->model())),
      path_(options.path.value_or(cache::SelectCacheSlotIoPath(
          cache->options().backend, cache->options().tp_size, ucx->takes_device_memory()))),
      depth_(std::max(kImportDepth, options.import_threads + 2)),
      writers_(std::make_unique<TaskPool>(options.import_threads)),
      reaper_(std::make_unique<cache::QuietRelease>(
          options.device_quiet, static_cast<size_t>(std::max(options.max_open, 1)))) {}

Receiver::~Receiver() {
  absl::MutexLock lock(&mu_);
  while (!pending_.empty()) DropLocked(pending_.begin());
}  // reaper_ then frees what they held, quiet or not

const Decision* Receiver::DecisionLocked(const std::string& transfer_id) const {
  if (auto it = committed_.find(transfer_id); it != committed_.end()) return &it->second.decision;
  auto it = aborted_.find(transfer_id);
  return it == aborted_.end() ? nullptr : &it->second;
}

void Receiver::DecideLocked(const std::string& transfer_id, Decision d, const std::string& peer) {
  if (DecisionLocked(transfer_id) != nullptr) return;  // decided once
  if (d.committed) {
    committed_.emplace(transfer_id, Committed{d, peer, Clock::now()});
    ++unacknowledged_[peer];
    return;
  }
  aborted_.emplace(transfer_id, d);
  aborted_order_.push_back(transfer_id);
  while (static_cast<int32_t>(aborted_order_.size()) > std::max(options_.remembered, 1)) {
    aborted_.erase(aborted_order_.front());  // harmless: unknown ids are answered "aborted"
    aborted_order_.pop_front();
  }
}

void Receiver::ForgetCommitLocked(std::map<std::string, Committed>::iterator it) {
  auto count = unacknowledged_.find(it->second.peer);
  if (count != unacknowledged_.end() && --count->second <= 0) unacknowledged_.erase(count);
  committed_.erase(it);
}

void Receiver::Acknowledge(const std::string& transfer_id, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = committed_.find(transfer_id);
  if (it != committed_.end() && it->second.peer == peer) ForgetCommitLocked(it);
}

absl::Status Receiver::FreeSlot(cache::SlotId slot) {
  absl::MutexLock lock(&mu_);  // a sender's Abort sees the slot and its decision change at once
  auto it = committed_.begin();
  while (it != committed_.end() && it->second.decision.slot != slot) ++it;
  absl::Status st = cache_->Free(slot);
  if (!st.ok() || it == committed_.end()) return st;
  const std::string id = it->first, peer = it->second.peer;
  ForgetCommitLocked(it);
  DecideLocked(id, Decision{}, peer);
  return st;
}

void Receiver::DropLocked(std::map<std::string, Pending>::iterator it) {
  Pending& p = it->second;
  if (p.importer != nullptr) p.importer->End(/*abort=*/true);
  p.writer.reset();  // uncommitted: the cache frees the slot
  // Not pooled: a sender's lanes may still put into it, and its next reservation would import
  // their bytes. Releasing its registration unmaps it, so those puts fail on the sender's
  // side; device memory then goes to the reaper, to be freed off the lock (see reaper_).
  if (p.buffer != nullptr) {
    p.buffer->region.reset();
    if (p.buffer->device != nullptr) {
      // Moved into the release: the reaper is its only owner, so it is freed there.
      reaper_->Add([dev = std::move(p.buffer->device)]() mutable { dev.reset(); });
    }
    p.buffer.reset();
  }
  pending_.erase(it);  // its claim settles as aborted
}

absl::StatusOr<std::unique_ptr<Receiver::Buffer>> Receiver::TakeBufferLocked() {
  if (!spare_.empty()) {
    std::unique_ptr<Buffer> b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }
  auto b = std::make_unique<Buffer>();
  b->payload = cache::SlotPayloadBytes(cache_->model());
  absl::StatusOr<std::unique_ptr<UcxTransport::Region>> r;
  if (path_ == cache::SlotIoPath::kDeviceDirect) {
    absl::StatusOr<std::unique_ptr<cache::BackendBuffer>> d =
        options_.allocate_device ? options_.allocate_device(b->payload)
                                 : cache_->AllocateBackendBuffer(b->payload);
    if (!d.ok()) return d.status();
    b->device = *std::move(d);
    r = ucx_->Register(b->device->data(), b->payload);
  } else {
    r = ucx_->Allocate(Buffer::DoorbellOffset(b->payload) + 64);
  }
  if (!r.ok()) return r.status();
  b->region = *std::move(r);
  return b;
}

int Receiver::ExpireLeases() {
  absl::MutexLock lock(&mu_);
  const Clock::time_point now = Clock::now();
  int n = 0;
  for (auto it = pending_.begin(); it != pending_.end();) {
    const Pending& p = it->second;
    if (!p.committing && now > p.commit_by) {
      const std::string id = it->first, peer = it->second.peer;
      DropLocked(it++);
      DecideLocked(id, Decision{}, peer);
      ++n;
    } else {
      ++it;
    }
  }
  for (auto it = committed_.begin(); it != committed_.end();) {
    if (now - it->second.decided > absl::ToChronoNanoseconds(options_.decision_horizon)) {
      ForgetCommitLocked(it++);
    } else {
      ++it;
    }
  }
  return n;
}

int Receiver::held_device_buffers() const { return reaper_->held(); }
int64_t Receiver::forced_device_frees() const { return reaper_->forced(); }

int Receiver::open() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(pending_.size());
}

absl::StatusOr<Reservation> Receiver::Reserve(const std::string& transfer_id,
                                              const StateFormat& format, int64_t seq_len,
                                              uint32_t checksum_version, absl::Duration budget,
                                              const std::string& peer, uint64_t owner) {
  if (transfer_id.empty()) {
    return absl::InvalidArgumentError("transfer_id: expected a non-empty id, got \"\"");
  }
  if (seq_len < 0) {
    return absl::InvalidArgumentError(absl::StrCat("seq_len: expected >= 0, got ", seq_len));
  }
  if (budget <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("budget: expected the sender's time left for the transfer (> 0), got ",
                     absl::FormatDuration(budget)));
  }
  if (checksum_version != cache::kChecksumVersion) {
    return absl::FailedPreconditionError(
        absl::StrCat("checksum_version: expected ", cache::kChecksumVersion, ", got ",
                     checksum_version, " (a sender of another build: upgrade both sides)"));
  }
  absl::Status st = format_.CheckCompatible(format);  // before any byte moves
  if (!st.ok()) return st;
  ExpireLeases();
  const Clock::time_point now = Clock::now();
  absl::MutexLock lock(&mu_);
  if (const Decision* d = DecisionLocked(transfer_id)) {
    if (d->committed) {
      return absl::AlreadyExistsError(absl::StrCat("transfer_id: ", transfer_id, " is committed"));
    }
    return absl::AbortedError(
        absl::StrCat("transfer_id: ", transfer_id, " was aborted; a new attempt needs a new id"));
  }
  if (auto it = pending_.find(transfer_id); it != pending_.end()) {  // a retried Reserve
    if (!peer.empty() && it->second.peer != peer) {  // never another peer's buffer and key
      return absl::AlreadyExistsError(
          absl::StrCat("transfer_id: ", transfer_id, " is reserved by another peer"));
    }
    if (it->second.seq_len != seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("seq_len: expected ", it->second.seq_len, " (transfer_id ", transfer_id,
                       " is reserved for that many tokens), got ", seq_len));
    }
    return it->second.buffer->Describe(ucx_->address());
  }
  if (static_cast<int32_t>(pending_.size()) >= options_.max_open) {
    return absl::ResourceExhaustedError(
        absl::StrCat("transfers: ", options_.max_open, " reservations are open already"));
  }
  if (auto it = unacknowledged_.find(peer);
      it != unacknowledged_.end() && it->second >= options_.max_unacknowledged_per_peer) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "transfers: peer ", peer.empty() ? "(unnamed)" : peer, " has ", it->second,
        " committed transfers it never acknowledged, the most one peer may; they are kept ",
        absl::FormatDuration(options_.decision_horizon), " after their commit"));
  }
  if (options_.max_open_per_peer > 0) {
    int32_t held = 0;
    for (const auto& [id, pending] : pending_) held += pending.peer == peer ? 1 : 0;
    if (held >= options_.max_open_per_peer) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "transfers: peer ", peer.empty() ? "(unnamed)" : peer, " holds ", held,
          " open reservations, the most one peer may (--transfer-reservations-per-peer)"));
    }
  }
  Claim claim;  // a refusal from here on settles it as aborted
  if (options_.admit) {
    if (absl::Status admitted = options_.admit(owner); !admitted.ok()) return admitted;
    claim = Claim(&options_, owner);
  }
  cache::SlotIoOptions io;
  io.chunk_bytes = options_.chunk_bytes;
  io.path = path_;
  io.staging_buffers = depth_;
  absl::StatusOr<std::unique_ptr<cache::SlotWriter>> writer = cache_->OpenImport(seq_len, io);
  if (!writer.ok()) return writer.status();
  absl::StatusOr<std::unique_ptr<Buffer>> buffer = TakeBufferLocked();
  if (!buffer.ok()) return buffer.status();
  Pending p;
  p.peer = peer;
  p.owner = owner;
  p.seq_len = seq_len;
  p.claim = std::move(claim);
  p.writer = *std::move(writer);
  p.buffer = *std::move(buffer);
  // The sender's commit deadline, never later than the lease.
  p.commit_by =
      now + absl::ToChronoNanoseconds(std::min(budget - AbortReserve(budget), options_.lease));
  if (uint64_t* bell = p.buffer->doorbell()) __atomic_store_n(bell, 0, __ATOMIC_RELEASE);
  StartImporter(p);
  const Reservation r = p.buffer->Describe(ucx_->address());
  pending_.emplace(transfer_id, std::move(p));
  return r;
}

void Receiver::StartImporter(Pending& p) {
  p.importer = std::make_unique<Importer>();
  Importer* in = p.importer.get();
  Buffer* buf = p.buffer.get();
  cache::SlotWriter* writer = p.writer.get();
  in->thread = std::thread([this, in, buf, writer] { in->result = Import(*buf, *in, *writer); });
}

absl::Status Receiver::Import(Buffer& buf, Importer& in, cache::SlotWriter& writer) {
  const size_t total = buf.payload;
  const uint64_t* bell = buf.doorbell();
  if (bell == nullptr) {  // backend memory: every byte once the sender says they landed
    if (!in.AwaitCommit()) return absl::AbortedError("transfer: aborted");
    return writer.Write(0, buf.data(), total, /*backend_memory=*/true);
  }
  // Landed bytes are written in pieces by the writer threads, several at once (each piece
  // hashed by the slot writer as it is copied); at most depth_ pieces are in their hands.
  struct Range {
    size_t offset, size;
  };
  std::vector<Range> pieces;
  size_t landed = 0, submitted = 0, written = 0;
  int idle = 0;
  TaskPool::Batch writes(writers_.get());  // its destructor waits for every write
  while (landed < total || written < pieces.size()) {
    // An abort (taken under the receiver's lock, which waits for this thread) ends it now,
    // not after it wrote every piece still landing; the pieces in the writers' hands finish.
    if (in.aborted.load(std::memory_order_acquire)) return absl::AbortedError("transfer: aborted");
    const size_t now = std::min<size_t>(__atomic_load_n(bell, __ATOMIC_ACQUIRE), total);
    for (size_t off = landed; off < now; off += options_.chunk_bytes) {
      pieces.push_back({off, std::min(options_.chunk_bytes, now - off)});
    }
    landed = std::max(landed, now);
    bool progress = false;
    for (; submitted < pieces.size() && submitted < written + static_cast<size_t>(depth_);
         ++submitted) {
      const Range r = pieces[submitted];
      writes.Submit([&writer, src = buf.data() + r.offset, r] {
        return writer.Write(r.offset, src, r.size);
      });
      progress = true;
    }
    absl::Status st;
    if (written < submitted &&
        writes.WaitFor(written, progress ? absl::ZeroDuration() : absl::Microseconds(50), &st)) {
      if (!st.ok()) return st;
      ++written;
      idle = 0;
      continue;
    }
    if (progress || written < submitted) continue;
    // A commit comes after the sender's last flush: every byte is here, or never will be
    // (the writer's commit then reports what is missing).
    if (in.ended.load(std::memory_order_acquire) &&
        __atomic_load_n(bell, __ATOMIC_ACQUIRE) <= landed) {
      break;
    }
    if (++idle < 256) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  }
  return in.AwaitCommit() ? absl::OkStatus() : absl::AbortedError("transfer: aborted");
}

absl::StatusOr<Decision> Receiver::Commit(const std::string& transfer_id,
                                          const std::vector<int32_t>& tokens, uint64_t checksum,
                                          const std::string& peer) {
  Importer* in = nullptr;
  cache::SlotWriter* writer = nullptr;
  {
    absl::MutexLock lock(&mu_);
    AwaitNoCommitLocked(transfer_id);  // a retry while the first is being committed
    if (const Decision* d = DecisionLocked(transfer_id)) {
      if (d->committed) return *d;
      return absl::AbortedError(absl::StrCat("transfer_id: ", transfer_id, " was aborted"));
    }
    auto it = pending_.find(transfer_id);
    // Another peer's reservation is as unknown to this caller: it neither commits nor aborts it.
    if (it != pending_.end() && !peer.empty() && it->second.peer != peer) it = pending_.end();
    if (it == pending_.end()) {  // nothing to remember: an unknown id can never commit
      return absl::NotFoundError(absl::StrCat("transfer_id: ", transfer_id,
                                              " has no open reservation (expired or never made)"));
    }
    if (Clock::now() > it->second.commit_by) {
      const std::string peer = it->second.peer;
      DropLocked(it);
      DecideLocked(transfer_id, Decision{}, peer);
      return absl::AbortedError(
          absl::StrCat("transfer_id: ", transfer_id,
                       " came after its commit-by time (the sender had given up on it); aborted"));
    }
    it->second.committing = true;
    in = it->second.importer.get();
    writer = it->second.writer.get();
  }
  in->End(/*abort=*/false);
  absl::StatusOr<cache::SlotId> slot = in->result.ok() ? writer->Commit(tokens, checksum)
                                                       : absl::StatusOr<cache::SlotId>(in->result);
  Pending done;
  Decision decision;  // aborted unless the slot committed
  cache::SlotId refused = cache::kPaddingSlot;
  {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(transfer_id);
    done = std::move(it->second);
    pending_.erase(it);
    // Decided now: a commit that ends after the service began draining is aborted (its slot
    // given back below), or the server would stop holding the state its sender let go.
    if (slot.ok() && options_.accepting && !options_.accepting()) {
      refused = *slot;
      slot = absl::UnavailableError(absl::StrCat(
          "transfer_id: ", transfer_id,
          ": the server began draining while it committed: aborted, the sender keeps its source"));
    }
    if (slot.ok()) {
      decision = Decision{true, *slot, static_cast<int64_t>(tokens.size()), done.owner};
    }
    DecideLocked(transfer_id, decision, done.peer);
    done.claim.Settle(slot.ok() ? *slot : cache::kPaddingSlot);
    if (static_cast<int32_t>(spare_.size()) < options_.max_open) {
      spare_.push_back(std::move(done.buffer));
    }
  }
  if (refused != cache::kPaddingSlot) cache_->Free(refused).IgnoreError();  // nobody's handle
  if (!slot.ok()) return slot.status();  // `done` goes: an uncommitted writer frees its slot
  return decision;
}

void Receiver::AwaitNoCommitLocked(const std::string& transfer_id) {
  struct Arg {
    Receiver* r;
    const std::string* id;
  } arg{this, &transfer_id};
  mu_.Await(absl::Condition(
      +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS {
        auto it = a->r->pending_.find(*a->id);
        return it == a->r->pending_.end() || !it->second.committing;
      },
      &arg));
}

absl::StatusOr<Decision> Receiver::Abort(const std::string& transfer_id, const std::string& peer) {
  absl::MutexLock lock(&mu_);
  AwaitNoCommitLocked(transfer_id);
  if (const Decision* d = DecisionLocked(transfer_id)) return *d;
  std::string holder = peer;
  if (auto it = pending_.find(transfer_id); it != pending_.end()) {
    if (!peer.empty() && it->second.peer != peer) {  // not the asker's: undecided, left open
      return absl::NotFoundError(absl::StrCat(
          "transfer_id: ", transfer_id,
          " has no open reservation of this peer (undecided: ask again from the address that "
          "reserved it, or after its lease)"));
    }
    holder = it->second.peer;
    DropLocked(it);
  }
  DecideLocked(transfer_id, Decision{}, holder);  // the aborts' FIFO: commits are never evicted
  return Decision{};
}

}  // namespace replayssm::transfer
