#include "slot_checksum.h"

#include <algorithm>
#include <cstring>

namespace replayssm::cache {
namespace {

constexpr uint64_t kSeed = 0x5eed0003;
constexpr size_t kL1Piece = 16 << 10;  // copied, then hashed while still in L1

// Copies (when dst is set) and hashes src[0, n) into `sum` in L1-sized pieces.
void CopyAndUpdate(segment_hash::Stream& sum, uint8_t* dst, const uint8_t* src, size_t n) {
  if (dst == nullptr) {
    sum.Update(src, n);
    return;
  }
  for (size_t off = 0; off < n; off += kL1Piece) {
    const size_t k = std::min(kL1Piece, n - off);
    std::memcpy(dst + off, src + off, k);
    sum.Update(dst + off, k);
  }
}

}  // namespace

uint64_t CombineSegmentDigests(const uint64_t* digests, size_t count, size_t total) {
  uint64_t h = kSeed;
  for (size_t i = 0; i < count; ++i) h = segment_hash::Mix(h, digests[i]);
  return segment_hash::Mix(h, total);
}

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
    if (dst != nullptr) std::memcpy(dst, src, n);
    const uint8_t* keep = dst != nullptr ? dst : src;
    s.early.emplace(offset, std::vector<uint8_t>(keep, keep + n));
    return;
  }
  CopyAndUpdate(s.sum, dst, src, n);
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
  std::vector<uint64_t> d(count_);
  for (size_t i = 0; i < count_; ++i) {
    std::lock_guard<std::mutex> lock(segs_[i].mu);
    d[i] = segs_[i].sum.Digest();
  }
  return CombineSegmentDigests(d.data(), count_, total_);
}

uint64_t PayloadChecksum(const void* data, size_t size) {
  return PayloadChecksumOfSegments(data, size, kChecksumSegmentBytes);
}

uint64_t PayloadChecksumOfSegments(const void* data, size_t size, size_t segment) {
  const auto* p = static_cast<const uint8_t*>(data);
  std::vector<uint64_t> d;
  for (size_t off = 0; off < size; off += segment) {
    d.push_back(segment_hash::Digest(p + off, std::min(segment, size - off)));
  }
  return CombineSegmentDigests(d.data(), d.size(), size);
}

}  // namespace replayssm::cache
