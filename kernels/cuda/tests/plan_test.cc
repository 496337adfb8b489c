// The launch planner (cuda/plan.h) on an H200's limits: the measured choices it encodes, the
// properties every plan keeps, the overrides, and the internal entry points that take them
// (src/launch_overrides.h). Plain C++: runs without a GPU.
#include "cuda/plan.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "src/launch_overrides.h"
#include "tests/harness.h"

namespace replayssm::kernels::cuda {
namespace {

constexpr DeviceLimits kH200{132, 232448, 233472};

// The benchmark shape: HV = 32, K = V = 128, L = 16.
// ring_bytes 0: the state's.
LaunchProblem Shape(KernelOp op, int64_t batch, bool kda = false, int state_bytes = 4,
                    int ring_bytes = 0) {
  LaunchProblem p;
  p.op = op;
  p.kda = kda;
  p.num_v_heads = 32;
  p.head_k = p.head_v = 128;
  p.ring_len = 16;
  p.state_bytes = state_bytes;
  p.ring_bytes = ring_bytes != 0 ? ring_bytes : state_bytes;
  p.batch = batch;
  p.num_draft = op == KernelOp::kVerify ? 4 : 1;
  return p;
}

LaunchPlan PlanOf(const LaunchProblem& p, const LaunchOverrides& ov = {},
                  const DeviceLimits& dev = kH200) {
  const std::optional<LaunchPlan> plan = Plan(p, dev, ov);
  EXPECT_TRUE(plan.has_value());
  return plan.value_or(LaunchPlan{});
}

// Replay decode without the stream kernel: the tests of the bulk kernel's replay shapes.
LaunchOverrides NoStream() {
  LaunchOverrides ov;
  ov.stream_min_batch = -1;
  return ov;
}

int CtasPerSm(const LaunchPlan& plan) {
  return kH200.smem_per_sm / (static_cast<int>(plan.smem_bytes) + 1024);
}

// fp32 replay takes the small-batch kernel while B * HV <= SmallReplayMaxRowHeads(kda) (at
// HV = 32: GDN up to B = 4, KDA up to B = 2), then the bulk kernel, then from B * HV >=
// StreamMinRowHeads(kda) the stream kernel; a 16-bit state always the bulk kernel.
TEST(Plan, ReplayTakesTheSmallKernelAtSmallBatchesThenTheBulkKernel) {
  for (int64_t b : {1, 2, 3, 4, 5, 8, 16, 64, 256, 4096}) {
    const bool small = b <= 4;
    const bool small_kda = b <= 2;
    const bool stream = b * 32 >= StreamMinRowHeads(false);
    for (bool kda : {false, true}) {
      const bool stream_here = b * 32 >= StreamMinRowHeads(kda);
      for (int ring_bytes : {4, 2}) {
        EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, b, kda, 4, ring_bytes)).role,
                  stream_here                 ? KernelRole::kStreamReplay
                  : (kda ? small_kda : small) ? KernelRole::kSmallReplay
                                              : KernelRole::kBulkStep)
            << "batch " << b << " kda " << kda << " ring bytes " << ring_bytes;
      }
    }
    if (stream || b * 32 >= StreamMinRowHeads(true)) {
      EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, b, false, 2)).role, KernelRole::kBulkStep);
      continue;
    }
    EXPECT_EQ(small, b * 32 <= SmallReplayMaxRowHeads(false));
    EXPECT_EQ(small_kda, b * 32 <= SmallReplayMaxRowHeads(true));
    EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, b, true)).role,
              small_kda ? KernelRole::kSmallReplay : KernelRole::kBulkStep)
        << "KDA batch " << b;
    const LaunchPlan plan = PlanOf(Shape(KernelOp::kReplay, b));
    EXPECT_EQ(plan.role, small ? KernelRole::kSmallReplay : KernelRole::kBulkStep) << "batch " << b;
    if (small) {
      EXPECT_EQ(plan.small.rows_per_warp, kSmallReplayRowsPerWarp);
      EXPECT_EQ(plan.small.warps, kSmallReplayWarps);
      EXPECT_EQ(plan.grid_x, 32u * 128 / (kSmallReplayRowsPerWarp * kSmallReplayWarps));
      EXPECT_EQ(plan.grid_y, static_cast<uint32_t>(b));
      EXPECT_EQ(plan.threads, 32 * kSmallReplayWarps);
    }
    EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, b, false, 2)).role, KernelRole::kBulkStep);
    EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, b, true, 4, 2)).role,
              small_kda ? KernelRole::kSmallReplay : KernelRole::kBulkStep);
  }
}

// The small-batch kernel takes an fp32 checkpoint at K <= 128 in an aligned pool, unforced.
TEST(Plan, SmallReplayNeedsAnAlignedFp32PoolAndNarrowHeads) {
  LaunchProblem p = Shape(KernelOp::kReplay, 1);
  p.ring_k_aligned = false;
  EXPECT_EQ(PlanOf(p).role, KernelRole::kBulkStep);
  p = Shape(KernelOp::kReplay, 1);
  p.ring_g_aligned = false;  // GDN's g goes in 4-byte copies, KDA's in 16-byte ones
  EXPECT_EQ(PlanOf(p).role, KernelRole::kSmallReplay);
  p.kda = true;
  EXPECT_EQ(PlanOf(p).role, KernelRole::kBulkStep);
  p = Shape(KernelOp::kReplay, 1);
  p.head_k = 256;
  EXPECT_EQ(PlanOf(p).role, KernelRole::kBulkStep);
  LaunchOverrides ov;
  ov.step_kernel = LaunchOverrides::StepKernel::kBulk;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 1), ov).role, KernelRole::kBulkStep);
  ov = {};
  ov.small_replay_max_batch = -1;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 1), ov).role, KernelRole::kBulkStep);
  ov.small_replay_max_batch = 64;
  ov.small_replay_rows = 16;
  ov.stream_min_batch = -1;
  const LaunchPlan plan = PlanOf(Shape(KernelOp::kReplay, 64, true), ov);
  EXPECT_EQ(plan.role, KernelRole::kSmallReplay);
  EXPECT_EQ(plan.small.rows_per_warp, 16);
  EXPECT_EQ(plan.grid_x, 32u * 128 / (16 * kSmallReplayWarps));
  // Heads of rows that fill no whole CTA: the last CTA's spare warps do record dots only.
  p = Shape(KernelOp::kReplay, 1);
  for (auto [v, tiles] : {std::pair{16, 1}, {96, 3}, {104, 4}}) {
    p.head_v = v;
    const LaunchPlan narrow = PlanOf(p);
    EXPECT_EQ(narrow.role, KernelRole::kSmallReplay) << "V " << v;
    EXPECT_EQ(narrow.small.tiles, tiles) << "V " << v;
    EXPECT_EQ(narrow.grid_x, 32u * tiles) << "V " << v;
    EXPECT_EQ(narrow.threads, 32 * kSmallReplayWarps) << "V " << v;
  }
  EXPECT_EQ(PlanOf(Shape(KernelOp::kVerify, 1)).role, KernelRole::kBulkStep);
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 1)).role, KernelRole::kBaseline);
}

TEST(Plan, BaselineTakesItsKernelAtEveryBatch) {
  for (int64_t b : {1, 2, 16, 64, 128, 131, 132, 256, 4096, 65535}) {
    const LaunchPlan plan = PlanOf(Shape(KernelOp::kBaseline, b));
    EXPECT_EQ(plan.role, KernelRole::kBaseline) << "batch " << b;
    const BaselineConfig& c = plan.baseline;
    // 16 rows per warp once the batch has 32 v-heads per SM (32 x 132 >= 32 x 132).
    const int rows = b >= 132 ? kBaselineRowsPerWarpWide : kBaselineRowsPerWarp;
    EXPECT_EQ(c.channels_per_lane, 4);
    EXPECT_EQ(c.warps, kBaselineWarps);
    EXPECT_EQ(c.rows_per_warp, rows) << "batch " << b;
    EXPECT_EQ(c.cache, kBaselineCache);
    EXPECT_TRUE(c.vec);
    EXPECT_EQ(c.tiles, 128 / (kBaselineWarps * rows));
    EXPECT_EQ(plan.grid_x, 32u * c.tiles);
    EXPECT_EQ(plan.grid_y, static_cast<uint32_t>(b));
    EXPECT_EQ(plan.threads, kBaselineWarps * 32);
    EXPECT_EQ(plan.smem_bytes, 0u);
  }
  // Wide heads: 8 channels per lane, half the rows; unaligned slots: scalar loads.
  LaunchProblem p = Shape(KernelOp::kBaseline, 256);
  p.head_k = 256;
  p.head_v = 96;
  p.checkpoint_aligned = false;
  const LaunchPlan wide = PlanOf(p);
  const int rows = kBaselineRowsPerWarpWide / 2;
  EXPECT_EQ(wide.baseline.channels_per_lane, 8);
  EXPECT_EQ(wide.baseline.rows_per_warp, rows);
  EXPECT_EQ(wide.baseline.tiles, (96 + kBaselineWarps * rows - 1) / (kBaselineWarps * rows));
  EXPECT_FALSE(wide.baseline.vec);
  // Past the grid's 65535 rows, and when a step kernel is forced: replay's kernel.
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 65536)).role, KernelRole::kTiledStep);
  LaunchOverrides bulk;
  bulk.step_kernel = LaunchOverrides::StepKernel::kBulk;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 64), bulk).role, KernelRole::kBulkStep);
  // The benchmark's overrides.
  LaunchOverrides ov;
  ov.baseline_warps = 4;
  ov.baseline_rows = 8;
  ov.baseline_cache = kCacheStream;
  const BaselineConfig c = PlanOf(Shape(KernelOp::kBaseline, 64), ov).baseline;
  EXPECT_EQ(c.warps, 4);
  EXPECT_EQ(c.rows_per_warp, 8);
  EXPECT_EQ(c.cache, kCacheStream);
  EXPECT_EQ(c.tiles, 4);
}

// A 16-bit state takes the baseline kernel only while the bulk kernel's whole-head CTAs do not
// fill the GPU twice over (or when a baseline override asks for it).
TEST(Plan, SixteenBitBaselineTakesTheBulkKernelOnceItFillsTheGpu) {
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 8, false, 2)).role, KernelRole::kBaseline);
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 9, true, 2)).role, KernelRole::kBulkStep);
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 256, false, 2)).role, KernelRole::kBulkStep);
  LaunchOverrides ov;
  ov.baseline_rows = 16;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 256, false, 2), ov).role, KernelRole::kBaseline);
}

// Verify takes the bulk kernel at every batch at K <= 128 (the tiled kernel only as the fallback,
// or forced by its override); wider heads below 16 rows the tiled kernel.
TEST(Plan, VerifyTakesTheBulkKernelAtEveryBatch) {
  for (int64_t b : {1, 2, 8, 15, 16, 256}) {
    for (bool kda : {false, true}) {
      for (int state_bytes : {4, 2}) {
        EXPECT_EQ(PlanOf(Shape(KernelOp::kVerify, b, kda, state_bytes)).role, KernelRole::kBulkStep)
            << "batch " << b << " kda " << kda << " state bytes " << state_bytes;
      }
    }
  }
  for (int64_t b : {1, 16, 256}) {
    const LaunchPlan plan = PlanOf(Shape(KernelOp::kVerify, b));
    EXPECT_EQ(plan.role, KernelRole::kBulkStep) << "batch " << b;
    EXPECT_EQ(plan.bulk.tokens_per_pass, 4);
    EXPECT_EQ(plan.bulk.rows_per_batch, 4);
  }
}

TEST(Plan, LargeBatchesGetAWholeHeadPerCtaInTwoStages) {
  const LaunchPlan plan = PlanOf(Shape(KernelOp::kReplay, 256), NoStream());
  const BulkConfig& c = plan.bulk;
  EXPECT_EQ(c.warps, 4);
  EXPECT_EQ(c.rows_per_warp, 32);
  EXPECT_EQ(c.stages, 2);
  EXPECT_EQ(c.chunks, 1);
  EXPECT_EQ(c.channels_per_lane, 4);
  EXPECT_EQ(c.rows_per_batch, 8);
  EXPECT_EQ(plan.grid_x, 32u);
  EXPECT_EQ(plan.grid_y, 256u);
  EXPECT_EQ(plan.threads, 128);
  EXPECT_EQ(plan.smem_bytes, static_cast<size_t>(c.smem.total));
  EXPECT_EQ(CtasPerSm(plan), 4);
}

TEST(Plan, DecodeGivesUpAStageRatherThanACtaPerSm) {
  // KDA fp32 replay's [L][K] gates leave room for 3 CTAs per SM at two stages.
  const LaunchPlan replay = PlanOf(Shape(KernelOp::kReplay, 256, /*kda=*/true), NoStream());
  EXPECT_EQ(replay.bulk.stages, 1);
  EXPECT_GE(CtasPerSm(replay), 4);
  // The baseline holds no records: two stages fit (on the bulk kernel, forced).
  LaunchOverrides bulk;
  bulk.step_kernel = LaunchOverrides::StepKernel::kBulk;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kBaseline, 256, true), bulk).bulk.stages, 2);
  // A forced stage count is kept.
  LaunchOverrides ov = NoStream();
  ov.stages = 2;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 256, true), ov).bulk.stages, 2);
}

TEST(Plan, Fp32ReplayTakesALateStageWhereTheRecordsHoldOne) {
  // KDA fp32 replay: its records' k and g (16 KB) hold a batch for each of its 4 warps.
  const LaunchPlan kda = PlanOf(Shape(KernelOp::kReplay, 256, /*kda=*/true), NoStream());
  EXPECT_TRUE(kda.bulk.late_stage);
  EXPECT_GE(CtasPerSm(kda), 4);
  LaunchOverrides none = NoStream();
  none.late_stage = 0;
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kReplay, 256, true), none).bulk.late_stage);
  // GDN's records (8 KB of k) hold none; the baseline has no records; verify and 16-bit
  // state do not take it.
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kReplay, 256), NoStream()).bulk.late_stage);
  LaunchOverrides bulk;
  bulk.step_kernel = LaunchOverrides::StepKernel::kBulk;
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kBaseline, 256, true), bulk).bulk.late_stage);
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kVerify, 256, true)).bulk.late_stage);
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kReplay, 256, true, /*state_bytes=*/2)).bulk.late_stage);
  // Small batches: each warp's two batches are both in flight already.
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kReplay, 1, true), bulk).bulk.late_stage);
}

TEST(Plan, SmallBatchesSplitAHeadOverCtasOfTwoWarps) {
  LaunchOverrides bulk;
  bulk.step_kernel = LaunchOverrides::StepKernel::kBulk;
  const LaunchPlan plan = PlanOf(Shape(KernelOp::kReplay, 1), bulk);
  EXPECT_EQ(plan.bulk.warps, 2);
  EXPECT_EQ(plan.bulk.rows_per_warp, 16);
  EXPECT_EQ(plan.bulk.chunks, 4);
  EXPECT_EQ(plan.grid_x, 128u);
  EXPECT_EQ(plan.grid_y, 1u);
}

TEST(Plan, WideHeadsTakeEightChannelsPerLane) {
  LaunchProblem p = Shape(KernelOp::kReplay, 64);
  p.head_k = 256;
  EXPECT_EQ(PlanOf(p).bulk.channels_per_lane, 8);
  p.op = KernelOp::kVerify;
  EXPECT_EQ(PlanOf(p).bulk.rows_per_batch, 2);
  p.batch = 15;
  EXPECT_EQ(PlanOf(p).role, KernelRole::kTiledStep);
  EXPECT_EQ(PlanOf(p).tiled.kmax, 256);
  p.batch = 16;
  EXPECT_EQ(PlanOf(p).role, KernelRole::kBulkStep);
}

// Forced onto replay's kernels (the benchmark's comparison), the baseline takes replay's kernel
// and CTA geometry.
TEST(Plan, ForcedBaselineSharesReplaysKernelOnEveryShape) {
  for (bool kda : {false, true}) {
    for (auto [state_bytes, ring_bytes] : {std::pair{4, 4}, {4, 2}, {2, 2}}) {
      for (int k : {16, 64, 128, 256}) {
        for (int v : {16, 96, 256}) {
          for (int l : {1, 4, 16, 64}) {
            for (int64_t b : {1, 16, 64, 300, 70000}) {
              LaunchProblem p = Shape(KernelOp::kReplay, b, kda, state_bytes, ring_bytes);
              p.head_k = k;
              p.head_v = v;
              p.ring_len = l;
              LaunchOverrides no_small = NoStream();
              no_small.small_replay_max_batch = -1;
              const LaunchPlan replay = PlanOf(p, no_small);
              p.op = KernelOp::kBaseline;
              LaunchOverrides forced;
              forced.step_kernel = replay.role == KernelRole::kBulkStep
                                       ? LaunchOverrides::StepKernel::kBulk
                                       : LaunchOverrides::StepKernel::kTiled;
              const LaunchPlan baseline = PlanOf(p, forced);
              ASSERT_EQ(replay.role, baseline.role)
                  << "kda " << kda << " bytes " << state_bytes << "/" << ring_bytes << " K " << k
                  << " V " << v << " L " << l << " B " << b;
              if (replay.role == KernelRole::kBulkStep) {
                EXPECT_LE(replay.smem_bytes, static_cast<size_t>(kH200.smem_per_block));
                EXPECT_EQ(replay.bulk.channels_per_lane, baseline.bulk.channels_per_lane);
                EXPECT_EQ(replay.bulk.rows_per_batch, baseline.bulk.rows_per_batch);
              }
            }
          }
        }
      }
    }
  }
}

TEST(Plan, BatchesPastTheGridsRowLimitTakeTheTiledKernel) {
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 65535), NoStream()).role, KernelRole::kBulkStep);
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 65536), NoStream()).role, KernelRole::kTiledStep);
  // The stream kernel's persistent grid has no row limit.
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 65536)).role, KernelRole::kStreamReplay);
}

TEST(Plan, LayoutsThatDoNotFitFallBackToTheTiledKernel) {
  const DeviceLimits small{132, 4096, 8192};
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 64), {}, small).role, KernelRole::kTiledStep);
}

TEST(Plan, GridsPastTwoToTheThirtyOneCtasAreNotPlanned) {
  LaunchProblem p = Shape(KernelOp::kPrefill, int64_t{1} << 27);  // x 32 heads x 2 tiles
  EXPECT_FALSE(Plan(p, kH200).has_value());
  p.batch = 0;
  EXPECT_FALSE(Plan(p, kH200).has_value());
}

TEST(Plan, UnalignedPoolsTakePlainLoads) {
  LaunchProblem p = Shape(KernelOp::kReplay, 64);
  p.checkpoint_aligned = false;
  p.ring_k_aligned = false;
  const BulkConfig c = PlanOf(p).bulk;
  EXPECT_FALSE(c.vec_s0);
  EXPECT_FALSE(c.bulk_s0);
  EXPECT_FALSE(c.bulk_k);
  EXPECT_TRUE(c.bulk_d);
  EXPECT_TRUE(c.bulk_g);
  // GDN's g row goes in 16-byte units: not with L % 4 != 0; KDA's rows are whole channels.
  p.ring_len = 6;
  EXPECT_FALSE(PlanOf(p).bulk.bulk_g);
  p.kda = true;
  EXPECT_TRUE(PlanOf(p).bulk.bulk_g);
}

TEST(Plan, RingRowsComeInOneCopyExceptForFp32GdnDecode) {
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kReplay, 256), NoStream()).bulk.d_dense);
  EXPECT_TRUE(PlanOf(Shape(KernelOp::kReplay, 256, /*kda=*/true), NoStream()).bulk.d_dense);
  EXPECT_TRUE(PlanOf(Shape(KernelOp::kReplay, 256, false, /*state_bytes=*/2)).bulk.d_dense);
  EXPECT_TRUE(PlanOf(Shape(KernelOp::kVerify, 256)).bulk.d_dense);
  // Not when a CTA covers part of a head.
  EXPECT_FALSE(PlanOf(Shape(KernelOp::kReplay, 1, false, 2)).bulk.d_dense);
  const BulkConfig padded = PlanOf(Shape(KernelOp::kReplay, 256), NoStream()).bulk;
  EXPECT_EQ(padded.d_stride, 128 + 4);
}

// An fp32 checkpoint with a 16-bit ring: S0 stages at 4 bytes, the records' d and k at 2 (so
// W_j∘k_j of a fold gets its own fp32 array), and the ring d rows padded by 16 bytes.
TEST(Plan, RingDtypeSizesTheRecordsNotTheStages) {
  for (bool kda : {false, true}) {
    const BulkConfig f32 = PlanOf(Shape(KernelOp::kReplay, 256, kda), NoStream()).bulk;
    const BulkConfig mixed = PlanOf(Shape(KernelOp::kReplay, 256, kda, 4, 2), NoStream()).bulk;
    EXPECT_EQ(mixed.stages, f32.stages);
    EXPECT_EQ(mixed.smem.d - mixed.smem.s0, f32.smem.d - f32.smem.s0) << "S0 stages";
    EXPECT_EQ(mixed.smem.kw - mixed.smem.kr, 16 * 128 * 2) << "records' k, then W_j∘k_j";
    EXPECT_EQ(f32.smem.kw, f32.smem.kr) << "fp32 records: W_j∘k_j in place";
    EXPECT_EQ(mixed.smem.g - mixed.smem.kw, 16 * 128 * 4);
    if (!kda) {
      EXPECT_EQ(mixed.d_stride, 128 + 8);
    }
  }
}

TEST(Plan, PrefillAndFoldTakeThePrefillKernel) {
  for (KernelOp op : {KernelOp::kPrefill, KernelOp::kFold}) {
    LaunchProblem p = Shape(op, 8);
    const LaunchPlan fp32 = PlanOf(p);
    EXPECT_EQ(fp32.role, KernelRole::kPrefill);
    EXPECT_EQ(fp32.tiled.kmax, 128);
    EXPECT_EQ(fp32.tiled.tile_rows, 64);
    EXPECT_EQ(fp32.grid_x, 8u * 32 * 2);
    EXPECT_EQ(fp32.threads, kTiledThreads);
    p.state_bytes = 2;
    EXPECT_EQ(PlanOf(p).tiled.tile_rows, 128);
  }
}

TEST(Plan, OverridesForceTheKernel) {
  LaunchOverrides tiled;
  tiled.step_kernel = LaunchOverrides::StepKernel::kTiled;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 256), tiled).role, KernelRole::kTiledStep);
  LaunchOverrides bulk;
  bulk.step_kernel = LaunchOverrides::StepKernel::kBulk;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kVerify, 1), bulk).role, KernelRole::kBulkStep);
  LaunchOverrides threshold;
  threshold.bulk_min_batch = 4;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kVerify, 4), threshold).role, KernelRole::kBulkStep);
  EXPECT_EQ(PlanOf(Shape(KernelOp::kVerify, 3), threshold).role, KernelRole::kTiledStep);
}

TEST(Plan, OverridesForceTheCtaShapeAndCopies) {
  LaunchOverrides ov = NoStream();
  ov.warps = 1;
  ov.rows_per_warp = 64;
  ov.stages = 3;
  ov.bulk_copy = 2;  // the ring's d only
  const BulkConfig c = PlanOf(Shape(KernelOp::kReplay, 64), ov).bulk;
  EXPECT_EQ(c.warps, 1);
  EXPECT_EQ(c.rows_per_warp, 64);
  EXPECT_EQ(c.stages, 3);
  EXPECT_EQ(c.chunks, 2);
  EXPECT_FALSE(c.bulk_s0);
  EXPECT_TRUE(c.bulk_d);
  EXPECT_FALSE(c.bulk_k);
  EXPECT_FALSE(c.bulk_g);
  EXPECT_TRUE(c.vec_s0);  // the fold's stores do not depend on the copy engine
}

// The stream kernel: persistent CTAs, as many per SM (up to kStreamMaxCtasPerSm) as keep
// kStreamPlannedStages stages each (GDN 3, KDA's larger records 2), each with as many S0 stages
// per consumer warp as its share of the SM's shared memory holds; never more CTAs than items.
TEST(Plan, StreamReplayFillsItsShareOfAnSmWithStages) {
  for (bool kda : {false, true}) {
    for (int ring_bytes : {4, 2}) {
      LaunchOverrides forced;  // KDA is not planned on it (StreamMinRowHeads)
      forced.stream_min_batch = kda ? 1 : 0;
      const LaunchPlan plan = PlanOf(Shape(KernelOp::kReplay, 256, kda, 4, ring_bytes), forced);
      ASSERT_EQ(plan.role, KernelRole::kStreamReplay);
      const StreamConfig& c = plan.stream;
      EXPECT_EQ(c.ctas_per_sm, kda ? 2 : 3) << "kda " << kda;
      EXPECT_EQ(plan.grid_x, static_cast<uint32_t>(c.ctas_per_sm * kH200.sms));
      EXPECT_EQ(plan.threads, kStreamThreads);
      EXPECT_EQ(plan.smem_bytes, static_cast<size_t>(c.smem.total));
      EXPECT_LE(c.ctas_per_sm * (c.smem.total + 1024), kH200.smem_per_sm);
      EXPECT_GT(c.ctas_per_sm * (c.smem.total + 1024 + kStreamConsumerWarps * 8 * 128 * 4),
                kH200.smem_per_sm)
          << "one more stage per warp would not fit";
      EXPECT_GE(c.stages_per_warp * kStreamConsumerWarps, kStreamPlannedStages);
      EXPECT_EQ(c.stages_per_warp, kda ? 3 : 2);
      EXPECT_EQ(c.d_stride, 128 + 16 / ring_bytes);
      EXPECT_EQ(c.smem.s0 % 16, 0);
      EXPECT_EQ(c.smem.hdr_bytes % 16, 0);
      EXPECT_EQ(c.smem.sc_bytes % 16, 0);
    }
  }
  LaunchOverrides ov;
  ov.stream_min_batch = 1;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 1), ov).grid_x, 32u);  // one CTA per item
  ov.stream_grid = 5;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 1), ov).grid_x, 5u);
  ov = {};
  ov.stream_ctas_per_sm = 2;
  const LaunchPlan two = PlanOf(Shape(KernelOp::kReplay, 256), ov);
  EXPECT_EQ(two.stream.ctas_per_sm, 2);
  EXPECT_EQ(two.stream.stages_per_warp, 4);
  EXPECT_EQ(two.grid_x, 2u * kH200.sms);
  ov.stream_ctas_per_sm = 3;  // KDA forced to 3 CTAs: one stage per warp
  ov.stream_min_batch = 1;
  const LaunchPlan three = PlanOf(Shape(KernelOp::kReplay, 256, true), ov);
  EXPECT_EQ(three.stream.ctas_per_sm, 3);
  EXPECT_EQ(three.stream.stages_per_warp, 1);
}

// What the stream kernel requires (stream_replay_kernel.cuh); elsewhere replay keeps the bulk
// kernel.
TEST(Plan, StreamReplayNeedsAnAlignedFp32PoolAndItsShapes) {
  LaunchOverrides from1;
  from1.stream_min_batch = 1;
  auto role = [&from1](LaunchProblem p) { return PlanOf(p, from1).role; };
  LaunchProblem p = Shape(KernelOp::kReplay, 256);
  EXPECT_EQ(role(p), KernelRole::kStreamReplay);
  for (auto unalign : {&LaunchProblem::checkpoint_aligned, &LaunchProblem::ring_d_aligned,
                       &LaunchProblem::ring_k_aligned, &LaunchProblem::ring_g_aligned}) {
    LaunchProblem q = p;
    q.*unalign = false;
    EXPECT_EQ(role(q), KernelRole::kBulkStep);
  }
  for (auto [k, v, l, kda, stream] : {std::tuple{256, 128, 16, false, false},
                                      {120, 128, 16, false, false},
                                      {128, 256, 16, false, false},
                                      {128, 48, 16, false, false},
                                      {128, 96, 16, false, true},
                                      {64, 64, 8, false, true},
                                      {128, 128, 6, false, false},
                                      {128, 128, 6, true, true},
                                      {128, 128, 64, true, false},
                                      {128, 128, 32, false, true}}) {
    LaunchProblem q = Shape(KernelOp::kReplay, 256, kda);
    q.head_k = k, q.head_v = v, q.ring_len = l;
    EXPECT_EQ(role(q) == KernelRole::kStreamReplay, stream)
        << "K " << k << " V " << v << " L " << l << " kda " << kda;
  }
  EXPECT_EQ(role(Shape(KernelOp::kBaseline, 256)), KernelRole::kBaseline);
  EXPECT_EQ(role(Shape(KernelOp::kVerify, 256)), KernelRole::kBulkStep);
  // Planned: GDN from B * HV = 512; KDA keeps the bulk kernel.
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 16)).role, KernelRole::kStreamReplay);
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 15)).role, KernelRole::kBulkStep);
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 4096, true)).role, KernelRole::kBulkStep);
  LaunchOverrides bulk;
  bulk.step_kernel = LaunchOverrides::StepKernel::kBulk;
  EXPECT_EQ(PlanOf(Shape(KernelOp::kReplay, 256), bulk).role, KernelRole::kBulkStep);
}

TEST(Plan, CheckOverridesNamesTheFieldTheRangeAndTheValue) {
  EXPECT_EQ(CheckOverrides({}), "");
  LaunchOverrides ov;
  ov.rows_per_warp = 24;
  EXPECT_EQ(CheckOverrides(ov), "rows_per_warp: expected 0 (planned), 16, 32, 48 or 64, got 24");
  ov = {};
  ov.warps = 5;
  EXPECT_EQ(CheckOverrides(ov), "warps: expected 0 (planned) or 1..4, got 5");
  ov = {};
  ov.stages = 9;
  EXPECT_EQ(CheckOverrides(ov), "stages: expected 0 (planned) or 1..8, got 9");
  ov = {};
  ov.bulk_copy = 16;
  EXPECT_EQ(CheckOverrides(ov), "bulk_copy: expected a bit mask in 0..15, got 16");
  ov = {};
  ov.bulk_min_batch = -1;
  EXPECT_EQ(CheckOverrides(ov), "bulk_min_batch: expected 0 (planned) or >= 1, got -1");
  ov = {};
  ov.baseline_warps = 3;
  EXPECT_EQ(CheckOverrides(ov), "baseline_warps: expected 0 (planned), 1, 2, 4 or 8, got 3");
  ov = {};
  ov.baseline_rows = 32;
  EXPECT_EQ(CheckOverrides(ov), "baseline_rows: expected 0 (planned), 2, 4, 8 or 16, got 32");
  ov = {};
  ov.baseline_cache = 6;
  EXPECT_EQ(CheckOverrides(ov), "baseline_cache: expected 0 (planned) or 1..5, got 6");
  ov = {};
  ov.small_replay_max_batch = -2;
  EXPECT_EQ(CheckOverrides(ov),
            "small_replay_max_batch: expected 0 (planned), -1 (never) or >= 1, got -2");
  ov = {};
  ov.small_replay_rows = 4;
  EXPECT_EQ(CheckOverrides(ov), "small_replay_rows: expected 0 (planned), 8 or 16, got 4");
}

// The internal entry points check the overrides with every other argument, before anything
// runs: a refused call leaves outputs and pool as they were.
class LaunchOverridesEntry : public ::testing::Test {
 protected:
  LaunchOverridesEntry() : rng_(7), layer_(testing::Config{}, 2, rng_), tok_(layer_, 1, rng_) {
    layer_.RandomCheckpoint(0, rng_);
    before_ = layer_.SlotBytes(0);
    out_ = testing::Buffer(layer_.cfg.act_dtype, int64_t{layer_.cfg.hv} * layer_.cfg.v);
    out_.FillNaN();
  }
  // Expects `status` to be INVALID_ARGUMENT with `message`, and nothing written.
  void ExpectRefused(rssm_status status, const std::string& message) {
    EXPECT_EQ(status, RSSM_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(rssm_last_error()), message);
    for (int64_t i = 0; i < out_.size(); ++i) ASSERT_TRUE(std::isnan(out_.Get(i))) << i;
    EXPECT_EQ(layer_.SlotBytes(0), before_);
  }

  std::mt19937_64 rng_;
  testing::Layer layer_;
  testing::Tokens tok_;
  testing::Buffer out_;
  std::vector<uint8_t> before_;
  const int32_t slot_ = 0, pos_ = 3;
};

TEST_F(LaunchOverridesEntry, CpuLaunchesAreRefused) {
  rssm_decode_args a = layer_.DecodeArgs(1, &slot_, &pos_, tok_, out_);
  ExpectRefused(ReplayDecodeWith(&a, {}),
                "ReplayDecodeWith: launch.backend: expected RSSM_BACKEND_CUDA (1) with launch "
                "overrides, got 0");
  ExpectRefused(BaselineDecodeWith(&a, {}),
                "BaselineDecodeWith: launch.backend: expected RSSM_BACKEND_CUDA (1) with launch "
                "overrides, got 0");
}

TEST_F(LaunchOverridesEntry, OverridesOutOfRangeAreRefused) {
  rssm_decode_args a = layer_.DecodeArgs(1, &slot_, &pos_, tok_, out_);
  a.launch = {RSSM_BACKEND_CUDA, nullptr};
  LaunchOverrides ov;
  ov.stages = 9;
  ExpectRefused(ReplayDecodeWith(&a, ov),
                "ReplayDecodeWith: overrides.stages: expected 0 (planned) or 1..8, got 9");
  rssm_verify_args v{};
  v.launch = a.launch;
  v.shape = a.shape;
  v.params = a.params;
  v.pool = a.pool;
  v.batch = 1;
  v.num_draft = 1;
  v.slot_idx = &slot_;
  v.write_pos = &pos_;
  v.in = a.in;
  v.out = a.out;
  ExpectRefused(VerifyWith(&v, ov),
                "VerifyWith: overrides.stages: expected 0 (planned) or 1..8, got 9");
}

}  // namespace
}  // namespace replayssm::kernels::cuda
