// v7: the bulk-staged warp step (replay decode, baseline decode, speculative verify).
//
// Why (NOTES.md, v6): the v6 warp kernel spent few instructions per byte, but each warp held
// one batch of S0 rows in registers, so ~32 KB per SM were in flight and replay reads stalled
// near 2 TB/s. Here the bytes never pass through registers on their way in: the bulk copy
// engine (cp.async.bulk, completing on mbarriers) fetches S0 into shared-memory stages and the
// records into shared memory, so the bytes are in flight while the CTA computes the token.
//
// One CTA of nw warps per (row r, v-head h, chunk of nw * rpw state rows: the whole head unless
// the batch is small), on a grid (HV * nchunk, batch); warp w owns rpw rows, streamed through
// ns stages of RB rows (2, or 1 where 2 would leave fewer than kBulkMinCtas CTAs per SM).
// The prologue is two global round trips whatever the ring holds:
//   1. all threads: the row's slot and cursor AND the tokens' q, k, gates, beta, v (into
//      shared memory) — nothing reads the slot or cursor until the token loads are issued
//      (verify; decode not yet, see step 1 below);
//      every load of a group of tokens is issued before any of their shared-memory stores (a
//      store may alias a later load's generic pointer, which would serialize the round trips,
//      v7j); decode: warp 0's lane 0 issues the records' k and g (contiguous [w, K] / [w, Kg])
//      and the records' d for the CTA's rows (one copy for a whole head, else one per record),
//      all on one mbarrier, between its token loads and their stores (v7p);
//   2. each warp's lane 0 issues its first ns S0 batches (contiguous rows, L2 evict-first);
//      verify: warp 0's lane 0 the records first;
//   3. (while those bytes fly) norms and k·q: decode — every warp for itself, warp 0 appends
//      to the ring; verify — a warp per draft, which also keeps the draft's k for the later
//      drafts, then a CTA barrier;
//   4. the record dots in units of 4 records spread over the warps: the weights in the CPU
//      order (a unit first sums the gates of the records above it), W_j∘k_j kept for the fold,
//      A∘k and A∘q by the unit that reaches record 0;
//   5. each warp, per batch of RB rows (once its stage's mbarrier says the bytes landed): the
//      contraction S0·(A∘k), S0·(A∘q) plus the ring terms d_j[row]·u_j (lane j holds record
//      j) in the same per-lane partials, one transposed butterfly, the per-row finish, a
//      folding row's new checkpoint written from the stage; then the stage is refilled with
//      batch b + ns. Verify in one pass (T <= TT): lane i < RB chains row i's drafts with the
//      chain coefficients, betas and k·q held in registers (v7h).
// CTA barriers only in the prologue (two for decode, three for verify); the rows run without.
// Baseline = replay at w = 0 that always folds (the same instantiation: bit-identical at L = 1).
// Verify: TT drafts per pass over a batch; passes re-read the batch from shared memory.
// Requirements: K, V multiples of 16, rpw a multiple of 16. Sources the bulk engine cannot
// take (a pointer or slot stride not 16-byte aligned; GDN g rows when L % 4 != 0) are copied
// with plain loads instead (the launcher decides, BulkParams::bulk_*).
#ifndef REPLAYSSM_KERNELS_CUDA_BULK_KERNEL_CUH_
#define REPLAYSSM_KERNELS_CUDA_BULK_KERNEL_CUH_

#include "async_copy.cuh"
#include "common.cuh"
#include "params.h"

namespace replayssm::kernels::cuda {

constexpr int kBulkMaxWarps = 4;
constexpr int kBulkMaxStages = 8;  // S0 stages per warp (an mbarrier each)
constexpr int kBulkBars = kBulkMaxWarps * kBulkMaxStages + 1;  // + the records' mbarrier
constexpr int kBulkMinCtas = 4;  // decode: fewer S0 stages rather than fewer CTAs per SM

struct BulkParams {
  LayerDesc ly;
  int32_t batch, num_draft, mode;
  int32_t nw;      // warps per CTA (1..4)
  int32_t rpw;     // state rows per warp (multiple of 16)
  int32_t ns;      // S0 stages per warp (RB rows each, <= kBulkMaxStages), refilled as consumed
  int32_t nchunk;  // ceil(V / (nw * rpw))
  int32_t lr;      // ring records the layout holds (L; 0 for the baseline)
  int32_t dstride; // elements per ring d row in shared memory (the CTA's rows + 16 bytes)
  // Shared-memory offsets in bytes (multiples of 16); the mbarriers sit at 0.
  int32_t o_s0, o_d, o_kr, o_kw, o_g, o_tq, o_tk, o_tg, o_ka, o_qa, o_av, o_kn, o_vs, o_u, o_p,
      o_sc, o_dd;
  int32_t bulk_s0, bulk_d, bulk_k, bulk_g;  // sources aligned for the bulk copy engine
  int32_t vec_s0;                           // the fold's 16/8-byte stores are aligned
  int32_t d_dense;                          // the ring's d rows in one copy (dstride = V)
  const int32_t* slot_idx;
  const int32_t* write_pos;
  const uint8_t* force_fold;
#ifdef RSSM_BULK_TRACE
  unsigned long long* trace;  // kTraceWords per CTA (a diagnostic build only; launch.cuh)
#endif
};

// Per-CTA timeline of a diagnostic build (-DRSSM_BULK_TRACE): word 0 the CTA's SM, cursor and
// fold flag, 1/2 %globaltimer at its start and at warp 0's end, then clock64 at: 3 start,
// 4 tokens stored (thread 0), 5 first CTA barrier, 6 records landed (warp 0), 7 prologue end,
// 8..11 warp 0's batches 0..3 landed, 12..15 each warp's end.
constexpr int kTraceWords = 16;
// RSSM_TRACE(i, v) stores word i of this CTA's record; without RSSM_BULK_TRACE it expands to
// nothing (v is not evaluated), so the hooks cost a serving build nothing.
#ifdef RSSM_BULK_TRACE
#define RSSM_TRACE(i, v)                                                                      \
  do {                                                                                        \
    if (p.trace != nullptr) {                                                                 \
      p.trace[(int64_t(blockIdx.y) * gridDim.x + blockIdx.x) * kTraceWords + (i)] = (v);      \
    }                                                                                         \
  } while (0)
#else
#define RSSM_TRACE(i, v) \
  do {                   \
  } while (0)
#endif
__device__ __forceinline__ unsigned long long GlobalTimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned SmId() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// Ring d rows of a CTA in shared memory: its rows + 16 bytes, so that lanes reading their
// record's row (16-byte loads, lane j at record j) hit distinct banks.
__host__ __device__ constexpr int DStride(int rpw, int state_bytes) { return rpw + 16 / state_bytes; }

// The layout of one CTA's shared memory (bytes). T_ drafts, TT per pass.
struct BulkSmem {
  int32_t s0, d, kr, kw, g, tq, tk, tg, ka, qa, av, kn, vs, u, p, sc, dd, total;
  static BulkSmem Make(int K, int L, int lr, bool kda, int T, int TT, int nw, int rpw, int ns,
                       int rb, int state_bytes, bool fold_capable) {
    BulkSmem s;
    int o = kBulkBars * 8;
    auto take = [&o](int64_t bytes) {
      o = (o + 15) & ~15;
      const int at = o;
      o += static_cast<int>(bytes);
      return at;
    };
    const int kg = kda ? K : 1, rows = nw * rpw;
    s.s0 = take(int64_t{nw} * ns * rb * K * state_bytes);
    s.d = take(int64_t{lr} * DStride(rows, state_bytes) * state_bytes);
    s.kr = take(int64_t{lr} * K * state_bytes);
    // W_j∘k_j of a folding decode: in place over the fp32 records, else its own array.
    s.kw = fold_capable ? (state_bytes == 4 ? s.kr : take(int64_t{lr} * K * 4)) : s.kr;
    s.g = take(int64_t{lr} * kg * 4);
    s.tq = take(int64_t{T} * K * 4);
    s.tk = take(int64_t{T} * K * 4);
    s.tg = take(int64_t{T} * kg * 4);
    s.ka = take(int64_t{T} * K * 4);
    s.qa = take(int64_t{T} * K * 4);
    s.av = take(int64_t{K} * 4);
    s.kn = take(int64_t{K} * 4);
    s.vs = take(int64_t{T} * rows * 4);
    s.u = take(int64_t{T} * L * 4);
    s.p = take(int64_t{T} * L * 4);
    s.sc = take(int64_t{2} * T * 4);
    s.dd = take(T > TT ? int64_t{T} * rows * 4 : 0);
    s.total = (o + 15) & ~15;
    return s;
  }
};

// N consecutive elements of T kept raw in registers (converted on use).
template <typename T, int N>
struct Slice {
  static constexpr int kBytes = N * int(sizeof(T));
  static constexpr int kWords = (kBytes + 3) / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ float Get(int e) const { return ToF(reinterpret_cast<const T*>(w)[e]); }
  __device__ __forceinline__ void Set(int e, float x) { reinterpret_cast<T*>(w)[e] = FromF<T>(x); }
  __device__ __forceinline__ void Zero() {
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[i] = 0u;
  }
};

// Stores a slice to global memory: 16/8-byte streaming stores when `vec` (p aligned to the
// slice's width), else element by element.
template <typename T, int N>
__device__ __forceinline__ void StoreSlice(T* p, const Slice<T, N>& s, bool vec) {
  constexpr int B = Slice<T, N>::kBytes;
  if (vec) {
    if constexpr (B % 16 == 0) {
#pragma unroll
      for (int i = 0; i < B / 16; ++i) {
        __stcs(reinterpret_cast<uint4*>(p) + i,
               make_uint4(s.w[4 * i], s.w[4 * i + 1], s.w[4 * i + 2], s.w[4 * i + 3]));
      }
      return;
    } else if constexpr (B % 8 == 0) {
#pragma unroll
      for (int i = 0; i < B / 8; ++i) {
        __stcs(reinterpret_cast<uint2*>(p) + i, make_uint2(s.w[2 * i], s.w[2 * i + 1]));
      }
      return;
    }
  }
  const T* d = reinterpret_cast<const T*>(s.w);
#pragma unroll
  for (int e = 0; e < N; ++e) p[e] = d[e];
}

// N elements of T from shared memory at p (aligned to the slice's width, at most 16 bytes).
template <typename T, int N>
__device__ __forceinline__ void LoadSmemSlice(Slice<T, N>& s, const T* p) {
  constexpr int B = Slice<T, N>::kBytes;
  if constexpr (B % 16 == 0) {
#pragma unroll
    for (int i = 0; i < B / 16; ++i) {
      const uint4 x = reinterpret_cast<const uint4*>(p)[i];
      s.w[4 * i] = x.x, s.w[4 * i + 1] = x.y, s.w[4 * i + 2] = x.z, s.w[4 * i + 3] = x.w;
    }
  } else if constexpr (B % 8 == 0) {
#pragma unroll
    for (int i = 0; i < B / 8; ++i) {
      const uint2 x = reinterpret_cast<const uint2*>(p)[i];
      s.w[2 * i] = x.x, s.w[2 * i + 1] = x.y;
    }
  } else {
    T* d = reinterpret_cast<T*>(s.w);
#pragma unroll
    for (int e = 0; e < N; ++e) d[e] = p[e];
  }
}

template <typename T, int N>
__device__ __forceinline__ void StoreSmemSlice(T* p, const Slice<T, N>& s) {
  constexpr int B = Slice<T, N>::kBytes;
  static_assert(B % 16 == 0, "16-byte slices only");
#pragma unroll
  for (int i = 0; i < B / 16; ++i) {
    reinterpret_cast<uint4*>(p)[i] = make_uint4(s.w[4 * i], s.w[4 * i + 1], s.w[4 * i + 2], s.w[4 * i + 3]);
  }
}

// CTAs per SM the register budget is sized for. Decode: fp32 state 4 (128 registers: its
// layout allows 4 CTAs/SM anyway, and at 96 registers the fold spilled), 16-bit state 5 (96
// registers; half the shared memory, so 5 CTAs fit). v7m, same-call A/B
// (kernels-h200-2026-11-30-v7m-*.json): fp32 replay -7%, baseline -4% at 4; 16-bit baseline
// and GDN replay 3-5% better at 5. Verify: RSSM_BULK_VERIFY_MIN_BLOCKS, 4 (128 registers; v7l:
// -2..-7% against 3 CTAs at 168 registers, kernels-h200-2026-11-30-v7l-*.json).
__host__ __device__ constexpr int BulkDecodeMinCtas(size_t state_bytes) { return state_bytes == 4 ? 4 : 5; }
// Accumulators of the fold's row group (FR rows x KC channels per lane): what the decode
// register budget above holds without spills (ptxas, sm_90): fp32 32 at KC = 4 (a whole batch
// of 8 rows), 16 at KC = 8; 16-bit 16 at KC = 4 (v7o: replay -2..-13%, baseline -2..-3% against
// 8; 32 spilled), 8 at KC = 8.
__host__ __device__ constexpr int BulkFoldAccs(size_t state_bytes, int kc) {
  return state_bytes == 4 ? (kc <= 4 ? 32 : 16) : (kc <= 4 ? 16 : 8);
}
#ifndef RSSM_BULK_VERIFY_MIN_BLOCKS
#define RSSM_BULK_VERIFY_MIN_BLOCKS 4
#endif
template <typename T, int TT, int KC, int RB, bool KDA>
__global__ void __launch_bounds__(kBulkMaxWarps * 32, TT == 1 ? BulkDecodeMinCtas(sizeof(T)) : RSSM_BULK_VERIFY_MIN_BLOCKS)
    BulkStepKernel(const __grid_constant__ BulkParams p) {
  constexpr int NV = 2 * TT * RB;  // values per transposed butterfly (<= 32)
  // fp32 decode holds a batch's rows in registers (32 values) and refills early (below)
  constexpr bool kEarlyRefill = TT == 1 && sizeof(T) == 4 && RB * KC <= 32;
  static_assert(NV <= 32, "2 * TT * RB values must fit one butterfly");
  constexpr int SPREAD = 32 / NV;
  constexpr int G = 4;  // records per unit of the record dots (up to 4 units for L = 16)
  extern __shared__ __align__(128) unsigned char smem[];
  const LayerDesc& ly = p.ly;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tid = threadIdx.x, nthr = blockDim.x, nw = p.nw;
  // grid (HV * nchunk, batch): no division when a CTA covers a whole head (nchunk = 1)
  const int hc = blockIdx.x, r = blockIdx.y;
  const int chunk = p.nchunk == 1 ? 0 : hc % p.nchunk;
  const int h = p.nchunk == 1 ? hc : hc / p.nchunk;
  // decode (TT = 1) is one token: a compile-time T, so its pass loops fold away
  const int K = ly.K, V = ly.V, L = ly.L, H = ly.H, T_ = TT == 1 ? 1 : p.num_draft, rpw = p.rpw;
  constexpr bool kda = KDA;
  const int kg = kda ? K : 1;
  const int hq = h / ly.group;
  const int rows = nw * rpw;  // row capacity of the CTA (vs, dd strides)
  const int v0 = chunk * rows;
  const int vend = min(V, v0 + rows);
  const int wv0 = v0 + warp * rpw;  // the warp's first row
  const int wrows = max(0, min(vend - wv0, rpw));
  const int nb = wrows / RB;
  const int64_t tok0 = int64_t{r} * T_;
  const int c0 = lane * KC;
  const bool has_c = c0 < K;
  const bool has_c_all = K >= 32 * KC;  // every lane holds channels (warp-uniform)
  const int row_l = lane % RB;
  const int nrow = vend - v0;  // the CTA's rows
  if (tid == 0) {
    RSSM_TRACE(1, GlobalTimer());
    RSSM_TRACE(3, clock64());
  }
  // ---- 1. the loads that need nothing: the row's metadata, the tokens, the gates -----------
  // One round trip: nothing reads the slot, cursor or forced fold until the tokens are stored.
  // (A use before the token loads — a branch on the cursor, a pointer computed from the slot —
  // stalls the warp for the metadata's round trip before it issues them; v7p.) Verify and
  // 16-bit decode hold to it; fp32 decode does not, by choice: see issue_records (v7q).
  const int slot_i = p.slot_idx[r];
  const int wraw = p.mode != kModeBaseline ? p.write_pos[r] : 0;
  const int ffold = p.mode == kModeReplay && p.force_fold != nullptr ? p.force_fold[r] : 0;
  uint64_t* const wbar = reinterpret_cast<uint64_t*>(smem) + warp * kBulkMaxStages;
  uint64_t* const rbar = reinterpret_cast<uint64_t*>(smem) + kBulkMaxWarps * kBulkMaxStages;
  const int dst = p.dstride;  // ring d row stride in shared memory (rows + 16 bytes, or V)
  const int ns = p.ns, nst = min(ns, nb);  // stages, stages in use
  T* const s0s = reinterpret_cast<T*>(smem + p.o_s0) + int64_t{warp} * ns * RB * K;  // [ns][RB][K]
  T* const dsc = reinterpret_cast<T*>(smem + p.o_d);  // [j][dst]: the CTA's rows of record j
  T* const ds = dsc + warp * rpw;                      // the warp's columns
  T* const krs = reinterpret_cast<T*>(smem + p.o_kr);                            // [L][K]
  float* const gs = reinterpret_cast<float*>(smem + p.o_g);                      // [L][kg]
  const bool bs0 = p.bulk_s0 != 0;
  // The metadata's meaning (the tokens' loads are issued before any of these is called).
  auto row_pad = [&](int si) { return si < 0 || si >= ly.num_slots; };  // padding row
  auto ring_len = [&](int wp) {  // records the ring holds for this step (w)
    if (p.mode == kModeBaseline) return 0;
    const int c = min(max(wp, 0), L);
    return p.mode == kModeVerify ? max(min(c, L - T_), 0) : c;  // verify: w + T <= L
  };
  // The head's ring records in slot sl: d [L][V], k [L][K] (its qk-head's), g [L][kg].
  auto ring_d_at = [&](int64_t sl) {
    return static_cast<T*>(ly.ring_d) + sl * ly.d_stride + int64_t{h} * L * V;
  };
  auto ring_k_at = [&](int64_t sl) {
    return static_cast<T*>(ly.ring_k) + sl * ly.k_stride + int64_t{hq} * L * K;
  };
  auto ring_g_at = [&](int64_t sl) { return ly.ring_g + sl * ly.g_stride + int64_t{h} * L * kg; };
  // Warp 0's lane 0: the records' k, g and d (one copy when d_dense, else one per record) on
  // the records' mbarrier. They gate the record dots, which gate every row: decode issues them
  // as soon as the slot is in, between the token loads and their stores, so that the records'
  // round trip overlaps the tokens' (v7p); verify after its tokens are stored (issued in the
  // token loop, its four drafts' values spilled 48 bytes at 128 registers).
  auto issue_records = [&]() {
    // Left alone, the compiler hoists the records' address arithmetic out of decode's token
    // loop, ahead of the token loads, so every warp waits for the slot and cursor before issuing
    // them (bench/tools/cuda_prologue.sh). Passing both through an empty asm keeps the order:
    // 16-bit state -0.5..-2.5% (B = 16 -2..-3%), but fp32 replay +2.5% at B = 1 and +3.5% at
    // B = 16, KDA +0.5% at B >= 64 — so 16-bit state only (v7q, same-call A/B).
    int si = slot_i, wp = wraw;
    if constexpr (sizeof(T) == 2) asm volatile("" : "+r"(si), "+r"(wp));
    const int wr = ring_len(wp);
    if (row_pad(si) || wr == 0 || !(p.bulk_k || p.bulk_g || p.bulk_d)) return;
    const int64_t sl = si;
    const uint32_t kb = p.bulk_k ? static_cast<uint32_t>(wr * K * sizeof(T)) : 0u;
    // GDN's g row is copied in 16-byte units (the launcher allows it only when L % 4 == 0).
    const int gn = kda ? wr * K : (wr + 3) & ~3;
    const uint32_t gb = p.bulk_g ? static_cast<uint32_t>(gn * 4) : 0u;
    const uint32_t db = p.bulk_d ? static_cast<uint32_t>(wr * nrow * sizeof(T)) : 0u;
    const T* const rd_ = ring_d_at(sl);
    MbarInit(rbar, 1);
    MbarFenceInit();
    MbarExpectTx(rbar, kb + gb + db);
    if (kb) BulkLoad(krs, ring_k_at(sl), kb, rbar);
    if (gb) BulkLoad(gs, ring_g_at(sl), gb, rbar);
    if (db && p.d_dense) {
      BulkLoad(dsc, rd_, db, rbar);
    } else if (db) {  // record j's d for the CTA's rows: one copy per record
      for (int j = 0; j < wr; ++j) {
        BulkLoad(dsc + j * dst, rd_ + int64_t{j} * V + v0, static_cast<uint32_t>(nrow * sizeof(T)),
                 rbar);
      }
    }
  };

  float* const tq = reinterpret_cast<float*>(smem + p.o_tq);                     // [T][K]
  float* const tk = reinterpret_cast<float*>(smem + p.o_tk);
  float* const tg = reinterpret_cast<float*>(smem + p.o_tg);                     // [T][kg]
  float* const vsm = reinterpret_cast<float*>(smem + p.o_vs);                    // [T][rows]
  float* const betas = reinterpret_cast<float*>(smem + p.o_sc);                  // [T]
  float* const kqs = betas + T_;                                                 // [T]
  {
    // The activation dtype resolved once (not per element): A is float, bf16 or half. Every
    // load of a group of TT tokens is issued before any shared-memory store: a store may alias
    // a generic pointer, so a load after it cannot be hoisted above it, and each group would
    // cost one global round trip per token (v7j).
    auto tokens = [&](auto tag) {
      using A = decltype(tag);
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
                if constexpr (KDA) gv[u] = ToF(ga[(tok0 + t0 + u) * ly.a_stride + int64_t{h} * K + i]);
              }
              if (i < nrow) vv[u] = ToF(qr[vofs + i]);
            }
          }
          decay = -expf(alog);
          if (TT == 1 && tid == 0 && i == 0) issue_records();
#pragma unroll
          for (int u = 0; u < TT; ++u) {
            const int t = t0 + u;
            if (t < T_) {
              if (i < K) {
                tq[t * K + i] = qv[u];
                tk[t * K + i] = kv[u];
                if constexpr (KDA) tg[t * K + i] = decay * Softplus(gv[u] + db);
              }
              if (i < nrow) vsm[t * rows + i] = vv[u];
            }
          }
        }
      }
      decay = -expf(alog);
      if (tid < T_) {
        if (!kda) tg[tid] = decay * Softplus(ToF(a_t) + dtb_h);
        betas[tid] = Sigmoid(ToF(b_t));
      }
      for (int t = tid + nthr; t < T_; t += nthr) {  // more tokens than threads (not in practice)
        const int64_t n = tok0 + t;
        if (!kda) tg[t] = decay * Softplus(ToF(ga[n * ly.a_stride + h]) + ly.dt_bias[h]);
        betas[t] = Sigmoid(ToF(gb[n * ly.b_stride + h]));
      }
    };
    if (ly.act_dtype == kActBf16) {
      tokens(__nv_bfloat16{});
    } else if (ly.act_dtype == kActF32) {
      tokens(float{});
    } else {
      tokens(__half{});
    }
  }
  if (tid == 0) RSSM_TRACE(4, clock64());

  // ---- the metadata's uses (the tokens are stored) ---------------------------------------
  const bool pad = row_pad(slot_i);  // (CTA-uniform)
  const int64_t slot = pad ? 0 : slot_i;
  const int w = ring_len(wraw);  // verify: w + T <= L keeps every append inside the ring
  const bool fold =
      p.mode == kModeBaseline || (p.mode == kModeReplay && (w + 1 >= L || ffold != 0));
  T* const s0 = static_cast<T*>(ly.ckpt) + slot * ly.ckpt_stride + int64_t{h} * V * K;
  T* const rd = ring_d_at(slot);
  T* const rk = ring_k_at(slot);
  float* const rg = ring_g_at(slot);
  const bool bd = p.bulk_d != 0 && w > 0;
  const bool bk = p.bulk_k != 0 && w > 0, bg = p.bulk_g != 0 && w > 0;
  if (tid == 0) RSSM_TRACE(0, SmId() | (unsigned(w) << 8) | (unsigned(fold) << 16));

  // ---- 2. every byte of the CTA's state in flight (one more round trip), issued once the tokens
  // are stored. Lane 0 initializes, arms and uses its warp's mbarriers itself (no warp
  // sync needed); in verify warp 0's lane 0 first issues the records (decode did during the
  // tokens), then each lane 0 its warp's first S0 batches (v7o: records first, fp32 GDN replay
  // -0.5..-3%).
  // Tried and not kept: issuing before the token loads, with the tokens prefetched into L2
  // (v7m: the tokens waited for the slot's round trip, 2-8% slower); the S0 batches too issued
  // as soon as the slot is in, between the token loads and their stores (v7o: the tokens' round
  // trip grew from 2.2 to 3.7 us behind the state's bytes, replay +2-4%; the records alone
  // there, v7p, are ~8 KB where the S0 batches are 32 KB).
  if (!pad && lane == 0) {
    if (bs0) {
      for (int b = 0; b < nst; ++b) MbarInit(wbar + b, 1);
    }
    MbarFenceInit();
    if (TT > 1 && warp == 0) issue_records();  // verify: after the tokens (earlier, it spilled)
    const uint32_t bb = static_cast<uint32_t>(RB * K * sizeof(T));
    if (bs0) {  // the first nst batches; batch b + ns refills stage b % ns once b is done
      for (int b = 0; b < nst; ++b) {
        MbarExpectTx(wbar + b, bb);
        BulkLoadStream(s0s + int64_t{b} * RB * K, s0 + int64_t(wv0 + b * RB) * K, bb, wbar + b);
      }
    }
  }

  if (pad) {  // padding row: zero outputs (nothing was issued)
    for (int t = 0; t < T_; ++t) {
      for (int v = v0 + tid; v < vend; v += nthr) {
        StoreAct(ly.o, (tok0 + t) * ly.o_stride + int64_t{h} * V + v, ly.act_dtype, 0.f);
      }
    }
    return;
  }
  float* const kws = reinterpret_cast<float*>(smem + p.o_kw);                    // [L][K]
  float* const kas = reinterpret_cast<float*>(smem + p.o_ka);                    // [T][K]
  float* const qas = reinterpret_cast<float*>(smem + p.o_qa);
  float* const avs = reinterpret_cast<float*>(smem + p.o_av);                    // [K]
  float* const kns = reinterpret_cast<float*>(smem + p.o_kn);                    // [K]
  float* const us = reinterpret_cast<float*>(smem + p.o_u);                      // [T][L]
  float* const ps = reinterpret_cast<float*>(smem + p.o_p);
  float* const dds = reinterpret_cast<float*>(smem + p.o_dd);                    // [T][rows]

  // Plain copies where the bulk engine cannot go (unaligned slots, odd GDN ring lengths).
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
  __syncthreads();
  if (tid == 0) RSSM_TRACE(5, clock64());

  // ---- 3/4. norms and k·q, ring appends, record dots ------------------------------------------
  // Draft t's q, k normalized (q scaled) in registers (the lane's channels); returns k·q.
  auto norm_draft = [&](int t, float (&q)[KC], float (&kk)[KC]) {
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      q[e] = has_c ? tq[t * K + c0 + e] : 0.f;
      kk[e] = has_c ? tk[t * K + c0 + e] : 0.f;
    }
    if (ly.l2norm) {
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int e = 0; e < KC; ++e) sq += q[e] * q[e], sk += kk[e] * kk[e];
      sq = WarpSum(sq);
      sk = WarpSum(sk);
      const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
#pragma unroll
      for (int e = 0; e < KC; ++e) q[e] *= iq, kk[e] *= ik;
    }
    float dkq = 0.f;
#pragma unroll
    for (int e = 0; e < KC; ++e) {
      q[e] *= ly.scale;
      dkq += kk[e] * q[e];
    }
    return WarpSum(dkq);
  };
  // Appends draft t's k (once per qk-head group) and g to the ring (a decode that does not
  // fold, and verify).
  auto append = [&](int t, const float (&kk)[KC]) {
    const int P = w + t;
    if (fold || chunk != 0 || P >= L) return;
    if (has_c) {
      if (h % ly.group == 0) {
        T* kd = rk + int64_t{P} * K + c0;
#pragma unroll
        for (int e = 0; e < KC; ++e) kd[e] = FromF<T>(kk[e]);
      }
      if constexpr (KDA) {
#pragma unroll
        for (int e = 0; e < KC; ++e) rg[int64_t{P} * K + c0 + e] = tg[t * K + c0 + e];
      }
    }
    if (!KDA && lane == 0) rg[P] = tg[t];
  };
  // Record i's gate: the ring's (i < w) or the draft's (verify: i = w + t).
  auto gate = [&](int i, int e) {
    if constexpr (KDA) return i < w ? gs[i * K + c0 + e] : tg[(i - w) * K + c0 + e];
    return i < w ? gs[i] : tg[i - w];
  };
  const bool keep_kw = fold && TT == 1;  // a folding decode keeps W_j∘k_j for the fold
  // Unit bi of draft t: records P-1-bi*G down to P-bi*G-G; the weights from the top record
  // down (the CPU order): acc = g_P + Σ_{i>j} g_i; the unit that reaches record 0 writes A∘k,
  // A∘q (and A for the fold).
  auto unit = [&](int t, int bi, const float (&q)[KC], const float (&kk)[KC]) {
    const int P = w + t;
    const int jtop = P - 1 - bi * G;
    float acc[KC];
#pragma unroll
    for (int e = 0; e < KC; ++e) acc[e] = KDA ? (has_c ? tg[t * K + c0 + e] : 0.f) : tg[t];
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
            const float wj = KDA ? 0.f : expf(acc[0]);  // GDN: one weight per record
            Slice<T, KC> kr;
            LoadSmemSlice(kr, krs + j * K + c0);
            Slice<float, KC> kw;
#pragma unroll
            for (int e = 0; e < KC; ++e) {
              const float x = (KDA ? expf(acc[e]) : wj) * kr.Get(e);
              su += x * kk[e];
              sp += x * q[e];
              kw.Set(e, x);
              acc[e] += KDA ? gate(j, e) : gj;
            }
            if (keep_kw) StoreSmemSlice(kws + j * K + c0, kw);
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
  };
  if constexpr (TT == 1) {
    // Decode: every warp normalizes the token itself (no barrier between the norms and the
    // dots); warp 0 keeps k·q, the normalized k (fold) and appends.
    float q[KC], kk[KC];
    const float kq = norm_draft(0, q, kk);
    if (warp == 0) {
      if (lane == 0) kqs[0] = kq;
      if (has_c) {
#pragma unroll
        for (int e = 0; e < KC; ++e) kns[c0 + e] = kk[e];
      }
      append(0, kk);
    }
    if (bk || bg || bd) MbarWait(rbar, 0);
    if (tid == 0) RSSM_TRACE(6, clock64());
    const int nblk = max(1, (w + G - 1) / G);
    for (int bi = warp; bi < nblk; bi += nw) unit(0, bi, q, kk);
  } else {
    // Verify: a warp per draft (norms, the draft's k as stored for the later drafts, appends),
    // then the units of every draft spread over the warps.
    for (int t = warp; t < T_; t += nw) {
      float q[KC], kk[KC];
      const float kq = norm_draft(t, q, kk);
      if (lane == 0) kqs[t] = kq;
      const int P = w + t;
      if (has_c) {
#pragma unroll
        for (int e = 0; e < KC; ++e) tq[t * K + c0 + e] = q[e], tk[t * K + c0 + e] = kk[e];
        if (P < L) {
#pragma unroll
          for (int e = 0; e < KC; ++e) krs[P * K + c0 + e] = FromF<T>(kk[e]);
        }
      }
      append(t, kk);
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
        unit(t, bi, q, kk);
      }
    }
  }
  __syncthreads();
  if (tid == 0) RSSM_TRACE(7, clock64());

  // ---- 5. the warp's rows, RB at a time (no CTA barrier from here on) ------------------------
  if (nb == 0) return;
  float ka[TT][KC], qa[TT][KC], ur[TT], pr[TT], kn0[KC], av[KC];
  auto load_pass = [&](int pass0) {
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
  };
#pragma unroll
  for (int e = 0; e < KC; ++e) {
    kn0[e] = fold && has_c ? kns[c0 + e] : 0.f;
    av[e] = fold && has_c ? avs[c0 + e] : 0.f;
  }
  const bool one_pass = T_ <= TT;
  if (one_pass) load_pass(0);
  const bool vec_s0 = p.vec_s0 != 0;

  // Verify in one pass (T <= TT, the usual T = 4): the drafts' chain coefficients, betas and
  // k·q in registers; lane i < RB finishes row i of a batch for every draft.
  constexpr bool kVerify = TT > 1;
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
  const float* const vrow = vsm + (wv0 - v0) + row_l;            // + t * rows + rb0
  const int64_t orow = tok0 * ly.o_stride + int64_t{h} * V + wv0 + row_l;  // + t * o_stride + rb0
  T* const drow = rd + int64_t{w} * V + wv0 + row_l;             // + t * V + rb0

  int si = 0;            // the batch's stage (b % ns without a division)
  uint32_t sphase = 0u;  // ... and its mbarrier phase ((b / ns) & 1)
  #pragma unroll 1
  for (int b = 0; b < nb; ++b) {
    const int rb0 = b * RB;  // the batch's first row within the warp
    T* const stage = s0s + si * RB * K;
    if (bs0) {
      MbarWait(wbar + si, sphase);
      if (tid == 0 && b < 4) RSSM_TRACE(8 + b, clock64());
    } else {  // plain copy of the batch (unaligned slots)
      __syncwarp();
      for (int i = lane; i < RB * K; i += 32) stage[i] = s0[int64_t(wv0 + rb0) * K + i];
      __syncwarp();
    }
    const T* const st = stage + c0;
    // Refills the stage with batch b + ns once every lane's reads of it are done: in an fp32
    // decode that does not fold, right after the contraction's loads (the rows are then in
    // registers and nothing reads the stage again; v7o: KDA fp32 replay -3..-5%, GDN -0..-1%),
    // else at the batch's end. Not for verify (its rows held in registers spilled at 128
    // registers and cost it 30%) nor 16-bit state (at 96 registers its baseline lost 1.5%).
    auto refill = [&]() {
      if (bs0 && b + ns < nb) {
        __syncwarp();  // every lane's reads of the stage are done
        if (lane == 0) {
          FenceProxyAsync();  // ... and ordered before the bulk engine's writes
          const uint32_t bb = static_cast<uint32_t>(RB * K * sizeof(T));
          MbarExpectTx(wbar + si, bb);
          BulkLoadStream(stage, s0 + int64_t(wv0 + rb0 + ns * RB) * K, bb, wbar + si);
        }
      }
    };
    const bool early_refill = kEarlyRefill && !fold && has_c_all;
    float dcur = 0.f;
    #pragma unroll 1
    for (int pass0 = 0; pass0 < T_; pass0 += TT) {
      const int nt = min(TT, T_ - pass0);
      if (!one_pass) load_pass(pass0);
      float acc[NV];
#pragma unroll
      for (int i = 0; i < NV; ++i) acc[i] = 0.f;
      if (has_c) {
        // fp32 decode: the batch's rows all read before any use, so that the stage may be
        // refilled before the arithmetic.
        Slice<T, KC> xs[kEarlyRefill ? RB : 1];
        if constexpr (kEarlyRefill) {
#pragma unroll
          for (int i = 0; i < RB; ++i) LoadSmemSlice(xs[i], st + i * K);
          if (early_refill) refill();  // the stage is free once every lane has its rows
        }
#pragma unroll
        for (int i = 0; i < RB; ++i) {
          if constexpr (!kEarlyRefill) LoadSmemSlice(xs[0], st + i * K);
          const Slice<T, KC>& x = xs[kEarlyRefill ? i : 0];
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
      if (lane < w) {  // ring terms of record j = lane
        Slice<T, RB> dl;
        LoadSmemSlice(dl, ds + lane * dst + rb0);
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
        Slice<T, RB> d2;
        LoadSmemSlice(d2, ds + j * dst + rb0);
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
            float dr_prev[TT];  // the drafts' d as stored (rounded to T)
#pragma unroll
            for (int t = 0; t < TT; ++t) {
              dr_prev[t] = 0.f;
              if (t < T_) {
                float sk = skv[t], sq = sqv[t];
#pragma unroll
                for (int t2 = 0; t2 < t; ++t2) sk += dr_prev[t2] * cu[t][t2], sq += dr_prev[t2] * cp[t][t2];
                const float d = bt[t] * (vrow[t * rows + rb0] - sk);
                const T dr = FromF<T>(d);
                dr_prev[t] = ToF(dr);
                StoreAct(ly.o, orow + t * ly.o_stride + rb0, ly.act_dtype, sq + d * kqv[t]);
                drow[int64_t{t} * V + rb0] = dr;
              }
            }
          }
          continue;  // the only pass
        }
      }
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
          const T dr = FromF<T>(d);
          dd[t] = ToF(dr);
          dcur = d;
          const float o = sq + d * kqs[tg_];
          if (lane < RB) {
            const int v = wv0 + rb0 + row_l;
            StoreAct(ly.o, (tok0 + tg_) * ly.o_stride + int64_t{h} * V + v, ly.act_dtype, o);
            if (!fold) rd[int64_t{P} * V + v] = dr;
            if (!one_pass) dds[tg_ * rows + (v - v0)] = dd[t];
          }
        }
      }
      if (!one_pass) __syncwarp();  // the next pass reads this pass's dds
    }
    if constexpr (TT == 1) {  // decode only: the new checkpoint of the batch rows
      if (fold) {
        // FR rows at a time with their KC channels in registers: record j's W_j∘k_j and d_j of
        // the FR rows are read once for all of them (v7m; one row at a time read both per
        // (row, record) and left each lane 4 dependent accumulators: a folding CTA lived 2.4x
        // as long as the others). The order per element is unchanged: S0·A, the records in
        // order, then the new d.
        constexpr int FA = BulkFoldAccs(sizeof(T), KC);
        constexpr int FR = RB * KC <= FA ? RB : FA / KC;
        static_assert(RB % FR == 0, "fold row groups");
#pragma unroll 1
        for (int i0 = 0; i0 < RB; i0 += FR) {
          float out[FR][KC];
          if (has_c) {
#pragma unroll
            for (int i = 0; i < FR; ++i) {
              Slice<T, KC> x;
              LoadSmemSlice(x, st + (i0 + i) * K);
#pragma unroll
              for (int e = 0; e < KC; ++e) out[i][e] = x.Get(e) * av[e];
            }
#pragma unroll 2
            for (int j = 0; j < w; ++j) {
              Slice<T, FR> dj;
              LoadSmemSlice(dj, ds + j * dst + rb0 + i0);
              Slice<float, KC> kw;
              LoadSmemSlice(kw, kws + j * K + c0);
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
            const float di = __shfl_sync(0xffffffffu, dcur, i0 + i);  // unrounded d of the row
            if (!has_c) continue;
            Slice<T, KC> x;
#pragma unroll
            for (int e = 0; e < KC; ++e) x.Set(e, out[i][e] + di * kn0[e]);
            StoreSlice(s0 + int64_t(wv0 + rb0 + i0 + i) * K + c0, x, vec_s0);
          }
        }
      }
    }
    if (!early_refill) refill();
    if (++si == ns) si = 0, sphase ^= 1u;
  }
  if (lane == 0) RSSM_TRACE(12 + warp, clock64());
  if (tid == 0) RSSM_TRACE(2, GlobalTimer());
}

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_BULK_KERNEL_CUH_
