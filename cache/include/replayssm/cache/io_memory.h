// IoMemory: where a caller's buffers live (a forward's LayerIo, the checkpoints of ImportFrom /
// ExportInto, a registered region's lease), which decides whether the cache uses them in place
// or copies them through its pinned staging.
#ifndef REPLAYSSM_CACHE_IO_MEMORY_H_
#define REPLAYSSM_CACHE_IO_MEMORY_H_

#include <cstdint>

namespace replayssm::cache {

// Where the buffers of a LayerIo live.
enum class IoMemory : int32_t {
  // Ordinary host memory (e.g. a gRPC message): copied through the cache's pinned staging.
  kHost = 0,
  // The backend's own memory (device memory on CUDA, host memory on CPU), for co-located
  // callers: used in place, no copies. Work on it is queued on the operation's stream (see
  // Forward::RunLayer); the inputs must stay unchanged until that work is done.
  kBackend = 1,
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_IO_MEMORY_H_
