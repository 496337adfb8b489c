#include "lane.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

namespace replayssm::cache {
namespace {

// Staged regions start at this alignment (DMA engines move aligned blocks fastest).
constexpr size_t kAlign = 256;

size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

absl::Status Scratch::Grow(DeviceBuffer& buf, int32_t backend, size_t bytes) {
  if (buf.size() >= bytes) return absl::OkStatus();
  absl::StatusOr<DeviceBuffer> b = DeviceBuffer::Allocate(backend, std::max(bytes, 2 * buf.size()));
  if (!b.ok()) return b.status();
  if (buf.data() != nullptr) retired.push_back(std::move(buf));
  buf = std::move(*b);
  return absl::OkStatus();
}

absl::Status Scratch::Reserve(int32_t backend, const ModelSpec& m, int64_t tokens, int64_t rows) {
  const size_t es = rssm_dtype_size(m.shape.act_dtype);
  for (auto [buf, bytes] : {std::pair{&qkv, tokens * m.QkvWidth() * es},
                            {&a, tokens * m.AWidth() * es},
                            {&b, tokens * m.BWidth() * es},
                            {&out, tokens * m.OutWidth() * es},
                            {&conv, m.conv_width > 0 ? tokens * m.QkvWidth() * es : 0},
                            {&slot_idx, rows * 4},
                            {&write_pos, rows * 4},
                            {&cu, (rows + 1) * 4},
                            {&fold_idx, rows * 4},
                            {&fold_pos, rows * 4},
                            {&flags, rows}}) {
    absl::Status s = Grow(*buf, backend, static_cast<size_t>(bytes));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Scratch::ReserveConv(int32_t backend, const ModelSpec& m, int64_t tokens) {
  if (m.conv_width == 0) return absl::OkStatus();
  const size_t es = rssm_dtype_size(m.shape.act_dtype);
  return Grow(conv, backend, static_cast<size_t>(tokens * m.QkvWidth()) * es);
}

absl::Status Scratch::ReserveDigests(int32_t backend, size_t segments, size_t parts) {
  absl::Status s = Grow(digests, backend, segments * sizeof(uint64_t));
  if (s.ok()) s = Grow(digest_parts, backend, parts * sizeof(void*));
  return s;
}

size_t LaneHostBytes(const ModelSpec& m, int64_t max_batch) {
  const int64_t es = static_cast<int64_t>(rssm_dtype_size(m.shape.act_dtype));
  const int64_t acts = max_batch * (m.QkvWidth() + m.AWidth() + m.BWidth() + m.OutWidth()) * es;
  const int64_t index = 5 * (max_batch + 1) * 4;  // slot_idx, write_pos, cu, fold_idx/pos
  return AlignUp(static_cast<size_t>(acts)) + 10 * kAlign + static_cast<size_t>(index);
}

absl::StatusOr<std::unique_ptr<Lane>> Lane::Create(int32_t backend, size_t host_bytes,
                                                   int32_t max_waits) {
  host_bytes = std::max(AlignUp(host_bytes), kAlign);
  max_waits = std::max(max_waits, 0);
  // The release word, then two outcome words per wait.
  const size_t bell_bytes = (1 + 2 * static_cast<size_t>(max_waits)) * 4;
  void* stream = nullptr;
  absl::Status s = KernelStatus(rssm_stream_create(backend, &stream), "lane stream");
  if (!s.ok()) return s;
  void* bells = nullptr;
  s = KernelStatus(rssm_alloc_host(backend, bell_bytes, &bells), "lane doorbell release words");
  if (!s.ok()) {
    rssm_stream_destroy(backend, stream);
    return s;
  }
  std::memset(bells, 0, bell_bytes);
  return std::unique_ptr<Lane>(
      new Lane(backend, stream, host_bytes, static_cast<uint32_t*>(bells), max_waits));
}

Lane::~Lane() {
  (void)Synchronize();  // nothing may still use the stream or the staging
  rssm_stream_destroy(backend_, stream_);
  rssm_free_host(backend_, host_);
  rssm_free_host(backend_, bells_);
}

void Lane::SettleRelease() {
  std::atomic_ref<uint32_t>(*bells_).store(ticket_, std::memory_order_release);
}

absl::StatusOr<char*> Lane::Take(size_t want, size_t* got) {
  if (host_ == nullptr) {
    absl::Status s = KernelStatus(rssm_alloc_host(backend_, host_bytes_, &host_), "lane staging");
    if (!s.ok()) return s;
  }
  if (host_used_ >= host_bytes_) {
    absl::Status s = Synchronize();  // the queued copies still read or fill the buffer
    if (!s.ok()) return s;
  }
  char* p = static_cast<char*>(host_) + host_used_;
  *got = std::min(want, host_bytes_ - host_used_);
  host_used_ = std::min(host_bytes_, AlignUp(host_used_ + *got));
  return p;
}

bool Lane::FitsWithoutWait(int count, size_t bytes) const {
  return host_used_ + count * AlignUp(bytes) <= host_bytes_;
}

absl::Status Lane::Upload(void* dst, const void* src, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    size_t n = 0;
    absl::StatusOr<char*> staged = Take(bytes - done, &n);
    if (!staged.ok()) return staged.status();
    std::memcpy(*staged, static_cast<const char*>(src) + done, n);
    const rssm_launch l = Launch();
    absl::Status s = KernelStatus(
        rssm_memcpy(&l, static_cast<char*>(dst) + done, *staged, n, RSSM_COPY_HOST_TO_DEVICE),
        "upload");
    if (!s.ok()) return s;
    done += n;
  }
  return absl::OkStatus();
}

absl::Status Lane::Download(void* dst, const void* src, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    size_t n = 0;
    absl::StatusOr<char*> staged = Take(bytes - done, &n);
    if (!staged.ok()) return staged.status();
    const rssm_launch l = Launch();
    absl::Status s = KernelStatus(
        rssm_memcpy(&l, *staged, static_cast<const char*>(src) + done, n, RSSM_COPY_DEVICE_TO_HOST),
        "download");
    if (!s.ok()) return s;
    downloads_.push_back({static_cast<char*>(dst) + done, *staged, n});
    done += n;
  }
  return absl::OkStatus();
}

absl::Status Lane::Synchronize() {
  absl::Status s = absl::OkStatus();
  if (queued_) {
    const rssm_launch l{backend_, stream_};
    s = KernelStatus(rssm_synchronize(&l), "synchronize");
  }
  if (s.ok()) {
    for (const PendingDownload& d : downloads_) std::memcpy(d.dst, d.staged, d.bytes);
  }
  downloads_.clear();
  host_used_ = 0;
  queued_ = false;
  return s;
}

void LanePool::Lease::reset() {
  if (lane_ == nullptr) return;
  (void)lane_->Synchronize();  // the next user must find it idle
  lane_->SettleRelease();
  absl::MutexLock lock(&pool_->mu_);
  pool_->free_.push_back(std::move(lane_));
  pool_ = nullptr;
}

absl::StatusOr<LanePool::Lease> LanePool::Take() {
  Lease lease;
  lease.pool_ = this;
  {
    absl::MutexLock lock(&mu_);
    if (!free_.empty()) {
      lease.lane_ = std::move(free_.back());
      free_.pop_back();
      return lease;
    }
  }
  absl::StatusOr<std::unique_ptr<Lane>> lane = Lane::Create(backend_, host_bytes_, max_waits_);
  if (!lane.ok()) return lane.status();
  lease.lane_ = std::move(*lane);
  absl::MutexLock lock(&mu_);
  ++made_;
  return lease;
}

int64_t LanePool::size() const {
  absl::MutexLock lock(&mu_);
  return made_;
}

}  // namespace replayssm::cache

namespace replayssm::cache {

absl::StatusOr<std::unique_ptr<StagingRing>> StagingRing::Create(int32_t backend, int32_t count,
                                                                 size_t bytes) {
  std::unique_ptr<StagingRing> r(new StagingRing(backend, bytes));
  for (int32_t i = 0; i < count; ++i) {
    void* b = nullptr;
    void* s = nullptr;
    absl::Status st = KernelStatus(rssm_alloc_host(backend, bytes, &b), "staging buffer");
    if (!st.ok()) return st;
    r->buffers_.push_back(b);
    st = KernelStatus(rssm_stream_create(backend, &s), "staging stream");
    if (!st.ok()) return st;
    r->streams_.push_back(s);
  }
  return r;
}

StagingRing::~StagingRing() {
  for (size_t i = 0; i < streams_.size(); ++i) {
    Sync(static_cast<int32_t>(i)).IgnoreError();
    rssm_stream_destroy(backend_, streams_[i]);
  }
  for (void* b : buffers_) rssm_free_host(backend_, b);
}

absl::Status StagingRing::Copy(int32_t i, void* dst, const void* src, size_t n, int32_t kind) {
  const rssm_launch l{backend_, streams_[i]};
  return KernelStatus(rssm_memcpy(&l, dst, src, n, kind), "staging copy");
}

absl::Status StagingRing::Sync(int32_t i) {
  const rssm_launch l{backend_, streams_[i]};
  return KernelStatus(rssm_synchronize(&l), "staging synchronize");
}

void StagingPool::Lease::reset() {
  if (ring_ == nullptr) return;
  for (int32_t i = 0; i < ring_->count(); ++i) ring_->Sync(i).IgnoreError();
  absl::MutexLock lock(&pool_->mu_);
  pool_->idle_.push_back(std::move(ring_));
}

int64_t StagingPool::made() const {
  absl::MutexLock lock(&mu_);
  return made_;
}

absl::StatusOr<StagingPool::Lease> StagingPool::Take(int32_t count, size_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    for (auto it = idle_.begin(); it != idle_.end(); ++it) {
      if ((*it)->count() == count && (*it)->bytes() == bytes) {
        Lease l(this, std::move(*it));
        idle_.erase(it);
        return l;
      }
    }
  }
  absl::StatusOr<std::unique_ptr<StagingRing>> r = StagingRing::Create(backend_, count, bytes);
  if (!r.ok()) return r.status();
  absl::MutexLock lock(&mu_);
  ++made_;
  return Lease(this, *std::move(r));
}

}  // namespace replayssm::cache
