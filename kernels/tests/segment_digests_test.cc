// rssm_segment_digests_parts on the CPU backend: the segment hash of each segment, equal to the
// one-buffer digest of that segment (replayssm/segment_hash.h, what the cache's host checksum
// computes), pinned to digests the host computed before the round moved into that header;
// over several parts equal to it on their concatenation; bad arguments write nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "replayssm/segment_hash.h"
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

// The digests of one buffer: the parts call with one part (its table in place: on the CPU
// backend the table the backend reads may be the one validated).
rssm_status Whole(const rssm_launch* l, const void* data, size_t bytes, size_t segment,
                  uint64_t* digests) {
  const void* one[1] = {data};
  return rssm_segment_digests_parts(l, one, one, 1, bytes, segment, digests);
}

// The per-segment digests, one buffer digest each (the definition, segment by segment).
std::vector<uint64_t> Expected(const uint8_t* p, size_t bytes, size_t segment) {
  std::vector<uint64_t> out;
  for (size_t off = 0; off < bytes; off += segment) {
    out.push_back(segment_hash::Digest(p + off, std::min(segment, bytes - off)));
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
      ASSERT_EQ(Whole(&kCpu, x.data(), bytes, seg, got.data()), RSSM_OK)
          << rssm_last_error();
      EXPECT_EQ(got.back(), 0xdeadbeefu) << "written past ceil(bytes / segment)";
      got.pop_back();
      EXPECT_EQ(got, Expected(x.data(), bytes, seg)) << "segment " << seg << ", bytes " << bytes;
      if (bytes > 0) {  // a flipped bit changes its own segment's digest only
        const size_t at = bytes / 2;
        x.data()[at] ^= 0x20;
        std::vector<uint64_t> flipped(count);
        ASSERT_EQ(Whole(&kCpu, x.data(), bytes, seg, flipped.data()), RSSM_OK);
        for (size_t i = 0; i < count; ++i) {
          EXPECT_EQ(flipped[i] != got[i], i == at / seg) << "segment " << i << " of " << count;
        }
      }
    }
  }
}

TEST(SegmentDigests, PinnedToTheHostDigestsOfTheReleasedFormat) {
  // Computed by service/transfer/checksum.cc at cccb1a8 (before the round was shared): a
  // change to segment_hash.h that breaks older peers fails here, not only between backends.
  std::vector<uint8_t> x(3 * 4096 + 100);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint8_t>(i * 131 + 7);
  const std::pair<size_t, uint64_t> v2[] = {
      {0, 0x0f1ebb2e1103a1aaULL},  {1, 0xb1130e46ca861578ULL},    {63, 0x16243157ff091893ULL},
      {64, 0xa62fde8116eb48d7ULL}, {65, 0x86b941db9632437bULL},   {4096, 0xa5a1683d42537b42ULL},
      {x.size(), 0xc93669db67d85552ULL}};
  for (const auto& [n, want] : v2) EXPECT_EQ(segment_hash::Digest(x.data(), n), want) << n;
  std::mt19937_64 rng(1);
  HostData d(x.size(), rng);
  std::memcpy(d.data(), x.data(), x.size());
  uint64_t got[4];
  ASSERT_EQ(Whole(&kCpu, d.data(), x.size(), 4096, got), RSSM_OK);
  EXPECT_EQ(got[0], 0xa5a1683d42537b42ULL);
  EXPECT_EQ(got[3], segment_hash::Digest(x.data() + 3 * 4096, 100));
}

// Calls fn and expects INVALID_ARGUMENT naming `function: field` (expected ..., got ...) and
// the digests untouched.
void ExpectRejected(const std::function<rssm_status(uint64_t*)>& fn, const std::string& field,
                    const std::string& function = "rssm_segment_digests_parts") {
  const uint64_t pattern[4] = {0x1111, 0x2222, 0x3333, 0x4444};
  uint64_t digests[4];
  std::memcpy(digests, pattern, sizeof(digests));
  EXPECT_EQ(fn(digests), RSSM_ERR_INVALID_ARGUMENT) << function << ": " << field;
  const std::string msg = rssm_last_error();
  EXPECT_NE(msg.find(function + ": " + field), std::string::npos)
      << "message '" << msg << "' lacks " << function << ": " << field;
  EXPECT_NE(msg.find("expected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("got"), std::string::npos) << msg;
  EXPECT_EQ(std::memcmp(digests, pattern, sizeof(digests)), 0) << "digests written";
}

TEST(SegmentDigests, BadArgumentsWriteNothing) {
  std::mt19937_64 rng(5);
  HostData x(3000, rng);
  const void* p = x.data();
  ExpectRejected([&](uint64_t* d) { return Whole(nullptr, p, 3000, 1024, d); },
                 "launch");
  ExpectRejected([&](uint64_t* d) { return Whole(&kCpu, nullptr, 3000, 1024, d); },
                 "parts[0]");
  ExpectRejected([&](uint64_t*) { return Whole(&kCpu, p, 3000, 1024, nullptr); },
                 "digests");
  ExpectRejected([&](uint64_t* d) { return Whole(&kCpu, p, 3000, 0, d); },
                 "segment_bytes");
  ExpectRejected([&](uint64_t* d) { return Whole(&kCpu, p, 3000, 1000, d); },
                 "segment_bytes");
  ExpectRejected([&](uint64_t* d) { return Whole(&kCpu, p, 3000, 64 + 1, d); },
                 "segment_bytes");
  ExpectRejected(
      [&](uint64_t* d) { return Whole(&kCpu, x.data() + 8, 2000, 1024, d); },
      "parts[0]");
  const rssm_launch bad_backend{7, nullptr}, cpu_stream{RSSM_BACKEND_CPU, x.data()};
  ExpectRejected([&](uint64_t* d) { return Whole(&bad_backend, p, 3000, 1024, d); },
                 "launch.backend");
  ExpectRejected([&](uint64_t* d) { return Whole(&cpu_stream, p, 3000, 1024, d); },
                 "launch.stream");
  // Nothing to hash: OK with no data and no digests (and a bad segment still refused).
  EXPECT_EQ(Whole(&kCpu, nullptr, 0, 1024, nullptr), RSSM_OK);
  EXPECT_STREQ(rssm_last_error(), "");
  ExpectRejected([&](uint64_t* d) { return Whole(&kCpu, nullptr, 0, 0, d); },
                 "segment_bytes");
}

// `count` parts of part_bytes each, allocated one by one (every other one 16 bytes into its
// allocation: 16-byte but not 64-byte aligned), and their concatenation in one buffer.
class Parts {
 public:
  Parts(size_t count, size_t part_bytes, std::mt19937_64& rng) : whole_(count * part_bytes, rng) {
    for (size_t j = 0; j < count; ++j) {
      const size_t shift = j % 2 == 1 ? 16 : 0;
      own_.push_back(std::make_unique<HostData>(part_bytes + shift, rng));
      uint8_t* p = own_.back()->data() + shift;
      std::memcpy(p, whole_.data() + j * part_bytes, part_bytes);
      mutable_.push_back(p);
      parts_.push_back(p);
    }
  }
  const void* const* parts() const { return parts_.data(); }
  uint8_t* part(size_t j) const { return mutable_[j]; }
  size_t count() const { return parts_.size(); }
  size_t bytes() const { return whole_.bytes(); }
  const uint8_t* whole() const { return whole_.data(); }

 private:
  HostData whole_;
  std::vector<std::unique_ptr<HostData>> own_;
  std::vector<uint8_t*> mutable_;
  std::vector<const void*> parts_;  // the same pointers, as the call takes them
};

TEST(SegmentDigests, PartsHashAsTheirConcatenation) {
  std::mt19937_64 rng(17);
  struct Case {
    size_t count, part_bytes, segment;
  };
  const Case cases[] = {
      {9, 1040, 4096},             // parts smaller than a segment, a multiple of 16 not of 64
      {3, 10000, 4096},            // parts larger than a segment, not a multiple of 64
      {3, 8192, 4096},             // parts of whole segments
      {4, 700 * 1024 + 48, kMiB},  // a slot's layers: segments span parts
      {37, 16, 192},               // 16-byte parts: every block spans 4 of them
      {11, 16, 4096},              // one short segment whose 48-byte tail spans 3 parts
      {5, 48, 64},                 // 64-byte segments over 48-byte parts
      {1, 4097, 4096},             // count 1: any part_bytes
      {1, 63, 64},
      {1, 1, 192},
      {1, 3 * 4096 + 4096 / 2 + 17, 4096},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE("count " + std::to_string(k.count) + ", part_bytes " +
                 std::to_string(k.part_bytes) + ", segment " + std::to_string(k.segment));
    Parts x(k.count, k.part_bytes, rng);
    const size_t n = (x.bytes() + k.segment - 1) / k.segment;
    std::vector<uint64_t> want(n), got(n + 1, 0xdeadbeef);  // one past the end: never written
    ASSERT_EQ(Whole(&kCpu, x.whole(), x.bytes(), k.segment, want.data()), RSSM_OK)
        << rssm_last_error();
    ASSERT_EQ(want, Expected(x.whole(), x.bytes(), k.segment));
    ASSERT_EQ(rssm_segment_digests_parts(&kCpu, x.parts(), x.parts(), x.count(), k.part_bytes,
                                         k.segment,
                                         got.data()),
              RSSM_OK)
        << rssm_last_error();
    EXPECT_STREQ(rssm_last_error(), "");
    EXPECT_EQ(got.back(), 0xdeadbeefu) << "written past ceil(bytes / segment)";
    got.pop_back();
    EXPECT_EQ(got, want);
    // A flipped bit in the last part changes its own segment's digest only.
    const size_t j = x.count() - 1, at = k.part_bytes / 2, off = j * k.part_bytes + at;
    x.part(j)[at] ^= 0x04;
    std::vector<uint64_t> flipped(n);
    ASSERT_EQ(rssm_segment_digests_parts(&kCpu, x.parts(), x.parts(), x.count(), k.part_bytes,
                                         k.segment,
                                         flipped.data()),
              RSSM_OK);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_EQ(flipped[i] != want[i], i == off / k.segment) << "segment " << i << " of " << n;
    }
  }
}

TEST(SegmentDigests, PartsBadArgumentsWriteNothing) {
  const char* fn = "rssm_segment_digests_parts";
  std::mt19937_64 rng(6);
  Parts x(3, 1024, rng);
  const void* const* p = x.parts();
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(nullptr, p, p, 3, 1024, 1024, d); },
      "launch", fn);
  const rssm_launch bad_backend{7, nullptr}, cpu_stream{RSSM_BACKEND_CPU, x.part(0)};
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(&bad_backend, p, p, 3, 1024, 1024, d); },
      "launch.backend", fn);
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(&cpu_stream, p, p, 3, 1024, 1024, d); },
      "launch.stream", fn);
  for (size_t seg : {size_t{0}, size_t{1000}, size_t{64 + 1}}) {
    ExpectRejected(
        [&](uint64_t* d) { return rssm_segment_digests_parts(&kCpu, p, p, 3, 1024, seg, d); },
        "segment_bytes", fn);
  }
  ExpectRejected(
      [&](uint64_t* d) {
        return rssm_segment_digests_parts(&kCpu, nullptr, nullptr, 3, 1024, 1024, d);
      },
      "parts", fn);
  ExpectRejected(
      [&](uint64_t*) { return rssm_segment_digests_parts(&kCpu, p, p, 3, 1024, 1024, nullptr); },
      "digests", fn);
  // The table the backend reads: non-null and pointer-aligned.
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(&kCpu, p, nullptr, 3, 1024, 1024, d); },
      "parts_device", fn);
  const void* const* skewed = reinterpret_cast<const void* const*>(x.part(0) + 4);
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(&kCpu, p, skewed, 3, 1024, 1024, d); },
      "parts_device", fn);
  // count * part_bytes overflows; so many segments that the CUDA grid could not hold them.
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(&kCpu, p, p, SIZE_MAX / 8, 16, 64, d); },
      "part_bytes", fn);
  ExpectRejected(
      [&](uint64_t* d) {
        return rssm_segment_digests_parts(&kCpu, p, p, 1, (size_t{1} << 31) * 64, 64, d);
      },
      "segment_bytes", fn);
  // With count > 1 a part is a multiple of 16 bytes (count 1: any size, PartsHashAs...).
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(&kCpu, p, p, 3, 1000, 1024, d); },
      "part_bytes", fn);
  ExpectRejected([&](uint64_t* d) { return rssm_segment_digests_parts(&kCpu, p, p, 2, 8, 64, d); },
                 "part_bytes", fn);
  // Each part non-null and 16-byte aligned (the last one too).
  for (size_t j = 0; j < 3; ++j) {
    std::vector<const void*> q(p, p + 3);
    q[j] = nullptr;
    ExpectRejected(
        [&](uint64_t* d) {
          return rssm_segment_digests_parts(&kCpu, q.data(), p, 3, 1024, 1024, d);
        },
        "parts[" + std::to_string(j) + "]", fn);
    q[j] = x.part(j) + 8;
    ExpectRejected(
        [&](uint64_t* d) {
          return rssm_segment_digests_parts(&kCpu, q.data(), p, 3, 1024, 1024, d);
        },
        "parts[" + std::to_string(j) + "]", fn);
  }
  // Nothing to hash (no parts, or empty ones): OK with no parts and no digests (and a bad
  // segment still refused).
  EXPECT_EQ(rssm_segment_digests_parts(&kCpu, nullptr, nullptr, 0, 1024, 1024, nullptr),
            RSSM_OK);
  EXPECT_STREQ(rssm_last_error(), "");
  EXPECT_EQ(rssm_segment_digests_parts(&kCpu, nullptr, nullptr, 3, 0, 1024, nullptr),
            RSSM_OK);
  ExpectRejected(
      [&](uint64_t* d) { return rssm_segment_digests_parts(&kCpu, nullptr, nullptr, 0, 0, 0, d); },
      "segment_bytes", fn);
}

TEST(SegmentDigests, CudaWithoutTheBackendIsUnsupportedAndWritesNothing) {
  if (rssm_backend_available(RSSM_BACKEND_CUDA)) GTEST_SKIP() << "a GPU is present";
  std::mt19937_64 rng(2);
  HostData x(256, rng);
  const rssm_launch cuda{RSSM_BACKEND_CUDA, nullptr};
  uint64_t d[1] = {9};
  EXPECT_EQ(Whole(&cuda, x.data(), 256, 64 * 4, d), RSSM_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(rssm_last_error()).find("CUDA"), std::string::npos);
  EXPECT_EQ(d[0], 9u);
  const void* parts[2] = {x.data(), x.data() + 128};
  EXPECT_EQ(rssm_segment_digests_parts(&cuda, parts, parts, 2, 128, 64 * 4, d),
            RSSM_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(rssm_last_error()).find("CUDA"), std::string::npos);
  EXPECT_EQ(d[0], 9u);
}

}  // namespace
}  // namespace replayssm::kernels::testing
