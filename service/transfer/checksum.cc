#include "checksum.h"

#include <algorithm>
#include <cstring>

namespace replayssm::transfer {
namespace {

constexpr uint64_t kPrime1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t kPrime2 = 0xC2B2AE3D27D4EB4FULL;

inline uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t Mix(uint64_t h, uint64_t v) {
  h ^= v * 0x9E3779B97F4A7C15ULL;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ULL;
  return h ^ (h >> 32);
}

}  // namespace

void Checksummer::Blocks(const uint8_t* p, size_t n) {
  uint64_t l[8];
  std::memcpy(l, lane_, sizeof(l));
  for (size_t i = 0; i < n; i += 64) {
    for (int k = 0; k < 8; ++k) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * k, 8);
      l[k] = Rotl(l[k] + v * kPrime2, 31) * kPrime1;
    }
  }
  std::memcpy(lane_, l, sizeof(l));
}

void Checksummer::Update(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  total_ += size;
  if (tail_size_ > 0) {
    const size_t take = std::min(size, 64 - tail_size_);
    std::memcpy(tail_ + tail_size_, p, take);
    tail_size_ += take;
    p += take;
    size -= take;
    if (tail_size_ < 64) return;
    Blocks(tail_, 64);
    tail_size_ = 0;
  }
  const size_t whole = size & ~size_t{63};
  Blocks(p, whole);
  std::memcpy(tail_, p + whole, size - whole);
  tail_size_ = size - whole;
}

void Checksummer::CopyAndUpdate(void* dst, const void* src, size_t size) {
  constexpr size_t kPiece = 16 << 10;  // copied, then hashed while still in L1
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  for (size_t off = 0; off < size; off += kPiece) {
    const size_t n = std::min(kPiece, size - off);
    std::memcpy(d + off, s + off, n);
    Update(d + off, n);
  }
}

uint64_t Checksummer::Digest() const {
  uint64_t h = 0x5eed;
  for (uint64_t l : lane_) h = Mix(h, l);
  for (size_t i = 0; i < tail_size_; ++i) h = Mix(h, tail_[i]);
  return Mix(h, total_);
}

uint64_t Checksum(const void* data, size_t size) {
  Checksummer c;
  c.Update(data, size);
  return c.Digest();
}

}  // namespace replayssm::transfer
