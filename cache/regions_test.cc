#include "replayssm/cache/regions.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/str_replace.h"
#include "replayssm/kernels.h"

namespace replayssm::cache {
namespace {

// A POSIX shm object of `bytes`, unlinked when the test ends.
class ShmObject {
 public:
  explicit ShmObject(size_t bytes)
      : key_("/replayssm-test-" + std::to_string(getpid()) + "-" + std::to_string(next_++)) {
    const int fd = shm_open(key_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(bytes)), 0);
    base_ = static_cast<uint8_t*>(
        mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    close(fd);
    bytes_ = bytes;
  }
  ~ShmObject() {
    munmap(base_, bytes_);
    shm_unlink(key_.c_str());
  }
  const std::string& key() const { return key_; }
  uint8_t* data() const { return base_; }

 private:
  static inline int next_ = 0;
  std::string key_;
  uint8_t* base_ = nullptr;
  size_t bytes_ = 0;
};

RegionSpec System(const std::string& name, const ShmObject& shm, uint64_t offset,
                  uint64_t bytes) {
  RegionSpec s;
  s.name = name;
  s.kind = RegionKind::kSystem;
  s.shm_key = shm.key();
  s.offset = offset;
  s.bytes = bytes;
  return s;
}

TEST(RegionTable, SharedMemoryIsUsedInPlaceOnTheCpuBackend) {
  ShmObject shm(1 << 16);
  RegionTable t(RSSM_BACKEND_CPU, {});
  ASSERT_TRUE(t.Register(System("acts", shm, 4096, 8192)).ok());
  absl::StatusOr<RegionLease> l = t.Acquire("acts", 64, 128, 16, "mixed_qkv");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->memory(), IoMemory::kBackend);
  std::memset(shm.data() + 4096 + 64, 0x5a, 128);  // the client's write...
  EXPECT_EQ(static_cast<uint8_t*>(l->data())[127], 0x5a);  // ...is the server's read
  static_cast<uint8_t*>(l->data())[0] = 0x11;
  EXPECT_EQ(shm.data()[4096 + 64], 0x11);
}

// A client's ftruncate of its shm object under a registered region: the server's next read
// there raised SIGBUS and ended the process (every tenant's state with it). The region's
// mapping now turns into zero pages at the fault, and the region is refused from then on.
TEST(RegionTable, AnObjectShrunkUnderItsRegionEndsNoProcessAndIsRefused) {
  ShmObject shm(1 << 16), other(4096);
  RegionTable t(RSSM_BACKEND_CPU, {});
  ASSERT_TRUE(t.Register(System("shrunk", shm, 0, 1 << 16)).ok());
  ASSERT_TRUE(t.Register(System("kept", other, 0, 4096)).ok());
  absl::StatusOr<RegionLease> l = t.Acquire("shrunk", 8192, 4096, 16, "mixed_qkv");
  ASSERT_TRUE(l.ok()) << l.status();
  const int fd = shm_open(shm.key().c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(ftruncate(fd, 0), 0);
  close(fd);
  volatile uint8_t* p = static_cast<uint8_t*>(l->data());
  EXPECT_EQ(p[100], 0) << "zero pages, not SIGBUS";
  p[100] = 7;
  EXPECT_EQ(p[100], 7);
  const absl::Status refused = t.Acquire("shrunk", 0, 4, 4, "layers[0].a").status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  EXPECT_NE(refused.message().find(
                "layers[0].a.region: region \"shrunk\"'s shm object shrank below its registered"),
            std::string::npos)
      << refused;
  absl::StatusOr<RegionLease> kept = t.Acquire("kept", 0, 4, 4, "x");
  ASSERT_TRUE(kept.ok()) << kept.status();
  static_cast<uint8_t*>(kept->data())[0] = 3;
  EXPECT_EQ(other.data()[0], 3) << "another region is still the client's memory";
  *l = RegionLease();
  EXPECT_TRUE(t.Unregister("shrunk").ok());
}

TEST(RegionTable, StatusCountsLeases) {
  ShmObject shm(4096);
  RegionTable t(RSSM_BACKEND_CPU, {});
  ASSERT_TRUE(t.Register(System("r", shm, 0, 4096)).ok());
  absl::StatusOr<RegionLease> a = t.Acquire("r", 0, 4, 4, "x");
  ASSERT_TRUE(a.ok());
  absl::StatusOr<std::vector<RegionInfo>> s = t.Status("r");
  ASSERT_TRUE(s.ok());
  ASSERT_EQ(s->size(), 1u);
  EXPECT_EQ((*s)[0].leases, 1);
  EXPECT_EQ((*s)[0].bytes, 4096u);
  EXPECT_EQ(t.Status("nope").status().code(), absl::StatusCode::kNotFound);
}

TEST(RegionTable, UnregisterWhileLeasedKeepsTheMemoryUntilTheLeaseEnds) {
  ShmObject shm(4096);
  RegionTable t(RSSM_BACKEND_CPU, {});
  ASSERT_TRUE(t.Register(System("r", shm, 0, 4096)).ok());
  absl::StatusOr<RegionLease> l = t.Acquire("r", 0, 4096, 64, "out");
  ASSERT_TRUE(l.ok());
  ASSERT_TRUE(t.Unregister("r").ok());
  // New uses are refused by name...
  absl::StatusOr<RegionLease> again = t.Acquire("r", 0, 4, 4, "out");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(again.status().message().find("out.region"), std::string::npos);
  // ...while the open use still reads and writes mapped memory.
  static_cast<uint8_t*>(l->data())[4095] = 7;
  EXPECT_EQ(shm.data()[4095], 7);
  EXPECT_EQ(t.Unregister("r").code(), absl::StatusCode::kNotFound);
  // The name is free again.
  EXPECT_TRUE(t.Register(System("r", shm, 0, 4096)).ok());
}

// Whether `base` is mapped in this process (its line in /proc/self/maps).
bool Mapped(const void* base) {
  std::ifstream maps("/proc/self/maps");
  const uintptr_t at = reinterpret_cast<uintptr_t>(base);
  std::string line;
  while (std::getline(maps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &lo, &hi) == 2 && at >= lo && at < hi) return true;
  }
  return false;
}

// Only a CUDA region's unmapping waits for a quiet device (cache/regions.h): a table given
// device_quiet, the device never quiet, unmaps a shm region as its last lease goes and never
// asks; a lease that outlives the table still unmaps it.
TEST(RegionTable, AQuietCheckHoldsNoSharedMemoryRegion) {
  ShmObject shm(4096);
  int asked = 0;
  auto t = std::make_unique<RegionTable>(RSSM_BACKEND_CPU, RegionLimits{}, [&] {
    ++asked;
    return false;
  });
  ASSERT_TRUE(t->Register(System("r", shm, 0, 4096)).ok());
  absl::StatusOr<RegionLease> l = t->Acquire("r", 0, 4096, 64, "out");
  ASSERT_TRUE(l.ok());
  void* const mapped = l->data();
  EXPECT_TRUE(Mapped(mapped));
  ASSERT_TRUE(t->Unregister("r").ok());
  *l = RegionLease();
  EXPECT_FALSE(Mapped(mapped)) << "unmapped as its last lease went";
  EXPECT_EQ(t->held_unmaps(), 0);
  EXPECT_EQ(t->forced_unmaps(), 0);
  ASSERT_TRUE(t->Register(System("s", shm, 0, 4096)).ok());
  absl::StatusOr<RegionLease> outlives = t->Acquire("s", 0, 4096, 64, "out");
  ASSERT_TRUE(outlives.ok());
  void* const second = outlives->data();
  t.reset();
  EXPECT_TRUE(Mapped(second));
  *outlives = RegionLease();
  EXPECT_FALSE(Mapped(second));
  EXPECT_EQ(asked, 0);
}

TEST(RegionTable, ARegionUnregisteredWhileLeasedCountsAgainstTheLimitsUntilItsLeaseEnds) {
  // Register, lease, unregister, again and again: the mappings piled up past --max-regions
  // (4096 of one object in an outside review, which then filled the process's table of
  // guarded mappings and refused every other tenant's regions).
  ShmObject shm(4096);
  RegionLimits limits;
  limits.max_regions = 2;
  limits.max_bytes = 8192;
  RegionTable t(RSSM_BACKEND_CPU, limits);
  ASSERT_TRUE(t.Register(System("a", shm, 0, 4096)).ok());
  absl::StatusOr<RegionLease> held = t.Acquire("a", 0, 4, 4, "x");
  ASSERT_TRUE(held.ok());
  ASSERT_TRUE(t.Unregister("a").ok());
  ASSERT_TRUE(t.Register(System("b", shm, 0, 4096)).ok());
  const absl::Status third = t.Register(System("c", shm, 0, 64));
  EXPECT_EQ(third.code(), absl::StatusCode::kResourceExhausted) << third;
  EXPECT_NE(third.message().find("1 unregistered that forwards still hold"), std::string::npos)
      << third;
  ASSERT_TRUE(t.Unregister("b").ok());  // not leased: gone at once
  const absl::Status bytes = t.Register(System("c", shm, 0, 4097));
  EXPECT_EQ(bytes.code(), absl::StatusCode::kResourceExhausted) << bytes;
  EXPECT_NE(bytes.message().find("4096 in use"), std::string::npos) << bytes;
  *held = RegionLease();  // the last lease ends: its mapping and its count go
  EXPECT_TRUE(t.Register(System("c", shm, 0, 4096)).ok());
  EXPECT_TRUE(t.Register(System("d", shm, 0, 4096)).ok());
  // A leased region is never expired; unregistered, it counts until its lease ends.
  absl::StatusOr<RegionLease> lease = t.Acquire("c", 0, 4, 4, "x");
  ASSERT_TRUE(lease.ok());
  ASSERT_TRUE(t.Unregister("d").ok());
  EXPECT_EQ(t.ExpireIdle(absl::InfiniteFuture()), 0) << "a leased region is in use";
  ASSERT_TRUE(t.Unregister("c").ok());
  EXPECT_FALSE(t.Register(System("e", shm, 0, 4096)).ok() &&
               t.Register(System("f", shm, 0, 4096)).ok())
      << "c's mapping still counts";
  *lease = RegionLease();
  EXPECT_TRUE(t.Register(System("g", shm, 0, 64)).ok());
}

TEST(RegionTable, AcquireRefusesOutOfBoundsMisalignedAndEmptyRangesByField) {
  ShmObject shm(8192);
  RegionTable t(RSSM_BACKEND_CPU, {});
  ASSERT_TRUE(t.Register(System("r", shm, 0, 4096)).ok());
  for (auto [offset, bytes, align] : {std::tuple<uint64_t, uint64_t, uint64_t>{4000, 200, 4},
                                      {4097, 1, 1},
                                      {~0ULL, 2, 1},
                                      {0, 0, 1},
                                      {2, 8, 4}}) {
    absl::StatusOr<RegionLease> l = t.Acquire("r", offset, bytes, align, "layers[3].a");
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << offset << " " << bytes;
    EXPECT_NE(l.status().message().find("layers[3].a"), std::string::npos) << l.status();
    EXPECT_NE(l.status().message().find("expected"), std::string::npos) << l.status();
  }
  EXPECT_EQ(t.Status("r")->at(0).leases, 0);
}

// Issue 31 §4: with a key prefix (the service: "/<tenant>:") a name outside it is refused
// before anything is opened, the same for an object that exists and one that does not.
TEST(RegionTable, AKeyOutsideThePrefixIsRefusedUnopened) {
  ShmObject shm(4096);  // "/replayssm-test-...": another engine's
  RegionTable t(RSSM_BACKEND_CPU, {4, 1 << 20, "/alice:"});
  absl::Status other = t.Register(System("r", shm, 0, 16));
  EXPECT_EQ(other.code(), absl::StatusCode::kPermissionDenied) << other;
  EXPECT_NE(other.message().find("starts with \"/alice:\""), std::string::npos) << other;
  RegionSpec none = System("r", shm, 0, 16);
  none.shm_key = "/replayssm-test-does-not-exist";
  EXPECT_EQ(t.Register(none).message(),
            absl::StrReplaceAll(other.message(), {{shm.key(), none.shm_key}}));
  EXPECT_TRUE(t.Status("")->empty());
}

TEST(RegionTable, RegisterRefusesBadSpecsAndChangesNothing) {
  ShmObject shm(4096);
  RegionTable t(RSSM_BACKEND_CPU, {2, 1 << 20});
  EXPECT_EQ(t.Register(System("", shm, 0, 16)).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(t.Register(System("r", shm, 0, 0)).code(), absl::StatusCode::kInvalidArgument);
  absl::Status big = t.Register(System("r", shm, 4000, 200));
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(big.message().find("holds offset + byte_size bytes, got \"" + shm.key() +
                               "\" with offset 4000 and byte_size 200"),
            std::string::npos)
      << big;
  EXPECT_EQ(big.message().find("4096"), std::string::npos) << "never the object's size";
  RegionSpec missing = System("r", shm, 4000, 200);
  missing.shm_key = "/replayssm-test-does-not-exist";
  absl::Status m = t.Register(missing);
  EXPECT_EQ(m.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.message(), absl::StrReplaceAll(big.message(), {{shm.key(), missing.shm_key}}))
      << "a missing object and a short one are one answer: no existence oracle";
  missing.shm_key = "no-slash";
  EXPECT_EQ(t.Register(missing).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(t.Status("")->empty());

  ASSERT_TRUE(t.Register(System("a", shm, 0, 16)).ok());
  EXPECT_EQ(t.Register(System("a", shm, 0, 16)).code(), absl::StatusCode::kAlreadyExists);
  ASSERT_TRUE(t.Register(System("b", shm, 0, 16)).ok());
  EXPECT_EQ(t.Register(System("c", shm, 0, 16)).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(t.Status("")->size(), 2u);
}

TEST(RegionTable, CudaRegionsAreRefusedOnTheCpuBackend) {
  RegionTable t(RSSM_BACKEND_CPU, {});
  RegionSpec s;
  s.name = "gpu";
  s.kind = RegionKind::kCuda;
  s.cuda_handle = std::string(64, '\0');
  s.bytes = 1024;
  absl::Status st = t.Register(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_NE(st.message().find("CPU backend"), std::string::npos) << st;
  EXPECT_TRUE(t.Status("")->empty());
}

}  // namespace
}  // namespace replayssm::cache
