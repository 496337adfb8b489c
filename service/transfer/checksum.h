// The checksum of a transfer payload, computed once, chunk by chunk, while each chunk passes
// (the sender as it stages or puts it, the receiver as it imports it). See docs/transfer.md.
//
// Version 2 (Checksummer): eight 64-bit lanes over 64-byte blocks, one xxHash64-style round
// (multiply, rotate, multiply) per 8-byte word, lanes and length mixed at the end (the round
// and the finish: replayssm/checksum_v2.h, shared with the kernels' rssm_segment_digests).
// Incremental: any split of the payload into Update calls gives the same digest, but the
// calls must come in payload order, so one thread hashes the whole payload (~5 GB/s).
//
// Version 3 (SegmentedChecksum, what a sender declares now): the payload is cut into fixed
// segments at fixed offsets (kChecksumSegmentBytes, 1 MiB; the last one shorter); each is
// hashed on its own with version 2 (its own lanes, tail and length), and the segment
// digests are mixed in segment order, then the payload's length. It does not depend on how
// the payload is split into chunks either, and different segments can be hashed on
// different threads at once, in any order. The segment digests of memory a backend holds
// (device memory on CUDA) come from rssm_segment_digests (kernels.h), the same function on the
// device; CombineSegmentDigests turns them into the payload's digest.
//
// Neither is cryptographic: they catch corruption, not an adversary. (Version 1, one pass of
// four multiply-xorshift lanes over the whole payload, ran at a third of the speed and could
// not be taken chunk by chunk across an arbitrary split.)
//
// Thread safety: a Checksummer is a value; one thread at a time. SegmentedChecksum's Add and
// CopyAndAdd may be called from any number of threads at once (each byte of the payload
// exactly once); Digest once every byte was added (and those calls returned).
#ifndef REPLAYSSM_SERVICE_TRANSFER_CHECKSUM_H_
#define REPLAYSSM_SERVICE_TRANSFER_CHECKSUM_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "replayssm/checksum_v2.h"

namespace replayssm::transfer {

// What a sender declares (version 3); a receiver also verifies version 2 (an older sender).
inline constexpr uint32_t kChecksumVersion = 3;
inline constexpr uint32_t kChecksumV2 = 2;
// Version 3's segment: part of the format (both sides must use the same).
inline constexpr size_t kChecksumSegmentBytes = size_t{1} << 20;
// Declared by a device-direct sender of an older build (it did not hash device memory); the
// receiver accepts it and does not verify. Senders of this build declare 3 on every path.
inline constexpr uint32_t kChecksumNone = 100;

class Checksummer {
 public:
  void Update(const void* data, size_t size) { stream_.Update(data, size); }
  // Copies src[0, size) to dst (host memory, not overlapping) and hashes it: one pass over
  // src, in pieces small enough to stay in L1 between the copy and the hash.
  void CopyAndUpdate(void* dst, const void* src, size_t size);
  uint64_t Digest() const { return stream_.Digest(); }

 private:
  checksum_v2::Stream stream_;
};

// The version 2 digest of one contiguous buffer.
uint64_t Checksum(const void* data, size_t size);

// Version 3 from the version 2 digests of a payload's `count` segments (in segment order) and
// its length: what SegmentedChecksum, ChecksumV3 and a backend's segment digests end with.
uint64_t CombineSegmentDigests(const uint64_t* digests, size_t count, size_t total);

// Version 3 of a payload of `total` bytes, fed in pieces (payload offset, bytes) in any order
// and from any threads. A piece's part in a segment is hashed at once when it is the next
// part of that segment (a whole segment inside one piece, the common case, always is: no
// lock is contended, no byte copied); a part that comes before its predecessors is kept (a
// copy) until they came. `segment` other than kChecksumSegmentBytes: tests only.
class SegmentedChecksum {
 public:
  explicit SegmentedChecksum(size_t total, size_t segment = kChecksumSegmentBytes);
  void Add(size_t offset, const void* data, size_t size);
  // Copies src[0, size) to dst (host memory, not overlapping) and adds the copy (what dst
  // holds) as payload bytes [offset, offset + size), in L1-sized pieces.
  void CopyAndAdd(void* dst, const void* src, size_t offset, size_t size);
  uint64_t Digest() const;
  size_t total() const { return total_; }

 private:
  struct Segment {
    mutable std::mutex mu;
    Checksummer sum;   // the segment's bytes [begin, next) in order
    size_t next = 0;   // payload offset
    std::map<size_t, std::vector<uint8_t>> early;  // parts after a gap, by payload offset
  };
  void Part(Segment& s, size_t offset, const uint8_t* src, uint8_t* dst, size_t n);
  size_t total_, segment_, count_;
  std::unique_ptr<Segment[]> segs_;
};

// Version 3 of one contiguous buffer on one thread (the reference).
uint64_t ChecksumV3(const void* data, size_t size, size_t segment = kChecksumSegmentBytes);

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_SERVICE_TRANSFER_CHECKSUM_H_
