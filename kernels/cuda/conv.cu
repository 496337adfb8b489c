// rssm_short_conv and rssm_conv_fold on the device (docs/math-and-abi.md, "The short
// convolution"). The convolution is not recurrent (y_t reads x_{t-W+1..t} only), so a thread
// takes 16 bytes of channels (8 bf16/fp16 or 4 fp32; one channel when something is not
// 16-byte aligned) of a chunk of kTokensPerThread consecutive tokens of one row: it loads the
// W-1 inputs before its chunk (from x inside the row, from the slot's window and ring before
// it) and slides a register window over the chunk (W is a template parameter). A warp's loads
// and stores are consecutive channels (coalesced). Bytes per decode token: x, y and the ring record
// (C act values each), at most W-1 history entries and the weights (L2-resident across rows). A
// prefill rewrites the window that its first tokens read: that is a second launch, one thread per
// (row, channel), queued after the outputs' (stream order). A decode's call (APPEND, one token
// per row) takes ConvDecodeKernel: two rows per thread.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "../src/backend.h"
#include "common.cuh"

namespace replayssm::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kTokensPerThread = 16;
constexpr int kMaxHist = RSSM_MAX_CONV_WIDTH - 1;

rssm_status ReportConv(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return RSSM_OK;
  SetLastError(std::string(what) + ": CUDA error " + cudaGetErrorName(e) + ": " +
               cudaGetErrorString(e));
  return RSSM_ERR_DEVICE;
}

struct RowSpan {
  int64_t t0, len;
};

__device__ __forceinline__ RowSpan RowOf(const rssm_conv_args& a, int r) {
  if (a.cu_seqlens == nullptr) return {int64_t{r} * a.num_tokens, a.num_tokens};
  const int64_t t0 = a.cu_seqlens[r];
  return {t0, int64_t{a.cu_seqlens[r + 1]} - t0};
}

// Entry p of the slot's history (window[0..H-1] ++ ring_x[0..]): its row of C channels.
template <typename A>
__device__ __forceinline__ const A* HistRow(const A* win, const A* rx, int64_t C, int H, int p) {
  return p < H ? win + p * C : rx + (p - H) * C;
}

// 16-byte packs of activations: 4 fp32 or 8 bf16 / fp16 values in a uint4, element j read and
// written by a compile-time index (so that everything stays in registers).
template <typename A>
struct Pack;
template <>
struct Pack<float> {
  static constexpr int kN = 4;
  __device__ __forceinline__ static float Get(const uint4& p, int j) {
    return __uint_as_float((&p.x)[j]);
  }
  __device__ __forceinline__ static void Set(uint4& p, int j, float v) {
    (&p.x)[j] = __float_as_uint(v);
  }
};
// bf16 and fp16: two values per 32-bit word, converted through their 16-bit patterns (Bits:
// ToFloat / FromFloat of a pattern).
template <typename Bits>
struct Pack16 {
  static constexpr int kN = 8;
  __device__ __forceinline__ static float Get(const uint4& p, int j) {
    const unsigned w = (&p.x)[j / 2];
    return Bits::ToFloat(static_cast<unsigned short>(w >> (16 * (j % 2))));
  }
  __device__ __forceinline__ static void Set(uint4& p, int j, float v) {
    const unsigned h = Bits::FromFloat(v);
    unsigned& w = (&p.x)[j / 2];
    w = j % 2 ? (w & 0xffffu) | (h << 16) : (w & 0xffff0000u) | h;
  }
};
struct Bf16Bits {
  __device__ __forceinline__ static float ToFloat(unsigned short b) {
    return __bfloat162float(__ushort_as_bfloat16(b));
  }
  __device__ __forceinline__ static unsigned short FromFloat(float v) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
struct HalfBits {
  __device__ __forceinline__ static float ToFloat(unsigned short b) {
    return __half2float(__ushort_as_half(b));
  }
  __device__ __forceinline__ static unsigned short FromFloat(float v) {
    return __half_as_ushort(__float2half_rn(v));
  }
};
template <>
struct Pack<__nv_bfloat16> : Pack16<Bf16Bits> {};
template <>
struct Pack<__half> : Pack16<HalfBits> {};

// How the token kernel reads and writes activations: 16-byte packs (Pack<A>, when every
// pointer and stride allows them: ConvAligned) or one element at a time.
template <typename A, bool kVec>
struct Access;
template <typename A>
struct Access<A, true> {
  using Raw = uint4;
  static constexpr int kN = Pack<A>::kN;
  __device__ __forceinline__ static Raw Load(const A* p) {
    return *reinterpret_cast<const uint4*>(p);
  }
  __device__ __forceinline__ static void Store(A* p, const Raw& v) {
    *reinterpret_cast<uint4*>(p) = v;
  }
  __device__ __forceinline__ static Raw Zero() { return make_uint4(0, 0, 0, 0); }
  __device__ __forceinline__ static float Get(const Raw& r, int j) { return Pack<A>::Get(r, j); }
  __device__ __forceinline__ static void Set(Raw& r, int j, float v) { Pack<A>::Set(r, j, v); }
};
template <typename A>
struct Access<A, false> {
  using Raw = A;
  static constexpr int kN = 1;
  __device__ __forceinline__ static Raw Load(const A* p) { return *p; }
  __device__ __forceinline__ static void Store(A* p, const Raw& v) { *p = v; }
  __device__ __forceinline__ static Raw Zero() { return FromF<A>(0.f); }
  __device__ __forceinline__ static float Get(const Raw& r, int) { return ToF(r); }
  __device__ __forceinline__ static void Set(Raw& r, int, float v) { r = FromF<A>(v); }
};

// The weights of channels c0 .. c0 + N - 1 (N * W consecutive floats, 16-byte aligned: the
// packed kernels' case) into registers.
template <int N, int W>
__device__ __forceinline__ void LoadPackWeights(const float* weight, int64_t c0,
                                                float (&wt)[N][W]) {
  const float4* wp = reinterpret_cast<const float4*>(weight + c0 * W);
#pragma unroll
  for (int q = 0; q < N * W / 4; ++q) {
    const float4 v = wp[q];
    const float f[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) wt[(4 * q + e) / W][(4 * q + e) % W] = f[e];
  }
}

// A thread takes Access::kN consecutive channels of a chunk of tokens of one row; W is a
// template parameter, so the history and the weights live in registers.
template <typename A, int W, bool kVec>
__global__ void __launch_bounds__(kThreads) ConvKernel(rssm_conv_args a) {
  // A decode step queued behind this launch as its programmatic dependent (a joined
  // convolution, backend.cu) may start now: it streams its state and waits for y itself
  // (griddepcontrol.wait). Without a dependent this does nothing.
  asm volatile("griddepcontrol.launch_dependents;");
  using P = Access<A, kVec>;
  constexpr int N = P::kN, H = W - 1;
  const int64_t C = a.shape.channels;
  const int64_t c0 = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * N;
  const int r = blockIdx.z;
  if (c0 >= C) return;
  // Everything that does not depend on the slot is loaded first, beside the row's slot and
  // cursor (one dependent step less before the history loads: a decode call is latency-bound).
  const int32_t slot = a.slot_idx[r];
  const int32_t cursor = a.write_pos != nullptr ? a.write_pos[r] : 0;
  const RowSpan row = RowOf(a, r);
  const int64_t first = int64_t{blockIdx.y} * kTokensPerThread;
  if (first >= row.len) return;
  const int64_t last = min(row.len, first + kTokensPerThread);
  const A* x = static_cast<const A*>(a.x);
  A* y = static_cast<A*>(a.y);
  const typename P::Raw x_first = P::Load(x + (row.t0 + first) * a.x_token_stride + c0);
  float wt[N][W];  // the thread's channels' weights: N * W consecutive floats
  if constexpr (kVec) {
    LoadPackWeights(a.weight, c0, wt);
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) wt[0][i] = a.weight[c0 * W + i];
  }
  float bias[N];
#pragma unroll
  for (int j = 0; j < N; ++j) bias[j] = a.bias != nullptr ? a.bias[c0 + j] : 0.f;
  if (slot < 0 || slot >= a.state.num_slots) {
    for (int64_t t = first; t < last; ++t) {
      P::Store(y + (row.t0 + t) * a.y_token_stride + c0, P::Zero());
    }
    return;
  }
  const int L = a.shape.ring_len;
  const bool append = a.mode == RSSM_CONV_APPEND;
  const bool from_zero = !append && (a.initial == nullptr || a.initial[r] == 0);
  const int w = from_zero ? 0 : min(max(cursor, 0), L);
  const A* win = static_cast<const A*>(a.state.window) + slot * a.state.window_slot_stride;
  A* rx = static_cast<A*>(a.state.ring_x) + slot * a.state.ring_x_slot_stride;
  float hist[H][N];
#pragma unroll
  for (int i = 0; i < H; ++i) {
    const int64_t t = first - H + i;  // token index in the row; < 0: history
    typename P::Raw v = P::Zero();
    if (t >= 0) {
      v = P::Load(x + (row.t0 + t) * a.x_token_stride + c0);
    } else if (!from_zero) {
      v = P::Load(HistRow(win, rx, C, H, static_cast<int>(w + H + t)) + c0);
    }
#pragma unroll
    for (int j = 0; j < N; ++j) hist[i][j] = P::Get(v, j);
  }
  for (int64_t t = first; t < last; ++t) {
    const typename P::Raw xin =
        t == first ? x_first : P::Load(x + (row.t0 + t) * a.x_token_stride + c0);
    typename P::Raw out = P::Zero();
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const float xv = P::Get(xin, j);
      float acc = bias[j];
#pragma unroll
      for (int i = 0; i < H; ++i) acc = __fmaf_rn(wt[j][i], hist[i][j], acc);
      acc = __fmaf_rn(wt[j][H], xv, acc);
      P::Set(out, j, acc / (1.0f + expf(-acc)));
#pragma unroll
      for (int i = 0; i + 1 < H; ++i) hist[i][j] = hist[i + 1][j];
      hist[H - 1][j] = xv;
    }
    P::Store(y + (row.t0 + t) * a.y_token_stride + c0, out);
    if (append && w + t < L) P::Store(rx + (w + t) * C + c0, xin);
  }
}

// APPEND with one token per row and no cu_seqlens (a decode step's convolution; 16-byte
// packs): ConvKernel's arithmetic with kDecodeRows rows per thread, their slots, cursors,
// inputs and histories loaded together, so that a thread keeps that many dependent chains
// (slot and cursor, then history) in flight and the grid is that many times shorter — the
// kernel is latency-bound, and a decode step joined to it (rssm_decode_args.conv) can launch
// only once every CTA of it has started.
constexpr int kDecodeRows = 2;

template <typename A, int W>
__global__ void __launch_bounds__(kThreads) ConvDecodeKernel(rssm_conv_args a) {
  asm volatile("griddepcontrol.launch_dependents;");  // as ConvKernel
  using P = Access<A, true>;
  constexpr int N = P::kN, H = W - 1, R = kDecodeRows;
  const int64_t C = a.shape.channels;
  const int64_t c0 = (int64_t{blockIdx.x} * kThreads + threadIdx.x) * N;
  if (c0 >= C) return;
  const int L = a.shape.ring_len;
  const A* x = static_cast<const A*>(a.x);
  A* y = static_cast<A*>(a.y);
  int32_t slot[R], cursor[R];
  int64_t row[R];
  typename P::Raw xin[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    row[r] = int64_t{blockIdx.y} * R + r;
    const bool in = row[r] < a.batch;
    slot[r] = in ? a.slot_idx[row[r]] : -1;
    cursor[r] = in ? a.write_pos[row[r]] : 0;
    xin[r] = in ? P::Load(x + row[r] * a.x_token_stride + c0) : P::Zero();
  }
  float wt[N][W];
  LoadPackWeights(a.weight, c0, wt);
  float bias[N];
#pragma unroll
  for (int j = 0; j < N; ++j) bias[j] = a.bias != nullptr ? a.bias[c0 + j] : 0.f;
  typename P::Raw hist[R][H];
  bool live[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    live[r] = slot[r] >= 0 && slot[r] < a.state.num_slots;
    const int w = min(max(cursor[r], 0), L);
    const A* win = static_cast<const A*>(a.state.window) +
                   (live[r] ? slot[r] : 0) * a.state.window_slot_stride;
    const A* rx = static_cast<const A*>(a.state.ring_x) +
                  (live[r] ? slot[r] : 0) * a.state.ring_x_slot_stride;
#pragma unroll
    for (int i = 0; i < H; ++i) {
      hist[r][i] = live[r] ? P::Load(HistRow(win, rx, C, H, w + i) + c0) : P::Zero();
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (row[r] >= a.batch) continue;
    typename P::Raw out = P::Zero();
    if (live[r]) {
#pragma unroll
      for (int j = 0; j < N; ++j) {
        float acc = bias[j];
#pragma unroll
        for (int i = 0; i < H; ++i) acc = __fmaf_rn(wt[j][i], P::Get(hist[r][i], j), acc);
        acc = __fmaf_rn(wt[j][H], P::Get(xin[r], j), acc);
        P::Set(out, j, acc / (1.0f + expf(-acc)));
      }
      const int w = min(max(cursor[r], 0), L);
      if (w < L) {
        P::Store(static_cast<A*>(a.state.ring_x) + slot[r] * a.state.ring_x_slot_stride +
                     int64_t{w} * C + c0,
                 xin[r]);
      }
    }
    P::Store(y + row[r] * a.y_token_stride + c0, out);
  }
}

// Channel c of a slot's window <- the last H inputs of (its history at cursor w, or zeros)
// followed by the row's `len` tokens at x. Every entry is read before any is written (entry e
// may come from entry e + w). A prefill's window (after ConvKernel) and a fold (len 0).
template <typename A>
__device__ __forceinline__ void MoveWindow(A* win, const A* rx, const A* x, int64_t x_stride,
                                           int64_t C, int H, int w, bool from_zero, int64_t len,
                                           int64_t c) {
  A vals[kMaxHist];
#pragma unroll
  for (int e = 0; e < kMaxHist; ++e) {
    if (e >= H) break;
    const int64_t t = len - H + e;  // token index in the row; < 0: history
    if (t >= 0) {
      vals[e] = x[t * x_stride + c];
    } else if (from_zero) {
      vals[e] = FromF<A>(0.f);
    } else {
      vals[e] = HistRow(win, rx, C, H, static_cast<int>(w + H + t))[c];
    }
  }
#pragma unroll
  for (int e = 0; e < kMaxHist; ++e) {
    if (e < H) win[e * C + c] = vals[e];
  }
}

// PREFILL, after ConvKernel: window <- the last H inputs of history ++ tokens.
template <typename A>
__global__ void __launch_bounds__(kThreads) ConvWindowKernel(rssm_conv_args a) {
  const int64_t c = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int r = blockIdx.y;
  if (c >= a.shape.channels) return;
  const int32_t slot = a.slot_idx[r];
  if (slot < 0 || slot >= a.state.num_slots) return;
  const RowSpan row = RowOf(a, r);
  const bool from_zero = a.initial == nullptr || a.initial[r] == 0;
  const int w = from_zero ? 0 : min(max(a.write_pos[r], 0), a.shape.ring_len);
  MoveWindow(static_cast<A*>(a.state.window) + slot * a.state.window_slot_stride,
             static_cast<const A*>(a.state.ring_x) + slot * a.state.ring_x_slot_stride,
             static_cast<const A*>(a.x) + row.t0 * a.x_token_stride, a.x_token_stride,
             a.shape.channels, a.shape.width - 1, w, from_zero, row.len, c);
}

template <typename A>
__global__ void __launch_bounds__(kThreads) ConvFoldKernel(rssm_conv_fold_args a) {
  const int64_t c = int64_t{blockIdx.x} * kThreads + threadIdx.x;
  const int i = blockIdx.y;
  if (c >= a.shape.channels) return;
  const int32_t slot = a.slot_idx[i];
  if (slot < 0 || slot >= a.state.num_slots) return;
  const int w = min(max(a.write_pos[i], 0), a.shape.ring_len);
  if (w == 0) return;
  MoveWindow(static_cast<A*>(a.state.window) + slot * a.state.window_slot_stride,
             static_cast<const A*>(a.state.ring_x) + slot * a.state.ring_x_slot_stride,
             static_cast<const A*>(nullptr), 0, a.shape.channels, a.shape.width - 1, w,
             /*from_zero=*/false, /*len=*/0, c);
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Whether the 16-byte kernel applies: every base 16-byte aligned and every stride (and C) a
// whole number of 16-byte packs.
template <typename A>
bool ConvAligned(const rssm_conv_args& a) {
  const int64_t n = 16 / sizeof(A);
  return Aligned16(a.x) && Aligned16(a.y) && Aligned16(a.state.window) &&
         Aligned16(a.state.ring_x) && Aligned16(a.weight) &&
         (a.bias == nullptr || Aligned16(a.bias)) && a.shape.channels % n == 0 &&
         a.x_token_stride % n == 0 && a.y_token_stride % n == 0 &&
         a.state.window_slot_stride % n == 0 && a.state.ring_x_slot_stride % n == 0;
}

template <typename A, int W>
void LaunchConvW(const rssm_conv_args& a, dim3 grid, bool vec, cudaStream_t stream) {
  if (vec && a.mode == RSSM_CONV_APPEND && a.cu_seqlens == nullptr && a.num_tokens == 1) {
    const dim3 rows(grid.x, (grid.z + kDecodeRows - 1) / kDecodeRows);
    ConvDecodeKernel<A, W><<<rows, kThreads, 0, stream>>>(a);
  } else if (vec) {
    ConvKernel<A, W, true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    ConvKernel<A, W, false><<<grid, kThreads, 0, stream>>>(a);
  }
}

template <typename A>
cudaError_t LaunchConv(const rssm_conv_args& a) {
  cudaStream_t stream = static_cast<cudaStream_t>(a.launch.stream);
  const bool vec = ConvAligned<A>(a);
  const int64_t per_thread = vec ? 16 / sizeof(A) : 1;
  const int64_t threads = (a.shape.channels + per_thread - 1) / per_thread;
  const unsigned cblocks = static_cast<unsigned>((threads + kThreads - 1) / kThreads);
  const unsigned chunks =
      static_cast<unsigned>((int64_t{a.num_tokens} + kTokensPerThread - 1) / kTokensPerThread);
  if (chunks > 0) {  // no tokens at all (a prefill of empty rows): only the window moves
    const dim3 grid(cblocks, chunks, static_cast<unsigned>(a.batch));
    switch (a.shape.width) {
      case 2: LaunchConvW<A, 2>(a, grid, vec, stream); break;
      case 3: LaunchConvW<A, 3>(a, grid, vec, stream); break;
      case 4: LaunchConvW<A, 4>(a, grid, vec, stream); break;
      case 5: LaunchConvW<A, 5>(a, grid, vec, stream); break;
      case 6: LaunchConvW<A, 6>(a, grid, vec, stream); break;
      case 7: LaunchConvW<A, 7>(a, grid, vec, stream); break;
      default: LaunchConvW<A, 8>(a, grid, vec, stream); break;
    }
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  if (a.mode != RSSM_CONV_PREFILL) return cudaSuccess;
  const unsigned wblocks = static_cast<unsigned>((a.shape.channels + kThreads - 1) / kThreads);
  ConvWindowKernel<A><<<dim3(wblocks, static_cast<unsigned>(a.batch)), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename A>
cudaError_t LaunchConvFold(const rssm_conv_fold_args& a) {
  cudaStream_t stream = static_cast<cudaStream_t>(a.launch.stream);
  const unsigned cblocks = static_cast<unsigned>((a.shape.channels + kThreads - 1) / kThreads);
  ConvFoldKernel<A><<<dim3(cblocks, static_cast<unsigned>(a.count)), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// rssm_count_nonfinite: a grid-stride loop per part (blockIdx.y), 16-byte loads where the
// part allows them, one atomicAdd per block.
template <typename A>
__device__ __forceinline__ bool Finite(A v) {
  return isfinite(ToF(v));
}

template <typename A>
__global__ void __launch_bounds__(kThreads) CountNonfiniteKernel(const void* const* parts,
                                                                 size_t part_elems,
                                                                 uint32_t* result) {
  const A* p = static_cast<const A*>(parts[blockIdx.y]);
  unsigned bad = 0;
  const size_t stride = size_t{gridDim.x} * kThreads;
  for (size_t i = size_t{blockIdx.x} * kThreads + threadIdx.x; i < part_elems; i += stride) {
    bad += Finite(p[i]) ? 0u : 1u;
  }
  bad = __reduce_add_sync(0xffffffffu, bad);
  __shared__ unsigned block_bad;
  if (threadIdx.x == 0) block_bad = 0;
  __syncthreads();
  if ((threadIdx.x & 31) == 0 && bad > 0) atomicAdd(&block_bad, bad);
  __syncthreads();
  if (threadIdx.x == 0 && block_bad > 0) {
    // Saturating: a count past UINT32_MAX stays there.
    unsigned old = *result, assumed;
    do {
      assumed = old;
      const unsigned long long sum = static_cast<unsigned long long>(assumed) + block_bad;
      old = atomicCAS(result, assumed,
                      sum > 0xffffffffull ? 0xffffffffu : static_cast<unsigned>(sum));
    } while (old != assumed);
  }
}

}  // namespace

rssm_status ShortConv(const rssm_conv_args& a) {
  cudaError_t e;
  switch (a.shape.act_dtype) {
    case RSSM_DTYPE_BF16: e = LaunchConv<__nv_bfloat16>(a); break;
    case RSSM_DTYPE_F16: e = LaunchConv<__half>(a); break;
    default: e = LaunchConv<float>(a); break;
  }
  return ReportConv(e, "rssm_short_conv");
}

rssm_status ConvFold(const rssm_conv_fold_args& a) {
  cudaError_t e;
  switch (a.shape.act_dtype) {
    case RSSM_DTYPE_BF16: e = LaunchConvFold<__nv_bfloat16>(a); break;
    case RSSM_DTYPE_F16: e = LaunchConvFold<__half>(a); break;
    default: e = LaunchConvFold<float>(a); break;
  }
  return ReportConv(e, "rssm_conv_fold");
}

rssm_status CountNonfinite(const rssm_launch& launch, const void* const* parts_device,
                           size_t count, size_t part_elems, int32_t dtype, uint32_t* result) {
  cudaStream_t stream = static_cast<cudaStream_t>(launch.stream);
  cudaError_t e = cudaMemsetAsync(result, 0, sizeof(uint32_t), stream);
  if (e == cudaSuccess && count > 0 && part_elems > 0) {
    // Enough blocks per part to cover the device a few times over, at most one per 4096
    // elements; parts go in gridDim.y.
    const size_t per_part = std::min<size_t>((part_elems + 4095) / 4096,
                                             std::max<size_t>(1, 1024 / count));
    const dim3 grid(static_cast<unsigned>(std::max<size_t>(per_part, 1)),
                    static_cast<unsigned>(count));
    const void* const* parts = parts_device;
    switch (dtype) {
      case RSSM_DTYPE_BF16:
        CountNonfiniteKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(parts, part_elems, result);
        break;
      case RSSM_DTYPE_F16:
        CountNonfiniteKernel<__half><<<grid, kThreads, 0, stream>>>(parts, part_elems, result);
        break;
      default:
        CountNonfiniteKernel<float><<<grid, kThreads, 0, stream>>>(parts, part_elems, result);
        break;
    }
    e = cudaGetLastError();
  }
  return ReportConv(e, "rssm_count_nonfinite");
}

}  // namespace replayssm::kernels::cuda
