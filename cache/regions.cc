#include "replayssm/cache/regions.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <mutex>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "device_buffer.h"
#include "doorbells.h"
#include "replayssm/cache/quiet_release.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {
namespace {

// A client's shared memory can shrink under the server's mapping (its ftruncate): a read past
// the object's new end raises SIGBUS, which would end the process and every tenant's state
// with it. Each system region's mapping is listed here; the handler replaces a listed
// mapping that faults with zero pages (the access then succeeds, on private memory) and marks
// it, and the region refuses every later use (AcquireWhole). The list is read by the handler
// without locks: slots are claimed with a compare-and-swap and cleared before the munmap.
constexpr int kGuardedMappings = 4096;
struct GuardedMapping {
  std::atomic<uintptr_t> base{0};
  std::atomic<size_t> bytes{0};
  std::atomic<bool> faulted{false};
};
GuardedMapping g_guarded[kGuardedMappings];
struct sigaction g_previous_sigbus;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardedMapping& g : g_guarded) {
    const uintptr_t base = g.base.load(std::memory_order_acquire);
    const size_t bytes = g.bytes.load(std::memory_order_acquire);
    if (base == 0 || at < base || at - base >= bytes) continue;
    if (mmap(reinterpret_cast<void*>(base), bytes, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) != MAP_FAILED) {
      g.faulted.store(true, std::memory_order_release);
      return;  // the faulting access runs again, on zero pages
    }
    break;
  }
  // Not a region's: whoever handled it before (a sanitizer), else the default (the end).
  const struct sigaction& prev = g_previous_sigbus;
  if ((prev.sa_flags & SA_SIGINFO) != 0 && prev.sa_sigaction != nullptr) {
    prev.sa_sigaction(sig, info, context);
    return;
  }
  if ((prev.sa_flags & SA_SIGINFO) == 0 && prev.sa_handler != SIG_DFL &&
      prev.sa_handler != SIG_IGN) {
    prev.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

// The slot guarding [base, base + bytes), or -1 when every slot is taken.
int GuardMapping(void* base, size_t bytes) {
  static std::once_flag installed;
  std::call_once(installed, [] {
    struct sigaction sa {};
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, &g_previous_sigbus);
  });
  for (int i = 0; i < kGuardedMappings; ++i) {
    uintptr_t empty = 0;
    if (g_guarded[i].base.compare_exchange_strong(empty, reinterpret_cast<uintptr_t>(base))) {
      g_guarded[i].faulted.store(false, std::memory_order_release);
      g_guarded[i].bytes.store(bytes, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

}  // namespace

namespace internal {

struct Mapping {
  RegionInfo info;
  int32_t backend = RSSM_BACKEND_CPU;
  void* map_base = nullptr;  // what munmap / rssm_ipc_close take
  size_t map_bytes = 0;      // kSystem: the length mapped
  uint8_t* data = nullptr;   // the region's first byte
  IoMemory memory = IoMemory::kHost;
  int guard = -1;  // kSystem: its slot in g_guarded

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  // A kSystem mapping whose object shrank under it: zero pages now (OnSigbus).
  bool faulted() const {
    return guard >= 0 && g_guarded[guard].faulted.load(std::memory_order_acquire);
  }
  ~Mapping() {
    if (map_base == nullptr) return;
    if (info.kind == RegionKind::kSystem) {
      if (guard >= 0) {
        g_guarded[guard].bytes.store(0, std::memory_order_release);
        g_guarded[guard].base.store(0, std::memory_order_release);
      }
      munmap(map_base, map_bytes);
    } else {
      rssm_ipc_close(backend, map_base);
    }
  }
};

}  // namespace internal
namespace {

using internal::Mapping;

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

absl::Status MapSystem(const RegionSpec& spec, int32_t backend, Mapping& m) {
  if (spec.shm_key.empty() || spec.shm_key.size() > 255 || spec.shm_key[0] != '/' ||
      spec.shm_key.find('/', 1) != std::string::npos) {
    return Invalid("key", absl::StrCat("expected a POSIX shm name (\"/name\", no other "
                                           "'/', at most 255 characters), got \"",
                                           spec.shm_key.substr(0, 64), "\""));
  }
  // Missing, not openable and too short are one answer: no existence or size oracle.
  const absl::Status unusable = Invalid(
      "key", absl::StrCat("expected a shm object this server can open read-write that holds "
                          "offset + byte_size bytes, got \"", spec.shm_key, "\" with offset ",
                          spec.offset, " and byte_size ", spec.bytes));
  const int fd = shm_open(spec.shm_key.c_str(), O_RDWR, 0);
  if (fd < 0) return unusable;
  struct stat st {};
  const bool sized = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
  const uint64_t size = sized ? static_cast<uint64_t>(st.st_size) : 0;
  if (!sized || spec.offset > size || spec.bytes > size - spec.offset) {
    close(fd);
    return unusable;
  }
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t start = spec.offset / page * page;
  const size_t len = static_cast<size_t>(spec.offset + spec.bytes - start);
  void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, static_cast<off_t>(start));
  close(fd);  // the mapping keeps the object
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("region: mapping ", len, " bytes of \"", spec.shm_key,
                     "\" failed: ", std::strerror(errno)));
  }
  m.map_base = p;
  m.map_bytes = len;
  m.guard = GuardMapping(p, len);
  if (m.guard < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("region: ", kGuardedMappings,
                     " shared-memory regions are mapped in this server, the most "
                     "it guards; unregister one"));
  }
  m.data = static_cast<uint8_t*>(p) + (spec.offset - start);
  // Host memory is the CPU backend's own; the CUDA backend copies it through staging.
  m.memory = backend == RSSM_BACKEND_CPU ? IoMemory::kBackend : IoMemory::kHost;
  return absl::OkStatus();
}

absl::Status MapCuda(const RegionSpec& spec, int32_t backend, Mapping& m) {
  if (backend != RSSM_BACKEND_CUDA) {
    return absl::UnimplementedError(
        "kind: CUDA IPC regions need the CUDA backend; this server runs on the CPU backend "
        "(register POSIX shared memory instead)");
  }
  void* base = nullptr;
  size_t size = 0;
  const rssm_status s = rssm_ipc_open(backend, spec.cuda_handle.data(), spec.cuda_handle.size(),
                                      spec.device, &base, &size);
  if (s == RSSM_ERR_INVALID_ARGUMENT) return absl::InvalidArgumentError(rssm_last_error());
  if (absl::Status st = KernelStatus(s, "region"); !st.ok()) return st;
  m.map_base = base;
  if (spec.offset > size || spec.bytes > size - spec.offset) {
    return Invalid("byte_size", absl::StrCat("expected offset + byte_size within the CUDA allocation (",
                                         size, " bytes), got ", spec.offset, " + ",
                                         spec.bytes));
  }
  m.data = static_cast<uint8_t*>(base) + spec.offset;
  m.memory = IoMemory::kBackend;
  return absl::OkStatus();
}

absl::Status CheckSpec(const RegionSpec& spec) {
  if (spec.name.empty() || spec.name.size() > 128) {
    return Invalid("name", absl::StrCat("expected 1..128 characters, got ", spec.name.size()));
  }
  if (spec.bytes == 0) return Invalid("byte_size", "expected > 0, got 0");
  if (spec.kind != RegionKind::kSystem && spec.kind != RegionKind::kCuda) {
    return Invalid("kind", absl::StrCat("expected SYSTEM or CUDA, got ",
                                        static_cast<int32_t>(spec.kind)));
  }
  return absl::OkStatus();
}

// How many CUDA regions' unmappings wait for a quiet device at most (then the oldest goes all
// the same): a client registering and unregistering in a loop while forwards stay open.
constexpr size_t kMaxHeldUnmaps = 16;

}  // namespace

RegionTable::RegionTable(int32_t backend, RegionLimits limits,
                         std::function<bool()> device_quiet)
    : backend_(backend),
      limits_(limits),
      unmaps_(device_quiet != nullptr
                  ? std::make_shared<QuietRelease>(std::move(device_quiet), kMaxHeldUnmaps)
                  : nullptr) {}

// device_quiet may read state its owner destroys after the table: the unmaps still held go now,
// and those of leases that outlive the table go as their last lease does.
RegionTable::~RegionTable() {
  if (unmaps_ != nullptr) unmaps_->Stop();
}

int RegionTable::held_unmaps() const { return unmaps_ != nullptr ? unmaps_->held() : 0; }

int64_t RegionTable::forced_unmaps() const {
  return unmaps_ != nullptr ? unmaps_->forced() : 0;
}

absl::Status RegionTable::Register(const RegionSpec& spec) {
  if (absl::Status st = CheckSpec(spec); !st.ok()) return st;
  if (spec.kind == RegionKind::kSystem && !absl::StartsWith(spec.shm_key, limits_.key_prefix)) {
    return absl::PermissionDeniedError(absl::StrCat(
        "key: expected a shm name that starts with \"", limits_.key_prefix,
        "\" (the caller's tenant's), got \"", spec.shm_key, "\""));
  }
  {
    absl::MutexLock lock(&mu_);
    if (regions_.count(spec.name) != 0) {
      return absl::AlreadyExistsError(
          absl::StrCat("name: region \"", spec.name, "\" is already registered"));
    }
    PruneRetiredLocked();
    if (absl::Status st = CheckLimitsLocked(spec.bytes); !st.ok()) return st;
  }
  // The last holder unmaps it: a CUDA region through unmaps_ (when the device is quiet).
  std::shared_ptr<Mapping> m(new Mapping, [unmaps = unmaps_](Mapping* p) {
    if (unmaps != nullptr && p->info.kind == RegionKind::kCuda && p->map_base != nullptr) {
      unmaps->Add([p] { delete p; });
    } else {
      delete p;
    }
  });
  m->backend = backend_;
  m->info = RegionInfo{spec.name, spec.kind, spec.bytes, spec.device, 0, absl::Now()};
  absl::Status st = spec.kind == RegionKind::kSystem ? MapSystem(spec, backend_, *m)
                                                     : MapCuda(spec, backend_, *m);
  if (!st.ok()) return st;  // m unmaps what was mapped
  absl::MutexLock lock(&mu_);
  if (regions_.count(spec.name) != 0) {  // registered meanwhile by another call
    return absl::AlreadyExistsError(
        absl::StrCat("name: region \"", spec.name, "\" is already registered"));
  }
  PruneRetiredLocked();
  if (absl::Status st = CheckLimitsLocked(spec.bytes); !st.ok()) return st;  // reached meanwhile
  bytes_ += spec.bytes;
  regions_.emplace(spec.name, std::move(m));
  return absl::OkStatus();
}

absl::Status RegionTable::CheckLimitsLocked(uint64_t bytes) const {
  const size_t held = retired_.size();
  const std::string retired =
      held == 0 ? ""
                : absl::StrCat(" (and ", held,
                               " unregistered that forwards still hold, counted until they end)");
  if (static_cast<int64_t>(regions_.size() + held) >= limits_.max_regions) {
    return absl::ResourceExhaustedError(absl::StrCat("regions: ", regions_.size(), " registered",
                                                     retired, ", the limit (--max-regions) is ",
                                                     limits_.max_regions));
  }
  if (bytes > limits_.max_bytes - bytes_) {
    return absl::ResourceExhaustedError(
        absl::StrCat("bytes: ", bytes, " more would exceed the registered-bytes limit (",
                     limits_.max_bytes, ", ", bytes_, " in use", retired, ")"));
  }
  return absl::OkStatus();
}

void RegionTable::PruneRetiredLocked() {
  for (auto it = retired_.begin(); it != retired_.end();) {
    if (!it->hold.expired()) {
      ++it;
      continue;
    }
    bytes_ -= it->bytes;
    it = retired_.erase(it);
  }
}

absl::Status RegionTable::Unregister(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto it = regions_.find(name);
  if (it == regions_.end()) {
    return absl::NotFoundError(absl::StrCat("name: no region \"", name, "\" is registered"));
  }
  if (it->second.use_count() > 1) {  // leased: the mapping lives on, and counts, until they end
    retired_.push_back({it->second, it->second->info.bytes});
  } else {
    bytes_ -= it->second->info.bytes;
  }
  regions_.erase(it);
  return absl::OkStatus();
}

int32_t RegionTable::ExpireIdle(absl::Time cutoff) {
  absl::MutexLock lock(&mu_);
  int32_t n = 0;
  for (auto it = regions_.begin(); it != regions_.end();) {
    const bool leased = it->second.use_count() > 1;  // the table's own reference is not one
    // A region a forward holds is in use now: its idle time starts when the lease ends (give
    // or take a sweep). It used to count from the lease's start, so a forward longer than the
    // TTL left its region to be reaped just after the commit (an outside review).
    if (leased) it->second->info.last_use = absl::Now();
    if (leased || it->second->info.last_use > cutoff) {
      ++it;
      continue;
    }
    bytes_ -= it->second->info.bytes;  // not leased (checked above, under mu_): unmapped now
    it = regions_.erase(it);
    ++n;
  }
  return n;
}

absl::StatusOr<std::vector<RegionInfo>> RegionTable::Status(const std::string& name) const {
  absl::MutexLock lock(&mu_);
  std::vector<RegionInfo> out;
  for (const auto& [n, m] : regions_) {
    if (!name.empty() && n != name) continue;
    RegionInfo info = m->info;
    info.leases = m.use_count() - 1;  // the table's own reference is not a lease
    out.push_back(std::move(info));
  }
  if (!name.empty() && out.empty()) {
    return absl::NotFoundError(absl::StrCat("name: no region \"", name, "\" is registered"));
  }
  return out;
}

absl::StatusOr<RegionLease> RegionTable::Acquire(const std::string& name, uint64_t offset,
                                                 uint64_t bytes, uint64_t alignment,
                                                 const std::string& field) const {
  absl::StatusOr<RegionLease> whole = AcquireWhole(name, field);
  if (!whole.ok()) return whole.status();
  absl::StatusOr<void*> at = whole->Within(offset, bytes, alignment, field);
  if (!at.ok()) return at.status();
  RegionLease lease = *std::move(whole);
  lease.data_ = *at;
  lease.bytes_ = bytes;
  return lease;
}

absl::StatusOr<RegionLease> RegionTable::AcquireWhole(const std::string& name,
                                                      const std::string& field) const {
  std::shared_ptr<Mapping> m;
  {
    absl::MutexLock lock(&mu_);
    auto it = regions_.find(name);
    if (it == regions_.end()) {
      return absl::NotFoundError(absl::StrCat(field, ".region: no region \"", name,
                                              "\" is registered (unknown or unregistered)"));
    }
    m = it->second;
    m->info.last_use = absl::Now();  // under mu_: ExpireIdle reads it there
  }
  if (m->faulted()) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ".region: region \"", name,
                     "\"'s shm object shrank below its registered size "
                     "(the server reads zeros there now); unregister it and register a new one"));
  }
  RegionLease lease;
  lease.data_ = m->data;
  lease.bytes_ = m->info.bytes;
  lease.memory_ = m->memory;
  lease.hold_ = std::move(m);
  return lease;
}

absl::StatusOr<void*> RegionLease::Within(uint64_t offset, uint64_t bytes, uint64_t alignment,
                                          const std::string& field) const {
  const uint64_t size = bytes_;
  const std::string& name = hold_->info.name;
  if (bytes == 0 || offset > size || bytes > size - offset) {
    return Invalid(field, absl::StrCat("expected [offset, offset + bytes) within region \"", name,
                                       "\" (", size, " bytes), got offset ", offset, " and ",
                                       bytes, " bytes"));
  }
  const uintptr_t at = reinterpret_cast<uintptr_t>(data_) + offset;
  if (alignment > 1 && at % alignment != 0) {
    return Invalid(field, absl::StrCat("expected a ", alignment, "-byte aligned offset, got ",
                                       offset, " (the region's memory starts ",
                                       reinterpret_cast<uintptr_t>(data_) % alignment,
                                       " bytes past such a boundary)"));
  }
  return reinterpret_cast<void*>(at);
}

absl::Status RegionTable::RingAll(const RegionLease& lease, uint32_t value) const {
  if (lease.memory() != IoMemory::kBackend || lease.bytes() % 4 != 0) {
    return absl::InvalidArgumentError(
        "doorbells: expected whole 32-bit words in memory the backend uses in place");
  }
  void* stream = nullptr;
  if (rssm_stream_create(backend_, &stream) != RSSM_OK) {
    return absl::InternalError(absl::StrCat("doorbells: ", rssm_last_error()));
  }
  const rssm_launch side{backend_, stream};
  uint32_t* words = static_cast<uint32_t*>(lease.data());
  rssm_status st = RSSM_OK;
  for (uint64_t i = 0; st == RSSM_OK && i < lease.bytes() / 4; ++i) {
    st = rssm_stream_raise_value32(&side, words + i, value);  // never sets a later ring back
  }
  if (st == RSSM_OK) st = rssm_synchronize(&side);
  const absl::Status out =
      st == RSSM_OK ? absl::OkStatus()
                    : absl::InternalError(absl::StrCat("doorbells: ", rssm_last_error()));
  rssm_stream_destroy(backend_, stream);
  return out;
}

}  // namespace replayssm::cache
