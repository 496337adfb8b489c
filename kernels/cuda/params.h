// Parameter structs of the CUDA kernels (plain pointers, dims, strides; passed by value as
// __grid_constant__) and the host launchers' declarations. See tiled_step_kernel.cuh and
// bulk_step_kernel.cuh (replay, baseline, verify) and prefill_kernel.cuh (prefill, fold) for
// what each field means.
#ifndef REPLAYSSM_KERNELS_CUDA_PARAMS_H_
#define REPLAYSSM_KERNELS_CUDA_PARAMS_H_

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "layout.h"
#include "plan.h"

namespace replayssm::kernels::cuda {

// What the layer looks like (shared by every kernel).
struct LayerDesc {
  int32_t H, HV, K, V, L, group;  // group = HV / H
  int32_t kda, l2norm, act_dtype, round_beta;
  float scale;
  const float* a_log;    // [HV]
  const float* dt_bias;  // GDN [HV], KDA [HV, K]
  void* ckpt;            // [S, HV, V, K] state dtype
  void* ring_d;          // [S, HV, L, V] ring dtype
  void* ring_k;          // [S, H, L, K] ring dtype
  float* ring_g;         // [S, HV, L] or [S, HV, L, K]
  int64_t num_slots, ckpt_stride, d_stride, k_stride, g_stride;
  const void* qkv;  // [N, 2HK + HV V]
  const void* a;    // [N, HV] or [N, HV, K]
  const void* b;    // [N, HV]
  int64_t qkv_stride, a_stride, b_stride;
  void* o;  // [N, HV, V] act dtype, or null (prefill only)
  int64_t o_stride;
};

struct StepParams {
  LayerDesc ly;
  int32_t batch;
  int32_t num_draft;  // T (1 for decode)
  int32_t mode;       // StepMode
  int32_t num_vtiles;
  const int32_t* slot_idx;    // [B]
  const int32_t* write_pos;   // [B] (null for the baseline)
  const uint8_t* force_fold;  // [B] or null
  // Decode behind its convolution (rssm_decode_args.conv): launched as the convolution's
  // programmatic dependent, the bulk kernel streams its state before it waits for the tokens.
  int32_t after_conv;
  SmemLayout sm;
};

struct PrefillParams {
  LayerDesc ly;
  int32_t batch;
  int32_t num_vtiles;
  int32_t fold_only;          // 1: the fold op (no tokens, every row starts from its slot)
  const int32_t* slot_idx;    // [B]
  const int32_t* cu_seqlens;  // [B+1] (null when fold_only)
  const uint8_t* initial;     // [B] or null
  const int32_t* write_pos;   // [B] or null
  SmemLayout sm;
};

// Launchers, one per (state, ring) dtype pair (explicit instantiations in kernels_<state>.cu and
// kernels_f32_ring_<ring>.cu; a 16-bit state keeps its ring in its own dtype): launch what
// `plan` (Plan(), plan.h) says for `p` on `stream`, on the current device (`device`, its index),
// and return the launch status.
cudaError_t LaunchStepF32(const LaunchPlan& plan, int device, const StepParams& p,
                          cudaStream_t stream);
cudaError_t LaunchStepBf16(const LaunchPlan& plan, int device, const StepParams& p,
                           cudaStream_t stream);
cudaError_t LaunchStepF16(const LaunchPlan& plan, int device, const StepParams& p,
                          cudaStream_t stream);
cudaError_t LaunchStepF32RingBf16(const LaunchPlan& plan, int device, const StepParams& p,
                                  cudaStream_t stream);
cudaError_t LaunchStepF32RingF16(const LaunchPlan& plan, int device, const StepParams& p,
                                 cudaStream_t stream);
cudaError_t LaunchPrefillF32(const LaunchPlan& plan, int device, const PrefillParams& p,
                             cudaStream_t stream);
cudaError_t LaunchPrefillBf16(const LaunchPlan& plan, int device, const PrefillParams& p,
                              cudaStream_t stream);
cudaError_t LaunchPrefillF16(const LaunchPlan& plan, int device, const PrefillParams& p,
                             cudaStream_t stream);
cudaError_t LaunchPrefillF32RingBf16(const LaunchPlan& plan, int device, const PrefillParams& p,
                                     cudaStream_t stream);
cudaError_t LaunchPrefillF32RingF16(const LaunchPlan& plan, int device, const PrefillParams& p,
                                    cudaStream_t stream);

// rssm_segment_digests_parts (checksum.cu; rssm_segment_digests is count 1): the payload is
// parts[0] | parts[1] | ... (part_bytes each); segment i is payload bytes [i * segment_bytes,
// min((i + 1) * segment_bytes, bytes)); digests[i] its version 2 digest.
struct SegmentDigestParams {
  const uint8_t* const* parts;  // [count] device memory: the parts' device pointers, each
                                // 16-byte aligned
  size_t count;                 // >= 1
  size_t part_bytes;            // > 0; a multiple of 16 when count > 1
  size_t bytes;                 // count * part_bytes
  size_t segment_bytes;         // a positive multiple of 64
  uint64_t* digests;            // [ceil(bytes / segment_bytes)], device memory
};
// One CTA per segment; no synchronization.
cudaError_t LaunchSegmentDigests(const SegmentDigestParams& p, cudaStream_t stream);

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_PARAMS_H_
