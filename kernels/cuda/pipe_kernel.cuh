// Replay decode, baseline decode and verify: the pipelined (persistent) kernel, v3.
//
// Same work items and arithmetic as StepKernel (step_kernel.cuh): one item = (row r, v-head h,
// V-tile of VT state rows), the same functions for normalization, weights, record dots, the
// contraction, the per-row finish and the fold, in the same order, so results are those of
// StepKernel bit for bit. What changes is where the bytes come from and when:
//   - a persistent grid (a few CTAs per SM, sized by the occupancy calculator) walks the items
//     with a stride of gridDim.x;
//   - the S0 tile [VT, K] (contiguous in memory), the ring k rows 0..w-1 of the qk-head, the
//     ring d rows of the tile and (KDA) the ring g rows are fetched by the bulk copy engine
//     (cp.async.bulk, completing on an mbarrier) into one of NS shared-memory stages (2 by
//     default, REPLAYSSM_CUDA_PIPE_STAGES): item i+NS-1's copies are issued when item i
//     starts, so they are in flight during the chains before it, and the tile never
//     occupies registers;
//   - the slot index and cursor are read one item before their copies are issued, and the
//     token inputs (q, k, v, a, b, the parameters) one item ahead, into registers (raw bits:
//     no stall until the next item consumes them).
// Status (NOTES.md v3): opt-in (REPLAYSSM_CUDA_STEP=pipe). Measured on the H200 it is slower
// than StepKernel at every stage count: the step is bound by its per-item chain, not by bytes
// in flight, and the stages cost CTAs per SM. Kept, tested, for when the chain is short.
// Requirements (checked by the launcher, else StepKernel runs): K <= 128, GDN L % 4 == 0, the
// checkpoint and ring pointers 16-byte aligned, the slot strides multiples of 16 bytes, and
// the stages fitting in shared memory.
#ifndef REPLAYSSM_KERNELS_CUDA_PIPE_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_PIPE_KERNEL_CUH_

#include "async_copy.cuh"
#include "head_ops.cuh"

namespace replayssm::kernels::cuda {

constexpr int kPipeMaxStages = 8;
constexpr int kPipeHeader = kPipeMaxStages * 8 + kPipeMaxStages * 16;  // mbarriers, metadata

// Raw activation bits (no conversion, so the load does not stall until the value is used).
__device__ __forceinline__ uint32_t LoadActRaw(const void* base, int64_t i, int dt) {
  if (dt == kActF32) return static_cast<const uint32_t*>(base)[i];
  return static_cast<const uint16_t*>(base)[i];
}
__device__ __forceinline__ float ActRawToF(uint32_t u, int dt) {
  if (dt == kActF32) return __uint_as_float(u);
  if (dt == kActBf16) return __uint_as_float(u << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(u)));
}

// Item metadata: slot (-1 = padding), cursor, fold flag.
struct ItemMeta {
  int slot, w, fold;
};

__device__ __forceinline__ ItemMeta LoadMeta(const StepParams& p, int64_t item) {
  const LayerDesc& ly = p.ly;
  const int r = static_cast<int>(item / (int64_t{ly.HV} * p.num_vtiles));
  ItemMeta m{-1, 0, 1};
  // All loads first (no control dependence on the slot), so nothing waits until first use.
  const int64_t slot = p.slot_idx[r];
  const int wraw = p.mode != kModeBaseline ? p.write_pos[r] : 0;
  const int ff = p.mode == kModeReplay && p.force_fold != nullptr ? p.force_fold[r] : 0;
  if (slot < 0 || slot >= ly.num_slots) return m;
  m.slot = static_cast<int>(slot);
  if (p.mode != kModeBaseline) {
    int w = min(max(wraw, 0), ly.L);
    if (p.mode == kModeVerify) {
      m.w = min(w, ly.L - p.num_draft);
      m.fold = 0;
    } else {
      m.w = w;
      m.fold = (w + 1 >= ly.L || ff != 0) ? 1 : 0;
    }
  }
  return m;
}

// Token inputs of the first TC drafts of an item, as raw bits (thread per key channel for q, k
// and the KDA gate, thread per tile row for v, thread 0 for the GDN gate and beta).
template <int TC>
struct TokRegs {
  uint32_t q[TC], k[TC], v[TC], a[TC], b[TC];
  float alog, dtb;
};

template <int TC>
__device__ __forceinline__ void LoadTokRegs(const LayerDesc& ly, TokRegs<TC>& tr, int64_t tok0,
                                            int nt, int h, int v0, int VT) {
  const int tid = threadIdx.x, K = ly.K, V = ly.V, H = ly.H, hq = h / ly.group;
  const int dt = ly.act_dtype;
#pragma unroll
  for (int t = 0; t < TC; ++t) {
    if (t >= nt) break;
    const int64_t n = tok0 + t;
    const int64_t row = n * ly.qkv_stride;
    if (tid < K) {
      tr.q[t] = LoadActRaw(ly.qkv, row + int64_t{hq} * K + tid, dt);
      tr.k[t] = LoadActRaw(ly.qkv, row + int64_t{H + hq} * K + tid, dt);
      if (ly.kda) tr.a[t] = LoadActRaw(ly.a, n * ly.a_stride + int64_t{h} * K + tid, dt);
    }
    if (tid < VT && v0 + tid < V) {
      tr.v[t] = LoadActRaw(ly.qkv, row + 2LL * H * K + int64_t{h} * V + v0 + tid, dt);
    }
    if (tid == 0) {
      if (!ly.kda) tr.a[t] = LoadActRaw(ly.a, n * ly.a_stride + h, dt);
      tr.b[t] = LoadActRaw(ly.b, n * ly.b_stride + h, dt);
    }
  }
  if (ly.kda) {
    if (tid < K) {
      tr.alog = ly.a_log[h];
      tr.dtb = ly.dt_bias[int64_t{h} * K + tid];
    }
  } else if (tid == 0) {
    tr.alog = ly.a_log[h];
    tr.dtb = ly.dt_bias[h];
  }
}

// The same shared-memory contents as LoadToken for draft slots 0..nt-1 at positions P0 + t.
template <int TC>
__device__ __forceinline__ void StoreTokRegs(const LayerDesc& ly, const SmemLayout& sm, float* s,
                                             const TokRegs<TC>& tr, int nt, int P0, int v0,
                                             int VT) {
  const int tid = threadIdx.x, K = ly.K, V = ly.V, dt = ly.act_dtype;
#pragma unroll
  for (int t = 0; t < TC; ++t) {
    if (t >= nt) break;
    if (tid < K) {
      s[sm.qs + t * K + tid] = ActRawToF(tr.q[t], dt);
      s[sm.ks + t * K + tid] = ActRawToF(tr.k[t], dt);
      if (ly.kda) {
        const float decay = -expf(tr.alog);
        s[sm.gext + (P0 + t) * K + tid] = decay * Softplus(ActRawToF(tr.a[t], dt) + tr.dtb);
      }
    }
    if (tid < VT) s[sm.vs + t * VT + tid] = v0 + tid < V ? ActRawToF(tr.v[t], dt) : 0.f;
    if (tid == 0) {
      if (!ly.kda) {
        const float decay = -expf(tr.alog);
        s[sm.gext + P0 + t] = decay * Softplus(ActRawToF(tr.a[t], dt) + tr.dtb);
      }
      s[sm.beta + t] = Sigmoid(ActRawToF(tr.b[t], dt));
    }
  }
}

template <typename T, int TC>
__global__ void __launch_bounds__(kThreads) PipeStepKernel(const __grid_constant__ StepParams p) {
  using Cfg = TileCfg<T, 128>;
  constexpr int R = Cfg::R, CPL = Cfg::CPL, E = Cfg::E, VT = Cfg::VT;
  extern __shared__ float4 smem4[];
  char* base = reinterpret_cast<char*>(smem4);
  uint64_t* bar = reinterpret_cast<uint64_t*>(base);                 // [NS]
  int* meta = reinterpret_cast<int*>(base + kPipeMaxStages * 8);     // [NS][4]
  const int NS = p.num_stages, D = NS - 1;  // stages; items in flight ahead of the current
  float* s = reinterpret_cast<float*>(base + kPipeHeader);
  char* stages = base + kPipeHeader + size_t(p.sm.total) * sizeof(float);
  const LayerDesc& ly = p.ly;
  const SmemLayout& sm = p.sm;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int K = ly.K, V = ly.V, L = ly.L, T_ = p.num_draft;
  const int64_t per_row = int64_t{ly.HV} * p.num_vtiles;
  const int64_t nitems = p.num_items;
  const int64_t stride = gridDim.x;

  if (tid == 0) {
    for (int i = 0; i < NS; ++i) MbarInit(&bar[i], 1);
    MbarFenceInit();
  }
  __syncthreads();

  // Warp 0: writes the item's metadata into stage st and issues its copies (lane 0 arms the
  // barrier, then lane j copies ring d row j).
  auto issue = [&](int64_t item, ItemMeta m, int st) {
    if (lane == 0) {
      meta[st * 4 + 0] = m.slot;
      meta[st * 4 + 1] = m.w;
      meta[st * 4 + 2] = m.fold;
    }
    if (m.slot < 0) return;
    const int64_t rem = item % per_row;
    const int h = static_cast<int>(rem / p.num_vtiles);
    const int v0 = static_cast<int>(rem % p.num_vtiles) * VT;
    const int nrows = min(VT, V - v0), hq = h / ly.group, w = m.w;
    const int64_t slot = m.slot;
    char* sb = stages + size_t(st) * p.stage_bytes;
    const uint32_t row_bytes = uint32_t(nrows) * sizeof(T);
    uint32_t bytes = row_bytes * K + uint32_t(w) * (uint32_t(K) * sizeof(T) + row_bytes);
    const uint32_t g_bytes = ly.kda ? uint32_t(w) * K * 4 : uint32_t((w + 3) & ~3) * 4;
    if (w > 0) bytes += g_bytes;
    if (lane == 0) {
      FenceProxyAsync();
      MbarExpectTx(&bar[st], bytes);
    }
    __syncwarp();
    const T* s0 = static_cast<const T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V + v0) * K;
    if (lane == 0) BulkLoad(sb, s0, row_bytes * K, &bar[st]);
    if (w > 0) {
      if (lane == 1) {
        const T* rk = static_cast<const T*>(ly.ring_k) + slot * ly.k_stride + int64_t{hq} * L * K;
        BulkLoad(sb + p.st_rk, rk, uint32_t(w) * K * sizeof(T), &bar[st]);
      }
      if (lane == 2) {  // GDN: w rounded up to 4 floats (L % 4 == 0 keeps it in the row)
        const float* rg = ly.ring_g + slot * ly.g_stride + int64_t{h} * L * (ly.kda ? K : 1);
        BulkLoad(sb + p.st_rg, rg, g_bytes, &bar[st]);
      }
      const T* rd = static_cast<const T*>(ly.ring_d) + slot * ly.d_stride + int64_t{h} * L * V + v0;
      for (int j = lane; j < w; j += 32) {
        BulkLoad(sb + p.st_rd + size_t(j) * VT * sizeof(T), rd + int64_t{j} * V, row_bytes,
                 &bar[st]);
      }
    }
  };
  auto bcast = [&](ItemMeta m) {
    m.slot = __shfl_sync(0xffffffffu, m.slot, 0);
    m.w = __shfl_sync(0xffffffffu, m.w, 0);
    m.fold = __shfl_sync(0xffffffffu, m.fold, 0);
    return m;
  };

  // Prologue: items 0..D-1's copies, item D's metadata, item 0's tokens.
  ItemMeta next_meta{-1, 0, 1};
  int64_t item = blockIdx.x;
  if (warp == 0) {
    for (int i = 0; i < D; ++i) {
      const int64_t it_i = item + i * stride;
      if (it_i >= nitems) break;
      ItemMeta m0{-1, 0, 1};
      if (lane == 0) m0 = LoadMeta(p, it_i);
      issue(it_i, bcast(m0), i);
    }
    if (lane == 0 && item + D * stride < nitems) next_meta = LoadMeta(p, item + D * stride);
  }
  TokRegs<TC> tr;
  if (item < nitems) {
    const int64_t r = item / per_row, rem = item % per_row;
    LoadTokRegs<TC>(ly, tr, r * T_, min(TC, T_), static_cast<int>(rem / p.num_vtiles),
                    static_cast<int>(rem % p.num_vtiles) * VT, VT);
  }
  __syncthreads();  // item 0's metadata

  uint32_t parity = 0;  // bit st: the phase to wait for on stage st
  for (int it = 0, st = 0; item < nitems; item += stride, ++it, st = st + 1 == NS ? 0 : st + 1) {
    const int64_t r64 = item / per_row, rem = item % per_row;
    const int h = static_cast<int>(rem / p.num_vtiles);
    const int vt = static_cast<int>(rem % p.num_vtiles);
    const int v0 = vt * VT;
    const int64_t tok0 = r64 * T_;
    const int slot_i = meta[st * 4 + 0];
    const int w = meta[st * 4 + 1];
    const bool fold = meta[st * 4 + 2] != 0;
    const bool valid = slot_i >= 0;
    const int64_t slot = slot_i;
    const int nt0 = min(TC, T_);

    // Consume this item's registers, then prefetch the next item's.
    if (valid) StoreTokRegs<TC>(ly, sm, s, tr, nt0, w, v0, VT);
    const int64_t far = item + D * stride;  // its stage was last used by the previous item
    if (warp == 0 && far < nitems) {
      int sf = st + D;
      if (sf >= NS) sf -= NS;
      issue(far, bcast(next_meta), sf);
      if (lane == 0 && far + stride < nitems) next_meta = LoadMeta(p, far + stride);
    }
    const int64_t nxt = item + stride;
    if (nxt < nitems) {
      const int64_t rn = nxt / per_row, remn = nxt % per_row;
      LoadTokRegs<TC>(ly, tr, rn * T_, nt0, static_cast<int>(remn / p.num_vtiles),
                      static_cast<int>(remn % p.num_vtiles) * VT, VT);
    }

    if (!valid) {  // padding row: zero outputs, touch no state
      for (int i = tid; i < T_ * VT; i += kThreads) {
        const int t = i / VT, row = i % VT;
        if (v0 + row < V) {
          StoreAct(ly.o, (tok0 + t) * ly.o_stride + int64_t{h} * V + v0 + row, ly.act_dtype, 0.f);
        }
      }
      __syncthreads();
      continue;
    }

    // Wait for the tile and records; records into the fp32 arrays of the step kernel.
    MbarWait(&bar[st], (parity >> st) & 1u);
    parity ^= 1u << st;
    const char* sb = stages + size_t(st) * p.stage_bytes;
    const T* tile = reinterpret_cast<const T*>(sb);
    if (w > 0) {
      const T* rk = reinterpret_cast<const T*>(sb + p.st_rk);
      for (int i = tid; i < w * K; i += kThreads) s[sm.kext + i] = ToF(rk[i]);
      const T* rd = reinterpret_cast<const T*>(sb + p.st_rd);
      for (int i = tid; i < w * VT; i += kThreads) {
        const int row = i % VT;
        s[sm.dext + i] = v0 + row < V ? ToF(rd[i]) : 0.f;
      }
      const float* rg = reinterpret_cast<const float*>(sb + p.st_rg);
      for (int i = tid; i < w * (ly.kda ? K : 1); i += kThreads) s[sm.gext + i] = rg[i];
    }
    const bool k_writer = (h % ly.group) == 0 && vt == 0;
    const int hq = h / ly.group;

    for (int c0 = 0; c0 < T_; c0 += TC) {
      const int nt = min(TC, T_ - c0);
      if (c0 > 0) {
        for (int t = 0; t < nt; ++t) LoadToken(ly, sm, s, tok0 + c0 + t, h, t, w + c0 + t, v0, VT);
      }
      __syncthreads();
      NormalizeTokens<T>(ly, sm, s, nt, w + c0);
      if (!fold && vt == 0) {
        for (int i = tid; i < nt * K; i += kThreads) {
          const int t = i / K, c = i % K, P = w + c0 + t;
          if (k_writer) {
            T* rk = static_cast<T*>(ly.ring_k) + slot * ly.k_stride + (int64_t{hq} * L + P) * K;
            rk[c] = FromF<T>(s[sm.ks + i]);
          }
          float* rg = ly.ring_g + slot * ly.g_stride;
          if (ly.kda) {
            rg[(int64_t{h} * L + P) * K + c] = s[sm.gext + P * K + c];
          } else if (c == 0) {
            rg[int64_t{h} * L + P] = s[sm.gext + P];
          }
        }
      }
      __syncthreads();
      for (int t = 0; t < nt; ++t) {
        const int P = w + c0 + t;
        Weights(ly, sm, s, P, t, false, true);
        __syncthreads();
        RecordDots(ly, sm, s, P, t);
        if (t + 1 < nt) __syncthreads();
      }
      // Contraction of the shared-memory tile with A∘k, A∘q of the chunk's tokens.
      float acc[TC * R * 2];
#pragma unroll
      for (int i = 0; i < TC * R * 2; ++i) acc[i] = 0.f;
#pragma unroll
      for (int ch = 0; ch < CPL; ++ch) {
        const int c = Cfg::Chan(ch, lane);
        if (c >= K) continue;
        Chunk<T> x[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
          const int row = Cfg::Row(i, warp, lane);
          if (v0 + row < V) {
            x[i].raw = *reinterpret_cast<const uint4*>(tile + row * K + c);
          } else {
            x[i].raw = make_uint4(0, 0, 0, 0);
          }
        }
#pragma unroll
        for (int t = 0; t < TC; ++t) {
          float kav[E], qav[E];
#pragma unroll
          for (int e = 0; e < E; e += 4) {
            const float4 a4 = *reinterpret_cast<const float4*>(s + sm.ka + t * K + c + e);
            const float4 b4 = *reinterpret_cast<const float4*>(s + sm.qa + t * K + c + e);
            kav[e] = a4.x, kav[e + 1] = a4.y, kav[e + 2] = a4.z, kav[e + 3] = a4.w;
            qav[e] = b4.x, qav[e + 1] = b4.y, qav[e + 2] = b4.z, qav[e + 3] = b4.w;
          }
#pragma unroll
          for (int i = 0; i < R; ++i) {
#pragma unroll
            for (int e = 0; e < E; ++e) {
              const float xv = x[i].Get(e);
              acc[(t * R + i) * 2] += xv * kav[e];
              acc[(t * R + i) * 2 + 1] += xv * qav[e];
            }
          }
        }
      }
      ReduceToSmem<Cfg, TC>(acc, sm, s);
      __syncthreads();
      if (tid < VT) {
        const int row = tid;
        const bool vrow = v0 + row < V;
        for (int t = 0; t < nt; ++t) {
          const int P = w + c0 + t;
          float sk = s[sm.skq + (t * VT + row) * 2];
          float sq = s[sm.skq + (t * VT + row) * 2 + 1];
          const float* u = s + sm.u + t * (L + 1);
          const float* pq = s + sm.pp + t * (L + 1);
          for (int j = 0; j < P; ++j) {
            const float dj = s[sm.dext + j * VT + row];
            sk += dj * u[j];
            sq += dj * pq[j];
          }
          const float d = s[sm.beta + t] * (s[sm.vs + t * VT + row] - sk);
          const float o = sq + d * s[sm.kq + t];
          const T dr = FromF<T>(d);
          s[sm.dext + P * VT + row] = ToF(dr);
          s[sm.dcur + row] = d;
          if (vrow) {
            StoreAct(ly.o, (tok0 + c0 + t) * ly.o_stride + int64_t{h} * V + v0 + row,
                     ly.act_dtype, o);
            if (!fold) {
              T* rd = static_cast<T*>(ly.ring_d) + slot * ly.d_stride + (int64_t{h} * L + P) * V;
              rd[v0 + row] = dr;
            }
          }
        }
      }
      __syncthreads();
    }

    if (fold) {
      T* s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V + v0) * K;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const int row = Cfg::Row(i, warp, lane);
        if (v0 + row >= V) continue;
        const float dt = s[sm.dcur + row];
#pragma unroll
        for (int ch = 0; ch < CPL; ++ch) {
          const int c = Cfg::Chan(ch, lane);
          if (c >= K) continue;
          Chunk<T> x;
          x.raw = *reinterpret_cast<const uint4*>(tile + row * K + c);
          float a[E];
#pragma unroll
          for (int e = 0; e < E; ++e) a[e] = x.Get(e) * s[sm.avec + c + e];
          for (int j = 0; j < w; ++j) {
            const float dj = s[sm.dext + j * VT + row];
            const float* kw = s + sm.kw + j * K + c;
#pragma unroll
            for (int e = 0; e < E; e += 4) {
              const float4 y = *reinterpret_cast<const float4*>(kw + e);
              a[e] += dj * y.x;
              a[e + 1] += dj * y.y;
              a[e + 2] += dj * y.z;
              a[e + 3] += dj * y.w;
            }
          }
          Chunk<T> out;
#pragma unroll
          for (int e = 0; e < E; ++e) out.Set(e, a[e] + dt * s[sm.ks + c + e]);
          __stcs(reinterpret_cast<uint4*>(s0 + int64_t{row} * K + c), out.raw);
        }
      }
      __syncthreads();  // the stage is re-filled by the item after next
    }
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_PIPE_KERNEL_CUH_
