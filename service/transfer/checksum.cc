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

namespace {

constexpr uint64_t kV3Seed = 0x5eed0003;

}  // namespace

SegmentedChecksum::SegmentedChecksum(size_t total, size_t segment)
    : total_(total),
      segment_(segment == 0 ? kChecksumSegmentBytes : segment),
      count_((total + segment_ - 1) / segment_),
      segs_(std::make_unique<Segment[]>(count_)) {
  for (size_t i = 0; i < count_; ++i) segs_[i].next = i * segment_;
}

void SegmentedChecksum::Part(Segment& s, size_t offset, const uint8_t* src, uint8_t* dst,
                             size_t n) {
  std::lock_guard<std::mutex> lock(s.mu);
  if (offset != s.next) {  // its predecessors have not come yet: keep what it holds
    const uint8_t* keep = src;
    if (dst != nullptr) {
      std::memcpy(dst, src, n);
      keep = dst;
    }
    s.early.emplace(offset, std::vector<uint8_t>(keep, keep + n));
    return;
  }
  if (dst != nullptr) {
    s.sum.CopyAndUpdate(dst, src, n);
  } else {
    s.sum.Update(src, n);
  }
  s.next += n;
  for (auto it = s.early.begin(); it != s.early.end() && it->first == s.next;
       it = s.early.erase(it)) {
    s.sum.Update(it->second.data(), it->second.size());
    s.next += it->second.size();
  }
}

void SegmentedChecksum::CopyAndAdd(void* dst, const void* src, size_t offset, size_t size) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* p = static_cast<const uint8_t*>(src);
  size = std::min(size, total_ > offset ? total_ - offset : 0);
  while (size > 0) {
    const size_t seg = offset / segment_;
    const size_t n = std::min(size, (seg + 1) * segment_ - offset);
    Part(segs_[seg], offset, p, d, n);
    offset += n;
    p += n;
    if (d != nullptr) d += n;
    size -= n;
  }
}

void SegmentedChecksum::Add(size_t offset, const void* data, size_t size) {
  CopyAndAdd(nullptr, data, offset, size);
}

uint64_t SegmentedChecksum::Digest() const {
  uint64_t h = kV3Seed;
  for (size_t i = 0; i < count_; ++i) {
    std::lock_guard<std::mutex> lock(segs_[i].mu);
    h = Mix(h, segs_[i].sum.Digest());
  }
  return Mix(h, total_);
}

uint64_t ChecksumV3(const void* data, size_t size, size_t segment) {
  if (segment == 0) segment = kChecksumSegmentBytes;
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t h = kV3Seed;
  for (size_t off = 0; off < size; off += segment) {
    h = Mix(h, Checksum(p + off, std::min(segment, size - off)));
  }
  return Mix(h, size);
}

}  // namespace replayssm::transfer
