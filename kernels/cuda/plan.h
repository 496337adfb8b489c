// The launch planner of the CUDA backend: from a problem (op, dims, state dtype, batch, pool
// alignment) and the device's limits, which kernel runs and with what CTA shape, stages and
// shared-memory layout. Every launch of the backend goes through Plan(); the launchers only
// carry its answer out. Plain host C++ (no CUDA headers): built and unit-tested everywhere.
//
// Overrides exist for the kernel benchmark and the GPU tests (kernels/src/launch_overrides.h);
// the serving path always plans with none.
#ifndef REPLAYSSM_KERNELS_CUDA_PLAN_H_
#define REPLAYSSM_KERNELS_CUDA_PLAN_H_

#include <stddef.h>
#include <stdint.h>

#include <optional>
#include <string>

#include "layout.h"

namespace replayssm::kernels::cuda {

// The kernels, by role.
enum class KernelRole {
  kTiledStep,     // register-tiled step: a CTA of 256 threads per (row, v-head, tile of rows)
  kBulkStep,      // bulk-staged step: S0 through shared-memory stages filled by the copy engine
  kPrefill,       // prefill and the fold op: the state in registers for the whole row
  kBaseline,      // baseline decode: small CTAs, each a few of a head's state rows in registers
  kSmallReplay,   // replay decode at small batch: CTAs of 4 baseline warps, records copied
  kStreamReplay,  // replay decode at large batch: persistent CTAs, a producer warp streaming S0
};
// "tiled", "bulk", "prefill", "baseline", "small-replay", "stream-replay"
const char* KernelRoleName(KernelRole role);

enum class KernelOp { kReplay, kBaseline, kVerify, kPrefill, kFold };

struct LaunchProblem {
  KernelOp op = KernelOp::kReplay;
  bool kda = false;
  int32_t num_v_heads = 0;  // HV
  int32_t head_k = 0;       // K
  int32_t head_v = 0;       // V
  int32_t ring_len = 0;     // L
  int32_t state_bytes = 4;  // 4 (f32) or 2 (bf16, f16): the checkpoint
  int32_t ring_bytes = 4;   // 4 or 2: the ring's d and k
  int64_t batch = 0;        // rows (> 0)
  int32_t num_draft = 1;    // T (verify)
  // Each pool array's base and slot stride are 16-byte aligned (the bulk copy engine's need).
  bool checkpoint_aligned = true, ring_d_aligned = true, ring_k_aligned = true,
       ring_g_aligned = true;
};

// Read from the device once (launch.cuh, DeviceFactsOf).
struct DeviceLimits {
  int sms = 0;             // multiprocessors
  int smem_per_block = 0;  // opt-in maximum of dynamic shared memory per CTA, bytes
  int smem_per_sm = 0;     // bytes
};

// Launch overrides for experiments; zero (or kAuto) leaves a choice to the planner. A forced
// shape that does not fit shared memory still shrinks (stages, then warps), as planned ones do.
struct LaunchOverrides {
  enum class StepKernel { kAuto, kTiled, kBulk };
  StepKernel step_kernel = StepKernel::kAuto;  // one step kernel for every op and batch
  int64_t bulk_min_batch = 0;  // verify takes the bulk kernel from this batch (0: 1; 16 at K > 128)
  int rows_per_warp = 0;       // bulk: state rows per warp, 16..64 in steps of 16
  int warps = 0;               // bulk: warps per CTA, 1..4
  int stages = 0;              // bulk: S0 stages per warp, 1..8
  int bulk_copy = 15;          // bulk: pieces the copy engine may fetch (1 S0, 2 ring d,
                               // 4 ring k, 8 ring g); the others take plain loads
  int late_stage = 1;          // bulk: 1 decode's late S0 stage where planned (BulkConfig), 0 none
  // The baseline kernel (kAuto only; kTiled or kBulk run the baseline there; any of these set
  // takes the baseline kernel for a 16-bit state too). Only the shapes launch.cuh builds launch
  // (the planned ones; more for the benchmark's types).
  int baseline_warps = 0;  // warps per CTA: 1, 2, 4 or 8
  int baseline_rows = 0;   // state rows per warp: 2, 4, 8 or 16
  int baseline_cache = 0;  // BaselineCache (layout.h)
  // The small-batch replay kernel (kAuto only): replay decode takes it up to this batch (0:
  // B * HV <= SmallReplayMaxRowHeads(kda); -1: never), with this many rows per warp (0: planned; 8
  // or 16).
  int64_t small_replay_max_batch = 0;
  int small_replay_rows = 0;
  // The stream replay kernel (kAuto only): replay decode takes it from this batch (0: planned,
  // B * HV >= StreamMinRowHeads(kda); -1: never) on `stream_grid` CTAs (0: planned; else at most
  // this many, each then walking more items: the tests' way to wrap the stage rings).
  int64_t stream_min_batch = 0;
  int stream_grid = 0;
  int stream_ctas_per_sm = 0;  // 1..kStreamMaxCtasPerSm (0: planned; the shared memory per CTA)
  int stream_stages = 0;       // S0 stages per consumer warp: 0 as many as fit, else at most
};

// "" when every override is in range, else "<field>: expected <range>, got <value>".
std::string CheckOverrides(const LaunchOverrides& overrides);

struct TiledConfig {        // kTiledStep, kPrefill
  int kmax = 0;             // register tile width in channels (128 or 256)
  int tokens_per_pass = 0;  // TC: 1, or 4 for verify
  int tile_rows = 0;        // VT
  int num_vtiles = 0;
  SmemLayout smem{};
};

struct BulkConfig {           // kBulkStep
  int tokens_per_pass = 0;    // TT: 1 for decode, 4 for verify
  int channels_per_lane = 0;  // KC: 4 for K <= 128, else 8
  int rows_per_batch = 0;     // RB: rows per S0 stage
  int warps = 0;              // nw
  int rows_per_warp = 0;      // rpw
  int stages = 0;             // ns
  int chunks = 0;             // CTAs per v-head: ceil(V / (nw * rpw))
  int ring_records = 0;       // records the layout holds (L; 0 for the baseline)
  int d_stride = 0;           // ring-dtype elements per ring d row in shared memory
  bool d_dense = false;       // the ring's d rows in one copy (d_stride = V)
  bool vec_s0 = false;        // the checkpoint takes 16-byte stores
  bool bulk_s0 = false, bulk_d = false, bulk_k = false, bulk_g = false;  // by the copy engine
  // fp32 replay decode: a further S0 stage per warp over the records' k and g (BulkSmem kr to
  // g's end), dead once the record dots are done; a CTA that does not fold issues it then.
  bool late_stage = false;
  BulkSmem smem{};
};

struct BaselineConfig {       // kBaseline
  int channels_per_lane = 0;  // KC: 4 for K <= 128, else 8
  int warps = 0;              // NW
  int rows_per_warp = 0;      // RPW
  int tiles = 0;              // CTAs per v-head: ceil(V / (NW * RPW))
  int cache = 0;              // BaselineCache
  bool vec = false;           // the checkpoint takes vector loads and stores
};

struct SmallReplayConfig {  // kSmallReplay
  int rows_per_warp = 0;    // RPW (KC is 4: K <= 128)
  int warps = 0;            // NW: warps per CTA (they share the record dots)
  int tiles = 0;            // CTAs per v-head: ceil(V / (NW * RPW))
  SmallReplaySmem smem{};
};

struct StreamConfig {       // kStreamReplay
  int stages_per_warp = 0;  // nsw: each consumer warp's ring of S0 stages
  int ctas_per_sm = 0;
  int d_stride = 0;  // ring-dtype elements per ring d row in shared memory
  StreamSmem smem{};
};

struct LaunchPlan {
  KernelRole role = KernelRole::kTiledStep;
  uint32_t grid_x = 0, grid_y = 1;
  int threads = 0;
  size_t smem_bytes = 0;
  TiledConfig tiled;        // kTiledStep, kPrefill
  BulkConfig bulk;          // kBulkStep
  BaselineConfig baseline;  // kBaseline
  SmallReplayConfig small;  // kSmallReplay
  StreamConfig stream;      // kStreamReplay
};

// The launch of `problem` on a device with `limits`; nullopt when no grid can cover it (more
// than 2^31 - 1 CTAs). `overrides` must have passed CheckOverrides. The baseline takes its own
// kernel (up to 65535 rows), whose arithmetic is the bulk kernel's: replay at L = 1 is the
// baseline bit for bit wherever replay takes the bulk kernel.
std::optional<LaunchPlan> Plan(const LaunchProblem& problem, const DeviceLimits& limits,
                               const LaunchOverrides& overrides = {});

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_PLAN_H_
