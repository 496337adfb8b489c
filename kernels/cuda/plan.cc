// The launch planner (plan.h). The choices below were each measured on the H200 against the
// alternatives; docs/gpu.md ("Design decisions") has the figures.
#include "plan.h"

#include <algorithm>
#include <string>

namespace replayssm::kernels::cuda {
namespace {

constexpr int kVerifyTokensPerPass = 4;
// Verify takes the bulk kernel from this batch: at K <= 128 every batch (faster than the tiled
// kernel at every small batch, gate and dtype); wider heads (8 channels a lane, not measured at
// small batches) from 16 rows, the rule measured before the bulk kernel's later changes.
// The figures behind this file's choices: bench/results/kernels.md and docs/gpu.md.
constexpr int64_t kBulkVerifyMinBatch = 1;
constexpr int64_t kBulkVerifyMinBatchWide = 16;
constexpr int kBulkDefaultStages = 2;  // more stages cost CTAs per SM and measured slower
constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridY = 65535;
constexpr int kReservedSmemPerCta = 1024;  // the system's share of each CTA's shared memory

int CeilDiv(int a, int b) { return (a + b - 1) / b; }
int RoundUp16(int x) { return (x + 15) / 16 * 16; }
bool IsStep(KernelOp op) {
  return op == KernelOp::kReplay || op == KernelOp::kBaseline || op == KernelOp::kVerify;
}

// The tiled kernels: a CTA per (row, v-head, tile of VT rows) on a flat grid.
std::optional<LaunchPlan> PlanTiled(const LaunchProblem& pr, KernelRole role) {
  LaunchPlan plan;
  plan.role = role;
  TiledConfig& c = plan.tiled;
  c.kmax = pr.head_k <= 128 ? 128 : 256;
  c.tokens_per_pass = pr.op == KernelOp::kVerify ? kVerifyTokensPerPass : 1;
  c.tile_rows = TiledTileRows(pr.state_bytes, c.kmax);
  c.num_vtiles = CeilDiv(pr.head_v, c.tile_rows);
  c.smem = SmemLayout::Make(pr.head_k, pr.ring_len, c.tile_rows, c.tokens_per_pass, pr.kda);
  const int64_t ctas = pr.batch * pr.num_v_heads * c.num_vtiles;
  if (ctas <= 0 || ctas > kMaxGridX) return std::nullopt;
  plan.grid_x = static_cast<uint32_t>(ctas);
  plan.threads = kTiledThreads;
  plan.smem_bytes = static_cast<size_t>(c.smem.total) * sizeof(float);
  return plan;
}

// The bulk kernel's CTA shape: warps, rows per warp, S0 stages and its shared-memory layout.
// false when no shape fits the device's shared memory.
bool ShapeBulk(const LaunchProblem& pr, const DeviceLimits& dev, const LaunchOverrides& ov,
               BulkConfig* c) {
  const bool verify = pr.op == KernelOp::kVerify;
  const int V = pr.head_v;
  const int64_t row_heads = pr.batch * pr.num_v_heads;
  c->tokens_per_pass = verify ? kVerifyTokensPerPass : 1;
  c->channels_per_lane = pr.head_k <= 128 ? 4 : 8;
  // Rows per S0 stage: decode 8; verify as many as keep 2 * TT * RB values in one butterfly.
  c->rows_per_batch = !verify ? 8 : c->channels_per_lane == 4 ? 4 : 2;
  c->ring_records = pr.op == KernelOp::kBaseline ? 0 : pr.ring_len;
  int nw = ov.warps != 0 ? ov.warps : kBulkMaxWarps;
  int rpw = ov.rows_per_warp;
  if (rpw == 0) {
    // A whole head per CTA (its prologue paid once) while the grid fills the GPU twice over;
    // else 16 rows per warp, halving the warps (down to 2) while the grid is still short.
    auto per_warp = [&](int n) { return RoundUp16(CeilDiv(V, n)); };
    rpw = row_heads >= 2LL * dev.sms ? per_warp(nw) : 16;
    if (ov.warps == 0 && rpw == 16) {
      auto ctas = [&](int n) { return row_heads * CeilDiv(V, n * 16); };
      while (nw > 2 && ctas(nw) < 2LL * dev.sms) nw /= 2;
    }
  }
  rpw = std::min(rpw, RoundUp16(V));
  const int rb = c->rows_per_batch;
  int ns = std::min(ov.stages != 0 ? ov.stages : kBulkDefaultStages, CeilDiv(rpw, rb));
  // Stages give way to CTAs per SM in decode (unless forced); then warps give way until the
  // layout fits at all.
  const bool stages_free = ov.stages == 0;
  for (;;) {
    c->smem =
        BulkSmem::Make(pr.head_k, pr.ring_len, c->ring_records, pr.kda, pr.num_draft,
                       c->tokens_per_pass, nw, rpw, ns, rb, pr.state_bytes, pr.ring_bytes, !verify);
    const bool few_ctas = stages_free && !verify &&
                          dev.smem_per_sm / (c->smem.total + kReservedSmemPerCta) < kBulkMinCtas;
    if (c->smem.total <= dev.smem_per_block && !(few_ctas && ns > 1)) break;
    if (ns > 1) {
      --ns;
    } else if (nw > 1) {
      nw /= 2;
    } else {
      return false;
    }
  }
  c->warps = nw;
  c->rows_per_warp = rpw;
  c->stages = ns;
  c->chunks = CeilDiv(V, nw * rpw);
  return true;
}

// The bulk kernel, or nullopt when it cannot take the problem (then the tiled kernel runs).
std::optional<LaunchPlan> PlanBulk(const LaunchProblem& pr, const DeviceLimits& dev,
                                   const LaunchOverrides& ov) {
  LaunchPlan plan;
  plan.role = KernelRole::kBulkStep;
  BulkConfig& c = plan.bulk;
  if (!ShapeBulk(pr, dev, ov, &c)) return std::nullopt;
  c.vec_s0 = pr.checkpoint_aligned;
  c.bulk_s0 = c.vec_s0 && (ov.bulk_copy & 1) != 0;
  c.bulk_d = pr.ring_d_aligned && (ov.bulk_copy & 2) != 0;
  c.bulk_k = pr.ring_k_aligned && (ov.bulk_copy & 4) != 0;
  // GDN's g row goes in 16-byte units: only when every row starts 16-byte aligned.
  c.bulk_g = pr.ring_g_aligned && (pr.kda || pr.ring_len % 4 == 0) && (ov.bulk_copy & 8) != 0;
  // A whole-head CTA takes the ring's d rows in one copy, unpadded (bank conflicts in the
  // ring terms, fewer copies to issue); fp32 GDN decode, the most row-bound, keeps padded rows.
  const bool dense_ok = !(c.tokens_per_pass == 1 && pr.state_bytes == 4 && !pr.kda);
  const int rows = c.warps * c.rows_per_warp;
  c.d_dense = dense_ok && c.bulk_d && c.chunks == 1 && rows == pr.head_v;
  c.d_stride = c.d_dense ? pr.head_v : DStride(rows, pr.ring_bytes);
  // The late stage: fp32 replay decode whose warps have batches beyond their stages, where the
  // records' k and g (contiguous from kr to g's end) hold a stage for every warp: KDA at K = V
  // = 128 (16 KB; faster there). Not 16-bit decode (slower: its stages refill at a batch's end)
  // nor verify (its registers spilled, or the rotation's arithmetic cost more).
  const int late_region = c.smem.g + c.ring_records * (pr.kda ? pr.head_k : 1) * 4 - c.smem.kr;
  const int stage_bytes = c.warps * c.rows_per_batch * pr.head_k * pr.state_bytes;
  c.late_stage = ov.late_stage != 0 && c.tokens_per_pass == 1 && pr.state_bytes == 4 &&
                 c.ring_records > 0 && c.bulk_s0 && c.stages < kBulkMaxStages &&
                 c.stages < CeilDiv(c.rows_per_warp, c.rows_per_batch) &&
                 late_region >= stage_bytes;
  plan.grid_x = static_cast<uint32_t>(int64_t{pr.num_v_heads} * c.chunks);
  plan.grid_y = static_cast<uint32_t>(pr.batch);
  plan.threads = c.warps * 32;
  plan.smem_bytes = static_cast<size_t>(c.smem.total);
  return plan;
}

// The baseline kernel: a CTA of NW warps x RPW rows on a grid (HV * tiles, B). nullopt past the
// grid's 65535 rows, and for a 16-bit state once the bulk kernel's whole-head CTAs fill the GPU
// twice over (its 8-byte rows leave the small CTAs short of bytes in flight: slower than the
// bulk kernel there, faster at B = 1; issue 20).
std::optional<LaunchPlan> PlanBaseline(const LaunchProblem& pr, const DeviceLimits& dev,
                                       const LaunchOverrides& ov) {
  const int64_t row_heads = pr.batch * pr.num_v_heads;
  if (pr.batch > kMaxGridY) return std::nullopt;
  if (pr.state_bytes != 4 && row_heads >= 2LL * dev.sms && ov.baseline_warps == 0 &&
      ov.baseline_rows == 0 && ov.baseline_cache == 0) {
    return std::nullopt;
  }
  LaunchPlan plan;
  plan.role = KernelRole::kBaseline;
  BaselineConfig& c = plan.baseline;
  c.channels_per_lane = pr.head_k <= 128 ? 4 : 8;
  c.warps = ov.baseline_warps != 0 ? ov.baseline_warps : kBaselineWarps;
  // Wide heads: half the rows, so that a lane keeps the same state bytes in registers.
  const bool wide = row_heads >= int64_t{kBaselineWideHeadsPerSm} * dev.sms;
  const int rows = wide ? kBaselineRowsPerWarpWide : kBaselineRowsPerWarp;
  c.rows_per_warp =
      ov.baseline_rows != 0 ? ov.baseline_rows : (c.channels_per_lane == 4 ? rows : rows / 2);
  c.cache = ov.baseline_cache != 0 ? ov.baseline_cache : kBaselineCache;
  c.vec = pr.checkpoint_aligned;
  c.tiles = CeilDiv(pr.head_v, c.warps * c.rows_per_warp);
  const int64_t grid_x = int64_t{pr.num_v_heads} * c.tiles;
  if (grid_x > kMaxGridX) return std::nullopt;
  plan.grid_x = static_cast<uint32_t>(grid_x);
  plan.grid_y = static_cast<uint32_t>(pr.batch);
  plan.threads = c.warps * 32;
  plan.smem_bytes = 0;
  return plan;
}

// The small-batch replay kernel: replay decode of an fp32 state at K <= 128 while the batch is
// too small for the bulk kernel's CTAs to fill the GPU (B * HV <= SmallReplayMaxRowHeads),
// every pool array 16-byte aligned (its record copies and S0 loads are vector-wide; GDN's g
// goes in 4-byte copies); nullopt otherwise.
// At B = 1 it is the cheapest replay kernel measured (the bulk kernel, 4 or 16 rows per warp
// were slower), yet slower than the baseline kernel: the step is one latency chain, and replay's
// record dots and CTA barrier sit between the loads' arrival and the rows. No kernel can take a
// replay call's place here: the planner does not see the cursors, a row with records must read
// them, and the baseline writes the state in place, which an abandoned forward could not take
// back (docs/gpu.md, "Why B = 1 does not plan the baseline instead").
std::optional<LaunchPlan> PlanSmallReplay(const LaunchProblem& pr, const DeviceLimits& dev,
                                          const LaunchOverrides& ov) {
  if (ov.small_replay_max_batch < 0 || pr.batch > kMaxGridY) return std::nullopt;
  const bool small = ov.small_replay_max_batch != 0
                         ? pr.batch <= ov.small_replay_max_batch
                         : pr.batch * pr.num_v_heads <= SmallReplayMaxRowHeads(pr.kda);
  const int rpw = ov.small_replay_rows != 0 ? ov.small_replay_rows : kSmallReplayRowsPerWarp;
  if (!small || pr.state_bytes != 4 || pr.head_k > 128 || pr.head_v % rpw != 0 ||
      !pr.checkpoint_aligned || !pr.ring_d_aligned || !pr.ring_k_aligned ||
      (pr.kda && !pr.ring_g_aligned)) {
    return std::nullopt;
  }
  LaunchPlan plan;
  plan.role = KernelRole::kSmallReplay;
  SmallReplayConfig& c = plan.small;
  const int nw = kSmallReplayWarps;
  c.rows_per_warp = rpw;
  c.warps = nw;
  c.tiles = (pr.head_v + rpw * nw - 1) / (rpw * nw);
  c.smem = SmallReplaySmem::Make(pr.head_k, pr.ring_len, pr.kda, rpw * nw, pr.ring_bytes);
  if (c.smem.total > dev.smem_per_block) return std::nullopt;
  const int64_t grid_x = int64_t{pr.num_v_heads} * c.tiles;
  if (grid_x > kMaxGridX) return std::nullopt;
  plan.grid_x = static_cast<uint32_t>(grid_x);
  plan.grid_y = static_cast<uint32_t>(pr.batch);
  plan.threads = 32 * nw;
  plan.smem_bytes = static_cast<size_t>(c.smem.total);
  return plan;
}

// The stream replay kernel: replay decode of an fp32 checkpoint at large batches (B * HV >=
// StreamMinRowHeads(kda)), on persistent CTAs that share an SM's shared memory, each filling its
// share with S0 stages; nullopt where its requirements (stream_replay_kernel.cuh) do not hold.
std::optional<LaunchPlan> PlanStreamReplay(const LaunchProblem& pr, const DeviceLimits& dev,
                                           const LaunchOverrides& ov) {
  const int K = pr.head_k, V = pr.head_v, L = pr.ring_len;
  const int64_t items = pr.batch * pr.num_v_heads;
  const bool wanted = ov.stream_min_batch != 0
                          ? ov.stream_min_batch > 0 && pr.batch >= ov.stream_min_batch
                          : items >= StreamMinRowHeads(pr.kda);
  const int per_item_rows = kStreamConsumerWarps * kStreamStageRows;
  if (!wanted || pr.op != KernelOp::kReplay || pr.state_bytes != 4 || K > 128 || K % 16 != 0 ||
      V > 128 || V % per_item_rows != 0 || L < 1 || L > 32 || (!pr.kda && L % 4 != 0) ||
      !pr.checkpoint_aligned || !pr.ring_d_aligned || !pr.ring_k_aligned || !pr.ring_g_aligned ||
      items > 0x7fffffff || dev.sms <= 0) {
    return std::nullopt;
  }
  LaunchPlan plan;
  plan.role = KernelRole::kStreamReplay;
  StreamConfig& c = plan.stream;
  c.d_stride = DStride(V, pr.ring_bytes);
  // The most CTAs per SM whose share of its shared memory holds kStreamPlannedStages stages;
  // as many stages per consumer warp as fit in that share.
  const StreamSmem fixed = StreamSmem::Make(K, L, pr.kda, c.d_stride, 0, pr.ring_bytes);
  const int stage_bytes = kStreamStageRows * K * 4;
  auto stages_per_warp = [&](int ctas) {
    const int budget = std::min(dev.smem_per_sm / ctas - kReservedSmemPerCta, dev.smem_per_block);
    return std::min((budget - fixed.total) / (stage_bytes * kStreamConsumerWarps),
                    kStreamMaxStages / kStreamConsumerWarps);
  };
  c.ctas_per_sm = ov.stream_ctas_per_sm;
  if (c.ctas_per_sm == 0) {
    c.ctas_per_sm = kStreamMaxCtasPerSm;
    while (c.ctas_per_sm > 1 &&
           stages_per_warp(c.ctas_per_sm) * kStreamConsumerWarps < kStreamPlannedStages) {
      --c.ctas_per_sm;
    }
  }
  int nsw = stages_per_warp(c.ctas_per_sm);
  if (ov.stream_stages != 0) nsw = std::min(nsw, ov.stream_stages);
  if (nsw * kStreamConsumerWarps < kStreamMinStages) return std::nullopt;
  c.stages_per_warp = nsw;
  c.smem = StreamSmem::Make(K, L, pr.kda, c.d_stride, nsw * kStreamConsumerWarps, pr.ring_bytes);
  int64_t grid = std::min<int64_t>(items, int64_t{c.ctas_per_sm} * dev.sms);
  if (ov.stream_grid > 0) grid = std::min<int64_t>(grid, ov.stream_grid);
  plan.grid_x = static_cast<uint32_t>(grid);
  plan.grid_y = 1;
  plan.threads = kStreamThreads;
  plan.smem_bytes = static_cast<size_t>(c.smem.total);
  return plan;
}

bool UseBulk(const LaunchProblem& pr, const LaunchOverrides& ov) {
  switch (ov.step_kernel) {
    case LaunchOverrides::StepKernel::kTiled: return false;
    case LaunchOverrides::StepKernel::kBulk: return true;
    case LaunchOverrides::StepKernel::kAuto: break;
  }
  if (pr.op != KernelOp::kVerify) return true;
  const int64_t planned = pr.head_k <= 128 ? kBulkVerifyMinBatch : kBulkVerifyMinBatchWide;
  return pr.batch >= (ov.bulk_min_batch != 0 ? ov.bulk_min_batch : planned);
}

std::string Field(const std::string& field, const std::string& expected, int64_t got) {
  return field + ": expected " + expected + ", got " + std::to_string(got);
}

}  // namespace

const char* KernelRoleName(KernelRole role) {
  switch (role) {
    case KernelRole::kTiledStep: return "tiled";
    case KernelRole::kBulkStep: return "bulk";
    case KernelRole::kPrefill: return "prefill";
    case KernelRole::kBaseline: return "baseline";
    case KernelRole::kSmallReplay: return "small-replay";
    case KernelRole::kStreamReplay: return "stream-replay";
  }
  return "unknown";
}

std::string CheckOverrides(const LaunchOverrides& ov) {
  using K = LaunchOverrides::StepKernel;
  if (ov.step_kernel != K::kAuto && ov.step_kernel != K::kTiled && ov.step_kernel != K::kBulk) {
    return Field("step_kernel", "kAuto, kTiled or kBulk", static_cast<int64_t>(ov.step_kernel));
  }
  if (ov.bulk_min_batch < 0)
    return Field("bulk_min_batch", "0 (planned) or >= 1", ov.bulk_min_batch);
  if (ov.rows_per_warp != 0 &&
      (ov.rows_per_warp < 16 || ov.rows_per_warp > 64 || ov.rows_per_warp % 16 != 0)) {
    return Field("rows_per_warp", "0 (planned), 16, 32, 48 or 64", ov.rows_per_warp);
  }
  if (ov.warps < 0 || ov.warps > kBulkMaxWarps) {
    return Field("warps", "0 (planned) or 1.." + std::to_string(kBulkMaxWarps), ov.warps);
  }
  if (ov.stages < 0 || ov.stages > kBulkMaxStages) {
    return Field("stages", "0 (planned) or 1.." + std::to_string(kBulkMaxStages), ov.stages);
  }
  if (ov.bulk_copy < 0 || ov.bulk_copy > 15) {
    return Field("bulk_copy", "a bit mask in 0..15", ov.bulk_copy);
  }
  if (ov.late_stage != 0 && ov.late_stage != 1) {
    return Field("late_stage", "0 or 1", ov.late_stage);
  }
  if (ov.baseline_warps != 0 && ov.baseline_warps != 1 && ov.baseline_warps != 2 &&
      ov.baseline_warps != 4 && ov.baseline_warps != 8) {
    return Field("baseline_warps", "0 (planned), 1, 2, 4 or 8", ov.baseline_warps);
  }
  if (ov.baseline_rows != 0 && ov.baseline_rows != 2 && ov.baseline_rows != 4 &&
      ov.baseline_rows != 8 && ov.baseline_rows != 16) {
    return Field("baseline_rows", "0 (planned), 2, 4, 8 or 16", ov.baseline_rows);
  }
  if (ov.baseline_cache < 0 || ov.baseline_cache > kCacheKeepStores) {
    return Field("baseline_cache", "0 (planned) or 1..5", ov.baseline_cache);
  }
  if (ov.small_replay_max_batch < -1) {
    return Field("small_replay_max_batch", "0 (planned), -1 (never) or >= 1",
                 ov.small_replay_max_batch);
  }
  if (ov.small_replay_rows != 0 && ov.small_replay_rows != 8 && ov.small_replay_rows != 16) {
    return Field("small_replay_rows", "0 (planned), 8 or 16", ov.small_replay_rows);
  }
  if (ov.stream_min_batch < -1) {
    return Field("stream_min_batch", "0 (planned), -1 (never) or >= 1", ov.stream_min_batch);
  }
  if (ov.stream_grid < 0) return Field("stream_grid", "0 (planned) or >= 1", ov.stream_grid);
  if (ov.stream_ctas_per_sm < 0 || ov.stream_ctas_per_sm > kStreamMaxCtasPerSm) {
    return Field("stream_ctas_per_sm", "0 (planned) or 1.." + std::to_string(kStreamMaxCtasPerSm),
                 ov.stream_ctas_per_sm);
  }
  if (ov.stream_stages < 0 || ov.stream_stages > kStreamMaxStages / kStreamConsumerWarps) {
    return Field("stream_stages",
                 "0 (planned) or 1.." + std::to_string(kStreamMaxStages / kStreamConsumerWarps),
                 ov.stream_stages);
  }
  return "";
}

std::optional<LaunchPlan> Plan(const LaunchProblem& pr, const DeviceLimits& dev,
                               const LaunchOverrides& ov) {
  if (!IsStep(pr.op)) return PlanTiled(pr, KernelRole::kPrefill);
  if (pr.op == KernelOp::kBaseline && ov.step_kernel == LaunchOverrides::StepKernel::kAuto) {
    if (std::optional<LaunchPlan> baseline = PlanBaseline(pr, dev, ov)) return baseline;
  }
  if (pr.op == KernelOp::kReplay && ov.step_kernel == LaunchOverrides::StepKernel::kAuto) {
    // The planned batches of the two do not meet; a forced stream kernel goes first.
    const bool stream_first = ov.stream_min_batch > 0;
    if (stream_first) {
      if (std::optional<LaunchPlan> stream = PlanStreamReplay(pr, dev, ov)) return stream;
    }
    if (std::optional<LaunchPlan> small = PlanSmallReplay(pr, dev, ov)) return small;
    if (!stream_first) {
      if (std::optional<LaunchPlan> stream = PlanStreamReplay(pr, dev, ov)) return stream;
    }
  }
  if (UseBulk(pr, ov) && pr.batch <= kMaxGridY) {
    if (std::optional<LaunchPlan> bulk = PlanBulk(pr, dev, ov)) return bulk;
  }
  return PlanTiled(pr, KernelRole::kTiledStep);
}

}  // namespace replayssm::kernels::cuda
