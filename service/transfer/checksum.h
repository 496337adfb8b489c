// The checksum of a transfer payload, computed once, chunk by chunk, while each chunk passes
// (the sender as it stages or puts it, the receiver as it imports it).
//
// Version 2 (the only one spoken; see kChecksumVersion and docs/transfer.md): eight 64-bit
// lanes over 64-byte blocks, one xxHash64-style round (multiply, rotate, multiply) per 8-byte
// word, lanes and length mixed at the end. Incremental: any split of the payload into Update
// calls gives the same digest. Not cryptographic: it catches corruption, not an adversary.
// (Version 1, one pass of four multiply-xorshift lanes over the whole payload, ran at a
// third of the speed and could not be taken chunk by chunk across an arbitrary split.)
//
// Thread safety: a Checksummer is a value; one thread at a time.
#ifndef REPLAYSSM_SERVICE_TRANSFER_CHECKSUM_H_
#define REPLAYSSM_SERVICE_TRANSFER_CHECKSUM_H_

#include <cstddef>
#include <cstdint>

namespace replayssm::transfer {

inline constexpr uint32_t kChecksumVersion = 2;
// Declared by a sender that puts device memory directly (UCX with CUDA support): it cannot
// hash what it never sees on the host, and the receiver does not verify.
inline constexpr uint32_t kChecksumNone = 100;

class Checksummer {
 public:
  void Update(const void* data, size_t size);
  // Copies src[0, size) to dst (host memory, not overlapping) and hashes it: one pass over
  // src, in pieces small enough to stay in L1 between the copy and the hash.
  void CopyAndUpdate(void* dst, const void* src, size_t size);
  uint64_t Digest() const;

 private:
  void Blocks(const uint8_t* p, size_t n);  // n a multiple of 64
  uint64_t lane_[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  uint8_t tail_[64] = {};
  size_t tail_size_ = 0;
  uint64_t total_ = 0;
};

// The digest of one contiguous buffer.
uint64_t Checksum(const void* data, size_t size);

}  // namespace replayssm::transfer

#endif  // REPLAYSSM_SERVICE_TRANSFER_CHECKSUM_H_
