// rssm_segment_digests on the CPU backend: the version 2 digest of each segment, equal to the
// one-buffer digest of that segment (what the host's Checksummer computes; the transfer tests
// compare with Checksummer itself), pinned to digests the host computed before the round moved
// into replayssm/checksum_v2.h; bad arguments write nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "replayssm/checksum_v2.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
const rssm_launch kCpu{RSSM_BACKEND_CPU, nullptr};

// Backend memory (64-byte aligned) filled with random bytes.
class HostData {
 public:
  HostData(size_t bytes, std::mt19937_64& rng) : bytes_(bytes) {
    EXPECT_EQ(rssm_alloc(RSSM_BACKEND_CPU, bytes, &p_), RSSM_OK);
    for (size_t i = 0; i < bytes; ++i) data()[i] = static_cast<uint8_t>(rng());
  }
  ~HostData() { rssm_free(RSSM_BACKEND_CPU, p_); }
  HostData(const HostData&) = delete;
  HostData& operator=(const HostData&) = delete;
  uint8_t* data() const { return static_cast<uint8_t*>(p_); }
  size_t bytes() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_;
};

// The per-segment digests, one buffer digest each (the definition, segment by segment).
std::vector<uint64_t> Expected(const uint8_t* p, size_t bytes, size_t segment) {
  std::vector<uint64_t> out;
  for (size_t off = 0; off < bytes; off += segment) {
    out.push_back(checksum_v2::Digest(p + off, std::min(segment, bytes - off)));
  }
  return out;
}

TEST(SegmentDigests, EachSegmentIsItsVersion2Digest) {
  std::mt19937_64 rng(11);
  for (size_t seg : {kMiB, size_t{4096}, size_t{192}}) {
    for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}, seg - 1, seg,
                         seg + 1, 3 * seg + seg / 2, 3 * seg + seg / 2 + 17}) {
      HostData x(bytes, rng);
      const size_t count = (bytes + seg - 1) / seg;
      std::vector<uint64_t> got(count + 1, 0xdeadbeef);  // one past the end: never written
      ASSERT_EQ(rssm_segment_digests(&kCpu, x.data(), bytes, seg, got.data()), RSSM_OK)
          << rssm_last_error();
      EXPECT_EQ(got.back(), 0xdeadbeefu) << "written past ceil(bytes / segment)";
      got.pop_back();
      EXPECT_EQ(got, Expected(x.data(), bytes, seg)) << "segment " << seg << ", bytes " << bytes;
      if (bytes > 0) {  // a flipped bit changes its own segment's digest only
        const size_t at = bytes / 2;
        x.data()[at] ^= 0x20;
        std::vector<uint64_t> flipped(count);
        ASSERT_EQ(rssm_segment_digests(&kCpu, x.data(), bytes, seg, flipped.data()), RSSM_OK);
        for (size_t i = 0; i < count; ++i) {
          EXPECT_EQ(flipped[i] != got[i], i == at / seg) << "segment " << i << " of " << count;
        }
      }
    }
  }
}

TEST(SegmentDigests, PinnedToTheHostDigestsOfTheReleasedFormat) {
  // Computed by service/transfer/checksum.cc at cccb1a8 (before the round was shared): a
  // change to checksum_v2.h that breaks older peers fails here, not only between backends.
  std::vector<uint8_t> x(3 * 4096 + 100);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::pair<size_t, uint64_t> v2[] = {
      {0, 0x0f1ebb2e1103a1aaULL},  {1, 0xb1130e46ca861578ULL},    {63, 0x16243157ff091893ULL},
      {64, 0xa62fde8116eb48d7ULL}, {65, 0x86b941db9632437bULL},   {4096, 0xa5a1683d42537b42ULL},
      {x.size(), 0xc93669db67d85552ULL}};
  for (const auto& [n, want] : v2) EXPECT_EQ(checksum_v2::Digest(x.data(), n), want) << n;
  std::mt19937_64 rng(1);
  HostData d(x.size(), rng);
  std::memcpy(d.data(), x.data(), x.size());
  uint64_t got[4];
  ASSERT_EQ(rssm_segment_digests(&kCpu, d.data(), x.size(), 4096, got), RSSM_OK);
  EXPECT_EQ(got[0], 0xa5a1683d42537b42ULL);
  EXPECT_EQ(got[3], checksum_v2::Digest(x.data() + 3 * 4096, 100));
}

// Calls fn and expects INVALID_ARGUMENT naming `field` (expected ..., got ...) and the
// digests untouched.
void ExpectRejected(const std::function<rssm_status(uint64_t*)>& fn, const std::string& field) {
  uint64_t digests[4] = {1, 2, 3, 4};
  EXPECT_EQ(fn(digests), RSSM_ERR_INVALID_ARGUMENT) << field;
  const std::string msg = rssm_last_error();
  EXPECT_NE(msg.find("rssm_segment_digests: " + field), std::string::npos)
      << "message '" << msg << "' lacks " << field;
  EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got"), std::string::npos) << msg;
  EXPECT_EQ(digests[0], 1u);
  EXPECT_EQ(digests[3], 4u);
}

TEST(SegmentDigests, BadArgumentsWriteNothing) {
  std::mt19937_64 rng(5);
  HostData x(3000, rng);
  const void* p = x.data();
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(nullptr, p, 3000, 1024, d); },
                 "launch");
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(&kCpu, nullptr, 3000, 1024, d); },
                 "data");
  ExpectRejected([&](uint64_t*) { return rssm_segment_digests(&kCpu, p, 3000, 1024, nullptr); },
                 "digests");
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(&kCpu, p, 3000, 0, d); },
                 "segment_bytes");
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(&kCpu, p, 3000, 1000, d); },
                 "segment_bytes");
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(&kCpu, p, 3000, 64 + 1, d); },
                 "segment_bytes");
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests(&kCpu, x.data() + 8, 2000, 1024, d); },
      "data");
  const rssm_launch bad_backend{7, nullptr}, cpu_stream{RSSM_BACKEND_CPU, x.data()};
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(&bad_backend, p, 3000, 1024, d); },
                 "launch.backend");
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(&cpu_stream, p, 3000, 1024, d); },
                 "launch.stream");
  // Nothing to hash: OK with no data and no digests (and a bad segment still refused).
  EXPECT_EQ(rssm_segment_digests(&kCpu, nullptr, 0, 1024, nullptr), RSSM_OK);
  EXPECT_STREQ(rssm_last_error(), "");
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests(&kCpu, nullptr, 0, 0, d); },
                 "segment_bytes");
}

TEST(SegmentDigests, CudaWithoutTheBackendIsUnsupportedAndWritesNothing) {
  if (rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "a GPU is present";
  std::mt19937_64 rng(2);
  HostData x(256, rng);
  const rssm_launch cuda{RSSM_BACKEND_CUDA, nullptr};
  uint64_t d[1] = {9};
  EXPECT_EQ(rssm_segment_digests(&cuda, x.data(), 256, 64 * 4, d), RSSM_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(rssm_last_error()).find("CUDA"), std::string::npos);
  EXPECT_EQ(d[0], 9u);
}

}  // namespace
}  // namespace replayssm::kernels::testing
