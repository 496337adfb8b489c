// The stream replay kernel: replay decode of an fp32 checkpoint at large batches, with the
// checkpoint's bytes kept in flight across items rather than per CTA.
//
// Persistent CTAs (up to kStreamMaxCtasPerSm per SM, sharing its shared memory), warp-specialized:
//   - the producer warp (its lane 0) walks the CTA's items (item i = (row, v-head), i = CTA,
//     CTA + grid, ...): it loads the next item's slot and cursor while it issues this one's,
//     copies the item's ring records (k, g, one copy per record of d into padded rows) into one
//     of two headers and then its S0 rows, kStreamStageRows at a time: stage s of the item
//     into consumer warp (s mod NC)'s ring of `nsw` stages, each on its own mbarriers (full:
//     copy engine, empty: the consumer). It runs up to NC * nsw stages ahead of the consumers,
//     past item boundaries: the copy engine keeps streaming while the consumers are in an
//     item's record dots. (One ring per warp, each consumed in order by its warp alone, so
//     that a wait on a stage's parity can never see a fill two rounds old.)
//   - the consumer warps take the item's tokens (loaded one item ahead into registers), the
//     record dots (one unit of 4 records a warp), one named barrier, then the rows: stage s of
//     the item is warp (s mod NC)'s, contracted a row at a time, finished, folded when the row
//     folds, and released; then the header is released.
// Every value is the bulk kernel's replay decode in its order (NormalizeQk, DotUnit, Contract,
// AddRingTerms, FinishRows, FoldBatch of bulk_step_kernel.cuh): the two give the same bits,
// and the GPU tests check it. Registers: no more than 3 CTAs per SM allow, without spills (with
// spills 3 CTAs ran slower than 2; bench/results/kernels.md): no stage's rows are held.
// Requirements (the planner's, PlanStreamReplay): fp32 checkpoint; K <= 128, a multiple of 16;
// V <= 128, a multiple of NC * kStreamStageRows (every warp the same stages per item); L <= 32
// (GDN: a multiple of 4, its g row goes in 16-byte units); every pool array 16-byte aligned.
#ifndef REPLAYSSM_KERNELS_CUDA_STREAM_REPLAY_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_STREAM_REPLAY_KERNEL_CUH_

#include <type_traits>

#include "async_copy.cuh"
#include "bulk_step_kernel.cuh"
#include "common.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

struct StreamParams {
  LayerDesc ly;
  int32_t items;  // B * HV
  int32_t nsw;    // S0 stages per consumer warp's ring
  int32_t dst;    // ring d row stride in shared memory (elements)
  int32_t after_conv;
  StreamSmem sm;
  const int32_t* slot_idx;    // [B]
  const int32_t* write_pos;   // [B]
  const uint8_t* force_fold;  // [B] or null
};

// An item's metadata as the producer hands it to the consumers (header h_meta).
struct StreamMeta {
  int32_t pad, slot, w, fold;
};

// An item's token as loaded, raw (converted on use, so that the loads of the next item stay in
// flight while this one is computed): lane l holds q, k (and KDA's a) of channels [4l, 4l + 4),
// v of one row of the warp's stages, and the head's scalars.
struct StreamTokens {
  uint32_t q[4], k[4], g[4];
  uint32_t a, b, v;
  float dtb[4];  // dt_bias: KDA per channel, GDN [0]
  float alog;
};

__device__ __forceinline__ float RawToF(uint32_t x, int dt) {
  if (dt == kActF32) return __uint_as_float(x);
  if (dt == kActBf16) return __uint_as_float(x << 16);
  return __half2float(__ushort_as_half(static_cast<unsigned short>(x)));
}

template <typename R, bool KDA>
struct StreamCta {
  using T = float;
  static constexpr int KC = 4, RB = kStreamStageRows, NV = 2 * RB, SPREAD = 32 / NV, G = 4;
  static constexpr int NC = kStreamConsumerWarps;
  static_assert(NV <= 32, "one butterfly per stage");

  const StreamParams& p;
  const LayerDesc& ly;
  unsigned char* const smem;
  int lane, warp;
  int K, V, L, H, HV, kg, nsi;
  uint64_t *full, *empty, *hfull, *hempty;
  T* stages;

  __device__ __forceinline__ StreamCta(const StreamParams& params, unsigned char* smem_base)
      : p(params), ly(params.ly), smem(smem_base) {
    lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    K = ly.K, V = ly.V, L = ly.L, H = ly.H, HV = ly.HV;
    kg = KDA ? K : 1;
    nsi = V / RB;
    full = reinterpret_cast<uint64_t*>(smem);
    empty = full + kStreamMaxStages;
    hfull = empty + kStreamMaxStages;
    hempty = hfull + kStreamHeaders;
    stages = reinterpret_cast<T*>(smem + p.sm.s0);
  }

  __device__ __forceinline__ unsigned char* Header(int hb) const {
    return smem + p.sm.hdr + hb * p.sm.hdr_bytes;
  }
  __device__ __forceinline__ unsigned char* Scratch(int par) const {
    return smem + p.sm.sc + par * p.sm.sc_bytes;
  }
  __device__ __forceinline__ R* RingD(int64_t sl, int h) const {
    return static_cast<R*>(ly.ring_d) + sl * ly.d_stride + int64_t{h} * L * V;
  }
  __device__ __forceinline__ R* RingK(int64_t sl, int hq) const {
    return static_cast<R*>(ly.ring_k) + sl * ly.k_stride + int64_t{hq} * L * K;
  }
  __device__ __forceinline__ float* RingG(int64_t sl, int h) const {
    return ly.ring_g + sl * ly.g_stride + int64_t{h} * L * kg;
  }

  __device__ __forceinline__ void InitBarriers() const {
    for (int i = 0; i < NC * p.nsw; ++i) MbarInit(full + i, 1), MbarInit(empty + i, 1);
    for (int i = 0; i < kStreamHeaders; ++i) MbarInit(hfull + i, 1), MbarInit(hempty + i, NC);
    MbarFenceInit();
  }

  // ---- the producer (one lane) ---------------------------------------------------------------
  __device__ __forceinline__ void Produce() const {
    const int grid = gridDim.x;
    int item = blockIdx.x;
    if (item >= p.items) return;
    auto load_meta = [&](int it, int& si, int& wp, int& ff) {
      const int r = it / HV;
      si = p.slot_idx[r];
      wp = p.write_pos[r];
      ff = p.force_fold != nullptr ? p.force_fold[r] : 0;
    };
    int si, wp, ff;
    load_meta(item, si, wp, ff);
    int wslot = 0;  // the warps' rings' position (the same for every warp between items)
    uint32_t wphase = 0u;
    const uint32_t stage_bytes = static_cast<uint32_t>(RB * K * sizeof(T));
    for (int it = 0; item < p.items; ++it, item += grid) {
      int nsi_ = 0, nwp = 0, nff = 0;
      if (item + grid < p.items) load_meta(item + grid, nsi_, nwp, nff);  // used next round
      const int h = item % HV, hq = h / ly.group;
      const bool pad = si < 0 || si >= ly.num_slots;
      const int64_t sl = pad ? 0 : si;
      const int w = min(max(wp, 0), L);
      const bool fold = w + 1 >= L || ff != 0;
      const int hb = it & 1;
      // The consumers fenced their accesses to the header before releasing it.
      MbarWait(hempty + hb, ((it >> 1) & 1) ^ 1u);
      unsigned char* const hdr = Header(hb);
      *reinterpret_cast<StreamMeta*>(hdr + p.sm.h_meta) =
          StreamMeta{pad ? 1 : 0, static_cast<int32_t>(sl), w, fold ? 1 : 0};
      const int wr = pad ? 0 : w;
      const uint32_t kb = static_cast<uint32_t>(wr * K * sizeof(R));
      const uint32_t gb = static_cast<uint32_t>((KDA ? wr * K : (wr + 3) & ~3) * 4);
      const uint32_t db = static_cast<uint32_t>(V * sizeof(R));
      MbarExpectTx(hfull + hb, wr > 0 ? kb + gb + wr * db : 0u);
      if (wr > 0) {
        BulkLoad(hdr + p.sm.h_k, RingK(sl, hq), kb, hfull + hb);
        BulkLoadStream(hdr + p.sm.h_g, RingG(sl, h), gb, hfull + hb);
        R* const dsm = reinterpret_cast<R*>(hdr + p.sm.h_d);
        const R* const dg = RingD(sl, h);
        for (int j = 0; j < wr; ++j) {
          BulkLoadStream(dsm + j * p.dst, dg + int64_t{j} * V, db, hfull + hb);
        }
      }
      if (!pad) {
        const T* const s0 =
            static_cast<const T*>(ly.ckpt) + sl * ly.ckpt_stride + int64_t{h} * V * K;
        for (int s0w = 0; s0w < nsi; s0w += NC) {
#pragma unroll
          for (int c = 0; c < NC; ++c) {
            const int b = c * p.nsw + wslot;
            MbarWait(empty + b, wphase ^ 1u);  // the consumer read the stage into registers
            MbarExpectTx(full + b, stage_bytes);
            BulkLoadStream(stages + int64_t{b} * RB * K, s0 + int64_t(s0w + c) * RB * K,
                           stage_bytes, full + b);
          }
          if (++wslot == p.nsw) wslot = 0, wphase ^= 1u;
        }
      }
      si = nsi_, wp = nwp, ff = nff;
    }
  }

  // ---- the consumers: tokens ------------------------------------------------------------------
  template <typename A>
  __device__ __forceinline__ void LoadTokensAs(int item, StreamTokens& t) const {
    const int r = item / HV, h = item % HV, hq = h / ly.group;
    const A* const qkv = static_cast<const A*>(ly.qkv);
    const A* const q0 = qkv + int64_t{r} * ly.qkv_stride + int64_t{hq} * K;
    const A* const ga = static_cast<const A*>(ly.a);
    const A* const gb = static_cast<const A*>(ly.b);
    auto raw = [](A x) -> uint32_t {
      if constexpr (std::is_same_v<A, float>) {
        return __float_as_uint(x);
      } else if constexpr (std::is_same_v<A, __nv_bfloat16>) {
        return static_cast<uint32_t>(__bfloat16_as_ushort(x));
      } else {
        return static_cast<uint32_t>(__half_as_ushort(x));
      }
    };
    const int c0 = lane * KC;
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      const bool on = c0 + e < K;
      t.q[e] = on ? raw(q0[c0 + e]) : 0u;
      t.k[e] = on ? raw(q0[int64_t{H} * K + c0 + e]) : 0u;
      if constexpr (KDA) {
        t.g[e] = on ? raw(ga[int64_t{r} * ly.a_stride + int64_t{h} * K + c0 + e]) : 0u;
        t.dtb[e] = on ? ly.dt_bias[int64_t{h} * K + c0 + e] : 0.f;
      }
    }
    if constexpr (!KDA) {
      t.a = raw(ga[int64_t{r} * ly.a_stride + h]);
      t.dtb[0] = ly.dt_bias[h];
    }
    t.b = raw(gb[int64_t{r} * ly.b_stride + h]);
    t.alog = ly.a_log[h];
    const int row = (warp + NC * (lane / RB)) * RB + lane % RB;  // the lane's row of v
    t.v = row < V ? raw(q0[int64_t{2 * H - hq} * K + int64_t{h} * V + row]) : 0u;
  }
  __device__ __forceinline__ void LoadTokens(int item, StreamTokens& t) const {
    if (ly.act_dtype == kActBf16) {
      LoadTokensAs<__nv_bfloat16>(item, t);
    } else if (ly.act_dtype == kActF32) {
      LoadTokensAs<float>(item, t);
    } else {
      LoadTokensAs<__half>(item, t);
    }
  }

  // ---- the consumers: one item ----------------------------------------------------------------
  // The item's state: where it lives, what the record dots left.
  struct Item {
    int r, h, hq, w;
    bool fold;
    int64_t slot;
    // Shared memory, as 32-bit addresses off the CTA's base (cheap to keep: 3 CTAs per SM
    // budget ~130 registers): the header and the scratch set of the item.
    uint32_t hdr, sc;
    const StreamParams* pp;
    unsigned char* base;
    __device__ __forceinline__ const R* ds() const {  // [L][dst] records' d
      return reinterpret_cast<const R*>(base + hdr + pp->sm.h_d);
    }
    __device__ __forceinline__ const R* krs() const {  // [L][K] records' k
      return reinterpret_cast<const R*>(base + hdr + pp->sm.h_k);
    }
    __device__ __forceinline__ const float* gs() const {  // [L][kg]
      return reinterpret_cast<const float*>(base + hdr + pp->sm.h_g);
    }
    __device__ __forceinline__ float* kws() const {  // [L][K] W_j∘k_j (fold)
      return reinterpret_cast<float*>(base + hdr + pp->sm.h_kw);
    }
    __device__ __forceinline__ float* F(int32_t o) const {
      return reinterpret_cast<float*>(base + sc + o);
    }
    __device__ __forceinline__ float* us() const { return F(pp->sm.s_u); }
    __device__ __forceinline__ float* ps() const { return F(pp->sm.s_p); }
    __device__ __forceinline__ float* kas() const { return F(pp->sm.s_ka); }
    __device__ __forceinline__ float* qas() const { return F(pp->sm.s_qa); }
    __device__ __forceinline__ float* avs() const { return F(pp->sm.s_av); }
    __device__ __forceinline__ float* kns() const { return F(pp->sm.s_kn); }
  };

  // Unit bi of the record dots (bulk_step_kernel.cuh DotUnit at t = 0): records w-1-bi*G down
  // to w-bi*G-G, the weights from the top record down (the CPU order).
  __device__ __forceinline__ void DotUnit(const Item& x, int bi, const float (&q)[KC],
                                          const float (&kk)[KC], const float (&tg)[KC],
                                          bool has_c) const {
    const int c0 = lane * KC;
    const int P = x.w;
    const int jtop = P - 1 - bi * G;
    float acc[KC];
#pragma unroll
    for (int e = 0; e < KC; ++e) acc[e] = KDA ? (has_c ? tg[e] : 0.f) : tg[0];
    auto gate = [&](int i, int e) -> float {
      if constexpr (KDA) return x.gs()[i * K + c0 + e];
      return x.gs()[i];
    };
    for (int i = P - 1; i > jtop; --i) {
      if constexpr (KDA) {
        if (has_c) {
#pragma unroll
          for (int e = 0; e < KC; ++e) acc[e] += gate(i, e);
        }
      } else {
        const float gi = gate(i, 0);
#pragma unroll
        for (int e = 0; e < KC; ++e) acc[e] += gi;
      }
    }
    if (jtop >= 0) {
      float v[2 * G];
#pragma unroll
      for (int jj = 0; jj < G; ++jj) {
        const int j = jtop - jj;
        float su = 0.f, sp = 0.f;
        if (j >= 0) {
          if (has_c) {
            const float gj = KDA ? 0.f : gate(j, 0);
            const float wj = KDA ? 0.f : expf(acc[0]);
            Vec<R, KC> kr;
            kr.LoadShared(x.krs() + j * K + c0);
            Vec<float, KC> kw;
#pragma unroll
            for (int e = 0; e < KC; ++e) {
              const float y = (KDA ? expf(acc[e]) : wj) * kr.Get(e);
              su += y * kk[e];
              sp += y * q[e];
              kw.Set(e, y);
              acc[e] += KDA ? gate(j, e) : gj;
            }
            if (x.fold) kw.StoreShared(x.kws() + j * K + c0);
          } else if (!KDA) {
            const float gj = gate(j, 0);
#pragma unroll
            for (int e = 0; e < KC; ++e) acc[e] += gj;
          }
        }
        v[jj] = su;
        v[G + jj] = sp;
      }
      TransposeReduce<2 * G, 16>::Run(v, lane);
      constexpr int kSpread = 32 / (2 * G);
      const int i = lane / kSpread;
      const int j = jtop - (i % G);
      if (lane % kSpread == 0 && j >= 0) (i < G ? x.us() : x.ps())[j] = v[0];
    }
    if (jtop < G && has_c) {  // the unit that reached record 0: acc is the whole decay
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        const float A = expf(acc[e]);
        x.kas()[c0 + e] = A * kk[e];
        x.qas()[c0 + e] = A * q[e];
        x.avs()[c0 + e] = A;
      }
    }
  }

  // The new checkpoint rows of a folding item's stage (bulk FoldBatch; the rows read from the
  // stage at st): S0·A + Σ_j d_j (W_j∘k_j) + d k, in the CPU's order per element.
  // FR rows at a time (the accumulators of 3 CTAs per SM's register budget).
  __device__ __forceinline__ void FoldStage(const Item& x, const T* st, int rb0, float dcur,
                                            bool has_c) const {
    constexpr int FR = 4;
    static_assert(RB % FR == 0, "fold row groups");
    const int c0 = lane * KC;
    float kn0[KC], av[KC];  // the normalized k as the ring holds it; A
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      kn0[e] = has_c ? x.kns()[c0 + e] : 0.f;
      av[e] = has_c ? x.avs()[c0 + e] : 0.f;
    }
    T* const s0 = static_cast<T*>(ly.ckpt) + x.slot * ly.ckpt_stride + int64_t{x.h} * V * K;
#pragma unroll
    for (int i0 = 0; i0 < RB; i0 += FR) {
      float out[FR][KC];
      if (has_c) {
#pragma unroll
        for (int i = 0; i < FR; ++i) {
          Vec<T, KC> xr;
          xr.LoadShared(st + (i0 + i) * K);
#pragma unroll
          for (int e = 0; e < KC; ++e) out[i][e] = xr.Get(e) * av[e];
        }
#pragma unroll 2
        for (int j = 0; j < x.w; ++j) {
          Vec<R, FR> dj;
          dj.LoadShared(x.ds() + j * p.dst + rb0 + i0);
          Vec<float, KC> kw;
          kw.LoadShared(x.kws() + j * K + c0);
#pragma unroll
          for (int i = 0; i < FR; ++i) {
            const float d = dj.Get(i);
#pragma unroll
            for (int e = 0; e < KC; ++e) out[i][e] += d * kw.Get(e);
          }
        }
      }
#pragma unroll
      for (int i = 0; i < FR; ++i) {
        const float di = __shfl_sync(0xffffffffu, dcur, i0 + i);  // the row's d, as stored
        if (!has_c) continue;
        Vec<T, KC> y;
#pragma unroll
        for (int e = 0; e < KC; ++e) y.Set(e, out[i][e] + di * kn0[e]);
        y.Store(s0 + int64_t(rb0 + i0 + i) * K + c0, true);
      }
    }
  }

  // A padding row's item: its output row zero, then the header released.
  __device__ __forceinline__ void PadItem(int64_t tok, int h, int hb, int dt) const {
    for (int v = warp * 32 + lane; v < V; v += NC * 32) {
      StoreAct(ly.o, tok * ly.o_stride + int64_t{h} * V + v, dt, 0.f);
    }
    __syncwarp();
    if (lane == 0) MbarArrive(hempty + hb);
  }

  // The token: norms, gates, beta (the bulk kernel's expressions). q, kk, tg: the lane's
  // channels (GDN's gate in tg[0]); kq = k·q; vf: the lane's row of v (LoadTokens').
  __device__ __forceinline__ void TokenGates(const StreamTokens& cur, int dt, bool has_c,
                                             float (&q)[KC], float (&kk)[KC], float (&tg)[KC],
                                             float& kq, float& beta, float& vf) const {
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      q[e] = has_c ? RawToF(cur.q[e], dt) : 0.f;
      kk[e] = has_c ? RawToF(cur.k[e], dt) : 0.f;
    }
    kq = NormalizeQk<KC>(ly, q, kk);
    const float decay = GateDecay(cur.alog);
    if constexpr (KDA) {
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        tg[e] = has_c ? TokenGate(decay, RawToF(cur.g[e], dt), cur.dtb[e]) : 0.f;
      }
    } else {
      tg[0] = TokenGate(decay, RawToF(cur.a, dt), cur.dtb[0]);
#pragma unroll
      for (int e = 1; e < KC; ++e) tg[e] = 0.f;
    }
    beta = Beta(RawToF(cur.b, dt), dt, ly.round_beta);
    vf = RawToF(cur.v, dt);
  }

  // Warp 0's: a folding item's k as the ring holds it (for the fold); otherwise, while the ring
  // has room, the ring appends of k (once per qk-head group) and g.
  __device__ __forceinline__ void AppendRings(const Item& x, const float (&kk)[KC],
                                              const float (&tg)[KC], bool has_c) const {
    const int c0 = lane * KC;
    const int P = x.w;
    if (x.fold && has_c) {
#pragma unroll
      for (int e = 0; e < KC; ++e) x.kns()[c0 + e] = RoundTo<R>(kk[e]);  // as the ring holds it
    }
    if (!x.fold && P < L) {  // the ring appends of k (once per qk-head group) and g
      if (has_c) {
        if (x.h % ly.group == 0) {
          R* const kd = RingK(x.slot, x.hq) + int64_t{P} * K + c0;
#pragma unroll
          for (int e = 0; e < KC; ++e) kd[e] = FromF<R>(kk[e]);
        }
        if constexpr (KDA) {
          float* const gd = RingG(x.slot, x.h) + int64_t{P} * K + c0;
#pragma unroll
          for (int e = 0; e < KC; ++e) gd[e] = tg[e];
        }
      }
      if (!KDA && lane == 0) RingG(x.slot, x.h)[P] = tg[0];
    }
  }

  // A stage's rows (at st, the lane's channels) contracted with A∘k, A∘q, plus the ring terms
  // d_j·u_j, d_j·p_j (ur, pr: lane j's record j), reduced: row i's S·(A∘k), S·(A∘q) in acc[0]
  // of lanes (2i) * SPREAD, (2i + 1) * SPREAD.
  __device__ __forceinline__ void ContractStage(const Item& x, const T* st, int rb0, float ur,
                                                float pr, float (&acc)[NV], int c0,
                                                bool has_c) const {
#pragma unroll
    for (int i = 0; i < NV; ++i) acc[i] = 0.f;
    if (has_c) {  // A∘k, A∘q from shared memory per stage (registers: 3 CTAs per SM)
      Vec<float, KC> ka, qa;
      ka.LoadShared(x.kas() + c0);
      qa.LoadShared(x.qas() + c0);
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        Vec<T, KC> xr;
        xr.LoadShared(st + i * K);
#pragma unroll
        for (int e = 0; e < KC; ++e) {
          const float sv = xr.Get(e);
          acc[i * 2] += sv * ka.Get(e);
          acc[i * 2 + 1] += sv * qa.Get(e);
        }
      }
    }
    if (lane < x.w) {  // the ring terms: lane j holds record j
      Vec<R, RB> dl;
      dl.LoadShared(x.ds() + lane * p.dst + rb0);
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        const float y = dl.Get(i);
        acc[i * 2] += y * ur;
        acc[i * 2 + 1] += y * pr;
      }
    }
    TransposeReduce<NV, 16>::Run(acc, lane);
  }

  // Row row_l of stage s finished from ContractStage's acc: d = beta (v - S·(A∘k)) as the ring
  // stores it (dr) and as it reads back (dcur); returns o = S·(A∘q) + d k·q.
  __device__ __forceinline__ float FinishRow(int s, const float (&acc)[NV], float kq, float beta,
                                             float vf, int row_l, R& dr, float& dcur) const {
    const float sk = __shfl_sync(0xffffffffu, acc[0], (row_l * 2) * SPREAD);
    const float sq = __shfl_sync(0xffffffffu, acc[0], (row_l * 2 + 1) * SPREAD);
    const float vcur = __shfl_sync(0xffffffffu, vf, (s / NC) * RB + row_l);
    const float d = beta * (vcur - sk);
    dr = FromF<R>(d);
    dcur = ToF(dr);
    return sq + d * kq;
  }

  // The item's rows, after the record dots: stage s of the item is warp (s mod NC)'s, taken
  // from the warp's ring at (wslot, wphase). The o and d stores and the fold stay in the loop's
  // body: a method around them (or one for the whole stage) moved address arithmetic in the PTX.
  __device__ __forceinline__ void ConsumeRows(const Item& x, int64_t tok, float kq,
                                              float beta, float vf, int dt, int row_l,
                                              int& wslot, uint32_t& wphase) const {
    const int c0 = lane * KC;
    const bool has_c = c0 < K;
    const float ur = lane < x.w ? x.us()[lane] : 0.f;
    const float pr = lane < x.w ? x.ps()[lane] : 0.f;
    R* const rdw = RingD(x.slot, x.h) + int64_t{x.w} * V;
    const int64_t orow = tok * ly.o_stride + int64_t{x.h} * V;
    for (int s = warp; s < nsi; s += NC) {
      const int rb0 = s * RB;
      const int b = warp * p.nsw + wslot;
      MbarWait(full + b, wphase);
      // The stage is read a row at a time and released once the row is done (its fold
      // reads it again): no stage's rows held in registers, for 3 CTAs per SM.
      const T* const st = stages + int64_t{b} * RB * K + c0;
      float acc[NV];
      ContractStage(x, st, rb0, ur, pr, acc, c0, has_c);
      R dr;
      float dcur;
      const float o = FinishRow(s, acc, kq, beta, vf, row_l, dr, dcur);
      if (lane < RB) {
        const int v = rb0 + row_l;
        StoreAct(ly.o, orow + v, dt, o);
        if (!x.fold) rdw[v] = dr;
      }
      if (x.fold) FoldStage(x, st, rb0, dcur, has_c);
      __syncwarp();
      if (lane == 0) MbarArrive(empty + b);  // every lane is done with the stage
      if (++wslot == p.nsw) wslot = 0, wphase ^= 1u;
    }
  }

  __device__ __forceinline__ void Consume() const {
    const int grid = gridDim.x;
    int item = blockIdx.x;
    if (item >= p.items) return;
    if (p.after_conv) asm volatile("griddepcontrol.wait;" ::: "memory");
    const int c0 = lane * KC;
    const bool has_c = c0 < K;
    const int row_l = lane % RB;
    const int dt = ly.act_dtype;
    StreamTokens cur;
    LoadTokens(item, cur);
    int wslot = 0;  // this warp's ring position
    uint32_t wphase = 0u;
    int live = 0;  // items not padding so far: the scratch set's parity (the consumers are at
                   // most one such item apart: one named barrier each)
    for (int it = 0; item < p.items; ++it, item += grid) {
      StreamTokens nxt{};
      if (item + grid < p.items) LoadTokens(item + grid, nxt);
      const int hb = it & 1;
      MbarWait(hfull + hb, (it >> 1) & 1);
      unsigned char* const hdr = Header(hb);
      const StreamMeta m = *reinterpret_cast<const StreamMeta*>(hdr + p.sm.h_meta);
      Item x;
      x.r = item / HV, x.h = item % HV, x.hq = x.h / ly.group;
      const int64_t tok = x.r;
      if (m.pad) {
        PadItem(tok, x.h, hb, dt);
        cur = nxt;
        continue;
      }
      x.w = m.w, x.fold = m.fold != 0, x.slot = m.slot;
      x.hdr = static_cast<uint32_t>(hdr - smem);
      x.sc = static_cast<uint32_t>(Scratch(live++ & 1) - smem);
      x.pp = &p;
      x.base = smem;

      float q[KC], kk[KC], tg[KC], kq, beta, vf;
      TokenGates(cur, dt, has_c, q, kk, tg, kq, beta, vf);
      if (warp == 0) AppendRings(x, kk, tg, has_c);
      const int nblk = max(1, (x.w + G - 1) / G);
      for (int bi = warp; bi < nblk; bi += NC) DotUnit(x, bi, q, kk, tg, has_c);
      NamedBarrierSync(1, NC * 32);
      ConsumeRows(x, tok, kq, beta, vf, dt, row_l, wslot, wphase);
      FenceProxyAsync();  // this warp's header accesses before the copy engine's next writes
      __syncwarp();
      if (lane == 0) MbarArrive(hempty + hb);
      cur = nxt;
    }
  }
};

// Grid: min(items, CTAs per SM x SMs) persistent CTAs of kStreamThreads threads (the last warp
// the producer), dynamic shared memory StreamSmem::total; registers budgeted for MINB CTAs per
// SM (StreamConfig::ctas_per_sm).
template <typename R, bool KDA, int MINB>
__global__ void __launch_bounds__(kStreamThreads, MINB)
    StreamReplayKernel(const __grid_constant__ StreamParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  StreamCta<R, KDA> cta(p, smem);
  if (threadIdx.x == 0) cta.InitBarriers();
  __syncthreads();
  if (cta.warp == kStreamConsumerWarps) {
    if (cta.lane == 0) cta.Produce();
  } else {
    cta.Consume();
  }
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_STREAM_REPLAY_KERNEL_CUH_
