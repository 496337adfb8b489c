// The CUDA backend of kernels/src/backend.h: maps the (already validated) C ABI arguments
// onto kernel params, dispatches on the state dtype, launches on the caller's stream and
// reports launch failures as RSSM_ERR_DEVICE with the CUDA error text. No synchronization and
// no allocation: every kernel works in the caller's buffers and shared memory.
#include <algorithm>
#include <string>
#include <vector>

#include "../src/backend.h"
#include "params.h"

namespace replayssm::kernels::cuda {
namespace {

LayerDesc Describe(const rssm_layer_shape& s, const rssm_state_pool& pool) {
  LayerDesc ly{};
  ly.H = s.num_qk_heads;
  ly.HV = s.num_v_heads;
  ly.K = s.head_k;
  ly.V = s.head_v;
  ly.L = s.ring_len;
  ly.group = s.num_v_heads / s.num_qk_heads;
  ly.kda = s.gate == RSSM_GATE_KDA ? 1 : 0;
  ly.act_dtype = static_cast<int32_t>(s.act_dtype);
  ly.ckpt = pool.checkpoint;
  ly.ring_d = pool.ring_d;
  ly.ring_k = pool.ring_k;
  ly.ring_g = pool.ring_g;
  ly.num_slots = pool.num_slots;
  ly.ckpt_stride = pool.checkpoint_slot_stride;
  ly.d_stride = pool.ring_d_slot_stride;
  ly.k_stride = pool.ring_k_slot_stride;
  ly.g_stride = pool.ring_g_slot_stride;
  return ly;
}

void SetParams(LayerDesc& ly, const rssm_layer_params& p) {
  ly.a_log = p.a_log;
  ly.dt_bias = p.dt_bias;
  ly.scale = p.scale;
  ly.l2norm = p.use_qk_l2norm;
}

void SetTokens(LayerDesc& ly, const rssm_token_inputs& in, const rssm_token_outputs& out) {
  ly.qkv = in.mixed_qkv;
  ly.a = in.a;
  ly.b = in.b;
  ly.qkv_stride = in.qkv_token_stride;
  ly.a_stride = in.a_token_stride;
  ly.b_stride = in.b_token_stride;
  ly.o = out.o;
  ly.o_stride = out.token_stride;
}

rssm_status Report(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return RSSM_OK;
  SetLastError(std::string(what) + ": CUDA error " + cudaGetErrorName(e) + ": " +
               cudaGetErrorString(e));
  return RSSM_ERR_DEVICE;
}

cudaStream_t StreamOf(const rssm_launch& l) { return static_cast<cudaStream_t>(l.stream); }

cudaError_t Step(const StepParams& p, int32_t state, cudaStream_t stream) {
  switch (state) {
    case RSSM_DTYPE_F32: return LaunchStepF32(p, stream);
    case RSSM_DTYPE_BF16: return LaunchStepBf16(p, stream);
    case RSSM_DTYPE_F16: return LaunchStepF16(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PrefillOrFold(const PrefillParams& p, int32_t state, cudaStream_t stream) {
  switch (state) {
    case RSSM_DTYPE_F32: return LaunchPrefillF32(p, stream);
    case RSSM_DTYPE_BF16: return LaunchPrefillBf16(p, stream);
    case RSSM_DTYPE_F16: return LaunchPrefillF16(p, stream);
  }
  return cudaErrorInvalidValue;
}

rssm_status Decode(const rssm_decode_args& a, int mode, const char* what) {
  if (a.batch == 0) return RSSM_OK;
  StepParams p{};
  p.ly = Describe(a.shape, a.pool);
  SetParams(p.ly, a.params);
  SetTokens(p.ly, a.in, a.out);
  p.batch = a.batch;
  p.num_draft = 1;
  p.mode = mode;
  p.slot_idx = a.slot_idx;
  p.write_pos = mode == kModeBaseline ? nullptr : a.write_pos;
  p.force_fold = mode == kModeBaseline ? nullptr : a.force_fold;
  return Report(Step(p, a.shape.state_dtype, StreamOf(a.launch)), what);
}

}  // namespace

bool Available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

rssm_status ReplayDecode(const rssm_decode_args& args) {
  return Decode(args, kModeReplay, "replay decode launch");
}

rssm_status BaselineDecode(const rssm_decode_args& args) {
  return Decode(args, kModeBaseline, "baseline decode launch");
}

rssm_status Verify(const rssm_verify_args& a) {
  if (a.batch == 0) return RSSM_OK;
  StepParams p{};
  p.ly = Describe(a.shape, a.pool);
  SetParams(p.ly, a.params);
  SetTokens(p.ly, a.in, a.out);
  p.batch = a.batch;
  p.num_draft = a.num_draft;
  p.mode = kModeVerify;
  p.slot_idx = a.slot_idx;
  p.write_pos = a.write_pos;
  return Report(Step(p, a.shape.state_dtype, StreamOf(a.launch)), "verify launch");
}

rssm_status Fold(const rssm_fold_args& a) {
  if (a.count == 0) return RSSM_OK;
  PrefillParams p{};
  p.ly = Describe(a.shape, a.pool);
  p.batch = a.count;
  p.fold_only = 1;
  p.slot_idx = a.slot_idx;
  p.write_pos = a.write_pos;
  return Report(PrefillOrFold(p, a.shape.state_dtype, StreamOf(a.launch)), "fold launch");
}

rssm_status Prefill(const rssm_prefill_args& a) {
  if (a.batch == 0) return RSSM_OK;
  PrefillParams p{};
  p.ly = Describe(a.shape, a.pool);
  SetParams(p.ly, a.params);
  SetTokens(p.ly, a.in, a.out);
  p.batch = a.batch;
  p.slot_idx = a.slot_idx;
  p.cu_seqlens = a.cu_seqlens;
  p.initial = a.initial;
  p.write_pos = a.write_pos;
  return Report(PrefillOrFold(p, a.shape.state_dtype, StreamOf(a.launch)), "prefill launch");
}

// Queued on the caller's stream; the part table is already in device memory (the caller's
// copy), so no allocation and no synchronization.
rssm_status SegmentDigests(const rssm_launch& launch, const void* const* parts, size_t count,
                           size_t part_bytes, size_t segment_bytes, uint64_t* digests) {
  const SegmentDigestParams p{reinterpret_cast<const uint8_t* const*>(parts), count, part_bytes,
                              count * part_bytes, segment_bytes, digests};
  return Report(LaunchSegmentDigests(p, StreamOf(launch)), "segment digests launch");
}

}  // namespace replayssm::kernels::cuda
