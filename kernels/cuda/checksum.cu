// rssm_segment_digests on the device: the version 2 digest (replayssm/checksum_v2.h, the same
// Round and Finish as the host's Checksummer) of each segment of a device buffer.
//
// Version 2 is a serial chain per lane: lane k of a segment takes word k of every 64-byte
// block in order, so a segment has only 8 independent chains (16384 rounds each for 1 MiB),
// and they are the bound, not memory. One CTA per segment: its 128 threads load the segment
// in 8 KiB tiles (coalesced 16-byte loads, double-buffered in shared memory: the next tile is
// in flight while the current one is hashed), threads 0..7 run the 8 lane chains over each
// tile from shared memory (8 consecutive words per block: no bank conflict), and thread 0
// finishes (lanes, the tail of a short last segment, the length). Expected on an H200: a
// 1 MiB segment's chain is ~16384 dependent rounds of ~25 cycles (64-bit add, rotate,
// multiply), ~0.2-0.3 ms; all segments of a 75 MB slot (72) run at once, one CTA per SM, so
// the slot takes about as long as one segment.
#include "params.h"
#include "replayssm/checksum_v2.h"

namespace replayssm::kernels::cuda {
namespace {

namespace v2 = ::replayssm::checksum_v2;

constexpr int kThreads = 128;
constexpr size_t kTileBytes = 8192;                     // one stage; two in shared memory
constexpr int kTileChunks = kTileBytes / 16;            // 16-byte loads per tile
constexpr int kChunksPerThread = kTileChunks / kThreads;
static_assert(kTileChunks % kThreads == 0 && kTileBytes % v2::kBlockBytes == 0);
static_assert(kThreads >= v2::kLanes);

__device__ __forceinline__ size_t Min(size_t a, size_t b) { return a < b ? a : b; }

__global__ void __launch_bounds__(kThreads)
    SegmentDigestKernel(const __grid_constant__ SegmentDigestParams p) {
  __shared__ uint4 tile[2][kTileChunks];  // [stage, 16-byte chunk]
  __shared__ uint64_t lanes[v2::kLanes];
  const int t = threadIdx.x;
  const size_t begin = static_cast<size_t>(blockIdx.x) * p.segment_bytes;
  const size_t size = Min(p.segment_bytes, p.bytes - begin);
  const size_t whole = size / v2::kBlockBytes * v2::kBlockBytes;  // the tail: size - whole
  const uint4* src = reinterpret_cast<const uint4*>(p.data + begin);
  uint4 r[kChunksPerThread];
  // Tile bytes [off, off + n) of the segment: global -> registers, then registers -> stage b.
  auto load = [&](size_t off, size_t n) {
#pragma unroll
    for (int q = 0; q < kChunksPerThread; ++q) {
      const size_t j = t + q * kThreads;
      if (j * 16 < n) r[q] = __ldg(src + off / 16 + j);
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
  load(0, n);
  store(0, n);
  __syncthreads();
  uint64_t lane = v2::LaneInit(t);  // meaningful for t < kLanes
  int b = 0;
  for (size_t off = 0; off < whole; off += kTileBytes, b ^= 1) {
    const size_t next = off + kTileBytes;
    const size_t nn = next < whole ? Min(kTileBytes, whole - next) : 0;
    load(next, nn);  // in flight while this tile is hashed
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
  if (t == 0) {
    p.digests[blockIdx.x] = v2::Finish(lanes, p.data + begin + whole, size - whole, size);
  }
}

}  // namespace

cudaError_t LaunchSegmentDigests(const SegmentDigestParams& p, cudaStream_t stream) {
  const size_t count = (p.bytes + p.segment_bytes - 1) / p.segment_bytes;
  SegmentDigestKernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace replayssm::kernels::cuda
