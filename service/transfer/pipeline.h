// The pieces of the chunked transfer pipeline shared by Sender and Receiver: how a payload
// (all layers' checkpoints, layer-major) splits into chunks, a ring of pinned host staging
// buffers with one backend stream each, and a hashing thread that runs beside the puts.
//
// Thread safety: StagingRing is used by one transfer at a time (its owner's lock);
// HashWorker's methods may be called from one producer thread while its own thread hashes.
#ifndef REPLAYSSM_SERVICE_TRANSFER_PIPELINE_H_
#define REPLAYSSM_SERVICE_TRANSFER_PIPELINE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "checksum.h"
#include "replayssm/cache/state_cache.h"

namespace replayssm::transfer {

// How the bytes of a slot reach UCX on one side of a transfer.
enum class DataPath {
  kHostDirect,    // CPU backend: slot memory is host memory; put from / import into it as is
  kDeviceDirect,  // CUDA backend and a UCX with CUDA memory: device memory goes to UCX as is
  kHostStaged,    // CUDA backend, UCX without CUDA memory: chunks through pinned host buffers
};
DataPath SelectDataPath(int32_t backend, bool ucx_cuda_memory);
const char* DataPathName(DataPath p);

// One chunk of the payload: bytes [offset, offset + size) of the layer-major payload, which
// are bytes [layer_offset, layer_offset + size) of layer `layer`'s checkpoint.
struct Piece {
  int32_t layer = 0;
  size_t layer_offset = 0, offset = 0, size = 0;
};
// Chunks of at most `chunk` bytes that never cross a layer boundary.
std::vector<Piece> SplitPayload(int32_t num_layers, size_t bytes_per_layer, size_t chunk);
// Pieces of [begin, end) of the payload (for a receiver consuming what has landed).
std::vector<Piece> SplitRange(size_t begin, size_t end, size_t bytes_per_layer, size_t chunk);

// `count` pinned host buffers of `bytes` each (rssm_alloc_host) and one stream per buffer
// (rssm_stream_create): copy into buffer i on stream i, synchronize stream i before use.
class StagingRing {
 public:
  StagingRing() = default;
  ~StagingRing();
  StagingRing(const StagingRing&) = delete;
  StagingRing& operator=(const StagingRing&) = delete;
  // (Re)allocates when the backend, count or size differ from what is held.
  absl::Status Ensure(int32_t backend, int32_t count, size_t bytes);
  int32_t count() const { return static_cast<int32_t>(buffers_.size()); }
  uint8_t* buffer(int32_t i) const { return static_cast<uint8_t*>(buffers_[i]); }
  // Enqueues a copy (rssm_copy_kind) on stream i; Sync waits for everything on it.
  absl::Status Copy(int32_t i, void* dst, const void* src, size_t bytes, int32_t kind);
  absl::Status Sync(int32_t i);

 private:
  void Release();
  int32_t backend_ = RSSM_BACKEND_CPU;
  size_t bytes_ = 0;
  std::vector<void*> buffers_, streams_;
};

// Hashes submitted host ranges in order on its own thread (the sender's checksum runs beside
// its puts instead of before them).
class HashWorker {
 public:
  HashWorker();
  ~HashWorker();
  // Queues data[0, size) (valid until WaitFor(ticket) returns); returns its ticket.
  uint64_t Submit(const void* data, size_t size);
  void WaitFor(uint64_t ticket);
  uint64_t Finish();  // waits for everything; the digest

 private:
  void Loop();
  absl::Mutex mu_;
  std::deque<std::pair<const void*, size_t>> queue_ ABSL_GUARDED_BY(mu_);
  uint64_t submitted_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  Checksummer sum_;  // only the worker thread touches it until Finish
  std::thread thread_;
};

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_SERVICE_TRANSFER_PIPELINE_H_
