// The payload checksum of a slot move (kChecksumVersion, slot_io.h), on the host: what a
// writer computes over the bytes it copies into a slot, from any number of threads at once.
//
// The payload is cut into segments at fixed payload offsets (kChecksumSegmentBytes; the last
// one shorter). Each segment is hashed on its own with the segment hash of
// replayssm/segment_hash.h (eight 64-bit lanes, one xxHash64-style round per 8-byte word, the
// lanes, tail and length mixed at the end); the segment digests are then mixed in segment
// order, and the payload's length. The digest does not depend on how either side splits the
// payload into chunks, and different segments are hashed on different threads in any order.
// The device computes the same segment digests (rssm_segment_digests_parts) and
// CombineSegmentDigests turns them into the same digest. Not cryptographic: it catches
// corruption, not an adversary.
//
// Thread safety: SegmentedChecksum's Add and CopyAndAdd may be called from any number of
// threads at once (each payload byte exactly once); Digest once every byte was added.
#ifndef REPLAYSSM_CACHE_SLOT_CHECKSUM_H_
#define REPLAYSSM_CACHE_SLOT_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "replayssm/cache/slot_io.h"
#include "replayssm/segment_hash.h"

namespace replayssm::cache {

// The digest from the segment digests of a payload of `total` bytes (in segment order).
uint64_t CombineSegmentDigests(const uint64_t* digests, size_t count, size_t total);

// The checksum of a payload of `total` bytes fed in pieces (payload offset, bytes) in any
// order. A piece's part in a segment is hashed at once when it is the next part of that
// segment (a whole segment inside one piece always is: no lock contended, no byte copied); a
// part that comes before its predecessors is kept (a copy) until they came. `segment` other
// than kChecksumSegmentBytes: tests only.
class SegmentedChecksum {
 public:
  explicit SegmentedChecksum(size_t total, size_t segment = kChecksumSegmentBytes);
  void Add(size_t offset, const void* data, size_t size);
  // Copies src[0, size) to dst (host memory, not overlapping) and adds the copy (what dst
  // holds) as payload bytes [offset, offset + size), in L1-sized pieces: one pass over src.
  void CopyAndAdd(void* dst, const void* src, size_t offset, size_t size);
  uint64_t Digest() const;
  size_t total() const { return total_; }

 private:
  struct Segment {
    mutable std::mutex mu;
    segment_hash::Stream sum;                       // the segment's bytes [begin, next) in order
    size_t next = 0;                               // payload offset
    std::map<size_t, std::vector<uint8_t>> early;  // parts after a gap, by payload offset
  };
  void Part(Segment& s, size_t offset, const uint8_t* src, uint8_t* dst, size_t n);
  size_t total_, segment_, count_;
  std::unique_ptr<Segment[]> segs_;
};

// PayloadChecksum (slot_io.h) with segments of `segment` bytes (tests only).
uint64_t PayloadChecksumOfSegments(const void* data, size_t size, size_t segment);

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_SLOT_CHECKSUM_H_
