// rssm_segment_digests_parts on the device (rssm_segment_digests is its count-1 case): the
// version 2 digest (replayssm/segment_hash.h, the same Round and Finish as the host's
// Checksummer) of each segment of a payload held as `count` device parts of part_bytes each,
// hashed where the parts lie (a slot's layers need no gather into one buffer first).
//
// Version 2 is a serial chain per lane: lane k of a segment takes word k of every 64-byte
// block in order, so a segment has only 8 independent chains (16384 rounds each for 1 MiB),
// and they are the bound, not memory. One CTA per segment: its 128 threads load the segment
// in 8 KiB tiles (coalesced 16-byte loads, double-buffered in shared memory: the next tile is
// in flight while the current one is hashed), threads 0..7 run the 8 lane chains over each
// tile from shared memory (8 consecutive words per block: no bank conflict), and thread 0
// finishes (lanes, the tail of a short last segment, the length). A 1 MiB segment's chain is
// 16384 dependent rounds (64-bit add, rotate, multiply); all segments of a 75 MB slot (72)
// run at once, one CTA per SM, so the slot takes about as long as one segment's chain. The
// cache's call on a slot (part table up, digests back) is timed in bench/results/transfer.md
// ("checksum of the slot by the cache, in place on the device").
//
// Parts: the 16-byte chunk at payload offset off is at parts[off / part_bytes] +
// off % part_bytes. The API's rule (every part 16-byte aligned, part_bytes a multiple of 16
// when count > 1) keeps every chunk of the whole blocks inside one part and 16-byte aligned,
// so the loads stay 16-byte loads. A thread's chunks are kStride bytes apart all through its
// segment, so it walks them with a PartCursor that divides only where it crosses into another
// part (once per part for a slot's layers, MBs each); no per-chunk division. The tail (the
// last size % 64 bytes, read byte by byte by v2::Finish) may span parts: it is copied into
// shared memory first, one byte per thread, beside the first tile's loads.
#include "params.h"
#include "replayssm/segment_hash.h"

namespace replayssm::kernels::cuda {
namespace {

namespace v2 = ::replayssm::segment_hash;

constexpr int kThreads = 128;
constexpr size_t kTileBytes = 8192;                     // one stage; two in shared memory
constexpr int kTileChunks = kTileBytes / 16;            // 16-byte loads per tile
constexpr int kChunksPerThread = kTileChunks / kThreads;
constexpr size_t kStride = kThreads * 16;               // between a thread's chunks
static_assert(kTileChunks % kThreads == 0 && kTileBytes % v2::kBlockBytes == 0);
static_assert(kThreads >= v2::kLanes && kThreads >= v2::kBlockBytes);

__device__ __forceinline__ size_t Min(size_t a, size_t b) { return a < b ? a : b; }

// One thread's place in the payload: offset `off` is byte in_part of part `part`, whose
// pointer is kept in `base` (null past the last part, where nothing is loaded).
struct PartCursor {
  size_t part, in_part;
  const uint8_t* base;

  __device__ __forceinline__ void Seek(const SegmentDigestParams& p, size_t off) {
    part = off / p.part_bytes;
    in_part = off - part * p.part_bytes;
    base = part < p.count ? p.parts[part] : nullptr;
  }
  __device__ __forceinline__ void Advance(const SegmentDigestParams& p, size_t n) {
    in_part += n;
    if (in_part < p.part_bytes) return;  // the common case: same part
    const size_t skip = in_part / p.part_bytes;
    part += skip;
    in_part -= skip * p.part_bytes;
    base = part < p.count ? p.parts[part] : nullptr;
  }
  __device__ __forceinline__ const uint4* chunk() const {
    return reinterpret_cast<const uint4*>(base + in_part);
  }
};

__global__ void __launch_bounds__(kThreads)
    SegmentDigestKernel(const __grid_constant__ SegmentDigestParams p) {
  __shared__ uint4 tile[2][kTileChunks];  // [stage, 16-byte chunk]
  __shared__ uint64_t lanes[v2::kLanes];
  __shared__ uint8_t tail[v2::kBlockBytes];  // the segment's tail, gathered from its parts
  const int t = threadIdx.x;
  const size_t begin = static_cast<size_t>(blockIdx.x) * p.segment_bytes;
  const size_t size = Min(p.segment_bytes, p.bytes - begin);
  const size_t whole = size / v2::kBlockBytes * v2::kBlockBytes;  // the tail: size - whole
  const size_t tail_size = size - whole;
  PartCursor at;  // chunk t, then t + kThreads, ... of the segment (kStride bytes apart)
  at.Seek(p, begin + static_cast<size_t>(t) * 16);
  uint4 r[kChunksPerThread];
  // The next tile's first n bytes of the segment: global -> registers, then registers ->
  // stage b. Tiles are loaded in order, each once (n == 0 past the last: the cursor only
  // moves).
  auto load = [&](size_t n) {
#pragma unroll
    for (int q = 0; q < kChunksPerThread; ++q) {
      const size_t j = t + q * kThreads;
      if (j * 16 < n) r[q] = __ldg(at.chunk());
      at.Advance(p, kStride);
    }
  };
  auto store = [&](int b, size_t n) {
#pragma unroll
    for (int q = 0; q < kChunksPerThread; ++q) {
      const size_t j = t + q * kThreads;
      if (j * 16 < n) tile[b][j] = r[q];
    }
  };
  size_t n = Min(kTileBytes, whole);
  load(n);
  uint8_t tail_byte = 0;  // byte t of the tail, loaded beside the first tile
  if (static_cast<size_t>(t) < tail_size) {
    const size_t off = begin + whole + t, part = off / p.part_bytes;
    tail_byte = p.parts[part][off - part * p.part_bytes];
  }
  store(0, n);
  if (static_cast<size_t>(t) < tail_size) tail[t] = tail_byte;
  __syncthreads();
  uint64_t lane = v2::LaneInit(t);  // meaningful for t < kLanes
  int b = 0;
  for (size_t off = 0; off < whole; off += kTileBytes, b ^= 1) {
    const size_t next = off + kTileBytes;
    const size_t nn = next < whole ? Min(kTileBytes, whole - next) : 0;
    load(nn);  // in flight while this tile is hashed
    if (t < v2::kLanes) {
      const uint64_t* w = reinterpret_cast<const uint64_t*>(tile[b]) + t;
      const int blocks = static_cast<int>(n / v2::kBlockBytes);
#pragma unroll 8
      for (int i = 0; i < blocks; ++i) lane = v2::Round(lane, w[i * v2::kLanes]);
    }
    store(b ^ 1, nn);  // the stage hashed in the previous iteration
    __syncthreads();
    n = nn;
  }
  if (t < v2::kLanes) lanes[t] = lane;
  __syncthreads();
  if (t == 0) p.digests[blockIdx.x] = v2::Finish(lanes, tail, tail_size, size);
}

}  // namespace

cudaError_t LaunchSegmentDigests(const SegmentDigestParams& p, cudaStream_t stream) {
  const size_t count = (p.bytes + p.segment_bytes - 1) / p.segment_bytes;
  SegmentDigestKernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace replayssm::kernels::cuda
