// The segment hash of a transfer payload's checksum (docs/transfer.md, "Checksum"): each
// 1 MiB segment is hashed on its own with this function, and the segment digests are mixed
// in order (cache/slot_checksum.h). The one definition of its round, lanes and finish (and,
// on the host, the carry of a digest fed in pieces: Stream), shared by the host's
// SegmentedChecksum, the CPU backend's and the CUDA kernel's rssm_segment_digests(_parts)
// (kernels.h), so that they cannot drift. C++ only (the C ABI does not depend on it); the
// round and the finish are __host__ __device__ when compiled by nvcc. (It was the whole
// payload's checksum in version 2 of the format, hence its constants.)
//
// The function: eight 64-bit lanes (initially 1..8) over the 64-byte blocks of the data, lane
// k taking word k (8 bytes, little-endian) of each block through Round; then, from seed
// kSeed, Mix of each lane in order, of each byte of the tail (the last size % 64 bytes) in
// order, and of the length in bytes. Not cryptographic: it catches corruption.
#ifndef REPLAYSSM_SEGMENT_HASH_H_
#define REPLAYSSM_SEGMENT_HASH_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define RSSM_SEGMENT_HASH_HD __host__ __device__ __forceinline__
#else
#define RSSM_SEGMENT_HASH_HD inline
#endif

namespace replayssm::segment_hash {

inline constexpr int kLanes = 8;
inline constexpr size_t kBlockBytes = 64;  // kLanes words of 8 bytes
inline constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kSeed = 0x5eed;

// Lane k's value before the first block.
RSSM_SEGMENT_HASH_HD uint64_t LaneInit(int k) { return static_cast<uint64_t>(k) + 1; }

RSSM_SEGMENT_HASH_HD uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

// One lane takes one word (xxHash64's round: multiply, rotate, multiply).
RSSM_SEGMENT_HASH_HD uint64_t Round(uint64_t lane, uint64_t word) {
  return Rotl(lane + word * kPrime2, 31) * kPrime1;
}

// The finish's mix (also what version 3 mixes its segment digests with).
RSSM_SEGMENT_HASH_HD uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v * 0x9E3779B97F4A7C15ULL;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 32);
}

// The digest from the lanes after every whole block, the tail (< 64 bytes) and the length.
RSSM_SEGMENT_HASH_HD uint64_t Finish(const uint64_t* lanes, const uint8_t* tail, size_t tail_size,
                                 uint64_t total) {
  uint64_t h = kSeed;
  for (int k = 0; k < kLanes; ++k) h = Mix(h, lanes[k]);
  for (size_t i = 0; i < tail_size; ++i) h = Mix(h, tail[i]);
  return Mix(h, total);
}

// Host: feeds n bytes (a multiple of 64; any alignment) of whole blocks into the lanes.
inline void Blocks(uint64_t* lanes, const uint8_t* p, size_t n) {
  uint64_t l[kLanes];
  std::memcpy(l, lanes, sizeof(l));
  for (size_t i = 0; i < n; i += kBlockBytes) {
    for (int k = 0; k < kLanes; ++k) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * k, 8);
      l[k] = Round(l[k], v);
    }
  }
  std::memcpy(lanes, l, sizeof(l));
}

// Host: the digest of data fed in pieces of any size (a block that spans pieces goes through
// a 64-byte carry): Update(a); Update(b) gives Digest of a | b.
class Stream {
 public:
  Stream() {
    for (int k = 0; k < kLanes; ++k) lanes_[k] = LaneInit(k);
  }
  void Update(const void* data, size_t size) {
    const auto* p = static_cast<const uint8_t*>(data);
    total_ += size;
    if (carry_size_ > 0) {  // finish the block begun by an earlier piece
      const size_t take = size < kBlockBytes - carry_size_ ? size : kBlockBytes - carry_size_;
      std::memcpy(carry_ + carry_size_, p, take);
      carry_size_ += take;
      p += take;
      size -= take;
      if (carry_size_ < kBlockBytes) return;
      Blocks(lanes_, carry_, kBlockBytes);
      carry_size_ = 0;
    }
    const size_t whole = size / kBlockBytes * kBlockBytes;
    Blocks(lanes_, p, whole);
    std::memcpy(carry_, p + whole, size - whole);
    carry_size_ = size - whole;
  }
  uint64_t Digest() const { return Finish(lanes_, carry_, carry_size_, total_); }

 private:
  uint64_t lanes_[kLanes];
  uint8_t carry_[kBlockBytes] = {};
  size_t carry_size_ = 0;
  uint64_t total_ = 0;
};

// Host: the digest of one contiguous buffer.
inline uint64_t Digest(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t lanes[kLanes];
  for (int k = 0; k < kLanes; ++k) lanes[k] = LaneInit(k);
  const size_t whole = size / kBlockBytes * kBlockBytes;
  Blocks(lanes, p, whole);
  return Finish(lanes, p + whole, size - whole, size);
}

}  // namespace replayssm::segment_hash

#endif  // REPLAYSSM_SEGMENT_HASH_H_
