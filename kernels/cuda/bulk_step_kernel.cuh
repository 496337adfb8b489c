// The bulk step kernel: replay decode, baseline decode and speculative verify with S0 streamed
// through shared-memory stages by the bulk copy engine (cp.async.bulk, completing on
// mbarriers), so the state's bytes are in flight while the CTA computes the token and never
// pass through registers on their way in.
//
// One CTA of nw warps per (row r, v-head h, chunk of nw * rpw state rows: the whole head unless
// the batch is small), on a grid (HV * nchunk, batch); warp w owns rpw rows, streamed through
// ns stages of RB rows. The phases (BulkCta below):
//   1. LoadTokens: every thread issues the tokens' q, k, gates, beta, v before any
//      shared-memory store, and nothing reads the row's slot or cursor until those loads are
//      out (a use before them would wait for the metadata's round trip first). Decode's warp 0
//      also issues the ring records (IssueRecords) between its token loads and their stores.
//   2. IssueS0: each warp's lane 0 issues its first ns S0 batches (verify: warp 0 the records
//      first); CopyRecordsPlain covers sources the copy engine cannot take.
//   3. NormDraft / Append: while those bytes fly, q and k normalized, k·q, the ring appended.
//   4. RecordDots: the record dots in units of 4 records spread over the warps, the weights in
//      the CPU order; W_j∘k_j kept for the fold, A∘k and A∘q by the unit that reaches record 0.
//   5. Rows: per batch of RB rows (once its stage has landed) Contract (S0·(A∘k), S0·(A∘q)
//      plus the ring terms d_j[row]·u_j in the same per-lane partials), one transposed
//      butterfly, the per-row finish, FoldBatch for a folding row; then RefillStage.
// CTA barriers only in the prologue (two for decode, three for verify); the rows run without.
// Baseline = replay at w = 0 that always folds (the same instantiation: bit-identical at L = 1).
// Verify: TT drafts per pass over a batch; passes re-read the batch from shared memory.
// Requirements: K, V multiples of 16, rpw a multiple of 16. Sources the copy engine cannot
// take (a pointer or slot stride not 16-byte aligned; GDN g rows when L % 4 != 0) are copied
// with plain loads instead (the planner decides, BulkParams::bulk_*).
// Types: T the checkpoint's storage, R the ring's d and k (T itself, or a 16-bit ring under an
// fp32 checkpoint); a record's d and k are rounded to R where they are written.
#ifndef REPLAYSSM_KERNELS_CUDA_BULK_STEP_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_BULK_STEP_KERNEL_CUH_

#include "async_copy.cuh"
#include "common.cuh"
#include "loads.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

struct BulkParams {
  LayerDesc ly;
  int32_t batch, num_draft, mode;
  int32_t nw;       // warps per CTA (1..4)
  int32_t rpw;      // state rows per warp (multiple of 16)
  int32_t ns;       // S0 stages per warp (RB rows each, <= kBulkMaxStages), refilled as consumed
  int32_t nchunk;   // ceil(V / (nw * rpw))
  int32_t lr;       // ring records the layout holds (L; 0 for the baseline)
  int32_t dstride;  // elements per ring d row in shared memory (the CTA's rows + 16 bytes)
  // Shared-memory offsets in bytes (multiples of 16; BulkSmem); the mbarriers sit at 0.
  int32_t o_s0, o_d, o_kr, o_kw, o_g, o_tq, o_tk, o_tg, o_ka, o_qa, o_av, o_kn, o_vs, o_u, o_p,
      o_sc, o_dd;
  int32_t bulk_s0, bulk_d, bulk_k, bulk_g;  // sources aligned for the bulk copy engine
  int32_t vec_s0;                           // the fold's 16/8-byte stores are aligned
  int32_t d_dense;                          // the ring's d rows in one copy (dstride = V)
  // A further S0 stage per warp at this offset, over the records' k and g (dead once the record
  // dots are done), for a decode that does not fold; -1: none (BulkConfig::late_stage).
  int32_t o_late;
  const int32_t* slot_idx;
  const int32_t* write_pos;
  const uint8_t* force_fold;
};

// CTAs per SM the registers are budgeted for. Decode: fp32 state 4 (128 registers; its layout
// allows no more, and at 96 the fold spilled), 16-bit state 5 (96 registers; half the shared
// memory). Verify: 4 (128 registers, a few bytes of spills; faster than 3 CTAs at 168).
__host__ __device__ constexpr int BulkDecodeMinCtas(size_t state_bytes) {
  return state_bytes == 4 ? 4 : 5;
}
constexpr int kBulkVerifyMinCtas = 4;
// Accumulators of the fold's row group (FR rows x KC channels per lane): as many as the decode
// register budget above holds without spills (ptxas, sm_90).
__host__ __device__ constexpr int BulkFoldAccs(size_t state_bytes, int kc) {
  return state_bytes == 4 ? (kc <= 4 ? 32 : 16) : (kc <= 4 ? 16 : 8);
}

// One CTA of the bulk step kernel: where it sits in the grid, its shared-memory arrays, and
// the phases of its step. Every member function is inlined into BulkStepKernel.
template <typename T, typename R, int TT, int KC, int RB, bool KDA>
struct BulkCta {
  static constexpr int NV = 2 * TT * RB;  // values per transposed butterfly (<= 32)
  // fp32 decode holds a batch's rows in registers (32 values) and refills early (Rows)
  static constexpr bool kEarlyRefill = TT == 1 && sizeof(T) == 4 && RB * KC <= 32;
  static_assert(NV <= 32, "2 * TT * RB values must fit one butterfly");
  static constexpr int SPREAD = 32 / NV;
  static constexpr int G = 4;  // records per unit of the record dots (up to 4 units for L = 16)
  static constexpr bool kda = KDA;
  static constexpr bool kVerify = TT > 1;
  // fp32 decode may take the late stage (BulkParams::o_late); the others keep their code.
  static constexpr bool kLate = TT == 1 && sizeof(T) == 4;

  const BulkParams& p;
  unsigned char* const smem;
  const LayerDesc& ly;
  // Where the CTA, its warp and its lane sit.
  int lane, warp, tid, nthr, nw;
  int chunk, h;             // grid (HV * nchunk, batch): no division when a CTA is a whole head
  int K, V, L, H, T_, rpw;  // decode's T_ is the constant 1, so its pass loops fold away
  int kg, hq;
  int rows;        // row capacity of the CTA (vs, dd strides)
  int v0, vend;    // the CTA's rows [v0, vend)
  int wv0, wrows;  // the warp's first row and row count
  int nb;          // the warp's batches of RB rows
  int64_t tok0;
  int c0;          // the lane's first key channel
  bool has_c;      // the lane holds channels
  bool has_c_all;  // every lane holds channels (warp-uniform)
  int row_l;       // the lane's row within a batch
  int nrow;        // the CTA's rows
  // The row's metadata as loaded (read only once the token loads are issued).
  int slot_i, wraw, ffold;
  // Shared memory: mbarriers, S0 stages, records, tokens.
  uint64_t* wbar;  // the warp's stages' mbarriers
  uint64_t* rbar;  // the records' mbarrier
  int dst;         // ring d row stride in shared memory (rows + 16 bytes, or V)
  int ns, nst;     // stages, stages in use
  int nse;         // decode: stages in the rotation (ns, or ns + 1 with the late stage)
  T* s0s;          // [ns][RB][K] the warp's stages
  R* dsc;          // [j][dst]: the CTA's rows of record j
  R* ds;           // the warp's columns of dsc
  R* krs;          // [L][K]
  float* gs;       // [L][kg]
  bool bs0;
  float *tq, *tk;  // [T][K]
  float* tg;       // [T][kg]
  float* vsm;      // [T][rows]
  float* betas;    // [T]
  float* kqs;      // [T]
  // The metadata's meaning (once the tokens are stored).
  bool pad;  // padding row (CTA-uniform)
  int64_t slot;
  int w;  // ring records this step reads; verify: w + T <= L
  bool fold;
  T* s0;       // the head's checkpoint rows in the slot
  R *rd, *rk;  // the head's ring d, its qk-head's ring k
  float* rg;
  bool bd, bk, bg;   // records in flight on the copy engine
  float* kws;        // [L][K] W_j∘k_j (fold)
  float *kas, *qas;  // [T][K] A∘k, A∘q
  float* avs;        // [K] A (fold)
  float* kns;        // [K] the normalized k rounded to R (fold)
  float *us, *ps;    // [T][L] (W_j∘k_j)·k, (W_j∘k_j)·q
  float* dds;        // [T][rows] drafts' d across passes
  bool keep_kw;      // a folding decode keeps W_j∘k_j for the fold

  __device__ __forceinline__ BulkCta(const BulkParams& params, unsigned char* smem_base)
      : p(params), smem(smem_base), ly(params.ly) {
    lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    tid = threadIdx.x, nthr = blockDim.x, nw = p.nw;
    const int hc = blockIdx.x, r = blockIdx.y;
    chunk = p.nchunk == 1 ? 0 : hc % p.nchunk;
    h = p.nchunk == 1 ? hc : hc / p.nchunk;
    K = ly.K, V = ly.V, L = ly.L, H = ly.H, T_ = TT == 1 ? 1 : p.num_draft, rpw = p.rpw;
    kg = kda ? K : 1;
    hq = h / ly.group;
    rows = nw * rpw;
    v0 = chunk * rows;
    vend = min(V, v0 + rows);
    wv0 = v0 + warp * rpw;
    wrows = max(0, min(vend - wv0, rpw));
    nb = wrows / RB;
    tok0 = int64_t{r} * T_;
    c0 = lane * KC;
    has_c = c0 < K;
    has_c_all = K >= 32 * KC;
    row_l = lane % RB;
    nrow = vend - v0;
    // The metadata's loads, first: nothing reads them until the token loads are issued.
    slot_i = p.slot_idx[r];
    wraw = p.mode != kModeBaseline ? p.write_pos[r] : 0;
    ffold = p.mode == kModeReplay && p.force_fold != nullptr ? p.force_fold[r] : 0;
    wbar = reinterpret_cast<uint64_t*>(smem) + warp * kBulkMaxStages;
    rbar = reinterpret_cast<uint64_t*>(smem) + kBulkMaxWarps * kBulkMaxStages;
    dst = p.dstride;
    ns = p.ns, nst = min(ns, nb), nse = ns;
    s0s = reinterpret_cast<T*>(smem + p.o_s0) + int64_t{warp} * ns * RB * K;
    dsc = reinterpret_cast<R*>(smem + p.o_d);
    ds = dsc + warp * rpw;
    krs = reinterpret_cast<R*>(smem + p.o_kr);
    gs = reinterpret_cast<float*>(smem + p.o_g);
    bs0 = p.bulk_s0 != 0;
  }

  __device__ __forceinline__ bool RowPad(int si) const { return si < 0 || si >= ly.num_slots; }
  // Records the ring holds for this step (w).
  __device__ __forceinline__ int RingLen(int wp) const {
    if (p.mode == kModeBaseline) return 0;
    const int c = min(max(wp, 0), L);
    return p.mode == kModeVerify ? max(min(c, L - T_), 0) : c;  // verify: w + T <= L
  }
  // The head's ring records in slot sl: d [L][V], k [L][K] (its qk-head's), g [L][kg].
  __device__ __forceinline__ R* RingD(int64_t sl) const {
    return static_cast<R*>(ly.ring_d) + sl * ly.d_stride + int64_t{h} * L * V;
  }
  __device__ __forceinline__ R* RingK(int64_t sl) const {
    return static_cast<R*>(ly.ring_k) + sl * ly.k_stride + int64_t{hq} * L * K;
  }
  __device__ __forceinline__ float* RingG(int64_t sl) const {
    return ly.ring_g + sl * ly.g_stride + int64_t{h} * L * kg;
  }

  // ---- 1. the tokens and the records -------------------------------------------------------
  // Warp 0's lane 0: the records' k, g and d (one copy when d_dense, else one per record) on
  // the records' mbarrier. They gate the record dots, which gate every row: decode issues them
  // inside its token loads' round trip; verify after its tokens are stored (earlier, its four
  // drafts' values spilled).
  __device__ __forceinline__ void IssueRecords() {
    // The compiler would hoist this address arithmetic ahead of the token loads, making every
    // warp wait for the slot and cursor first; an empty asm keeps the order. 16-bit state
    // only: fp32 decode measured faster with the hoist (bench/tools/cuda_prologue.sh checks).
    int si = slot_i, wp = wraw;
    if constexpr (sizeof(T) == 2) asm volatile("" : "+r"(si), "+r"(wp));
    const int wr = RingLen(wp);
    if (RowPad(si) || wr == 0 || !(p.bulk_k || p.bulk_g || p.bulk_d)) return;
    const int64_t sl = si;
    const uint32_t kb = p.bulk_k ? static_cast<uint32_t>(wr * K * sizeof(R)) : 0u;
    // GDN's g row is copied in 16-byte units (the planner allows it only when L % 4 == 0).
    const int gn = kda ? wr * K : (wr + 3) & ~3;
    const uint32_t gb = p.bulk_g ? static_cast<uint32_t>(gn * 4) : 0u;
    const uint32_t db = p.bulk_d ? static_cast<uint32_t>(wr * nrow * sizeof(R)) : 0u;
    const R* const rd_ = RingD(sl);
    MbarInit(rbar, 1);
    MbarFenceInit();
    MbarExpectTx(rbar, kb + gb + db);
    if (kb) BulkLoad(krs, RingK(sl), kb, rbar);
    if (gb) BulkLoad(gs, RingG(sl), gb, rbar);
    if (db && p.d_dense) {
      BulkLoad(dsc, rd_, db, rbar);
    } else if (db) {  // record j's d for the CTA's rows: one copy per record
      for (int j = 0; j < wr; ++j) {
        BulkLoad(dsc + j * dst, rd_ + int64_t{j} * V + v0, static_cast<uint32_t>(nrow * sizeof(R)),
                 rbar);
      }
    }
  }

  // The tokens' q, k, v, gates and beta into shared memory, for activations of type A (float,
  // bf16 or half: resolved once, not per element). Every load of a group of TT tokens is issued
  // before any shared-memory store: a store may alias a generic pointer, so a load after it
  // could not be hoisted above it, and each group would cost one round trip per token.
  // kRecords: decode's warp 0 lane 0 issues the ring records among the loads (false: they
  // were issued before, behind a joined convolution's wait).
  template <typename A, bool kRecords>
  __device__ __forceinline__ void LoadTokens() {
    const A* const qkv = static_cast<const A*>(ly.qkv);
    const A* const ga = static_cast<const A*>(ly.a);
    const A* const gb = static_cast<const A*>(ly.b);
    const A* const q0 = qkv + tok0 * ly.qkv_stride + int64_t{hq} * K;
    const int64_t vofs = int64_t{2 * H - hq} * K + int64_t{h} * V + v0;  // v from q's row
    const float alog = ly.a_log[h];
    // Thread t < T's scalars (GDN a; b), kept raw: converted where used, after the token
    // loads (a conversion here would wait for them before the token loads are issued).
    A a_t{}, b_t{};
    float dtb_h = 0.f;
    if (tid < T_) {
      if (!kda) a_t = ga[(tok0 + tid) * ly.a_stride + h], dtb_h = ly.dt_bias[h];
      b_t = gb[(tok0 + tid) * ly.b_stride + h];
    }
    const int span = max(K, nrow);
    float decay = 0.f;
    for (int t0 = 0; t0 < T_; t0 += TT) {
      for (int i = tid; i < span; i += nthr) {
        float qv[TT], kv[TT], gv[TT], vv[TT];
        [[maybe_unused]] const float db = KDA && i < K ? ly.dt_bias[int64_t{h} * K + i] : 0.f;
#pragma unroll
        for (int u = 0; u < TT; ++u) {
          qv[u] = kv[u] = gv[u] = vv[u] = 0.f;
          if (t0 + u < T_) {
            const A* const qr = q0 + int64_t(t0 + u) * ly.qkv_stride;
            if (i < K) {
              qv[u] = ToF(qr[i]);
              kv[u] = ToF(qr[int64_t{H} * K + i]);
              if constexpr (KDA) {
                gv[u] = ToF(ga[(tok0 + t0 + u) * ly.a_stride + int64_t{h} * K + i]);
              }
            }
            if (i < nrow) vv[u] = ToF(qr[vofs + i]);
          }
        }
        decay = GateDecay(alog);
        if (kRecords && TT == 1 && tid == 0 && i == 0) IssueRecords();
#pragma unroll
        for (int u = 0; u < TT; ++u) {
          const int t = t0 + u;
          if (t < T_) {
            if (i < K) {
              tq[t * K + i] = qv[u];
              tk[t * K + i] = kv[u];
              if constexpr (KDA) tg[t * K + i] = TokenGate(decay, gv[u], db);
            }
            if (i < nrow) vsm[t * rows + i] = vv[u];
          }
        }
      }
    }
    decay = GateDecay(alog);
    if (tid < T_) {
      if (!kda) tg[tid] = TokenGate(decay, ToF(a_t), dtb_h);
      betas[tid] = Beta(ToF(b_t), ly.act_dtype, ly.round_beta);
    }
    for (int t = tid + nthr; t < T_; t += nthr) {  // more tokens than threads (not in practice)
      const int64_t n = tok0 + t;
      if (!kda) tg[t] = TokenGate(decay, ToF(ga[n * ly.a_stride + h]), ly.dt_bias[h]);
      betas[t] = Beta(ToF(gb[n * ly.b_stride + h]), ly.act_dtype, ly.round_beta);
    }
  }

  template <bool kRecords = true>
  __device__ __forceinline__ void LoadTokensOfDtype() {
    tq = reinterpret_cast<float*>(smem + p.o_tq);
    tk = reinterpret_cast<float*>(smem + p.o_tk);
    tg = reinterpret_cast<float*>(smem + p.o_tg);
    vsm = reinterpret_cast<float*>(smem + p.o_vs);
    betas = reinterpret_cast<float*>(smem + p.o_sc);
    kqs = betas + T_;
    if (ly.act_dtype == kActBf16) {
      LoadTokens<__nv_bfloat16, kRecords>();
    } else if (ly.act_dtype == kActF32) {
      LoadTokens<float, kRecords>();
    } else {
      LoadTokens<__half, kRecords>();
    }
  }

  // The metadata's uses, once the tokens are stored.
  __device__ __forceinline__ void ReadMetadata() {
    pad = RowPad(slot_i);
    slot = pad ? 0 : slot_i;
    w = RingLen(wraw);
    fold = p.mode == kModeBaseline || (p.mode == kModeReplay && (w + 1 >= L || ffold != 0));
    s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + int64_t{h} * V * K;
    rd = RingD(slot);
    rk = RingK(slot);
    rg = RingG(slot);
    bd = p.bulk_d != 0 && w > 0;
    // The late stage: a decode that does not fold, with batches left once the first ns are out.
    if (kLate && p.o_late >= 0 && bs0 && !fold && nb > ns) nse = ns + 1;
    bk = p.bulk_k != 0 && w > 0, bg = p.bulk_g != 0 && w > 0;
  }

  // ---- 2. every byte of the CTA's state in flight --------------------------------------------
  // Lane 0 initializes, arms and uses its warp's mbarriers itself (no warp sync needed): verify's
  // warp 0 first issues the records (decode did during the tokens), then each lane 0 its warp's
  // first S0 batches. Issued only now: earlier, the state's bytes delayed the tokens' loads.
  __device__ __forceinline__ void IssueS0() {
    if (pad || lane != 0) return;
    if (bs0) {
      for (int b = 0; b < (kLate && nse > ns ? nse : nst); ++b) MbarInit(wbar + b, 1);
    }
    MbarFenceInit();
    if (TT > 1 && warp == 0) IssueRecords();
    const uint32_t bb = static_cast<uint32_t>(RB * K * sizeof(T));
    if (bs0) {  // the first nst batches; batch b + ns refills stage b % ns once b is done
      for (int b = 0; b < nst; ++b) {
        MbarExpectTx(wbar + b, bb);
        BulkLoadStream(s0s + int64_t{b} * RB * K, s0 + int64_t(wv0 + b * RB) * K, bb, wbar + b);
      }
    }
  }

  // A padding row: zero outputs (nothing was issued).
  __device__ __forceinline__ void ZeroOutputs() {
    for (int t = 0; t < T_; ++t) {
      for (int v = v0 + tid; v < vend; v += nthr) {
        StoreAct(ly.o, (tok0 + t) * ly.o_stride + int64_t{h} * V + v, ly.act_dtype, 0.f);
      }
    }
  }

  __device__ __forceinline__ void TakeScratch() {
    kws = reinterpret_cast<float*>(smem + p.o_kw);
    kas = reinterpret_cast<float*>(smem + p.o_ka);
    qas = reinterpret_cast<float*>(smem + p.o_qa);
    avs = reinterpret_cast<float*>(smem + p.o_av);
    kns = reinterpret_cast<float*>(smem + p.o_kn);
    us = reinterpret_cast<float*>(smem + p.o_u);
    ps = reinterpret_cast<float*>(smem + p.o_p);
    dds = reinterpret_cast<float*>(smem + p.o_dd);
  }

  // Plain copies where the copy engine cannot go (unaligned slots, odd GDN ring lengths).
  __device__ __forceinline__ void CopyRecordsPlain() {
    if (!bd) {
      for (int i = tid; i < w * nrow; i += nthr) {
        const int j = i / nrow, v = i % nrow;
        dsc[j * dst + v] = rd[int64_t{j} * V + v0 + v];
      }
    }
    if (!bk) {
      for (int i = tid; i < w * K; i += nthr) krs[i] = rk[i];
    }
    if (!bg) {
      for (int i = tid; i < w * kg; i += nthr) gs[i] = rg[i];
    }
  }

  // ---- 3/4. norms and k·q, ring appends, record dots ------------------------------------------
  // Draft t's q, k normalized (q scaled) in registers (the lane's channels); returns k·q.
  __device__ __forceinline__ float NormDraft(int t, float (&q)[KC], float (&kk)[KC]) const {
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      q[e] = has_c ? tq[t * K + c0 + e] : 0.f;
      kk[e] = has_c ? tk[t * K + c0 + e] : 0.f;
    }
    return NormalizeQk<KC>(ly, q, kk);
  }

  // Appends draft t's k (once per qk-head group) and g to the ring (a decode that does not
  // fold, and verify).
  __device__ __forceinline__ void Append(int t, const float (&kk)[KC]) const {
    const int P = w + t;
    if (fold || chunk != 0 || P >= L) return;
    if (has_c) {
      if (h % ly.group == 0) {
        R* kd = rk + int64_t{P} * K + c0;
#pragma unroll
        for (int e = 0; e < KC; ++e) kd[e] = FromF<R>(kk[e]);
      }
      if constexpr (KDA) {
#pragma unroll
        for (int e = 0; e < KC; ++e) rg[int64_t{P} * K + c0 + e] = tg[t * K + c0 + e];
      }
    }
    if (!KDA && lane == 0) rg[P] = tg[t];
  }

  // Record i's gate: the ring's (i < w) or the draft's (verify: i = w + t).
  __device__ __forceinline__ float Gate(int i, int e) const {
    if constexpr (KDA) return i < w ? gs[i * K + c0 + e] : tg[(i - w) * K + c0 + e];
    return i < w ? gs[i] : tg[i - w];
  }

  // Unit bi of draft t: records P-1-bi*G down to P-bi*G-G; the weights from the top record
  // down (the CPU order): acc = g_P + Σ_{i>j} g_i; the unit that reaches record 0 writes A∘k,
  // A∘q (and A for the fold).
  __device__ __forceinline__ void DotUnit(int t, int bi, const float (&q)[KC],
                                          const float (&kk)[KC]) const {
    const int P = w + t;
    const int jtop = P - 1 - bi * G;
    float acc[KC];
#pragma unroll
    for (int e = 0; e < KC; ++e) acc[e] = KDA ? (has_c ? tg[t * K + c0 + e] : 0.f) : tg[t];
    for (int i = P - 1; i > jtop; --i) {
      if constexpr (KDA) {
        if (has_c) {
#pragma unroll
          for (int e = 0; e < KC; ++e) acc[e] += Gate(i, e);
        }
      } else {
        const float gi = Gate(i, 0);
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
            const float gj = KDA ? 0.f : Gate(j, 0);
            const float wj = KDA ? 0.f : expf(acc[0]);  // GDN: one weight per record
            Vec<R, KC> kr;
            kr.LoadShared(krs + j * K + c0);
            Vec<float, KC> kw;
#pragma unroll
            for (int e = 0; e < KC; ++e) {
              const float x = (KDA ? expf(acc[e]) : wj) * kr.Get(e);
              su += x * kk[e];
              sp += x * q[e];
              kw.Set(e, x);
              acc[e] += KDA ? Gate(j, e) : gj;
            }
            if (keep_kw) kw.StoreShared(kws + j * K + c0);
          } else if (!KDA) {
            const float gj = Gate(j, 0);
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
      if (lane % kSpread == 0 && j >= 0) (i < G ? us : ps)[t * L + j] = v[0];
    }
    if (jtop < G && has_c) {  // the unit that reached record 0: acc is the whole decay
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        const float A = expf(acc[e]);
        kas[t * K + c0 + e] = A * kk[e];
        qas[t * K + c0 + e] = A * q[e];
        if (t == 0) avs[c0 + e] = A;
      }
    }
  }

  // Decode: every warp normalizes the token itself (no barrier between the norms and the
  // dots); warp 0 keeps k·q, the normalized k (fold) and appends.
  __device__ __forceinline__ void DecodeDots() const {
    float q[KC], kk[KC];
    const float kq = NormDraft(0, q, kk);
    if (warp == 0) {
      if (lane == 0) kqs[0] = kq;
      if (has_c) {
#pragma unroll
        for (int e = 0; e < KC; ++e) kns[c0 + e] = RoundTo<R>(kk[e]);  // as the ring holds it
      }
      Append(0, kk);
    }
    if (bk || bg || bd) MbarWait(rbar, 0);
    const int nblk = max(1, (w + G - 1) / G);
    for (int bi = warp; bi < nblk; bi += nw) DotUnit(0, bi, q, kk);
  }

  // Verify: a warp per draft (norms, the draft's k as stored for the later drafts, appends),
  // then the units of every draft spread over the warps.
  __device__ __forceinline__ void VerifyDots() const {
    for (int t = warp; t < T_; t += nw) {
      float q[KC], kk[KC];
      const float kq = NormDraft(t, q, kk);
      if (lane == 0) kqs[t] = kq;
      const int P = w + t;
      if (has_c) {
#pragma unroll
        for (int e = 0; e < KC; ++e) tq[t * K + c0 + e] = q[e], tk[t * K + c0 + e] = kk[e];
        if (P < L) {
#pragma unroll
          for (int e = 0; e < KC; ++e) krs[P * K + c0 + e] = FromF<R>(kk[e]);
        }
      }
      Append(t, kk);
    }
    __syncthreads();
    if (bk || bg || bd) MbarWait(rbar, 0);
    int owner = 0;  // the warp of the next unit (round robin)
    for (int t = 0; t < T_; ++t) {
      const int nblk = max(1, (w + t + G - 1) / G);
      for (int bi = 0; bi < nblk; ++bi) {
        const bool mine = owner == warp;
        if (++owner == nw) owner = 0;
        if (!mine) continue;
        float q[KC], kk[KC];
#pragma unroll
        for (int e = 0; e < KC; ++e) {
          q[e] = has_c ? tq[t * K + c0 + e] : 0.f;
          kk[e] = has_c ? tk[t * K + c0 + e] : 0.f;
        }
        DotUnit(t, bi, q, kk);
      }
    }
  }

  __device__ __forceinline__ void RecordDots() {
    keep_kw = fold && TT == 1;
    if constexpr (TT == 1) {
      DecodeDots();
    } else {
      VerifyDots();
    }
  }

  // ---- 5. the warp's rows, RB at a time (no CTA barrier from here on) ------------------------
  // Refills stage si with batch b + nsr (rows rb0 + nsr * RB; nsr the stages in the rotation)
  // once every lane's reads of it are done.
  __device__ __forceinline__ void RefillStage(int b, int rb0, int si, T* stage) const {
    const int nsr = kLate ? nse : ns;
    if (bs0 && b + nsr < nb) {
      __syncwarp();  // every lane's reads of the stage are done
      if (lane == 0) {
        FenceProxyAsync();  // ... and ordered before the bulk engine's writes
        const uint32_t bb = static_cast<uint32_t>(RB * K * sizeof(T));
        MbarExpectTx(wbar + si, bb);
        BulkLoadStream(stage, s0 + int64_t(wv0 + rb0 + nsr * RB) * K, bb, wbar + si);
      }
    }
  }

  // The batch's S0 rows (rb0 on) in its stage: waits for the copy engine, or copies them
  // (unaligned slots).
  __device__ __forceinline__ void AwaitStage(int rb0, uint64_t* bar, uint32_t phase,
                                             T* stage) const {
    if (bs0) {
      MbarWait(bar, phase);
    } else {
      __syncwarp();
      for (int i = lane; i < RB * K; i += 32) stage[i] = s0[int64_t(wv0 + rb0) * K + i];
      __syncwarp();
    }
  }

  // The contraction S0·(A∘k), S0·(A∘q) of batch b's rows (stage at st + c0) into the lane's
  // partials. fp32 decode reads the batch's rows all before any use, so that the stage may be
  // refilled before the arithmetic (when `early_refill`).
  __device__ __forceinline__ void Contract(float (&acc)[NV],
                                           Vec<T, KC> (&xs)[kEarlyRefill ? RB : 1], const T* st,
                                           const float (&ka)[TT][KC], const float (&qa)[TT][KC],
                                           bool early_refill, int b, int rb0, int si,
                                           T* stage) const {
    if constexpr (kEarlyRefill) {
#pragma unroll
      for (int i = 0; i < RB; ++i) xs[i].LoadShared(st + i * K);
      if (early_refill) RefillStage(b, rb0, si, stage);  // free once every lane has its rows
    }
    Vec<T, KC> xl;  // a row at a time otherwise
#pragma unroll
    for (int i = 0; i < RB; ++i) {
      if constexpr (!kEarlyRefill) xl.LoadShared(st + i * K);
      const Vec<T, KC>& x = kEarlyRefill ? xs[i] : xl;
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        const float s = x.Get(e);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          acc[(t * RB + i) * 2] += s * ka[t][e];
          acc[(t * RB + i) * 2 + 1] += s * qa[t][e];
        }
      }
    }
  }

  // The ring terms d_j[row]·u_j, d_j[row]·p_j of the batch's rows (lane j holds record j) into
  // the same partials.
  __device__ __forceinline__ void AddRingTerms(float (&acc)[NV], int rb0, int pass0, int nt,
                                               const float (&ur)[TT], const float (&pr)[TT]) const {
    if (lane < w) {
      Vec<R, RB> dl;
      dl.LoadShared(ds + lane * dst + rb0);
#pragma unroll
      for (int i = 0; i < RB; ++i) {
        const float x = dl.Get(i);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          acc[(t * RB + i) * 2] += x * ur[t];
          acc[(t * RB + i) * 2 + 1] += x * pr[t];
        }
      }
    }
    for (int j = lane + 32; j < w; j += 32) {  // rings longer than 32 records
      Vec<R, RB> d2;
      d2.LoadShared(ds + j * dst + rb0);
#pragma unroll
      for (int i = 0; i < RB; ++i) {
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          if (t < nt) {
            acc[(t * RB + i) * 2] += d2.Get(i) * us[(pass0 + t) * L + j];
            acc[(t * RB + i) * 2 + 1] += d2.Get(i) * ps[(pass0 + t) * L + j];
          }
        }
      }
    }
  }

  // Decode, and verify in several passes: the per-row finish of the pass's drafts (lane
  // i < RB writes row i); returns d of the pass's last draft as stored (the fold's).
  __device__ __forceinline__ float FinishRows(float (&acc)[NV], int rb0, int pass0, int nt,
                                              bool one_pass) const {
    float dcur = 0.f;
    float vcur[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      vcur[t] = t < nt ? vsm[(pass0 + t) * rows + (wv0 - v0) + rb0 + row_l] : 0.f;
    }
    TransposeReduce<NV, 16>::Run(acc, lane);
    float dd[TT];
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      float sk = __shfl_sync(0xffffffffu, acc[0], ((t * RB + row_l) * 2) * SPREAD);
      float sq = __shfl_sync(0xffffffffu, acc[0], ((t * RB + row_l) * 2 + 1) * SPREAD);
      dd[t] = 0.f;
      if (t < nt) {
        const int tg_ = pass0 + t;  // the draft's index
        const int P = w + tg_;
        for (int t2 = 0; t2 < pass0; ++t2) {  // drafts of earlier passes
          const float x = dds[t2 * rows + (wv0 - v0) + rb0 + row_l];
          sk += x * us[tg_ * L + w + t2];
          sq += x * ps[tg_ * L + w + t2];
        }
#pragma unroll
        for (int t2 = 0; t2 < TT; ++t2) {  // drafts of this pass
          if (t2 < t) {
            sk += dd[t2] * us[tg_ * L + w + pass0 + t2];
            sq += dd[t2] * ps[tg_ * L + w + pass0 + t2];
          }
        }
        const float d = betas[tg_] * (vcur[t] - sk);
        const R dr = FromF<R>(d);
        dd[t] = ToF(dr);
        dcur = dd[t];  // the fold adds the record as the ring would hold it
        const float o = sq + d * kqs[tg_];
        if (lane < RB) {
          const int v = wv0 + rb0 + row_l;
          StoreAct(ly.o, (tok0 + tg_) * ly.o_stride + int64_t{h} * V + v, ly.act_dtype, o);
          if (!fold) rd[int64_t{P} * V + v] = dr;
          if (!one_pass) dds[tg_ * rows + (v - v0)] = dd[t];
        }
      }
    }
    return dcur;
  }

  // A folding decode: the batch's new checkpoint rows, S0·A + Σ_j d_j (W_j∘k_j) + d k, FR rows
  // at a time with their KC channels in registers, so that record j's W_j∘k_j and d_j are read
  // once for all of them. The order per element is the CPU's: S0·A, the records in order, the
  // new d.
  // fp32 decode passes the batch's rows as Contract read them into registers (`xs`; the stage
  // is refilled by then); the others read them from the stage again.
  __device__ __forceinline__ void FoldBatch(const T* st,
                                            const Vec<T, KC> (&xs)[kEarlyRefill ? RB : 1], int rb0,
                                            float dcur, const float (&kn0)[KC],
                                            const float (&av)[KC], bool vec_s0) const {
    constexpr int FA = BulkFoldAccs(sizeof(T), KC);
    constexpr int FR = RB * KC <= FA ? RB : FA / KC;
    static_assert(RB % FR == 0, "fold row groups");
    static_assert(!kEarlyRefill || FR == RB, "rows in registers: one fold group");
#pragma unroll 1
    for (int i0 = 0; i0 < RB; i0 += FR) {
      float out[FR][KC];
      if (has_c) {
#pragma unroll
        for (int i = 0; i < FR; ++i) {
          Vec<T, KC> x;
          if constexpr (kEarlyRefill) {
            x = xs[i];
          } else {
            x.LoadShared(st + (i0 + i) * K);
          }
#pragma unroll
          for (int e = 0; e < KC; ++e) out[i][e] = x.Get(e) * av[e];
        }
#pragma unroll 2
        for (int j = 0; j < w; ++j) {
          Vec<R, FR> dj;
          dj.LoadShared(ds + j * dst + rb0 + i0);
          Vec<float, KC> kw;
          kw.LoadShared(kws + j * K + c0);
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
        Vec<T, KC> x;
#pragma unroll
        for (int e = 0; e < KC; ++e) x.Set(e, out[i][e] + di * kn0[e]);
        x.Store(s0 + int64_t(wv0 + rb0 + i0 + i) * K + c0, vec_s0);
      }
    }
  }

  // Pass pass0's A∘k, A∘q and ring-term weights (the lane's record) into registers.
  __device__ __forceinline__ void LoadPass(int pass0, float (&ka)[TT][KC], float (&qa)[TT][KC],
                                           float (&ur)[TT], float (&pr)[TT]) const {
    const int nt = min(TT, T_ - pass0);
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      const bool on = t < nt;
#pragma unroll
      for (int e = 0; e < KC; ++e) {
        ka[t][e] = on && has_c ? kas[(pass0 + t) * K + c0 + e] : 0.f;
        qa[t][e] = on && has_c ? qas[(pass0 + t) * K + c0 + e] : 0.f;
      }
      ur[t] = on && lane < w ? us[(pass0 + t) * L + lane] : 0.f;
      pr[t] = on && lane < w ? ps[(pass0 + t) * L + lane] : 0.f;
    }
  }

  __device__ __forceinline__ void Rows() const {
    if (nb == 0) return;
    float ka[TT][KC], qa[TT][KC], ur[TT], pr[TT], kn0[KC], av[KC];
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      kn0[e] = fold && has_c ? kns[c0 + e] : 0.f;
      av[e] = fold && has_c ? avs[c0 + e] : 0.f;
    }
    const bool one_pass = T_ <= TT;
    if (one_pass) LoadPass(0, ka, qa, ur, pr);
    const bool vec_s0 = p.vec_s0 != 0;

    // Verify in one pass (T <= TT, the usual T = 4): the drafts' chain coefficients, betas and
    // k·q in registers.
    float cu[TT][TT], cp[TT][TT], bt[TT], kqv[TT];
    if constexpr (kVerify) {
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        const bool on = t < T_;
        bt[t] = on ? betas[t] : 0.f;
        kqv[t] = on ? kqs[t] : 0.f;
#pragma unroll
        for (int t2 = 0; t2 < TT; ++t2) {
          cu[t][t2] = on && t2 < t ? us[t * L + w + t2] : 0.f;
          cp[t][t2] = on && t2 < t ? ps[t * L + w + t2] : 0.f;
        }
      }
    }
    const float* const vrow = vsm + (wv0 - v0) + row_l;                      // + t * rows + rb0
    const int64_t orow = tok0 * ly.o_stride + int64_t{h} * V + wv0 + row_l;  // + t * o_stride + rb0
    R* const drow = rd + int64_t{w} * V + wv0 + row_l;                       // + t * V + rb0

    // Decode's late stage, issued now that the record dots (behind the CTA barrier) are done
    // with the records' k and g beneath it: batch ns.
    T* const late = reinterpret_cast<T*>(smem + p.o_late) + warp * RB * K;
    if (kLate && nse > ns && lane == 0) {
      FenceProxyAsync();  // the record dots' reads of k and g before the bulk engine's writes
      const uint32_t bb = static_cast<uint32_t>(RB * K * sizeof(T));
      MbarExpectTx(wbar + ns, bb);
      BulkLoadStream(late, s0 + int64_t(wv0 + ns * RB) * K, bb, wbar + ns);
    }
    int si = 0;            // the batch's stage (b % nse without a division)
    uint32_t sphase = 0u;  // ... and its mbarrier phase ((b / nse) & 1)
#pragma unroll 1
    for (int b = 0; b < nb; ++b) {
      const int rb0 = b * RB;  // the batch's first row within the warp
      T* const stage = !kLate || si < ns ? s0s + si * RB * K : late;
      AwaitStage(rb0, wbar + si, sphase, stage);
      const T* const st = stage + c0;
      // fp32 decode refills right after the contraction's loads (its rows are then in
      // registers, where a folding row's fold reads them); everything else at the batch's end
      // (verify's rows held in registers spilled, and 16-bit decode measured slower).
      const bool early_refill = kEarlyRefill && has_c_all;
      Vec<T, KC> xs[kEarlyRefill ? RB : 1];
      float dcur = 0.f;
#pragma unroll 1
      for (int pass0 = 0; pass0 < T_; pass0 += TT) {
        const int nt = min(TT, T_ - pass0);
        if (!one_pass) LoadPass(pass0, ka, qa, ur, pr);
        float acc[NV];
#pragma unroll
        for (int i = 0; i < NV; ++i) acc[i] = 0.f;
        if (has_c) Contract(acc, xs, st, ka, qa, early_refill, b, rb0, si, stage);
        AddRingTerms(acc, rb0, pass0, nt, ur, pr);
        if constexpr (kVerify) {
          if (one_pass) {  // lane i < RB chains row i's drafts with register coefficients
            TransposeReduce<NV, 16>::Run(acc, lane);
            float skv[TT], sqv[TT];
#pragma unroll
            for (int t = 0; t < TT; ++t) {
              skv[t] = __shfl_sync(0xffffffffu, acc[0], ((t * RB + row_l) * 2) * SPREAD);
              sqv[t] = __shfl_sync(0xffffffffu, acc[0], ((t * RB + row_l) * 2 + 1) * SPREAD);
            }
            if (lane < RB) {
              // The chain without a branch (a draft past T_ has zero coefficients, beta and v;
              // its values are never stored and enter no earlier draft's), then the stores, the
              // activation dtype resolved once for all drafts.
              float dr_prev[TT], ov[TT];  // the drafts' d as stored (rounded to R); outputs
              R drs[TT];
#pragma unroll
              for (int t = 0; t < TT; ++t) {
                float sk = skv[t], sq = sqv[t];
#pragma unroll
                for (int t2 = 0; t2 < t; ++t2) {
                  sk += dr_prev[t2] * cu[t][t2], sq += dr_prev[t2] * cp[t][t2];
                }
                const float vt = t < T_ ? vrow[t * rows + rb0] : 0.f;
                const float d = bt[t] * (vt - sk);
                drs[t] = FromF<R>(d);
                dr_prev[t] = ToF(drs[t]);
                ov[t] = sq + d * kqv[t];
              }
              StoreActs(ly.o, orow + rb0, ly.o_stride, ly.act_dtype, ov, T_);
#pragma unroll
              for (int t = 0; t < TT; ++t) {
                if (t < T_) drow[int64_t{t} * V + rb0] = drs[t];
              }
            }
            continue;  // the only pass
          }
        }
        dcur = FinishRows(acc, rb0, pass0, nt, one_pass);
        if (!one_pass) __syncwarp();  // the next pass reads this pass's dds
      }
      if constexpr (TT == 1) {  // decode only: the new checkpoint of the batch rows
        if (fold) FoldBatch(st, xs, rb0, dcur, kn0, av, vec_s0);
      }
      if (!early_refill) RefillStage(b, rb0, si, stage);
      if (++si == (kLate ? nse : ns)) si = 0, sphase ^= 1u;
    }
  }
};

// AFTER_CONV (decode only): launched as the programmatic dependent of its convolution
// (rssm_decode_args.conv), whose outputs are its tokens. The row's metadata, checkpoint and
// records are not the convolution's to write, so the CTA reads its metadata and issues its
// records and S0 stages first, then waits for the convolution's grid (griddepcontrol.wait: its
// writes are visible after it) and loads the tokens: the state streams while the convolution
// runs, and what follows the wait is the tokens' L2 round trip, not the records' DRAM one.
template <typename T, typename R, int TT, int KC, int RB, bool KDA, bool AFTER_CONV = false>
__global__ void __launch_bounds__(kBulkMaxWarps * 32,
                                  TT == 1 ? BulkDecodeMinCtas(sizeof(T)) : kBulkVerifyMinCtas)
    BulkStepKernel(const __grid_constant__ BulkParams p) {
  static_assert(!AFTER_CONV || TT == 1, "only decode joins its convolution");
  extern __shared__ __align__(128) unsigned char smem[];
  BulkCta<T, R, TT, KC, RB, KDA> cta(p, smem);
  if constexpr (AFTER_CONV) {
    cta.ReadMetadata();
    if (threadIdx.x == 0) cta.IssueRecords();
    cta.IssueS0();
    asm volatile("griddepcontrol.wait;" ::: "memory");
    cta.template LoadTokensOfDtype<false>();
  } else {
    cta.LoadTokensOfDtype();
    cta.ReadMetadata();
    cta.IssueS0();
  }
  if (cta.pad) {
    cta.ZeroOutputs();
    return;
  }
  cta.TakeScratch();
  cta.CopyRecordsPlain();
  __syncthreads();
  cta.RecordDots();
  __syncthreads();
  cta.Rows();
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_BULK_STEP_KERNEL_CUH_
