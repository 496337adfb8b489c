// Shared-memory layouts and CTA-shape constants of the step and prefill kernels: plain C++
// (no CUDA headers), so that the launch planner (plan.h) is built and tested without a GPU
// toolchain while the kernels read the very same definitions.
#ifndef REPLAYSSM_KERNELS_CUDA_LAYOUT_H_
#define REPLAYSSM_KERNELS_CUDA_LAYOUT_H_

#include <stdint.h>

#ifdef __CUDACC__
#define RSSM_HOST_DEVICE __host__ __device__
#else
#define RSSM_HOST_DEVICE
#endif

namespace replayssm::kernels::cuda {

// What a step computes (StepParams::mode, BulkParams::mode).
enum StepMode : int32_t { kModeReplay = 0, kModeBaseline = 1, kModeVerify = 2 };

// ---- the tiled kernels (tiled_step_kernel.cuh, prefill_kernel.cuh) -----------------------
// Threads per CTA: 256 rather than 128, so the per-CTA chain (token, records, weights, record
// dots) is paid once per twice the state rows.
constexpr int kTiledThreads = 256;

// State rows of one CTA's register tile: 16-byte chunks of a KMAX-channel row spread over up
// to 32 lanes, at least 8 chunks per thread in flight (TileCfg in common.cuh).
RSSM_HOST_DEVICE constexpr int TiledTileRows(int state_bytes, int kmax) {
  const int chunks = kmax / (16 / state_bytes);  // per row
  const int lanes = chunks < 32 ? chunks : 32;   // per row
  const int per_lane = chunks / lanes;
  const int rows_per_thread = per_lane >= 8 ? 1 : 8 / per_lane;
  return rows_per_thread * (kTiledThreads / 32) * (32 / lanes);
}

// Offsets (in floats, each a multiple of 4) of the shared-memory arrays of one tiled CTA.
struct SmemLayout {
  int kext;            // [(L+1), K]  records' k as stored, then the chunk's drafts' k (rounded)
  int gext;            // [(L+1), Kg] records' g, then the drafts' g (Kg = K for KDA, 1 for GDN)
  int kw;              // [L, K]      W_j ∘ k_j for the current token
  int dext;            // [(L+1), VT] records' d for the tile rows, then the drafts' d (rounded)
  int qs, ks, ka, qa;  // [TC, K] q, k (normalized, q scaled); A∘k, A∘q
  int avec;            // [K]         A of the last token (fold)
  int vs;              // [TC, VT]    v of the tile rows
  int u, pp;           // [TC, L+1]   (W_j∘k_j)·k, (W_j∘k_j)·q
  int skq;             // [TC, VT, 2] S0 contractions
  int dcur;            // [VT]        d of the last token, rounded to the ring dtype (fold)
  int beta, kq, norm;  // [TC], [TC], [TC, 2]
  int total;           // floats
  static SmemLayout Make(int K, int L, int VT, int TC, bool kda) {
    SmemLayout s;
    int o = 0;
    auto take = [&o](int n) {
      const int at = o;
      o += (n + 3) & ~3;
      return at;
    };
    s.kext = take((L + 1) * K);
    s.gext = take((L + 1) * (kda ? K : 1));
    s.kw = take(L * K);
    s.dext = take((L + 1) * VT);
    s.qs = take(TC * K);
    s.ks = take(TC * K);
    s.ka = take(TC * K);
    s.qa = take(TC * K);
    s.avec = take(K);
    s.vs = take(TC * VT);
    s.u = take(TC * (L + 1));
    s.pp = take(TC * (L + 1));
    s.skq = take(TC * VT * 2);
    s.dcur = take(VT);
    s.beta = take(TC);
    s.kq = take(TC);
    s.norm = take(2 * TC);
    s.total = o;
    return s;
  }
};

// ---- the baseline kernel (baseline_kernel.cuh) -----------------------------------------------
// The planned CTA (issue 20; the figures in bench/results/kernels.md): one warp of 8 state rows
// at K <= 128 (4 channels per lane; half the rows at K > 128, whose lanes hold 8) — one-warp
// CTAs measured faster than two- or four-warp ones of the same rows at B >= 64; 16 rows once the
// batch has kBaselineWideHeadsPerSm v-heads per SM: twice the bytes in flight per token
// prologue, at 168 registers (faster at the largest batches only).
constexpr int kBaselineWarps = 1;
constexpr int kBaselineRowsPerWarp = 8;
constexpr int kBaselineRowsPerWarpWide = 16;
constexpr int kBaselineWideHeadsPerSm = 32;
// How the baseline kernel loads and stores the state (BaselineConfig::cache): plain, no hint
// (faster than .cs at B >= 64; kCacheKeepStores was faster still in the peer method, but leaves
// dead state lines in L2 at high priority for the kernels after it).
enum BaselineCache : int32_t {
  kCacheStream = 1,      // ld.global.cs, st.global.cs (evict-first)
  kCacheNoL1 = 2,        // ld.global.nc.L1::no_allocate, st.global.cs
  kCacheStreamLoad = 3,  // ld.global.cs, plain store
  kCachePlain = 4,       // plain load and store
  kCacheKeepStores = 5,  // ld.global.cs, st.global with an L2::evict_last policy
};
constexpr int kBaselineCache = kCachePlain;

// ---- the bulk step kernel (bulk_step_kernel.cuh) --------------------------------------------
constexpr int kBulkMaxWarps = 4;
constexpr int kBulkMaxStages = 8;  // S0 stages per warp (an mbarrier each)
constexpr int kBulkBars = kBulkMaxWarps * kBulkMaxStages + 1;  // + the records' mbarrier
// Decode keeps at least this many CTAs per SM, giving up S0 stages first: the prologue's
// round trips are hidden by other CTAs, not by deeper stages.
constexpr int kBulkMinCtas = 4;

// Ring d rows of a CTA in shared memory: its rows + 16 bytes, so that lanes reading their
// record's row (16-byte loads, lane j at record j) hit distinct banks. In ring elements.
RSSM_HOST_DEVICE constexpr int DStride(int rows, int ring_bytes) { return rows + 16 / ring_bytes; }

// The layout of one bulk CTA's shared memory (byte offsets, multiples of 16; the mbarriers
// sit at 0). T drafts, TT per pass; S0 stages in the state's element size, the records' d and k
// in the ring's.
struct BulkSmem {
  int32_t s0, d, kr, kw, g, tq, tk, tg, ka, qa, av, kn, vs, u, p, sc, dd, total;
  static BulkSmem Make(int K, int L, int lr, bool kda, int T, int TT, int nw, int rpw, int ns,
                       int rb, int state_bytes, int ring_bytes, bool fold_capable) {
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
    s.d = take(int64_t{lr} * DStride(rows, ring_bytes) * ring_bytes);
    s.kr = take(int64_t{lr} * K * ring_bytes);
    // W_j∘k_j of a folding decode: in place over the fp32 records, else its own array.
    s.kw = fold_capable ? (ring_bytes == 4 ? s.kr : take(int64_t{lr} * K * 4)) : s.kr;
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

// ---- the small-batch replay kernel (small_replay_kernel.cuh) --------------------------------
// The planned rows per warp (the baseline kernel's; 16 rows measured slower at B = 1 in one-warp
// CTAs, and no faster in the 4-warp ones), and the batch up to which replay decode takes the
// kernel, per gate: GDN while B * HV <= 128, KDA while B * HV <= 64 — where it measured faster
// than the bulk kernel (bench/results/kernels.md; KDA's per-channel gates' chain is repeated by
// each of a head's CTAs, which costs more from B = 4 at HV = 32).
constexpr int kSmallReplayRowsPerWarp = 8;
constexpr int kSmallReplayMaxRowHeadsGdn = 128;
constexpr int kSmallReplayMaxRowHeadsKda = 64;
constexpr int SmallReplayMaxRowHeads(bool kda) {
  return kda ? kSmallReplayMaxRowHeadsKda : kSmallReplayMaxRowHeadsGdn;
}
// Warps per small-replay CTA, which share its record dots (each those of every 4th record; a
// last CTA's warps past the head's rows do only those), and the records per block of its chain
// (the k and g copies are padded to whole blocks).
constexpr int kSmallReplayWarps = 4;
constexpr int kSmallReplayRecordBlock = 16;

// The layout of one small-replay CTA's shared memory (byte offsets, multiples of 16): the ring
// records it reads (k, g, the d of its `rows` rows), W_j∘k_j of a folding row (in place over an
// fp32 ring's k), the record dots u, p.
struct SmallReplaySmem {
  int32_t k, g, d, kw, u, p, total;
  static SmallReplaySmem Make(int K, int L, bool kda, int rows, int ring_bytes) {
    SmallReplaySmem s;
    int o = 0;
    auto take = [&o](int64_t bytes) {
      o = (o + 15) & ~15;
      const int at = o;
      o += static_cast<int>(bytes);
      return at;
    };
    const int64_t lb = (L + kSmallReplayRecordBlock - 1) / kSmallReplayRecordBlock *
                       kSmallReplayRecordBlock;  // whole blocks: the chain reads past L
    s.k = take(lb * K * ring_bytes);
    s.kw = ring_bytes == 4 ? s.k : take(int64_t{L} * K * 4);
    s.g = take(lb * (kda ? K : 1) * 4);
    s.d = take(int64_t{L} * rows * ring_bytes);
    s.u = take(int64_t{L} * 4);
    s.p = take(int64_t{L} * 4);
    s.total = (o + 15) & ~15;
    return s;
  }
};

// ---- the stream replay kernel (stream_replay_kernel.cuh) ------------------------------------
// Persistent CTAs of kStreamConsumerWarps consumer warps and one producer warp; an item is one
// (row, v-head). S0 streams through a ring of `stages` stages of kStreamStageRows rows each.
constexpr int kStreamConsumerWarps = 4;
constexpr int kStreamThreads = (kStreamConsumerWarps + 1) * 32;
constexpr int kStreamStageRows = 8;   // rows per S0 stage (the bulk kernel's decode batch)
constexpr int kStreamMaxStages = 32;  // an mbarrier pair each
// CTAs per SM: the most, up to kStreamMaxCtasPerSm, whose share of the SM's shared memory
// still holds kStreamPlannedStages stages. Each CTA adds an item in flight, and the consumers'
// chain per item, not the bytes in flight, bounds the kernel; but 4 stages a CTA (KDA at 3
// CTAs) starve it (bench/results/kernels.md). A forced shape runs with kStreamMinStages.
constexpr int kStreamMaxCtasPerSm = 3;
constexpr int kStreamPlannedStages = 8;
constexpr int kStreamMinStages = 4;
constexpr int kStreamHeaders = 2;  // items whose records are in shared memory at once
// Replay decode takes the stream kernel from this many (row, v-head) items, per gate: GDN from
// B * HV = 512, where it measured faster than the bulk kernel; KDA never (its records leave 3
// CTAs per SM 4 stages each, and at 2 it did not beat the bulk kernel; bench/results/kernels.md).
constexpr int64_t kStreamMinRowHeadsGdn = 512;
constexpr int64_t kStreamMinRowHeadsKda = INT64_MAX;
RSSM_HOST_DEVICE constexpr int64_t StreamMinRowHeads(bool kda) {
  return kda ? kStreamMinRowHeadsKda : kStreamMinRowHeadsGdn;
}

// One stream CTA's shared memory (byte offsets, multiples of 16). At 0 the mbarriers: stage
// full[kStreamMaxStages], stage empty[kStreamMaxStages], header full[2], header empty[2]. Then
// `stages` S0 stages [RB][K] (fp32); two item headers (hdr_bytes apart) of the ring records
// (d rows padded to dst, k, g, W_j∘k_j for a 16-bit ring, the item's metadata); two scratch
// sets (sc_bytes apart) of the record dots' results.
struct StreamSmem {
  int32_t s0, hdr, hdr_bytes, h_d, h_k, h_g, h_kw, h_meta;
  int32_t sc, sc_bytes, s_u, s_p, s_ka, s_qa, s_av, s_kn;
  int32_t fixed;  // bytes before the stages and after them (everything but the stages)
  int32_t total;
  static StreamSmem Make(int K, int L, bool kda, int dst, int stages, int ring_bytes) {
    StreamSmem s;
    auto r16 = [](int64_t x) { return static_cast<int32_t>((x + 15) & ~int64_t{15}); };
    const int bars = r16(int64_t{2 * kStreamMaxStages + 2 * kStreamHeaders} * 8);
    const int stage_bytes = kStreamStageRows * K * 4;
    int o = 0;
    auto take = [&o, &r16](int64_t bytes) {
      const int at = o;
      o = r16(o + bytes);
      return at;
    };
    s.h_d = take(int64_t{L} * dst * ring_bytes);
    s.h_k = take(int64_t{L} * K * ring_bytes);
    s.h_g = take(kda ? int64_t{L} * K * 4 : int64_t{(L + 3) & ~3} * 4);
    s.h_kw = ring_bytes == 4 ? s.h_k : take(int64_t{L} * K * 4);
    s.h_meta = take(16);
    s.hdr_bytes = o;
    o = 0;
    s.s_u = take(int64_t{L} * 4);
    s.s_p = take(int64_t{L} * 4);
    s.s_ka = take(int64_t{K} * 4);
    s.s_qa = take(int64_t{K} * 4);
    s.s_av = take(int64_t{K} * 4);
    s.s_kn = take(int64_t{K} * 4);
    s.sc_bytes = o;
    s.s0 = bars;
    s.hdr = bars + stages * stage_bytes;
    s.sc = s.hdr + kStreamHeaders * s.hdr_bytes;
    s.total = s.sc + kStreamHeaders * s.sc_bytes;
    s.fixed = s.total - stages * stage_bytes;
    return s;
  }
};

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_LAYOUT_H_
