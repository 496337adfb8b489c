#include "checksum.h"

#include <algorithm>
#include <cstring>

namespace replayssm::transfer {
namespace {

using checksum_v2::Mix;

constexpr uint64_t kV3Seed = 0x5eed0003;

}  // namespace

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

uint64_t Checksum(const void* data, size_t size) { return checksum_v2::Digest(data, size); }

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

uint64_t CombineSegmentDigests(const uint64_t* digests, size_t count, size_t total) {
  uint64_t h = kV3Seed;
  for (size_t i = 0; i < count; ++i) h = Mix(h, digests[i]);
  return Mix(h, total);
}

uint64_t SegmentedChecksum::Digest() const {
  std::vector<uint64_t> d(count_);
  for (size_t i = 0; i < count_; ++i) {
    std::lock_guard<std::mutex> lock(segs_[i].mu);
    d[i] = segs_[i].sum.Digest();
  }
  return CombineSegmentDigests(d.data(), count_, total_);
}

uint64_t ChecksumV3(const void* data, size_t size, size_t segment) {
  if (segment == 0) segment = kChecksumSegmentBytes;
  const auto* p = static_cast<const uint8_t*>(data);
  std::vector<uint64_t> d;
  for (size_t off = 0; off < size; off += segment) {
    d.push_back(Checksum(p + off, std::min(segment, size - off)));
  }
  return CombineSegmentDigests(d.data(), d.size(), size);
}

}  // namespace replayssm::transfer
