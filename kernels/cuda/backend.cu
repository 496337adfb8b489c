// The CUDA backend of kernels/src/backend.h: maps the (already validated) C ABI arguments
// onto kernel params, plans the launch (plan.h), dispatches on the (state, ring) dtypes, launches
// on the caller's stream and reports launch failures as RSSM_ERR_DEVICE with the CUDA error text.
// No synchronization and no allocation: every kernel works in the caller's buffers and shared
// memory.
#include <algorithm>
#include <atomic>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "../src/backend.h"
#include "params.h"

namespace replayssm::kernels::cuda {
namespace {

// The current device's index and the limits the planner needs, read from the runtime once per
// device (every layer of every step launches: no attribute queries on that path).
struct DeviceFacts {
  int id = 0;
  DeviceLimits limits;
};
constexpr int kMaxDevices = 64;
cudaError_t DeviceFactsOf(DeviceFacts* out) {
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  static std::mutex mu;
  static DeviceFacts cache[kMaxDevices];
  static std::atomic<bool> ready[kMaxDevices];
  const bool cached = dev >= 0 && dev < kMaxDevices;
  if (cached && ready[dev].load(std::memory_order_acquire)) {
    *out = cache[dev];
    return cudaSuccess;
  }
  DeviceFacts d;
  d.id = dev;
  DeviceLimits& l = d.limits;
  if ((e = cudaDeviceGetAttribute(&l.smem_per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                  dev)) != cudaSuccess ||
      (e = cudaDeviceGetAttribute(&l.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                  dev)) != cudaSuccess ||
      (e = cudaDeviceGetAttribute(&l.sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess) {
    return e;
  }
  if (cached) {
    std::lock_guard<std::mutex> lock(mu);
    if (!ready[dev].load(std::memory_order_relaxed)) {  // never rewritten once readers may see it
      cache[dev] = d;
      ready[dev].store(true, std::memory_order_release);
    }
  }
  *out = d;
  return cudaSuccess;
}

// 16-byte aligned base and slot stride (a stride of 0: `dense` elements).
bool Aligned16(const void* ptr, int64_t stride, int64_t dense, size_t elem) {
  const int64_t s = stride != 0 ? stride : dense;
  return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0 && (s * int64_t(elem)) % 16 == 0;
}

// The (state, ring) dtype pair of a shape, as the launchers are keyed.
struct Storage {
  int32_t state, ring;
};
Storage StorageOf(const rssm_layer_shape& s) {
  return {s.state_dtype, rssm_ring_storage_dtype(&s)};
}

LaunchProblem ProblemOf(const LayerDesc& ly, KernelOp op, int64_t batch, int num_draft,
                        Storage storage) {
  LaunchProblem pr;
  pr.op = op;
  pr.kda = ly.kda != 0;
  pr.num_v_heads = ly.HV;
  pr.head_k = ly.K;
  pr.head_v = ly.V;
  pr.ring_len = ly.L;
  pr.state_bytes = storage.state == RSSM_DTYPE_F32 ? 4 : 2;
  pr.ring_bytes = storage.ring == RSSM_DTYPE_F32 ? 4 : 2;
  pr.batch = batch;
  pr.num_draft = num_draft;
  const size_t sz = static_cast<size_t>(pr.state_bytes), rz = static_cast<size_t>(pr.ring_bytes);
  pr.checkpoint_aligned = Aligned16(ly.ckpt, ly.ckpt_stride, int64_t{ly.HV} * ly.V * ly.K, sz);
  pr.ring_d_aligned = Aligned16(ly.ring_d, ly.d_stride, int64_t{ly.HV} * ly.L * ly.V, rz);
  pr.ring_k_aligned = Aligned16(ly.ring_k, ly.k_stride, int64_t{ly.H} * ly.L * ly.K, rz);
  pr.ring_g_aligned =
      Aligned16(ly.ring_g, ly.g_stride, int64_t{ly.HV} * ly.L * (ly.kda ? ly.K : 1), 4);
  return pr;
}

// The plan of `pr` on the current device, or the error that prevents one.
cudaError_t PlanOn(const LaunchProblem& pr, const LaunchOverrides& overrides, int* device,
                   LaunchPlan* plan) {
  DeviceFacts dev;
  const cudaError_t e = DeviceFactsOf(&dev);
  if (e != cudaSuccess) return e;
  const std::optional<LaunchPlan> planned = Plan(pr, dev.limits, overrides);
  if (!planned) return cudaErrorInvalidConfiguration;
  *device = dev.id;
  *plan = *planned;
  return cudaSuccess;
}

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
  ly.round_beta = p.round_beta;
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

// The pairs api.cc admits: an f32 state with any ring, a 16-bit state with its own.
cudaError_t Step(const StepParams& p, KernelOp op, Storage storage, cudaStream_t stream,
                 const LaunchOverrides& overrides, LaunchPlan* used) {
  LaunchPlan plan;
  int device = 0;
  const cudaError_t e =
      PlanOn(ProblemOf(p.ly, op, p.batch, p.num_draft, storage), overrides, &device, &plan);
  if (e != cudaSuccess) return e;
  if (used != nullptr) *used = plan;
  switch (storage.state) {
    case RSSM_DTYPE_F32:
      switch (storage.ring) {
        case RSSM_DTYPE_F32: return LaunchStepF32(plan, device, p, stream);
        case RSSM_DTYPE_BF16: return LaunchStepF32RingBf16(plan, device, p, stream);
        case RSSM_DTYPE_F16: return LaunchStepF32RingF16(plan, device, p, stream);
      }
      break;
    case RSSM_DTYPE_BF16: return LaunchStepBf16(plan, device, p, stream);
    case RSSM_DTYPE_F16: return LaunchStepF16(plan, device, p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t PrefillOrFold(const PrefillParams& p, KernelOp op, Storage storage,
                          cudaStream_t stream) {
  LaunchPlan plan;
  int device = 0;
  const cudaError_t e = PlanOn(ProblemOf(p.ly, op, p.batch, 1, storage), {}, &device, &plan);
  if (e != cudaSuccess) return e;
  switch (storage.state) {
    case RSSM_DTYPE_F32:
      switch (storage.ring) {
        case RSSM_DTYPE_F32: return LaunchPrefillF32(plan, device, p, stream);
        case RSSM_DTYPE_BF16: return LaunchPrefillF32RingBf16(plan, device, p, stream);
        case RSSM_DTYPE_F16: return LaunchPrefillF32RingF16(plan, device, p, stream);
      }
      break;
    case RSSM_DTYPE_BF16: return LaunchPrefillBf16(plan, device, p, stream);
    case RSSM_DTYPE_F16: return LaunchPrefillF16(plan, device, p, stream);
  }
  return cudaErrorInvalidValue;
}

rssm_status Decode(const rssm_decode_args& a, int mode, const char* what,
                   const LaunchOverrides& overrides, LaunchPlan* plan) {
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
  if (a.conv != nullptr) {  // api.cc refuses it for the baseline
    // The convolution first (its kernel lets dependents launch at once), then the step on y.
    const rssm_conv_args ca = JoinedConvArgs(a);
    const rssm_status st = ShortConv(ca);
    if (st != RSSM_OK) return st;
    p.ly.qkv = ca.y;
    p.ly.qkv_stride = ca.y_token_stride;
    p.after_conv = 1;
  }
  const KernelOp op = mode == kModeBaseline ? KernelOp::kBaseline : KernelOp::kReplay;
  return Report(Step(p, op, StorageOf(a.shape), StreamOf(a.launch), overrides, plan), what);
}

}  // namespace

bool Available() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

rssm_status ReplayDecode(const rssm_decode_args& args, const LaunchOverrides& overrides,
                         LaunchPlan* plan) {
  return Decode(args, kModeReplay, "replay decode launch", overrides, plan);
}

rssm_status BaselineDecode(const rssm_decode_args& args, const LaunchOverrides& overrides,
                           LaunchPlan* plan) {
  return Decode(args, kModeBaseline, "baseline decode launch", overrides, plan);
}

rssm_status Verify(const rssm_verify_args& a, const LaunchOverrides& overrides, LaunchPlan* plan) {
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
  return Report(Step(p, KernelOp::kVerify, StorageOf(a.shape), StreamOf(a.launch), overrides, plan),
                "verify launch");
}

rssm_status Fold(const rssm_fold_args& a) {
  if (a.count == 0) return RSSM_OK;
  PrefillParams p{};
  p.ly = Describe(a.shape, a.pool);
  p.batch = a.count;
  p.fold_only = 1;
  p.slot_idx = a.slot_idx;
  p.write_pos = a.write_pos;
  return Report(PrefillOrFold(p, KernelOp::kFold, StorageOf(a.shape), StreamOf(a.launch)),
                "fold launch");
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
  return Report(PrefillOrFold(p, KernelOp::kPrefill, StorageOf(a.shape), StreamOf(a.launch)),
                "prefill launch");
}

// Queued on the caller's stream; the part table is already in device memory (the caller's
// copy), so no allocation and no synchronization.
rssm_status SegmentDigests(const rssm_launch& launch, const void* const* parts, size_t count,
                           size_t part_bytes, size_t segment_bytes, uint64_t* digests) {
  const SegmentDigestParams p{reinterpret_cast<const uint8_t* const*>(parts), count, part_bytes,
                              count * part_bytes, segment_bytes, digests};
  return Report(LaunchSegmentDigests(p, StreamOf(launch)), "segment digests launch");
}

namespace {
// The cyclic comparison of CU_STREAM_WAIT_VALUE_GEQ. One thread: a word the owner rings
// further between the read and the swap fails the swap and is read again.
__global__ void RaiseValue32Kernel(uint32_t* addr, uint32_t value) {
  if (addr == nullptr) return;  // PreloadRaiseValue32's launch
  uint32_t old = atomicAdd(addr, 0u);
  while (static_cast<int32_t>(old - value) < 0) {
    const uint32_t seen = atomicCAS(addr, old, value);
    if (seen == old) break;
    old = seen;
  }
}
}  // namespace

// rssm_stream_wait_value32_or. One thread: its own word first (a wait whose word was rung is
// never counted unrung, even after the release), then the release word, which is host memory
// (a read crosses the bus: ~1 us, so it is read once per 16 polls of the word). Polls back off
// to a sleep of ~0.5 us once the wait has lasted a few microseconds.
__device__ __forceinline__ uint32_t LoadSys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__global__ void WaitValue32OrKernel(WaitArgs a) {
  if (a.addr == nullptr) return;  // PreloadDoorbellKernels' launch
  for (uint32_t i = 0;; ++i) {
    if (static_cast<int32_t>(LoadSys(a.addr) - a.value) >= 0) break;
    if (i % 16 == 0 && static_cast<int32_t>(LoadSys(a.release) - a.ticket) >= 0) {
      if (static_cast<int32_t>(LoadSys(a.addr) - a.value) >= 0) break;
      if (a.outcome != nullptr) {
        asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(a.outcome + (a.ticket & 1u)),
                     "r"(a.ticket)
                     : "memory");
      }
      break;
    }
    if (i >= 64) __nanosleep(i < 4096 ? 100 : 500);
  }
  // The work after the wait reads what its ringer wrote before the ring.
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}

rssm_status PreloadDoorbellKernels(void* stream) {
  RaiseValue32Kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(nullptr, 0u);
  WaitValue32OrKernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(WaitArgs{});
  return Report(cudaGetLastError(), "rssm_stream_create: loading the doorbell kernels");
}

rssm_status WaitValue32Or(const rssm_launch& launch, const WaitArgs& args) {
  WaitValue32OrKernel<<<1, 1, 0, StreamOf(launch)>>>(args);
  return Report(cudaGetLastError(), "rssm_stream_wait_value32_or launch");
}

rssm_status SetWaitNode(void* exec, void* node, const WaitArgs& args) {
  WaitArgs copy = args;
  void* params[] = {&copy};
  cudaKernelNodeParams p{};
  p.func = reinterpret_cast<void*>(&WaitValue32OrKernel);
  p.gridDim = dim3(1);
  p.blockDim = dim3(1);
  p.kernelParams = params;
  return Report(cudaGraphExecKernelNodeSetParams(static_cast<cudaGraphExec_t>(exec),
                                                 static_cast<cudaGraphNode_t>(node), &p),
                "rssm_graph_launch: setting a release wait");
}

rssm_status RaiseValue32(const rssm_launch& launch, uint32_t* addr, uint32_t value) {
  RaiseValue32Kernel<<<1, 1, 0, StreamOf(launch)>>>(addr, value);
  return Report(cudaGetLastError(), "rssm_stream_raise_value32 launch");
}

}  // namespace replayssm::kernels::cuda
