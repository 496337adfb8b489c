// The CPU backend of the short convolution (rssm_short_conv, rssm_conv_fold): the reference
// the CUDA kernels are tested against. Work is split over (row, block of channels); each task
// keeps its channels' last W-1 inputs in registers, so a prefill that rewrites the window
// reads it first.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "../src/backend.h"
#include "../src/dtype.h"
#include "thread_pool.h"

namespace replayssm::kernels::cpu {
namespace {

constexpr int64_t kChannelBlock = 256;

float Silu(float v) { return v / (1.0f + std::exp(-v)); }

template <typename A>
rssm_status RunConv(const rssm_conv_args& a) {
  const int64_t C = a.shape.channels;
  const int W = a.shape.width, H = W - 1;
  A* const window = static_cast<A*>(a.state.window);
  A* const ring = static_cast<A*>(a.state.ring_x);
  const A* const x = static_cast<const A*>(a.x);
  A* const y = static_cast<A*>(a.y);
  const bool append = a.mode == RSSM_CONV_APPEND;
  const int64_t blocks = (C + kChannelBlock - 1) / kChannelBlock;
  ThreadPool::Default().ParallelFor(int64_t{a.batch} * blocks, [&](int64_t task) {
    const int32_t r = static_cast<int32_t>(task / blocks);
    const int64_t c0 = (task % blocks) * kChannelBlock, c1 = std::min(C, c0 + kChannelBlock);
    const int64_t t0 = a.cu_seqlens ? a.cu_seqlens[r] : int64_t{r} * a.num_tokens;
    const int64_t t1 = a.cu_seqlens ? a.cu_seqlens[r + 1] : int64_t{r + 1} * a.num_tokens;
    const int32_t slot = a.slot_idx[r];
    if (slot < 0) {
      for (int64_t t = t0; t < t1; ++t) {
        std::memset(static_cast<void*>(y + t * a.y_token_stride + c0), 0, (c1 - c0) * sizeof(A));
      }
      return;
    }
    A* const win = window + slot * a.state.window_slot_stride;
    A* const rx = ring + slot * a.state.ring_x_slot_stride;
    const bool from_zero = !append && (a.initial == nullptr || a.initial[r] == 0);
    const int w = from_zero ? 0 : a.write_pos[r];
    for (int64_t c = c0; c < c1; ++c) {
      // The inputs before the row's first token: window[0..H-1] then ring_x[0..w-1]; the
      // last H of them.
      float hist[RSSM_MAX_CONV_WIDTH];
      for (int i = 0; i < H; ++i) {
        const int p = w + i;  // index into window ++ ring
        hist[i] = from_zero ? 0.f : ToFloat(p < H ? win[p * C + c] : rx[(p - H) * C + c]);
      }
      const float* wt = a.weight + c * W;
      const float b = a.bias ? a.bias[c] : 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        const A xin = x[t * a.x_token_stride + c];
        const float xv = ToFloat(xin);
        float acc = b;
        for (int i = 0; i < H; ++i) acc = std::fma(wt[i], hist[i], acc);
        acc = std::fma(wt[H], xv, acc);
        y[t * a.y_token_stride + c] = FromFloat<A>(Silu(acc));
        for (int i = 0; i + 1 < H; ++i) hist[i] = hist[i + 1];
        hist[H - 1] = xv;
        if (append) rx[(w + (t - t0)) * C + c] = xin;
      }
      if (!append) {
        for (int i = 0; i < H; ++i) win[i * C + c] = FromFloat<A>(hist[i]);
      }
    }
  });
  return RSSM_OK;
}

template <typename A>
rssm_status RunConvFold(const rssm_conv_fold_args& a) {
  const int64_t C = a.shape.channels;
  const int H = a.shape.width - 1;
  A* const window = static_cast<A*>(a.state.window);
  A* const ring = static_cast<A*>(a.state.ring_x);
  ThreadPool::Default().ParallelFor(a.count, [&](int64_t i) {
    const int32_t slot = a.slot_idx[i];
    const int w = a.write_pos[i];
    if (slot < 0 || w == 0) return;
    A* const win = window + slot * a.state.window_slot_stride;
    const A* const rx = ring + slot * a.state.ring_x_slot_stride;
    // New window entry i is entry w + i of window ++ ring; reading upwards never reads an
    // entry already overwritten (w + i > i).
    for (int e = 0; e < H; ++e) {
      const int p = w + e;
      const A* src = p < H ? win + p * C : rx + (p - H) * C;
      std::memmove(win + e * C, src, C * sizeof(A));
    }
  });
  return RSSM_OK;
}

}  // namespace

rssm_status ShortConv(const rssm_conv_args& a) {
  switch (a.shape.act_dtype) {
    case RSSM_DTYPE_BF16: return RunConv<Bf16>(a);
    case RSSM_DTYPE_F16: return RunConv<F16>(a);
    default: return RunConv<float>(a);
  }
}

rssm_status ConvFold(const rssm_conv_fold_args& a) {
  switch (a.shape.act_dtype) {
    case RSSM_DTYPE_BF16: return RunConvFold<Bf16>(a);
    case RSSM_DTYPE_F16: return RunConvFold<F16>(a);
    default: return RunConvFold<float>(a);
  }
}

rssm_status CountNonfinite(const void* const* parts, size_t count, size_t part_elems,
                           int32_t dtype, uint32_t* result) {
  uint64_t bad = 0;
  for (size_t p = 0; p < count && part_elems > 0; ++p) {
    const void* base = parts[p];
    for (size_t i = 0; i < part_elems; ++i) {
      float v;
      if (dtype == RSSM_DTYPE_BF16) {
        v = ToFloat(static_cast<const Bf16*>(base)[i]);
      } else if (dtype == RSSM_DTYPE_F16) {
        v = ToFloat(static_cast<const F16*>(base)[i]);
      } else {
        v = static_cast<const float*>(base)[i];
      }
      bad += std::isfinite(v) ? 0 : 1;
    }
  }
  *result = static_cast<uint32_t>(std::min<uint64_t>(bad, UINT32_MAX));
  return RSSM_OK;
}

}  // namespace replayssm::kernels::cpu
