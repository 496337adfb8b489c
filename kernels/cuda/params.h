// Parameter structs of the CUDA kernels (plain pointers, dims, strides; passed by value as
// __grid_constant__) and the host launchers' declarations. See step_kernel.cuh (replay,
// baseline, verify) and prefill_kernel.cuh (prefill, fold) for what each field means.
#ifndef REPLAYSSM_KERNELS_CUDA_PARAMS_H_
#define REPLAYSSM_KERNELS_CUDA_PARAMS_H_

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

namespace replayssm::kernels::cuda {

// Offsets (in floats, each a multiple of 4) of the shared-memory arrays of one CTA.
struct SmemLayout {
  int kext;   // [(L+1), K]  records' k as stored, then the chunk's drafts' k (rounded)
  int gext;   // [(L+1), Kg] records' g, then the drafts' g (Kg = K for KDA, 1 for GDN)
  int kw;     // [L, K]      W_j ∘ k_j for the current token
  int dext;   // [(L+1), VT] records' d for the tile rows, then the drafts' d (rounded)
  int qs, ks, ka, qa;  // [TC, K] q, k (normalized, q scaled); A∘k, A∘q
  int avec;   // [K]         A of the last token (fold)
  int vs;     // [TC, VT]    v of the tile rows
  int u, pp;  // [TC, L+1]   (W_j∘k_j)·k, (W_j∘k_j)·q
  int skq;    // [TC, VT, 2] S0 contractions
  int dcur;   // [VT]        d of the last token, unrounded (fold)
  int beta, kq, norm;  // [TC], [TC], [TC, 2]
  int total;  // floats
  __host__ __device__ static int Up4(int x) { return (x + 3) & ~3; }
  __host__ __device__ static SmemLayout Make(int K, int L, int VT, int TC, bool kda) {
    SmemLayout s;
    int o = 0;
    auto take = [&o](int n) { const int at = o; o += Up4(n); return at; };
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

// What the layer looks like (shared by every kernel).
struct LayerDesc {
  int32_t H, HV, K, V, L, group;  // group = HV / H
  int32_t kda, l2norm, act_dtype;
  float scale;
  const float* a_log;    // [HV]
  const float* dt_bias;  // GDN [HV], KDA [HV, K]
  void* ckpt;            // [S, HV, V, K] state dtype
  void* ring_d;          // [S, HV, L, V]
  void* ring_k;          // [S, H, L, K]
  float* ring_g;         // [S, HV, L] or [S, HV, L, K]
  int64_t num_slots, ckpt_stride, d_stride, k_stride, g_stride;
  const void* qkv;       // [N, 2HK + HV V]
  const void* a;         // [N, HV] or [N, HV, K]
  const void* b;         // [N, HV]
  int64_t qkv_stride, a_stride, b_stride;
  void* o;               // [N, HV, V] act dtype, or null (prefill only)
  int64_t o_stride;
};

enum StepMode : int32_t { kModeReplay = 0, kModeBaseline = 1, kModeVerify = 2 };

struct StepParams {
  LayerDesc ly;
  int32_t batch;
  int32_t num_draft;  // T (1 for decode)
  int32_t mode;       // StepMode
  int32_t num_vtiles;
  const int32_t* slot_idx;    // [B]
  const int32_t* write_pos;   // [B] (null for the baseline)
  const uint8_t* force_fold;  // [B] or null
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

// Launchers: plan the grid, launch on `stream`, return the launch status. state_dtype is the
// rssm_dtype of the state; kmax the register tile width (128 or 256).
cudaError_t LaunchStep(StepParams p, int state_dtype, cudaStream_t stream);
cudaError_t LaunchPrefill(PrefillParams p, int state_dtype, cudaStream_t stream);

// Per-state-dtype entry points (explicit instantiations live in step_<dtype>.cu).
cudaError_t LaunchStepF32(StepParams p, cudaStream_t stream);
cudaError_t LaunchStepBf16(StepParams p, cudaStream_t stream);
cudaError_t LaunchStepF16(StepParams p, cudaStream_t stream);
cudaError_t LaunchPrefillF32(PrefillParams p, cudaStream_t stream);
cudaError_t LaunchPrefillBf16(PrefillParams p, cudaStream_t stream);
cudaError_t LaunchPrefillF16(PrefillParams p, cudaStream_t stream);

// rssm_segment_digests_parts (checksum.cu; rssm_segment_digests is count 1): the payload is
// parts[0] | parts[1] | ... (part_bytes each); segment i is payload bytes [i * segment_bytes,
// min((i + 1) * segment_bytes, bytes)); digests[i] its version 2 digest.
struct SegmentDigestParams {
  const uint8_t* const* parts;  // [count] device memory: the parts' device pointers, each
                                // 16-byte aligned
  size_t count;          // >= 1
  size_t part_bytes;     // > 0; a multiple of 16 when count > 1
  size_t bytes;          // count * part_bytes
  size_t segment_bytes;  // a positive multiple of 64
  uint64_t* digests;     // [ceil(bytes / segment_bytes)], device memory
};
// One CTA per segment; no synchronization.
cudaError_t LaunchSegmentDigests(const SegmentDigestParams& p, cudaStream_t stream);

}  // namespace replayssm::kernels::cuda

#endif  // REPLAYSSM_KERNELS_CUDA_PARAMS_H_
