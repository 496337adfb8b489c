// Slot readers and writers (slot_io.h) on the three paths. What they share: the payload's
// layer-major layout over the slot's per-layer checkpoints, and the checksum (a reader hashes
// its slot where it lies, beside the mover's reads; a writer hashes what it copies in, or the
// slot where it lies at the commit when the bytes came from backend memory).
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "replayssm/cache/kernel_status.h"
#include "slot_checksum.h"
#include "slot_io_internal.h"

namespace replayssm::cache {
namespace {

// A piece of the payload inside one layer: payload bytes [offset, offset + size) are bytes
// [layer_offset, layer_offset + size) of layer `layer`'s checkpoint.
struct Piece {
  int32_t layer = 0;
  size_t layer_offset = 0, offset = 0, size = 0;
};

// Pieces of payload bytes [begin, end) of at most `chunk` bytes that never cross a layer.
std::vector<Piece> SplitRange(size_t begin, size_t end, size_t bytes_per_layer, size_t chunk) {
  std::vector<Piece> out;
  for (size_t off = begin; off < end;) {
    Piece p;
    p.layer = static_cast<int32_t>(off / bytes_per_layer);
    p.layer_offset = off % bytes_per_layer;
    p.offset = off;
    p.size = std::min({chunk, end - off, bytes_per_layer - p.layer_offset});
    out.push_back(p);
    off += p.size;
  }
  return out;
}

// Where payload piece p lies in slot `index` (backend memory).
uint8_t* SlotBytes(const SlotPool& pool, int32_t index, const Piece& p) {
  return static_cast<uint8_t*>(pool.LayerPool(p.layer).checkpoint) +
         static_cast<size_t>(index) * pool.CheckpointBytes() + p.layer_offset;
}

size_t PayloadBytes(const SlotPool& pool) {
  return static_cast<size_t>(pool.model().num_layers) * pool.CheckpointBytes();
}

absl::Status ChecksumMismatch() {
  return absl::DataLossError(
      "checksum: the received state does not match the sender's; nothing was committed");
}

// ---- readers ----

// What every reader does: the chunk list, the checksum on a thread of its own (on a lane of
// the cache, beside the reads) and the end of the move.
class ReaderBase : public SlotReader {
 public:
  ReaderBase(SlotIoOwner* owner, const SlotIoSpec& spec, int64_t seq_len,
             std::vector<int32_t> tokens)
      : owner_(owner),
        spec_(spec),
        seq_len_(seq_len),
        tokens_(std::move(tokens)),
        chunks_(SplitRange(0, PayloadBytes(owner->pool()), owner->pool().CheckpointBytes(),
                           spec.chunk_bytes)),
        digest_(absl::FailedPreconditionError(
            "checksum: this reader was opened without one (SlotIoOptions::checksum)")),
        hasher_([this] {
          if (!spec_.checksum) return;
          absl::StatusOr<LanePool::Lease> lane = owner_->lanes().Take();
          digest_ = lane.ok() ? SlotDigest(owner_->pool(), spec_.index, **lane) : lane.status();
        }) {}
  // Derived classes call Finish in their destructors (their buffers go first).

  int64_t seq_len() const override { return seq_len_; }
  const std::vector<int32_t>& tokens() const override { return tokens_; }
  size_t bytes() const override { return PayloadBytes(owner_->pool()); }
  SlotIoPath path() const override { return spec_.path; }
  size_t num_chunks() const override { return chunks_.size(); }

  absl::StatusOr<uint64_t> Checksum() override {
    absl::MutexLock lock(&mu_);
    if (hasher_.joinable()) hasher_.join();
    return digest_;
  }

  void Finish(bool moved) override {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    if (hasher_.joinable()) hasher_.join();
    ReleaseBuffers();
    owner_->EndExport(spec_.index, moved);
  }

 protected:
  // Called once, before the slot is released: nothing of this reader's may still read it.
  virtual void ReleaseBuffers() {}
  SlotChunk ChunkAt(size_t i, const void* data, bool backend_memory) const {
    return SlotChunk{i, chunks_[i].offset, chunks_[i].size, data, backend_memory};
  }

  SlotIoOwner* const owner_;
  const SlotIoSpec spec_;
  const int64_t seq_len_;
  const std::vector<int32_t> tokens_;
  const std::vector<Piece> chunks_;

 private:
  absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::StatusOr<uint64_t> digest_;  // written by hasher_ before it ends
  std::thread hasher_;               // declared last: starts once everything else is set
};

// Host-direct and device-direct: every chunk is a view of the slot's memory.
class DirectReader final : public ReaderBase {
 public:
  using ReaderBase::ReaderBase;
  ~DirectReader() override { Finish(/*moved=*/false); }
  size_t depth() const override { return chunks_.size(); }

  absl::StatusOr<SlotChunk> Next() override {
    const size_t i = next_.fetch_add(1);
    if (i >= chunks_.size()) {
      return absl::OutOfRangeError(
          absl::StrCat("slot reader: all ", chunks_.size(), " chunks were read"));
    }
    return ChunkAt(i, SlotBytes(owner_->pool(), spec_.index, chunks_[i]),
                   spec_.path == SlotIoPath::kDeviceDirect);
  }
  void Done(size_t) override {}

 private:
  std::atomic<size_t> next_{0};
};

// Staged: chunk i is copied device -> host into pinned buffer i % K on that buffer's stream,
// as far ahead as free buffers allow; a buffer is copied into again once its chunk is Done.
class StagedReader final : public ReaderBase {
 public:
  StagedReader(SlotIoOwner* owner, const SlotIoSpec& spec, int64_t seq_len,
               std::vector<int32_t> tokens, StagingPool::Lease ring)
      : ReaderBase(owner, spec, seq_len, std::move(tokens)),
        ring_(std::move(ring)),
        holds_(static_cast<size_t>(ring_->count()), kFree) {}
  ~StagedReader() override { Finish(/*moved=*/false); }
  size_t depth() const override { return static_cast<size_t>(ring_->count()); }

  absl::StatusOr<SlotChunk> Next() override {
    size_t i = 0;
    {
      absl::MutexLock lock(&mu_);
      i = next_;
      if (i >= chunks_.size()) {
        return absl::OutOfRangeError(
            absl::StrCat("slot reader: all ", chunks_.size(), " chunks were read"));
      }
      want_ = std::min(chunks_.size(), i + depth());
      StageLocked();
      if (!error_.ok()) return error_;
      if (staged_ <= i) {
        return absl::FailedPreconditionError(absl::StrCat("slot reader: chunk ", i,
                                                          " needs a staging buffer, but all ",
                                                          depth(), " hold chunks not yet Done"));
      }
      ++next_;
    }
    const int32_t k = Buffer(i);
    absl::Status st = ring_->Sync(k);  // its device -> host copy has landed
    if (!st.ok()) return st;
    return ChunkAt(i, ring_->buffer(k), /*backend_memory=*/false);
  }

  void Done(size_t index) override {
    absl::MutexLock lock(&mu_);
    const int32_t k = Buffer(index);
    if (holds_[k] == index) holds_[k] = kFree;
    StageLocked();
  }

 private:
  static constexpr size_t kFree = ~size_t{0};
  int32_t Buffer(size_t i) const { return static_cast<int32_t>(i % depth()); }

  // Queues the copies of chunks [staged_, want_) whose buffers are free, in order.
  void StageLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (; error_.ok() && staged_ < want_; ++staged_) {
      const int32_t k = Buffer(staged_);
      if (holds_[k] != kFree) return;
      const Piece& p = chunks_[staged_];
      error_ = ring_->Copy(k, ring_->buffer(k), SlotBytes(owner_->pool(), spec_.index, p), p.size,
                           RSSM_COPY_DEVICE_TO_HOST);
      holds_[k] = staged_;
    }
  }

  void ReleaseBuffers() override {
    for (int32_t k = 0; k < ring_->count(); ++k) ring_->Sync(k).IgnoreError();
    ring_.reset();
  }

  StagingPool::Lease ring_;
  absl::Mutex mu_;
  std::vector<size_t> holds_ ABSL_GUARDED_BY(mu_);  // per buffer: the chunk in it, or kFree
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;            // the chunk Next returns
  size_t staged_ ABSL_GUARDED_BY(mu_) = 0;          // chunks [0, staged_) are queued or done
  size_t want_ ABSL_GUARDED_BY(mu_) = 0;            // stage up to here
  absl::Status error_ ABSL_GUARDED_BY(mu_);
};

// ---- writers ----

// What every writer does: range checks, the count of bytes written, the commit's checks and
// the end of the import.
class WriterBase : public ShardSlotWriter {
 public:
  WriterBase(SlotIoOwner* owner, const SlotIoSpec& spec, int64_t seq_len)
      : owner_(owner), spec_(spec), seq_len_(seq_len), total_(PayloadBytes(owner->pool())) {}
  // Derived classes call End in their destructors (their copies end first).

  size_t bytes() const override { return total_; }
  SlotIoPath path() const override { return spec_.path; }

  absl::Status Write(size_t offset, const void* src, size_t size, bool backend_memory) override {
    return WriteRange(offset, src, size, backend_memory, HashAs{});
  }
  absl::Status WriteAndHash(size_t offset, const void* src, size_t size, SegmentedChecksum& sum,
                            size_t sum_offset) override {
    return WriteRange(offset, src, size, false,
                      HashAs{&sum, static_cast<int64_t>(sum_offset) - static_cast<int64_t>(offset)});
  }

  absl::StatusOr<SlotId> Commit(absl::Span<const int32_t> tokens, uint64_t checksum) override {
    if (ended_.exchange(true)) {
      return absl::FailedPreconditionError("slot writer: already committed");
    }
    absl::Status st = Drain();
    if (st.ok() && static_cast<int64_t>(tokens.size()) != seq_len_) {
      st = absl::FailedPreconditionError(absl::StrCat(
          "tokens: expected ", seq_len_, " (the reserved seq_len), got ", tokens.size()));
    }
    if (st.ok() && written_.load() != total_) {
      st = absl::DataLossError(absl::StrCat("payload: ", written_.load(), " of ", total_,
                                            " bytes arrived before the commit"));
    }
    absl::StatusOr<uint64_t> got =
        !st.ok() ? absl::StatusOr<uint64_t>(st) : spec_.checksum ? Digest() : checksum;
    if (got.ok() && *got != checksum) got = ChecksumMismatch();
    if (!got.ok()) {
      owner_->DropImport(spec_.index);
      return got.status();
    }
    return owner_->CommitImport(spec_.index, tokens);
  }

 protected:
  // Where a write's bytes are hashed besides (or instead of) the writer's own checksum: into
  // `sum` as its bytes [offset + shift, ...) (WriteAndHash); none: sum == nullptr.
  struct HashAs {
    SegmentedChecksum* sum = nullptr;
    int64_t shift = 0;
  };

  // dst <- src, and the bytes hashed as payload bytes [offset, offset + n): into `as.sum` when
  // set, else into `own` unless the writer was opened without a checksum.
  void CopyHashed(SegmentedChecksum& own, const HashAs& as, void* dst, const void* src,
                  size_t offset, size_t n) {
    if (as.sum != nullptr) {
      as.sum->CopyAndAdd(dst, src, static_cast<size_t>(static_cast<int64_t>(offset) + as.shift), n);
    } else if (spec_.checksum) {
      own.CopyAndAdd(dst, src, offset, n);
    } else {
      std::memcpy(dst, src, n);
    }
  }
  // Copies one piece (inside one layer) into the slot and hashes it (CopyHashed).
  virtual absl::Status Copy(const Piece& p, const uint8_t* src, bool backend_memory,
                            const HashAs& as) = 0;
  // Waits for every copy queued; the first error of one.
  virtual absl::Status Drain() = 0;
  // The checksum of what the slot got, once drained.
  virtual absl::StatusOr<uint64_t> Digest() = 0;
  // For destructors: an uncommitted import's slot is freed once its copies ended.
  void End() {
    if (ended_.exchange(true)) return;
    Drain().IgnoreError();
    owner_->DropImport(spec_.index);
  }

  SlotIoOwner* const owner_;
  const SlotIoSpec spec_;
  const int64_t seq_len_;
  const size_t total_;

 private:
  absl::Status WriteRange(size_t offset, const void* src, size_t size, bool backend_memory,
                          const HashAs& as) {
    if (ended_.load()) return absl::FailedPreconditionError("slot writer: already committed");
    if (offset > total_ || size > total_ - offset) {
      return absl::InvalidArgumentError(absl::StrCat("offset, size: expected a range inside the ",
                                                     total_, "-byte payload, got [", offset, ", ",
                                                     offset + size, ")"));
    }
    if (size > 0 && src == nullptr) {
      return absl::InvalidArgumentError("src: expected a non-null pointer, got NULL");
    }
    absl::Status st = absl::OkStatus();
    for (const Piece& p :
         SplitRange(offset, offset + size, owner_->pool().CheckpointBytes(), total_)) {
      st = Copy(p, static_cast<const uint8_t*>(src) + (p.offset - offset), backend_memory, as);
      if (!st.ok()) break;
    }
    if (st.ok()) written_ += size;
    return st;
  }

  std::atomic<size_t> written_{0};
  std::atomic<bool> ended_{false};
};

// Host-direct: the slot is host memory; each piece is copied into it and hashed from there
// in L1-sized pieces (one pass over the source).
class HostWriter final : public WriterBase {
 public:
  HostWriter(SlotIoOwner* owner, const SlotIoSpec& spec, int64_t seq_len)
      : WriterBase(owner, spec, seq_len), sum_(total_) {}
  ~HostWriter() override { End(); }

 private:
  absl::Status Copy(const Piece& p, const uint8_t* src, bool, const HashAs& as) override {
    CopyHashed(sum_, as, SlotBytes(owner_->pool(), spec_.index, p), src, p.offset, p.size);
    return absl::OkStatus();
  }
  absl::Status Drain() override { return absl::OkStatus(); }
  absl::StatusOr<uint64_t> Digest() override { return sum_.Digest(); }

  SegmentedChecksum sum_;
};

// Staged: each piece is copied into a free pinned buffer and hashed there (what is hashed is
// the source of the host -> device copy into the slot), then copied into the slot on that
// buffer's stream; the buffer's next user waits for that copy first.
class StagedWriter final : public WriterBase {
 public:
  StagedWriter(SlotIoOwner* owner, const SlotIoSpec& spec, int64_t seq_len, StagingPool::Lease ring)
      : WriterBase(owner, spec, seq_len), sum_(total_), ring_(std::move(ring)) {
    for (int32_t k = 0; k < ring_->count(); ++k) free_.push_back(k);
  }
  ~StagedWriter() override { End(); }

 private:
  absl::Status Copy(const Piece& p, const uint8_t* src, bool backend_memory,
                    const HashAs& as) override {
    if (backend_memory) {
      return absl::InvalidArgumentError(
          "backend_memory: the staged path takes host memory; expected false, got true");
    }
    absl::Status st = absl::OkStatus();
    for (size_t done = 0; st.ok() && done < p.size;) {
      const size_t n = std::min(p.size - done, ring_->bytes());
      const int32_t k = TakeBuffer();
      st = ring_->Sync(k);  // its last copy into a slot has landed
      if (st.ok()) {
        CopyHashed(sum_, as, ring_->buffer(k), src + done, p.offset + done, n);
        Piece part = p;
        part.layer_offset += done;
        st = ring_->Copy(k, SlotBytes(owner_->pool(), spec_.index, part), ring_->buffer(k), n,
                         RSSM_COPY_HOST_TO_DEVICE);
      }
      GiveBuffer(k, st);
      done += n;
    }
    return st;
  }

  absl::Status Drain() override {
    absl::Status first;
    for (int32_t k = 0; k < ring_->count(); ++k) {
      absl::Status st = ring_->Sync(k);
      if (first.ok()) first = st;
    }
    absl::MutexLock lock(&mu_);
    return first.ok() ? error_ : first;
  }
  absl::StatusOr<uint64_t> Digest() override { return sum_.Digest(); }

  int32_t TakeBuffer() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](std::vector<int32_t>* f) { return !f->empty(); }, &free_));
    const int32_t k = free_.back();
    free_.pop_back();
    return k;
  }
  void GiveBuffer(int32_t k, const absl::Status& st) {
    absl::MutexLock lock(&mu_);
    free_.push_back(k);
    if (error_.ok()) error_ = st;
  }

  SegmentedChecksum sum_;
  StagingPool::Lease ring_;
  absl::Mutex mu_;
  std::vector<int32_t> free_ ABSL_GUARDED_BY(mu_);  // buffers not in a copy's hands
  absl::Status error_ ABSL_GUARDED_BY(mu_);         // the first failed copy's
};

// Device-direct: each piece is copied into the slot on a lane of the cache (device to device,
// or host to device), and the slot is hashed where it lies at the commit.
class DeviceWriter final : public WriterBase {
 public:
  using WriterBase::WriterBase;
  ~DeviceWriter() override { End(); }

 private:
  absl::Status Copy(const Piece& p, const uint8_t* src, bool backend_memory,
                    const HashAs& as) override {
    absl::StatusOr<LanePool::Lease> lane = owner_->lanes().Take();
    if (!lane.ok()) return lane.status();
    uint8_t* dst = SlotBytes(owner_->pool(), spec_.index, p);
    // A group's payload bytes (WriteAndHash: host memory) are hashed here; the writer's own
    // checksum hashes the slot where it lies at the commit.
    if (as.sum != nullptr) {
      as.sum->Add(static_cast<size_t>(static_cast<int64_t>(p.offset) + as.shift), src, p.size);
    }
    absl::Status st;
    if (backend_memory) {
      const rssm_launch l = (*lane)->Launch();
      st = KernelStatus(rssm_memcpy(&l, dst, src, p.size, RSSM_COPY_DEVICE_TO_DEVICE),
                        "slot writer: copy");
    } else {
      st = (*lane)->Upload(dst, src, p.size);
    }
    const absl::Status done = (*lane)->Synchronize();
    return st.ok() ? done : st;
  }
  absl::Status Drain() override { return absl::OkStatus(); }  // every Copy waited for itself
  absl::StatusOr<uint64_t> Digest() override {
    absl::StatusOr<LanePool::Lease> lane = owner_->lanes().Take();
    if (!lane.ok()) return lane.status();
    return SlotDigest(owner_->pool(), spec_.index, **lane);
  }
};

class PooledBackendBuffer final : public BackendBuffer {
 public:
  explicit PooledBackendBuffer(DeviceBuffer b) : b_(std::move(b)) {}
  void* data() const override { return b_.data(); }
  size_t size() const override { return b_.size(); }

 private:
  DeviceBuffer b_;
};

}  // namespace

size_t SlotPayloadBytes(const ModelSpec& m) {
  return static_cast<size_t>(m.num_layers) * static_cast<size_t>(m.LayerStateBytes());
}

const char* SlotIoPathName(SlotIoPath path) {
  switch (path) {
    case SlotIoPath::kHostDirect:
      return "host-direct";
    case SlotIoPath::kStaged:
      return "staged";
    case SlotIoPath::kDeviceDirect:
      return "device-direct";
  }
  return "unknown";
}

SlotIoPath SelectSlotIoPath(int32_t backend, bool transport_takes_backend_memory) {
  if (backend == RSSM_BACKEND_CPU) return SlotIoPath::kHostDirect;
  return transport_takes_backend_memory ? SlotIoPath::kDeviceDirect : SlotIoPath::kStaged;
}

SlotIoPath SelectCacheSlotIoPath(int32_t backend, int32_t tp_size,
                                 bool transport_takes_backend_memory) {
  return SelectSlotIoPath(backend, transport_takes_backend_memory && tp_size <= 1);
}

absl::StatusOr<SlotIoSpec> ResolveSlotIo(int32_t backend, const SlotIoOptions& options) {
  SlotIoSpec spec;
  spec.path =
      options.path.value_or(SelectSlotIoPath(backend, options.transport_takes_backend_memory));
  if (spec.path == SlotIoPath::kHostDirect && backend != RSSM_BACKEND_CPU) {
    return absl::InvalidArgumentError(
        "path: host-direct reads slot memory as host memory; expected the CPU backend, got "
        "CUDA");
  }
  if (options.chunk_bytes == 0) {
    return absl::InvalidArgumentError("chunk_bytes: expected > 0, got 0");
  }
  if (options.staging_buffers < 2 || options.staging_buffers > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_buffers: expected 2..256, got ", options.staging_buffers));
  }
  spec.chunk_bytes = options.chunk_bytes;
  spec.staging_buffers = options.staging_buffers;
  spec.checksum = options.checksum;
  return spec;
}

absl::StatusOr<std::unique_ptr<SlotReader>> NewSlotReader(SlotIoOwner* owner,
                                                          const SlotIoSpec& spec, int64_t seq_len,
                                                          std::vector<int32_t> tokens) {
  if (spec.path != SlotIoPath::kStaged) {
    return std::make_unique<DirectReader>(owner, spec, seq_len, std::move(tokens));
  }
  absl::StatusOr<StagingPool::Lease> ring = owner->staging().Take(
      spec.staging_buffers, std::min(spec.chunk_bytes, owner->pool().CheckpointBytes()));
  if (!ring.ok()) return ring.status();
  return std::make_unique<StagedReader>(owner, spec, seq_len, std::move(tokens), *std::move(ring));
}

absl::StatusOr<std::unique_ptr<ShardSlotWriter>> NewSlotWriter(SlotIoOwner* owner,
                                                               const SlotIoSpec& spec,
                                                               int64_t seq_len) {
  switch (spec.path) {
    case SlotIoPath::kHostDirect:
      return std::make_unique<HostWriter>(owner, spec, seq_len);
    case SlotIoPath::kDeviceDirect:
      return std::make_unique<DeviceWriter>(owner, spec, seq_len);
    case SlotIoPath::kStaged:
      break;
  }
  absl::StatusOr<StagingPool::Lease> ring = owner->staging().Take(
      spec.staging_buffers, std::min(spec.chunk_bytes, owner->pool().CheckpointBytes()));
  if (!ring.ok()) return ring.status();
  return std::make_unique<StagedWriter>(owner, spec, seq_len, *std::move(ring));
}

absl::StatusOr<std::unique_ptr<BackendBuffer>> NewBackendBuffer(int32_t backend, size_t bytes) {
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(backend, bytes);
  if (!b.ok()) return b.status();
  return std::make_unique<PooledBackendBuffer>(*std::move(b));
}

absl::StatusOr<uint64_t> SlotDigest(const SlotPool& pool, int32_t index, Lane& lane) {
  const size_t per = pool.CheckpointBytes();
  const size_t count = static_cast<size_t>(pool.model().num_layers);
  const size_t total = count * per;
  const size_t segments = (total + kChecksumSegmentBytes - 1) / kChecksumSegmentBytes;
  if (segments == 0) return CombineSegmentDigests(nullptr, 0, 0);
  std::vector<const void*> parts(count);
  for (size_t l = 0; l < count; ++l) {
    parts[l] = SlotBytes(pool, index, Piece{static_cast<int32_t>(l), 0, l * per, per});
  }
  Scratch& s = lane.scratch;
  absl::Status st = s.ReserveDigests(lane.backend(), segments, count);
  // The device reads the part table from backend memory: uploaded ahead on the same stream.
  if (st.ok()) st = lane.Upload(s.digest_parts.data(), parts.data(), count * sizeof(void*));
  if (!st.ok()) return st;
  const rssm_launch l = lane.Launch();
  st = KernelStatus(
      rssm_segment_digests_parts(&l, parts.data(), s.digest_parts.as<const void*>(), count, per,
                                 kChecksumSegmentBytes, s.digests.as<uint64_t>()),
      "slot checksum");
  std::vector<uint64_t> digests(segments);
  if (st.ok()) st = lane.Download(digests.data(), s.digests.data(), segments * sizeof(uint64_t));
  const absl::Status done = lane.Synchronize();
  if (!st.ok()) return st;
  if (!done.ok()) return done;
  return CombineSegmentDigests(digests.data(), segments, total);
}

}  // namespace replayssm::cache
