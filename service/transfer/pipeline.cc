#include "pipeline.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace replayssm::transfer {
namespace {

absl::Status Kernel(rssm_status s, const char* what) {
  if (s == RSSM_OK) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("transfer staging: ", what, ": ", rssm_last_error()));
}

}  // namespace

DataPath SelectDataPath(int32_t backend, bool ucx_cuda_memory) {
  if (backend == RSSM_BACKEND_CPU) return DataPath::kHostDirect;
  return ucx_cuda_memory ? DataPath::kDeviceDirect : DataPath::kHostStaged;
}

const char* DataPathName(DataPath p) {
  switch (p) {
    case DataPath::kHostDirect:
      return "host-direct";
    case DataPath::kDeviceDirect:
      return "device-direct";
    case DataPath::kHostStaged:
      return "host-staged";
  }
  return "unknown";
}

std::vector<Piece> SplitRange(size_t begin, size_t end, size_t bytes_per_layer, size_t chunk) {
  std::vector<Piece> out;
  if (chunk == 0) chunk = bytes_per_layer;
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

std::vector<Piece> SplitPayload(int32_t num_layers, size_t bytes_per_layer, size_t chunk) {
  return SplitRange(0, static_cast<size_t>(num_layers) * bytes_per_layer, bytes_per_layer, chunk);
}

StagingRing::~StagingRing() { Release(); }

void StagingRing::Release() {
  for (void* b : buffers_) rssm_free_host(backend_, b);
  for (void* s : streams_) rssm_stream_destroy(backend_, s);
  buffers_.clear();
  streams_.clear();
  bytes_ = 0;
}

absl::Status StagingRing::Ensure(int32_t backend, int32_t count, size_t bytes) {
  if (backend == backend_ && count == this->count() && bytes == bytes_) return absl::OkStatus();
  Release();
  backend_ = backend;
  for (int32_t i = 0; i < count; ++i) {
    void* b = nullptr;
    void* s = nullptr;
    absl::Status st = Kernel(rssm_alloc_host(backend, bytes, &b), "alloc_host");
    if (st.ok()) st = Kernel(rssm_stream_create(backend, &s), "stream_create");
    if (b != nullptr) buffers_.push_back(b);
    if (!st.ok()) {
      Release();
      return st;
    }
    streams_.push_back(s);
  }
  bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status StagingRing::Copy(int32_t i, void* dst, const void* src, size_t bytes,
                               int32_t kind) {
  const rssm_launch l{backend_, streams_[i]};
  return Kernel(rssm_memcpy(&l, dst, src, bytes, kind), "copy");
}

absl::Status StagingRing::Sync(int32_t i) {
  const rssm_launch l{backend_, streams_[i]};
  return Kernel(rssm_synchronize(&l), "synchronize");
}

TaskPool::TaskPool(int32_t threads) {
  for (int32_t i = 0; i < std::max(threads, 1); ++i) threads_.emplace_back([this] { Loop(); });
}

TaskPool::~TaskPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (std::thread& t : threads_) t.join();
}

void TaskPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TaskPool* p) ABSL_NO_THREAD_SAFETY_ANALYSIS { return p->stop_ || !p->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
  }
}

TaskPool::Batch::~Batch() {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  s.mu.Await(absl::Condition(
      +[](State* st) ABSL_NO_THREAD_SAFETY_ANALYSIS { return st->running == 0; }, &s));
}

size_t TaskPool::Batch::Submit(std::function<absl::Status()> fn) {
  size_t i;
  {
    absl::MutexLock lock(&state_->mu);
    i = state_->results.size();
    state_->results.emplace_back();
    state_->done.push_back(false);
    ++state_->running;
  }
  absl::MutexLock lock(&pool_->mu_);
  pool_->queue_.push_back([state = state_, i, fn = std::move(fn)]() mutable {
    absl::Status st = fn();
    fn = nullptr;  // what it captured goes before the batch may end
    absl::MutexLock lock(&state->mu);
    state->results[i] = std::move(st);
    state->done[i] = true;
    --state->running;
  });
  return i;
}

bool TaskPool::Batch::WaitFor(size_t i, absl::Duration timeout, absl::Status* status) {
  State& s = *state_;
  absl::MutexLock lock(&s.mu);
  struct Arg {
    State* s;
    size_t i;
  } arg{&s, i};
  if (!s.mu.AwaitWithTimeout(
          absl::Condition(+[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->s->done[a->i]; },
                          &arg),
          timeout)) {
    return false;
  }
  *status = s.results[i];
  return true;
}

uint64_t PieceHasher::Submit(size_t offset, const void* data, size_t size) {
  batch_.Submit([this, offset, data, size] {
    sum_.Add(offset, data, size);
    return absl::OkStatus();
  });
  return ++submitted_;
}

void PieceHasher::WaitFor(uint64_t ticket) {
  if (ticket == 0) return;
  absl::Status st;
  batch_.WaitFor(static_cast<size_t>(ticket - 1), absl::InfiniteDuration(), &st);
}

uint64_t PieceHasher::Finish() {
  for (uint64_t t = 1; t <= submitted_; ++t) WaitFor(t);
  return sum_.Digest();
}

void BackendStream::Release() {
  if (!created_) return;
  const rssm_launch l{backend_, stream_};
  rssm_synchronize(&l);  // a stream is destroyed only with nothing queued on it
  rssm_stream_destroy(backend_, stream_);
  created_ = false;
  stream_ = nullptr;
}

absl::StatusOr<void*> BackendStream::Get(int32_t backend) {
  if (created_ && backend == backend_) return stream_;
  Release();
  backend_ = backend;
  absl::Status st = Kernel(rssm_stream_create(backend, &stream_), "stream_create");
  if (!st.ok()) return st;
  created_ = true;
  return stream_;
}

absl::StatusOr<uint64_t> BackendChecksum(const rssm_launch& l, const void* data, size_t bytes,
                                         uint32_t version) {
  return BackendPartsChecksum(l, &data, 1, bytes, version);
}

absl::StatusOr<uint64_t> BackendPartsChecksum(const rssm_launch& l, const void* const* parts,
                                              size_t count, size_t part_bytes, uint32_t version) {
  const size_t bytes = count * part_bytes;
  const bool v2 = version == kChecksumV2;
  const size_t segment =
      v2 ? std::max<size_t>(64, (bytes + 63) & ~size_t{63}) : kChecksumSegmentBytes;
  std::vector<uint64_t> digests((bytes + segment - 1) / segment);
  absl::Status st = Kernel(rssm_segment_digests_parts(&l, parts, count, part_bytes, segment,
                                                      digests.data()),
                           "segment digests");
  if (!st.ok()) return st;
  if (v2) return digests.empty() ? Checksum(nullptr, 0) : digests[0];
  return CombineSegmentDigests(digests.data(), digests.size(), bytes);
}

SlotHasher::SlotHasher(TaskPool* pool, void* stream, const cache::StateCache::CheckpointMemory& m)
    : digest_(absl::InternalError("slot hash: not run")), batch_(pool) {
  batch_.Submit([this, stream, &m] {
    const rssm_launch l{m.backend, stream};
    digest_ = BackendPartsChecksum(l, m.layers.data(), m.layers.size(), m.bytes_per_layer);
    return digest_.status();
  });
}

absl::StatusOr<uint64_t> SlotHasher::Finish() {
  absl::Status st;
  batch_.WaitFor(0, absl::InfiniteDuration(), &st);
  return digest_;
}

}  // namespace replayssm::transfer
