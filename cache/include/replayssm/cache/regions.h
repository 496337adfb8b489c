// RegionTable: memory that co-located clients register once so that tensors and doorbells can
// live there instead of travelling inline (Triton's shared-memory extension is the model).
// Two kinds: POSIX shared memory (host memory; usable in place by the CPU backend, copied
// through staging by the CUDA backend) and CUDA IPC (device memory another process allocated;
// in place on the CUDA backend only). Names are the client's, one table per server.
//
// Ownership: the table maps a region once at Register and keeps the mapping while it is
// registered; every RegionLease (a checked range, held by a forward while it may touch it)
// keeps it too, so Unregister while a forward uses the region takes the name away at once
// (new uses: NOT_FOUND) and unmaps only when the last lease has gone. On CUDA, unmapping a
// client's IPC region waits for every running kernel and holds every other CUDA call of the
// process meanwhile (an H100, 2026-12-07: bench/results/gpu_tests.md), a planned forward's
// doorbell waits among them: a table given `device_quiet` (the service on CUDA: no planned
// forward open) holds a CUDA region's unmapping until then, on a thread of its own
// (QuietRelease, past 16 held the oldest at once).
//
// Thread safety: every method is thread-safe.
#ifndef REPLAYSSM_CACHE_REGIONS_H_
#define REPLAYSSM_CACHE_REGIONS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "replayssm/cache/io_memory.h"

namespace replayssm::cache {

enum class RegionKind : int32_t { kSystem = 0, kCuda = 1 };

struct RegionSpec {
  std::string name;         // 1..128 characters, unique among registered regions
  RegionKind kind = RegionKind::kSystem;
  std::string shm_key;      // kSystem: the shm_open name, e.g. "/engine0"
  std::string cuda_handle;  // kCuda: the 64 bytes of a cudaIpcMemHandle_t
  int32_t device = 0;       // kCuda: the device the memory lives on
  uint64_t offset = 0;      // where the region starts in the shm object / the allocation
  uint64_t bytes = 0;       // the region's size, > 0
};

struct RegionLimits {
  int32_t max_regions = 64;           // registered at once
  uint64_t max_bytes = 64ULL << 30;   // all registered regions together (address space only)
  // kSystem keys must start with it (the service: "/<tenant>:" with tenants); "": any name.
  std::string key_prefix;
};

struct RegionInfo {
  std::string name;
  RegionKind kind = RegionKind::kSystem;
  uint64_t bytes = 0;
  int32_t device = 0;
  int64_t leases = 0;  // forwards (and other users) holding a range of it now
  absl::Time last_use = absl::InfinitePast();  // registered, or a lease taken (Acquire*)
};

class QuietRelease;  // quiet_release.h

namespace internal {
struct Mapping;  // one mapped region; unmapped by its destructor
}  // namespace internal

// A checked range of a registered region, valid while the lease lives (the mapping cannot
// go away under it). Copyable: copies share the hold.
class RegionLease {
 public:
  RegionLease() = default;
  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  // How the cache must treat the memory: in place (backend memory) or through staging.
  IoMemory memory() const { return memory_; }
  // For a lease of a whole region (RegionTable::AcquireWhole): the address of bytes
  // [offset, offset + bytes), checked as RegionTable::Acquire checks them (same errors).
  absl::StatusOr<void*> Within(uint64_t offset, uint64_t bytes, uint64_t alignment,
                               const std::string& field) const;
  // Whether both hold the same registration's mapping (a name unregistered and registered
  // again maps anew).
  bool SameMapping(const RegionLease& other) const { return hold_ == other.hold_; }
  // The same check without an error: the address, or null when Within would refuse.
  void* Contains(uint64_t offset, uint64_t bytes, uint64_t alignment) const {
    const uintptr_t at = reinterpret_cast<uintptr_t>(data_) + offset;
    const bool ok = bytes != 0 && offset <= bytes_ && bytes <= bytes_ - offset &&
                    (alignment <= 1 || at % alignment == 0);
    return ok ? reinterpret_cast<void*>(at) : nullptr;
  }

 private:
  friend class RegionTable;
  std::shared_ptr<internal::Mapping> hold_;
  void* data_ = nullptr;
  uint64_t bytes_ = 0;
  IoMemory memory_ = IoMemory::kHost;
};

class RegionTable {
 public:
  // backend: the cache's (a kCuda region needs RSSM_BACKEND_CUDA). device_quiet: as above;
  // null: every mapping is unmapped at once by whoever drops it last.
  RegionTable(int32_t backend, RegionLimits limits,
              std::function<bool()> device_quiet = nullptr);
  ~RegionTable();
  RegionTable(const RegionTable&) = delete;
  RegionTable& operator=(const RegionTable&) = delete;

  // Maps the region. INVALID_ARGUMENT naming the field by its wire name (name, key, device,
  // byte_size: the object or allocation must hold offset + byte_size), ALREADY_EXISTS for a
  // registered name, RESOURCE_EXHAUSTED past the limits, UNIMPLEMENTED for CUDA on the CPU,
  // PERMISSION_DENIED for a shm key outside limits.key_prefix (before it is opened). A shm
  // object that is missing, not openable or too short gets one message that names only what
  // the caller sent: errors never tell whether an object exists or how large it is.
  absl::Status Register(const RegionSpec& spec) ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND for an unknown name. The memory stays mapped while leases hold it, and counts
  // against the limits until then.
  absl::Status Unregister(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  // One region (NOT_FOUND when unknown) or, with an empty name, all of them.
  absl::StatusOr<std::vector<RegionInfo>> Status(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Bytes [offset, offset + bytes) of region `name`, `alignment`-aligned (a power of two).
  // `field` names the tensor in errors: NOT_FOUND (unknown or unregistered region) or
  // INVALID_ARGUMENT (out of bounds, misaligned, zero bytes).
  absl::StatusOr<RegionLease> Acquire(const std::string& name, uint64_t offset, uint64_t bytes,
                                      uint64_t alignment, const std::string& field) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // All of region `name` (NOT_FOUND as Acquire): one lookup for a plan naming many ranges of
  // it, each then checked by RegionLease::Within.
  absl::StatusOr<RegionLease> AcquireWhole(const std::string& name, const std::string& field) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // Unregisters every region that no lease holds and that nobody used (registered or
  // acquired a range of) since `cutoff`: the regions of a client that died (--region-ttl).
  // Status is not a use. Returns how many went.
  int32_t ExpireIdle(absl::Time cutoff) ABSL_LOCKS_EXCLUDED(mu_);

  int32_t backend() const { return backend_; }
  // CUDA regions whose unmapping waits for a quiet device now, and those unmapped all the same
  // past the bound (0 without device_quiet).
  int held_unmaps() const;
  int64_t forced_unmaps() const;

  // Rings every 32-bit word of `lease` (memory the backend uses in place) with `value` where it
  // has not reached it (rssm_stream_raise_value32: a later ring is never set back) and returns
  // once they are written: doorbells the server rings outside any forward (the done words of a
  // refused planned begin, docs/data-plane.md).
  absl::Status RingAll(const RegionLease& lease, uint32_t value) const;

 private:
  const int32_t backend_;
  const RegionLimits limits_;
  // Unmaps CUDA regions when the device is quiet; shared with the mappings (a lease may outlive
  // the table), stopped by the table's destructor.
  const std::shared_ptr<QuietRelease> unmaps_;
  // A region unregistered while leases held it (ExpireIdle takes no leased one): its mapping
  // lives until the last lease ends, and until then it still counts against --max-regions and
  // --max-region-bytes (else register, lease, unregister again and again piled up mappings
  // past both limits and filled the process's table of guarded mappings for every tenant; an
  // outside review).
  struct Retired {
    std::weak_ptr<internal::Mapping> hold;
    uint64_t bytes;
  };
  // Drops the retired mappings whose leases have all ended (they are unmapped by then); the
  // limits are checked only by Register, which calls it first.
  void PruneRetiredLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when one more region of `bytes` would pass a limit.
  absl::Status CheckLimitsLocked(uint64_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<internal::Mapping>> regions_ ABSL_GUARDED_BY(mu_);
  std::vector<Retired> retired_ ABSL_GUARDED_BY(mu_);
  uint64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;  // registered and retired regions' bytes
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_REGIONS_H_
