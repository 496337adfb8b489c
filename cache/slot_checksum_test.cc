// The payload checksum on the host: equal to its definition written out independently, for
// any split into pieces, any order and any number of threads; every corruption seen; and the
// backend's segment digests of a slot combine to the same digest.
#include "slot_checksum.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <vector>

namespace replayssm::cache {
namespace {

// The checksum written out from docs/transfer.md, independently of slot_checksum.cc: the
// segment hash of every `segment` bytes, mixed in order from a seed, then the length.
uint64_t Reference(const std::vector<uint8_t>& x, size_t segment) {
  auto mix = [](uint64_t h, uint64_t v) {
    h ^= v * 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
    h *= 0xBF58476D1CE4E5B9ULL;
    return h ^ (h >> 32);
  };
  uint64_t h = 0x5eed0003;
  for (size_t off = 0; off < x.size(); off += segment) {
    h = mix(h, segment_hash::Digest(x.data() + off, std::min(segment, x.size() - off)));
  }
  return mix(h, x.size());
}

// Random pieces of [0, size): sizes 1..max_piece (unaligned with anything), shuffled.
std::vector<std::pair<size_t, size_t>> RandomPieces(size_t size, size_t max_piece,
                                                    std::mt19937& rng) {
  std::vector<std::pair<size_t, size_t>> out;
  for (size_t off = 0; off < size;) {
    const size_t n = std::min<size_t>(size - off, 1 + rng() % max_piece);
    out.emplace_back(off, n);
    off += n;
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

TEST(SlotChecksum, EqualForAnyPiecesOrderAndThreadsAndToTheDefinition) {
  std::mt19937 rng(17);
  for (size_t segment : {size_t{64}, size_t{1000}, size_t{4096}, kChecksumSegmentBytes}) {
    for (size_t size : {size_t{0}, size_t{1}, size_t{999}, size_t{64 * 1000 + 7}, size_t{3} << 20,
                        (size_t{5} << 20) + 333}) {
      if (segment < 4096 && size > (size_t{1} << 20)) continue;  // the time goes to big cases
      std::vector<uint8_t> x(size);
      for (auto& b : x) b = static_cast<uint8_t>(rng());
      const uint64_t want = Reference(x, segment);
      ASSERT_EQ(PayloadChecksumOfSegments(x.data(), x.size(), segment), want) << segment;
      if (segment == kChecksumSegmentBytes) {
        EXPECT_EQ(PayloadChecksum(x.data(), x.size()), want);
      }
      // Pieces as movers cut them: 700 and 1000 bytes, 4 MiB, random sizes; in order,
      // shuffled, over 4 threads; hashed in place and as they are copied.
      for (size_t max_piece : {size_t{700}, size_t{1000}, size_t{4} << 20, size_t{3 * 1024 + 5},
                               segment + 1, size_t{333333}}) {
        for (int threads : {1, 4}) {
          std::vector<std::pair<size_t, size_t>> pieces = RandomPieces(size, max_piece, rng);
          if (threads == 1) std::sort(pieces.begin(), pieces.end());
          SegmentedChecksum sum(size, segment), copied(size, segment);
          std::vector<uint8_t> dst(size);
          std::atomic<size_t> next{0};
          auto work = [&] {
            for (size_t i; (i = next.fetch_add(1)) < pieces.size();) {
              const auto [off, n] = pieces[i];
              sum.Add(off, x.data() + off, n);
              copied.CopyAndAdd(dst.data() + off, x.data() + off, off, n);
            }
          };
          std::vector<std::thread> th;
          for (int t = 0; t < threads; ++t) th.emplace_back(work);
          for (auto& t : th) t.join();
          EXPECT_EQ(sum.Digest(), want) << segment << " " << size << " " << max_piece;
          EXPECT_EQ(copied.Digest(), want) << segment << " " << size << " " << max_piece;
          EXPECT_EQ(dst, x);
        }
      }
    }
  }
}

TEST(SlotChecksum, ACorruptionInAnySegmentIsSeen) {
  const size_t segment = 4096, size = 10 * 4096 + 100;  // 11 segments, the last one short
  std::vector<uint8_t> x(size);
  std::mt19937 rng(3);
  for (auto& b : x) b = static_cast<uint8_t>(rng());
  const uint64_t whole = PayloadChecksumOfSegments(x.data(), x.size(), segment);
  for (size_t seg = 0; seg * segment < size; ++seg) {
    for (size_t at : {size_t{0}, size_t{63}, size_t{2049}, segment - 1}) {
      const size_t i = std::min(size - 1, seg * segment + at);
      x[i] ^= 0x04;
      EXPECT_NE(PayloadChecksumOfSegments(x.data(), x.size(), segment), whole) << "byte " << i;
      SegmentedChecksum s(size, segment);
      for (const auto& [off, n] : RandomPieces(size, 1000, rng)) s.Add(off, x.data() + off, n);
      EXPECT_NE(s.Digest(), whole) << "byte " << i << ", out of order";
      x[i] ^= 0x04;
    }
  }
  std::vector<uint8_t> swapped = x;
  std::swap_ranges(swapped.begin(), swapped.begin() + segment, swapped.begin() + segment);
  EXPECT_NE(PayloadChecksumOfSegments(swapped.data(), size, segment), whole);
  EXPECT_NE(PayloadChecksumOfSegments(x.data(), size - 1, segment), whole);
}

}  // namespace
}  // namespace replayssm::cache
