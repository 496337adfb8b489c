// v5 step: a pre-pass and a streaming kernel (replay decode, baseline decode, verify).
//
// PrepassKernel: one warp per (row, v-head). Everything that does not depend on S0: q/k
// l2norm, gates, the weights W_j∘k_j (running suffix sum from the newest record back, as in
// the CPU reference), u_j = (W_j∘k_j)·k, p_j = (W_j∘k_j)·q, A∘k, A∘q, kq, beta; for verify the
// T drafts' sets (records j >= w are the earlier drafts' k as stored and their g, none depends
// on d). Writes them to the workspace (WsLayout), appends the records' k (first v-head of the
// group) and g, and for rows that fold also W_j∘k_j [w, K], A and k.
//
// StreamKernel: one CTA per (row, v-head, V-tile) as StepKernel: S0 tile into registers first,
// ring d rows of the tile and the vectors into shared memory / registers, one contraction pass
// for TC drafts, reduction, per-row finish (ring terms, d, o; drafts' d rounded as stored feed
// the later drafts), o and the record d, or the folded tile.
//
// Baseline = both kernels with w = 0 and fold: the same code path and arithmetic as a replay
// step that folds at w = 0 (L = 1 bit identity).
#ifndef REPLAYSSM_KERNELS_CUDA_STREAM_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_STREAM_KERNEL_CUH_

#include "head_ops.cuh"

namespace replayssm::kernels::cuda {

constexpr int kPrepassWarps = 4;
// Pre-pass CTAs per SM the registers are budgeted for (template MINB; REPLAYSSM_CUDA_PREPASS_MINB
// picks 3, 5 or 8 at run time, default 5: 102 registers, 20 warps/SM). v5a had no bound:
// 168 registers, 12 warps/SM, 58 µs per replay step at B = 256 (a latency chain wants warps).
constexpr int kPrepassDefaultMinBlocks = 5;

struct RowPlan {
  int64_t slot;
  int w;
  bool fold;
  bool pad;
};

__device__ __forceinline__ RowPlan PlanRow(const StreamParams& p, int r) {
  RowPlan rp;
  rp.slot = p.slot_idx[r];
  rp.pad = rp.slot < 0 || rp.slot >= p.ly.num_slots;
  rp.w = 0;
  rp.fold = true;
  if (!rp.pad && p.mode != kModeBaseline) {
    const int L = p.ly.L;
    rp.w = min(max(p.write_pos[r], 0), L);
    if (p.mode == kModeVerify) {
      rp.w = min(rp.w, L - p.num_draft);
      rp.fold = false;
    } else {
      rp.fold = rp.w + 1 >= L || (p.force_fold != nullptr && p.force_fold[r] != 0);
    }
  }
  return rp;
}

// NC = key channels per lane (K <= 32 * NC); channel of slot i is i * 32 + lane.
template <typename T, int NC, int MINB>
__global__ void __launch_bounds__(kPrepassWarps * 32, MINB) PrepassKernel(const __grid_constant__ StreamParams p) {
  const LayerDesc& ly = p.ly;
  const WsLayout& wl = p.wl;
  const int lane = threadIdx.x & 31;
  // PDL (opt-in, REPLAYSSM_CUDA_PDL=1): let the streaming kernel start its S0 loads now; it
  // waits (griddepcontrol.wait) for this grid's completion before it reads the workspace.
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int64_t item = int64_t{blockIdx.x} * kPrepassWarps + (threadIdx.x >> 5);
  if (item >= int64_t{p.batch} * ly.HV) return;
  const int h = static_cast<int>(item % ly.HV);
  const int r = static_cast<int>(item / ly.HV);
  const RowPlan rp = PlanRow(p, r);
  if (rp.pad) return;
  const int K = ly.K, L = ly.L, T_ = p.num_draft, hq = h / ly.group, w = rp.w;
  const bool kda = ly.kda != 0, fold = rp.fold;
  float* ws = p.ws + item * wl.stride;
  T* rk = static_cast<T*>(ly.ring_k) + rp.slot * ly.k_stride + int64_t{hq} * L * K;
  float* rg = ly.ring_g + rp.slot * ly.g_stride + (kda ? int64_t{h} * L * K : int64_t{h} * L);
  const bool k_writer = (h % ly.group) == 0;
  const float decay = -expf(ly.a_log[h]);

  for (int t = 0; t < T_; ++t) {
    const int64_t n = int64_t{r} * T_ + t;
    const int P = w + t;
    const int64_t row = n * ly.qkv_stride;
    float q[NC], k[NC], ar[NC], db[NC];
#pragma unroll
    for (int i = 0; i < NC; ++i) {
      const int c = i * 32 + lane;
      q[i] = k[i] = ar[i] = db[i] = 0.f;
      if (c < K) {
        q[i] = LoadAct(ly.qkv, row + int64_t{hq} * K + c, ly.act_dtype);
        k[i] = LoadAct(ly.qkv, row + int64_t{ly.H + hq} * K + c, ly.act_dtype);
        if (kda) {
          ar[i] = LoadAct(ly.a, n * ly.a_stride + int64_t{h} * K + c, ly.act_dtype);
          db[i] = ly.dt_bias[int64_t{h} * K + c];
        }
      }
    }
    float ga = 0.f, gb = 0.f;
    if (!kda) {
      ga = LoadAct(ly.a, n * ly.a_stride + h, ly.act_dtype);
      gb = ly.dt_bias[h];
    }
    const float bb = LoadAct(ly.b, n * ly.b_stride + h, ly.act_dtype);
    if (ly.l2norm) {
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int i = 0; i < NC; ++i) sq += q[i] * q[i], sk += k[i] * k[i];
      sq = WarpSum(sq);
      sk = WarpSum(sk);
      const float nq = 1.f / sqrtf(sq + 1e-6f), nk = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
      for (int i = 0; i < NC; ++i) q[i] *= nq, k[i] *= nk;
    }
    float kq = 0.f;
#pragma unroll
    for (int i = 0; i < NC; ++i) {
      q[i] *= ly.scale;
      kq += k[i] * q[i];
    }
    kq = WarpSum(kq);
    const float gs = kda ? 0.f : decay * Softplus(ga + gb);
    float acc[NC];
#pragma unroll
    for (int i = 0; i < NC; ++i) acc[i] = kda ? decay * Softplus(ar[i] + db[i]) : gs;

    // This token's record (k, g), when it is appended; the drafts' k as stored and g (verify).
    if (!fold) {
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const int c = i * 32 + lane;
        if (c < K) {
          if (k_writer) rk[int64_t{P} * K + c] = FromF<T>(k[i]);
          if (kda) rg[int64_t{P} * K + c] = acc[i];
        }
      }
      if (!kda && lane == 0) rg[P] = gs;
    }
    if (T_ > 1) {
#pragma unroll
      for (int i = 0; i < NC; ++i) {
        const int c = i * 32 + lane;
        if (c < K) {
          ws[wl.krec + t * K + c] = RoundTo<T>(k[i]);
          ws[wl.gd + t * K + c] = acc[i];
        }
      }
    }

    // Weights and record dots, NB records per block, newest first.
    constexpr int NB = 4;
    for (int jb = ((P - 1) / NB) * NB; P > 0 && jb >= 0; jb -= NB) {
      float kb[NB][NC], gj[NB][NC];
#pragma unroll
      for (int b = 0; b < NB; ++b) {
        const int j = jb + b;
#pragma unroll
        for (int i = 0; i < NC; ++i) {
          const int c = i * 32 + lane;
          kb[b][i] = gj[b][i] = 0.f;
          if (j < P && c < K) {
            if (j < w) {
              // Records 0..w-1 are read-only during this kernel (rows >= w are written).
              kb[b][i] = ToF(__ldg(rk + int64_t{j} * K + c));
              gj[b][i] = kda ? __ldg(rg + int64_t{j} * K + c) : __ldg(rg + j);
            } else {
              kb[b][i] = ws[wl.krec + (j - w) * K + c];
              gj[b][i] = ws[wl.gd + (j - w) * K + c];
            }
          }
        }
      }
      float part[2 * NB];
#pragma unroll
      for (int b = 0; b < 2 * NB; ++b) part[b] = 0.f;
#pragma unroll
      for (int b = NB - 1; b >= 0; --b) {
        const int j = jb + b;
        if (j < P) {
          // GDN: every acc[i] holds the same value (same g added), so one exp serves all.
          const float wg = kda ? 0.f : expf(acc[0]);
#pragma unroll
          for (int i = 0; i < NC; ++i) {
            const int c = i * 32 + lane;
            const float kw = (kda ? expf(acc[i]) : wg) * kb[b][i];
            part[2 * b] += kw * k[i];
            part[2 * b + 1] += kw * q[i];
            if (fold && c < K) ws[wl.kw + j * K + c] = kw;
            acc[i] += gj[b][i];
          }
        }
      }
      // Lane l holds the total of index l / (32 / 2NB) = 2 b + which.
      TransposeReduce<2 * NB, 16>::Run(part, lane);
      constexpr int kSpread = 32 / (2 * NB);
      if (lane % kSpread == 0) {
        const int idx = lane / kSpread, j = jb + (idx >> 1);
        if (j < P) ws[((idx & 1) ? wl.pp : wl.u) + t * (L + 1) + j] = part[0];
      }
    }
    const float ag = kda ? 0.f : expf(acc[0]);
#pragma unroll
    for (int i = 0; i < NC; ++i) {
      const int c = i * 32 + lane;
      if (c < K) {
        const float A = kda ? expf(acc[i]) : ag;
        ws[wl.ka + t * K + c] = A * k[i];
        ws[wl.qa + t * K + c] = A * q[i];
        if (fold) {
          ws[wl.avec + c] = A;
          ws[wl.kcur + c] = k[i];
        }
      }
    }
    if (lane == 0) {
      ws[wl.beta + t] = Sigmoid(bb);
      ws[wl.kq + t] = kq;
    }
  }
}

template <typename T, int KMAX, int TC>
__global__ void __launch_bounds__(kThreads, TC == 1 ? kStepMinBlocks : kVerifyMinBlocks) StreamKernel(const __grid_constant__ StreamParams p) {
  using Cfg = TileCfg<T, KMAX>;
  constexpr int R = Cfg::R, CPL = Cfg::CPL, E = Cfg::E, VT = Cfg::VT, G = Cfg::G;
  extern __shared__ float4 smem4[];
  float* s = reinterpret_cast<float*>(smem4);
  const LayerDesc& ly = p.ly;
  const StreamSmem& sm = p.sm;
  const WsLayout& wl = p.wl;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  int bid = blockIdx.x;
  const int vt = bid % p.num_vtiles;
  bid /= p.num_vtiles;
  const int h = bid % ly.HV;
  const int r = bid / ly.HV;
  const int v0 = vt * VT;
  const int K = ly.K, V = ly.V, L = ly.L, T_ = p.num_draft;
  const int64_t tok0 = int64_t{r} * T_;
  const RowPlan rp = PlanRow(p, r);

  if (rp.pad) {
    for (int i = tid; i < T_ * VT; i += kThreads) {
      const int t = i / VT, row = i % VT;
      if (v0 + row < V) {
        StoreAct(ly.o, (tok0 + t) * ly.o_stride + int64_t{h} * V + v0 + row, ly.act_dtype, 0.f);
      }
    }
    return;
  }
  const int w = rp.w;
  const bool fold = rp.fold;
  const int64_t slot = rp.slot;

  // 1. S0 tile into registers.
  T* s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + (int64_t{h} * V + v0) * K;
  const bool aligned = (reinterpret_cast<uintptr_t>(s0) & 15) == 0;
  Chunk<T> st[R][CPL];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = Cfg::Row(i, warp, lane);
#pragma unroll
    for (int ch = 0; ch < CPL; ++ch) {
      const int c = Cfg::Chan(ch, lane);
      if (v0 + row < V && c < K) {
        st[i][ch] = LoadChunk(s0 + int64_t{row} * K + c, aligned);
      } else {
        st[i][ch].raw = make_uint4(0, 0, 0, 0);
      }
    }
  }
  const float* ws = p.ws + (int64_t{r} * ly.HV + h) * wl.stride;

  // 2. Ring d rows of the tile (records 0..w-1).
  if (w > 0) {
    const T* rd = static_cast<const T*>(ly.ring_d) + slot * ly.d_stride + int64_t{h} * L * V + v0;
    for (int i0 = tid; i0 < w * VT; i0 += kThreads * kLoadBatch) {
      T v[kLoadBatch];
#pragma unroll
      for (int u = 0; u < kLoadBatch; ++u) {
        const int i = i0 + u * kThreads, j = i / VT, row = i % VT;
        if (i < w * VT && v0 + row < V) v[u] = rd[int64_t{j} * V + row];
      }
#pragma unroll
      for (int u = 0; u < kLoadBatch; ++u) {
        const int i = i0 + u * kThreads, row = i % VT;
        if (i < w * VT) s[sm.dext + i] = v0 + row < V ? ToF(v[u]) : 0.f;
      }
    }
  }

  // Everything above reads nothing the pre-pass writes (S0, ring d, indices); the workspace
  // below is its output. A no-op unless launched with programmatic stream serialization.
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int c0 = 0; c0 < T_; c0 += TC) {
    const int nt = min(TC, T_ - c0);
    // The chunk's per-draft scalars and vectors: u, p (j < w + c0 + t), beta, kq, v.
    {
      const int L1 = L + 1;
      for (int i = tid; i < nt * L1; i += kThreads) {
        const int t = i / L1, j = i % L1;
        if (j < w + c0 + t) {
          s[sm.u + i] = ws[wl.u + (c0 + t) * L1 + j];
          s[sm.pp + i] = ws[wl.pp + (c0 + t) * L1 + j];
        }
      }
      for (int i = tid; i < nt * VT; i += kThreads) {
        const int t = i / VT, row = i % VT;
        float vv = 0.f;
        if (v0 + row < V) {
          vv = LoadAct(ly.qkv, (tok0 + c0 + t) * ly.qkv_stride + 2LL * ly.H * K +
                                   int64_t{h} * V + v0 + row, ly.act_dtype);
        }
        s[sm.vs + i] = vv;
      }
      if (tid < nt) {
        s[sm.beta + tid] = ws[wl.beta + c0 + tid];
        s[sm.kq + tid] = ws[wl.kq + c0 + tid];
      }
    }
    // Contraction of the register tile with A∘k, A∘q of the chunk's drafts (from L2).
    float acc[TC * R * 2];
#pragma unroll
    for (int i = 0; i < TC * R * 2; ++i) acc[i] = 0.f;
#pragma unroll
    for (int ch = 0; ch < CPL; ++ch) {
      const int c = Cfg::Chan(ch, lane);
      if (c >= K) continue;
#pragma unroll
      for (int t = 0; t < TC; ++t) {
        if (t >= nt) continue;
        float kav[E], qav[E];
#pragma unroll
        for (int e = 0; e < E; e += 4) {
          const float4 x = __ldg(reinterpret_cast<const float4*>(ws + wl.ka + (c0 + t) * K + c + e));
          const float4 y = __ldg(reinterpret_cast<const float4*>(ws + wl.qa + (c0 + t) * K + c + e));
          kav[e] = x.x, kav[e + 1] = x.y, kav[e + 2] = x.z, kav[e + 3] = x.w;
          qav[e] = y.x, qav[e + 1] = y.y, qav[e + 2] = y.z, qav[e + 3] = y.w;
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
#pragma unroll
          for (int e = 0; e < E; ++e) {
            const float x = st[i][ch].Get(e);
            acc[(t * R + i) * 2] += x * kav[e];
            acc[(t * R + i) * 2 + 1] += x * qav[e];
          }
        }
      }
    }
    {
      constexpr int N = TC * R * 2;
      TransposeReduce<N, G / 2>::Run(acc, lane);
      const int gl = lane % G;
      auto put = [&](int idx, float x) {
        const int t = idx / (2 * R), i = (idx / 2) % R, which = idx & 1;
        const int row = Cfg::Row(i, warp, lane);
        s[sm.skq + (t * VT + row) * 2 + which] = x;
      };
      if constexpr (N >= G) {
#pragma unroll
        for (int i = 0; i < N / G; ++i) put(gl * (N / G) + i, acc[i]);
      } else {
        if (gl % (G / N) == 0) put(gl / (G / N), acc[0]);
      }
    }
    __syncthreads();
    // Per row: ring terms, d, o; the draft's d as stored feeds the next drafts.
    if (tid < VT) {
      const int row = tid;
      const bool valid = v0 + row < V;
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
        if (valid) {
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
  if (!fold) return;

  // Fold (decode only): S0·A + Σ_j d_j (W_j∘k_j) + d k, from registers; W_j∘k_j, A, k from
  // the workspace (written by this row's pre-pass).
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = Cfg::Row(i, warp, lane);
    if (v0 + row >= V) continue;
    const float dt = s[sm.dcur + row];
#pragma unroll
    for (int ch = 0; ch < CPL; ++ch) {
      const int c = Cfg::Chan(ch, lane);
      if (c >= K) continue;
      float a[E];
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(ws + wl.avec + c + e));
        a[e] = st[i][ch].Get(e) * x.x;
        a[e + 1] = st[i][ch].Get(e + 1) * x.y;
        a[e + 2] = st[i][ch].Get(e + 2) * x.z;
        a[e + 3] = st[i][ch].Get(e + 3) * x.w;
      }
      for (int j = 0; j < w; ++j) {
        const float dj = s[sm.dext + j * VT + row];
        const float* kw = ws + wl.kw + j * K + c;
#pragma unroll
        for (int e = 0; e < E; e += 4) {
          const float4 x = __ldg(reinterpret_cast<const float4*>(kw + e));
          a[e] += dj * x.x;
          a[e + 1] += dj * x.y;
          a[e + 2] += dj * x.z;
          a[e + 3] += dj * x.w;
        }
      }
      Chunk<T> out;
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        const float4 x = __ldg(reinterpret_cast<const float4*>(ws + wl.kcur + c + e));
        out.Set(e, a[e] + dt * x.x);
        out.Set(e + 1, a[e + 1] + dt * x.y);
        out.Set(e + 2, a[e + 2] + dt * x.z);
        out.Set(e + 3, a[e + 3] + dt * x.w);
      }
      StoreChunk(s0 + int64_t{row} * K + c, out, aligned);
    }
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_STREAM_KERNEL_CUH_
