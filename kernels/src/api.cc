// The C ABI front: validates every argument before any work starts, resolves default
// strides, and dispatches to the backend. Error text: "<function>: <field>: expected <what>,
// got <value>".
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>

#include "backend.h"
#include "calls.h"
#include "launch_overrides.h"
#include "replayssm/kernels.h"

namespace replayssm::kernels {
namespace {

thread_local std::string g_last_error;

// Collects the first failure of a validation pass.
class Check {
 public:
  explicit Check(const char* function) : function_(function) {}

  bool ok() const { return ok_; }

  // Records "field: expected ..., got ..." unless a failure is already recorded.
  void Fail(const std::string& field, const std::string& expected, const std::string& got) {
    if (!ok_) return;
    ok_ = false;
    SetLastError(std::string(function_) + ": " + field + ": expected " + expected + ", got " +
                 got);
  }
  // Records "<detail>" (already "field: expected ..., got ...") unless a failure is recorded.
  void Fail(const std::string& detail) {
    if (!ok_) return;
    ok_ = false;
    SetLastError(std::string(function_) + ": " + detail);
  }
  void NotNull(const void* p, const std::string& field) {
    if (p == nullptr) Fail(field, "a non-null pointer", "NULL");
  }
  void Range(int64_t v, int64_t lo, int64_t hi, const std::string& field) {
    if (v < lo || v > hi) {
      Fail(field, "a value in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
           std::to_string(v));
    }
  }
  // A stride of 0 becomes `dense`; a non-zero stride must be at least `dense`.
  void Stride(int64_t* stride, int64_t dense, const std::string& field) {
    if (*stride == 0) {
      *stride = dense;
    } else if (*stride < dense) {
      Fail(field, "0 (dense) or >= " + std::to_string(dense), std::to_string(*stride));
    }
  }
  rssm_status status() const { return ok_ ? RSSM_OK : RSSM_ERR_INVALID_ARGUMENT; }

 private:
  const char* function_;
  bool ok_ = true;
};

bool ValidDtype(int32_t d) {
  return d == RSSM_DTYPE_F32 || d == RSSM_DTYPE_BF16 || d == RSSM_DTYPE_F16;
}

// The ring's dtype: a valid code, and a pair the kernels are built for (an fp32 state with any
// ring dtype, a 16-bit state with its own).
void CheckRingDtype(Check& c, const rssm_layer_shape& s) {
  const int32_t ring = rssm_ring_storage_dtype(&s);
  if (ring < 0) {
    c.Fail("shape.ring_dtype",
           "RSSM_RING_DTYPE_STATE (0), RSSM_RING_DTYPE_F32 (16), RSSM_RING_DTYPE_BF16 (17) or "
           "RSSM_RING_DTYPE_F16 (18)",
           std::to_string(s.ring_dtype));
  } else if (s.state_dtype != RSSM_DTYPE_F32 && ring != s.state_dtype) {
    c.Fail("shape.ring_dtype",
           std::string("a ring of the state dtype with a ") + rssm_dtype_name(s.state_dtype) +
               " state (RSSM_RING_DTYPE_STATE; only an f32 state takes another ring dtype)",
           std::to_string(s.ring_dtype) + " (" + rssm_dtype_name(ring) + " ring)");
  }
}

void CheckShape(Check& c, const rssm_layer_shape& s) {
  if (s.gate != RSSM_GATE_GDN && s.gate != RSSM_GATE_KDA) {
    c.Fail("shape.gate", "RSSM_GATE_GDN (0) or RSSM_GATE_KDA (1)", std::to_string(s.gate));
  }
  c.Range(s.num_qk_heads, 1, 1 << 16, "shape.num_qk_heads");
  c.Range(s.num_v_heads, 1, 1 << 16, "shape.num_v_heads");
  if (c.ok() && s.num_v_heads % s.num_qk_heads != 0) {
    c.Fail("shape.num_v_heads", "a multiple of num_qk_heads (" +
           std::to_string(s.num_qk_heads) + ")", std::to_string(s.num_v_heads));
  }
  for (auto [v, name] : {std::pair{s.head_k, "shape.head_k"}, {s.head_v, "shape.head_v"}}) {
    if (v < 16 || v > RSSM_MAX_HEAD_DIM || v % 16 != 0) {
      c.Fail(name, "a multiple of 16 in [16, 256]", std::to_string(v));
    }
  }
  c.Range(s.ring_len, 1, RSSM_MAX_RING_LEN, "shape.ring_len");
  if (!ValidDtype(s.state_dtype)) {
    c.Fail("shape.state_dtype", "F32 (0), BF16 (1) or F16 (2)", std::to_string(s.state_dtype));
  }
  if (!ValidDtype(s.act_dtype)) {
    c.Fail("shape.act_dtype", "F32 (0), BF16 (1) or F16 (2)", std::to_string(s.act_dtype));
  }
  if (c.ok()) CheckRingDtype(c, s);
}

void CheckLaunch(Check& c, const rssm_launch& l) {
  if (l.backend == RSSM_BACKEND_CPU) {
    if (l.stream != nullptr) c.Fail("launch.stream", "NULL on the CPU backend", "a stream");
  } else if (l.backend != RSSM_BACKEND_CUDA) {
    c.Fail("launch.backend", "RSSM_BACKEND_CPU (0) or RSSM_BACKEND_CUDA (1)",
           std::to_string(l.backend));
  }
}

void CheckParams(Check& c, const rssm_layer_params& p) {
  c.NotNull(p.a_log, "params.a_log");
  c.NotNull(p.dt_bias, "params.dt_bias");
  if (p.use_qk_l2norm != 0 && p.use_qk_l2norm != 1) {
    c.Fail("params.use_qk_l2norm", "0 or 1", std::to_string(p.use_qk_l2norm));
  }
  if (p.round_beta != 0 && p.round_beta != 1) {
    c.Fail("params.round_beta", "0 or 1", std::to_string(p.round_beta));
  }
  if (!(p.scale == p.scale)) c.Fail("params.scale", "a number", "NaN");
}

void CheckPool(Check& c, rssm_state_pool& p, const rssm_layer_shape& s, bool ring) {
  c.NotNull(p.checkpoint, "pool.checkpoint");
  if (p.num_slots < 1) c.Fail("pool.num_slots", ">= 1", std::to_string(p.num_slots));
  if (!c.ok()) return;
  c.Stride(&p.checkpoint_slot_stride, rssm_checkpoint_elems(&s), "pool.checkpoint_slot_stride");
  if (!ring) return;
  c.NotNull(p.ring_d, "pool.ring_d");
  c.NotNull(p.ring_k, "pool.ring_k");
  c.NotNull(p.ring_g, "pool.ring_g");
  c.Stride(&p.ring_d_slot_stride, rssm_ring_d_elems(&s), "pool.ring_d_slot_stride");
  c.Stride(&p.ring_k_slot_stride, rssm_ring_k_elems(&s), "pool.ring_k_slot_stride");
  c.Stride(&p.ring_g_slot_stride, rssm_ring_g_elems(&s), "pool.ring_g_slot_stride");
}

// C = 2*H*K + HV*V: the channels of a token's mixed_qkv (and of the short convolution).
int64_t QkvChannels(const rssm_layer_shape& s) {
  return 2LL * s.num_qk_heads * s.head_k + int64_t{s.num_v_heads} * s.head_v;
}

void CheckInputs(Check& c, rssm_token_inputs& in, const rssm_layer_shape& s) {
  c.NotNull(in.mixed_qkv, "in.mixed_qkv");
  c.NotNull(in.a, "in.a");
  c.NotNull(in.b, "in.b");
  const int64_t qkv = QkvChannels(s);
  const int64_t a = s.gate == RSSM_GATE_KDA ? int64_t{s.num_v_heads} * s.head_k : s.num_v_heads;
  c.Stride(&in.qkv_token_stride, qkv, "in.qkv_token_stride");
  c.Stride(&in.a_token_stride, a, "in.a_token_stride");
  c.Stride(&in.b_token_stride, s.num_v_heads, "in.b_token_stride");
}

void CheckOutputs(Check& c, rssm_token_outputs& out, const rssm_layer_shape& s, bool optional) {
  if (!optional) c.NotNull(out.o, "out.o");
  c.Stride(&out.token_stride, int64_t{s.num_v_heads} * s.head_v, "out.token_stride");
}

// CPU only: the index arrays are host memory, so their values are checked as well.

// A [n] array of 0/1 flags: any other value is refused, not taken as true.
void CheckFlags(Check& c, const uint8_t* flags, int64_t n, const char* name) {
  if (flags == nullptr) return;
  for (int64_t r = 0; r < n && c.ok(); ++r) {
    if (flags[r] > 1) {
      c.Fail(std::string(name) + "[" + std::to_string(r) + "]", "0 or 1", std::to_string(flags[r]));
    }
  }
}

void CheckSlots(Check& c, const int32_t* slot_idx, int32_t n, int64_t num_slots) {
  std::unordered_set<int32_t> seen;
  for (int32_t i = 0; i < n && c.ok(); ++i) {
    const std::string field = "slot_idx[" + std::to_string(i) + "]";
    c.Range(slot_idx[i], -1, num_slots - 1, field);
    if (c.ok() && slot_idx[i] >= 0 && !seen.insert(slot_idx[i]).second) {
      c.Fail(field, "a slot not already used by another row of this call",
             "duplicate slot " + std::to_string(slot_idx[i]));
    }
  }
}

void CheckCursors(Check& c, const int32_t* slot_idx, const int32_t* write_pos, int32_t n,
                  int32_t max_pos, const char* rule) {
  for (int32_t i = 0; i < n && c.ok(); ++i) {
    if (slot_idx[i] < 0) continue;
    if (write_pos[i] < 0 || write_pos[i] > max_pos) {
      c.Fail("write_pos[" + std::to_string(i) + "]", std::string(rule) + " = [0, " +
             std::to_string(max_pos) + "]", std::to_string(write_pos[i]));
    }
  }
}

// Launch overrides (launch_overrides.h; null on the C ABI) run on the CUDA kernels only.
void CheckOverrides(Check& c, const rssm_launch& l, const cuda::LaunchOverrides* overrides) {
  if (overrides == nullptr) return;
  if (l.backend != RSSM_BACKEND_CUDA) {
    c.Fail("launch.backend", "RSSM_BACKEND_CUDA (1) with launch overrides",
           std::to_string(l.backend));
  }
  const std::string bad = cuda::CheckOverrides(*overrides);
  if (!bad.empty()) c.Fail("overrides." + bad);
}

void CheckConvShape(Check& c, const rssm_conv_shape& s) {
  if (s.channels < 1 || s.channels > (1 << 24) || s.channels % 8 != 0) {
    c.Fail("shape.channels", "a multiple of 8 in [8, 2^24]", std::to_string(s.channels));
  }
  c.Range(s.width, 2, RSSM_MAX_CONV_WIDTH, "shape.width");
  c.Range(s.ring_len, 1, RSSM_MAX_RING_LEN, "shape.ring_len");
  if (!ValidDtype(s.act_dtype)) {
    c.Fail("shape.act_dtype", "RSSM_DTYPE_F32 (0), RSSM_DTYPE_BF16 (1) or RSSM_DTYPE_F16 (2)",
           std::to_string(s.act_dtype));
  }
}

}  // namespace

rssm_conv_args JoinedConvArgs(const rssm_decode_args& args) {
  const rssm_layer_shape& s = args.shape;
  const int64_t channels = QkvChannels(s);
  rssm_conv_args c{};
  c.launch = args.launch;
  c.shape = {static_cast<int32_t>(channels), args.conv->width, s.ring_len, s.act_dtype};
  c.weight = args.conv->weight;
  c.bias = args.conv->bias;
  c.state = args.conv->state;
  c.mode = RSSM_CONV_APPEND;
  c.batch = args.batch;
  c.slot_idx = args.slot_idx;
  c.write_pos = args.write_pos;
  c.num_tokens = 1;
  c.x = args.in.mixed_qkv;
  c.x_token_stride = args.in.qkv_token_stride;
  c.y = args.conv->y;
  c.y_token_stride = channels;
  return c;
}

namespace {

// `prefix` names the state's fields in messages ("state." or "conv->state.").
void CheckConvState(Check& c, rssm_conv_state& st, const rssm_conv_shape& s,
                    const std::string& prefix = "state.") {
  c.NotNull(st.window, prefix + "window");
  c.NotNull(st.ring_x, prefix + "ring_x");
  if (st.num_slots < 1) c.Fail(prefix + "num_slots", ">= 1", std::to_string(st.num_slots));
  c.Stride(&st.window_slot_stride, int64_t{s.width - 1} * s.channels,
           prefix + "window_slot_stride");
  c.Stride(&st.ring_x_slot_stride, int64_t{s.ring_len} * s.channels, prefix + "ring_x_slot_stride");
}

// rssm_decode_args.conv (non-null): checked against the layer; on return *out holds it with
// dense strides resolved.
void CheckDecodeConv(Check& c, const rssm_decode_args& a, bool baseline, rssm_decode_conv* out) {
  if (baseline) {
    c.Fail("conv", "NULL (the baseline decode takes convolved inputs)", "a convolution");
    return;
  }
  *out = *a.conv;
  c.Range(a.batch, 0, 65535, "batch (with conv: the convolution's rows)");
  c.Range(out->width, 2, RSSM_MAX_CONV_WIDTH, "conv->width");
  c.NotNull(out->weight, "conv->weight");
  if (!c.ok()) return;
  const rssm_layer_shape& s = a.shape;
  const int64_t channels = QkvChannels(s);
  const rssm_conv_shape cs{static_cast<int32_t>(channels), out->width, s.ring_len, s.act_dtype};
  CheckConvState(c, out->state, cs, "conv->state.");
  if (c.ok() && out->state.num_slots != a.pool.num_slots) {
    c.Fail("conv->state.num_slots", "pool.num_slots = " + std::to_string(a.pool.num_slots),
           std::to_string(out->state.num_slots));
  }
  c.NotNull(out->y, "conv->y");
  if (c.ok() && out->y == a.in.mixed_qkv) {
    c.Fail("conv->y", "a buffer other than in.mixed_qkv", "y == in.mixed_qkv");
  }
}

bool IsCpu(const rssm_launch& l) { return l.backend == RSSM_BACKEND_CPU; }

rssm_status Finish(const Check& c) {
  if (c.ok()) g_last_error.clear();
  return c.status();
}

// The decode calls; `overrides` and `plan` as in launch_overrides.h (null on the C ABI).
rssm_status Decode(const rssm_decode_args* in, bool baseline, const char* fn,
                   const cuda::LaunchOverrides* overrides, cuda::LaunchPlan* plan) {
  Check c(fn);
  if (in == nullptr) {
    c.Fail("args", "a non-null pointer", "NULL");
    return Finish(c);
  }
  rssm_decode_args a = *in;
  CheckLaunch(c, a.launch);
  CheckOverrides(c, a.launch, overrides);
  CheckShape(c, a.shape);
  if (!c.ok()) return Finish(c);
  CheckParams(c, a.params);
  CheckPool(c, a.pool, a.shape, !baseline);
  c.Range(a.batch, 0, 1 << 24, "batch");
  if (!c.ok() || a.batch == 0) return Finish(c);
  c.NotNull(a.slot_idx, "slot_idx");
  if (!baseline) c.NotNull(a.write_pos, "write_pos");
  CheckInputs(c, a.in, a.shape);
  CheckOutputs(c, a.out, a.shape, false);
  rssm_decode_conv conv{};
  if (c.ok() && a.conv != nullptr) {
    CheckDecodeConv(c, a, baseline, &conv);
    a.conv = &conv;
  }
  if (c.ok() && IsCpu(a.launch)) {
    CheckSlots(c, a.slot_idx, a.batch, a.pool.num_slots);
    if (a.conv != nullptr) {  // the input's ring entry: w + 1 <= L
      CheckCursors(c, a.slot_idx, a.write_pos, a.batch, a.shape.ring_len - 1,
                   "room for the input in ring_x (conv): w + 1 <= L, w in");
    } else if (!baseline) {
      CheckCursors(c, a.slot_idx, a.write_pos, a.batch, a.shape.ring_len, "[0, L]");
    }
    if (!baseline) CheckFlags(c, a.force_fold, a.batch, "force_fold");
  }
  if (!c.ok()) return Finish(c);
  g_last_error.clear();
  if (IsCpu(a.launch)) return baseline ? cpu::BaselineDecode(a) : cpu::ReplayDecode(a);
  if (const rssm_status st = UseStreamDevice(&a.launch, fn); st != RSSM_OK) return st;
  const cuda::LaunchOverrides ov = overrides != nullptr ? *overrides : cuda::LaunchOverrides{};
  return baseline ? cuda::BaselineDecode(a, ov, plan) : cuda::ReplayDecode(a, ov, plan);
}

// The verify call, as Decode.
rssm_status Verify(const rssm_verify_args* in, const char* fn,
                   const cuda::LaunchOverrides* overrides, cuda::LaunchPlan* plan) {
  Check c(fn);
  if (in == nullptr) {
    c.Fail("args", "a non-null pointer", "NULL");
    return Finish(c);
  }
  rssm_verify_args a = *in;
  CheckLaunch(c, a.launch);
  CheckOverrides(c, a.launch, overrides);
  CheckShape(c, a.shape);
  if (!c.ok()) return Finish(c);
  CheckParams(c, a.params);
  CheckPool(c, a.pool, a.shape, true);
  c.Range(a.num_draft, 1, a.shape.ring_len, "num_draft (T, at most ring_len)");
  c.Range(a.batch, 0, 1 << 24, "batch");
  if (!c.ok() || a.batch == 0) return Finish(c);
  c.NotNull(a.slot_idx, "slot_idx");
  c.NotNull(a.write_pos, "write_pos");
  CheckInputs(c, a.in, a.shape);
  CheckOutputs(c, a.out, a.shape, false);
  if (c.ok() && IsCpu(a.launch)) {
    CheckSlots(c, a.slot_idx, a.batch, a.pool.num_slots);
    CheckCursors(c, a.slot_idx, a.write_pos, a.batch, a.shape.ring_len - a.num_draft,
                 "room for T drafts: w + T <= L, w in");
  }
  if (!c.ok()) return Finish(c);
  g_last_error.clear();
  if (IsCpu(a.launch)) return cpu::Verify(a);
  if (const rssm_status st = UseStreamDevice(&a.launch, fn); st != RSSM_OK) return st;
  const cuda::LaunchOverrides ov = overrides != nullptr ? *overrides : cuda::LaunchOverrides{};
  return cuda::Verify(a, ov, plan);
}

// What the digest call checks first: the launch (a NULL one ends the checks) and
// segment_bytes.
void CheckDigestCall(Check& c, const rssm_launch* launch, size_t segment_bytes) {
  if (launch == nullptr) {
    c.Fail("launch", "a non-null pointer", "NULL");
    return;
  }
  CheckLaunch(c, *launch);
  if (segment_bytes == 0 || segment_bytes % 64 != 0) {
    c.Fail("segment_bytes", "a positive multiple of 64", std::to_string(segment_bytes));
  }
}

// bytes > 0 (named `what`) in at most 2^31 - 1 segments: the CUDA kernel runs one CTA per
// segment.
void CheckSegmentCount(Check& c, size_t bytes, const char* what, size_t segment_bytes) {
  if ((bytes - 1) / segment_bytes >= size_t{INT32_MAX}) {
    c.Fail("segment_bytes", std::string("at most 2^31 - 1 segments of ") + what + " (" +
           std::to_string(bytes) + ")", std::to_string(segment_bytes));
  }
}

// A non-null pointer that is not 16-byte aligned fails (a null one is NotNull's to report).
void CheckAligned16(Check& c, const void* p, const std::string& field) {
  const uintptr_t off = reinterpret_cast<uintptr_t>(p) % 16;
  if (p != nullptr && off != 0) {
    c.Fail(field, "a 16-byte aligned pointer",
           "an address " + std::to_string(off) + " bytes past a multiple of 16");
  }
}

rssm_status RunSegmentDigests(const rssm_launch& l, const void* const* parts,
                              const void* const* parts_device, size_t count, size_t part_bytes,
                              size_t segment_bytes, uint64_t* digests) {
  g_last_error.clear();
  if (IsCpu(l)) return cpu::SegmentDigests(parts, count, part_bytes, segment_bytes, digests);
  if (const rssm_status st = UseStreamDevice(&l, "rssm_segment_digests"); st != RSSM_OK) return st;
  return cuda::SegmentDigests(l, parts_device, count, part_bytes, segment_bytes, digests);
}

}  // namespace

void SetLastError(std::string message) { g_last_error = std::move(message); }

rssm_status ReplayDecodeWith(const rssm_decode_args* args, const cuda::LaunchOverrides& overrides,
                             cuda::LaunchPlan* plan) {
  return Decode(args, false, "ReplayDecodeWith", &overrides, plan);
}

rssm_status BaselineDecodeWith(const rssm_decode_args* args,
                               const cuda::LaunchOverrides& overrides, cuda::LaunchPlan* plan) {
  return Decode(args, true, "BaselineDecodeWith", &overrides, plan);
}

rssm_status VerifyWith(const rssm_verify_args* args, const cuda::LaunchOverrides& overrides,
                       cuda::LaunchPlan* plan) {
  return Verify(args, "VerifyWith", &overrides, plan);
}

}  // namespace replayssm::kernels

using namespace replayssm::kernels;  // NOLINT: the C ABI below is a thin shell

extern "C" {

rssm_status rssm_replay_decode(const rssm_decode_args* args) {
  return Decode(args, false, "rssm_replay_decode", nullptr, nullptr);
}

rssm_status rssm_baseline_decode(const rssm_decode_args* args) {
  return Decode(args, true, "rssm_baseline_decode", nullptr, nullptr);
}

rssm_status rssm_fold(const rssm_fold_args* in) {
  Check c("rssm_fold");
  if (in == nullptr) {
    c.Fail("args", "a non-null pointer", "NULL");
    return Finish(c);
  }
  rssm_fold_args a = *in;
  CheckLaunch(c, a.launch);
  CheckShape(c, a.shape);
  if (!c.ok()) return Finish(c);
  CheckPool(c, a.pool, a.shape, true);
  c.Range(a.count, 0, 1 << 24, "count");
  if (!c.ok() || a.count == 0) return Finish(c);
  c.NotNull(a.slot_idx, "slot_idx");
  c.NotNull(a.write_pos, "write_pos");
  if (c.ok() && IsCpu(a.launch)) {
    CheckSlots(c, a.slot_idx, a.count, a.pool.num_slots);
    CheckCursors(c, a.slot_idx, a.write_pos, a.count, a.shape.ring_len, "[0, L]");
  }
  if (!c.ok()) return Finish(c);
  g_last_error.clear();
  if (IsCpu(a.launch)) {
    if (CpuFailureInjected("rssm_fold")) {
      SetLastError("rssm_fold: cpu: a failure injected (REPLAYSSM_CPU_FAIL_CALLS)");
      return RSSM_ERR_DEVICE;
    }
    return cpu::Fold(a);
  }
  if (const rssm_status st = UseStreamDevice(&a.launch, "rssm_fold"); st != RSSM_OK) return st;
  return cuda::Fold(a);
}

rssm_status rssm_prefill(const rssm_prefill_args* in) {
  Check c("rssm_prefill");
  if (in == nullptr) {
    c.Fail("args", "a non-null pointer", "NULL");
    return Finish(c);
  }
  rssm_prefill_args a = *in;
  CheckLaunch(c, a.launch);
  CheckShape(c, a.shape);
  if (!c.ok()) return Finish(c);
  CheckParams(c, a.params);
  CheckPool(c, a.pool, a.shape, true);
  c.Range(a.batch, 0, 1 << 24, "batch");
  if (!c.ok() || a.batch == 0) return Finish(c);
  c.NotNull(a.slot_idx, "slot_idx");
  c.NotNull(a.cu_seqlens, "cu_seqlens");
  if (a.initial != nullptr) c.NotNull(a.write_pos, "write_pos (required with initial)");
  c.Range(a.max_seqlen, 0, int64_t{1} << 30, "max_seqlen");
  CheckInputs(c, a.in, a.shape);
  CheckOutputs(c, a.out, a.shape, true);
  if (c.ok() && IsCpu(a.launch)) {
    CheckSlots(c, a.slot_idx, a.batch, a.pool.num_slots);
    CheckFlags(c, a.initial, a.batch, "initial");
    if (a.cu_seqlens[0] != 0) c.Fail("cu_seqlens[0]", "0", std::to_string(a.cu_seqlens[0]));
    for (int32_t r = 0; r < a.batch && c.ok(); ++r) {
      const int64_t len = int64_t{a.cu_seqlens[r + 1]} - a.cu_seqlens[r];
      c.Range(len, 0, a.max_seqlen, "cu_seqlens[" + std::to_string(r + 1) + "] - cu_seqlens[" +
              std::to_string(r) + "] (row length, at most max_seqlen)");
      if (a.initial != nullptr && a.initial[r] && a.slot_idx[r] >= 0) {
        c.Range(a.write_pos[r], 0, a.shape.ring_len, "write_pos[" + std::to_string(r) + "]");
      }
    }
  }
  if (!c.ok()) return Finish(c);
  g_last_error.clear();
  if (IsCpu(a.launch)) return cpu::Prefill(a);
  if (const rssm_status st = UseStreamDevice(&a.launch, "rssm_prefill"); st != RSSM_OK) return st;
  return cuda::Prefill(a);
}

rssm_status rssm_verify(const rssm_verify_args* args) {
  return Verify(args, "rssm_verify", nullptr, nullptr);
}

rssm_status rssm_short_conv(const rssm_conv_args* in) {
  Check c("rssm_short_conv");
  if (in == nullptr) {
    c.Fail("args", "a non-null pointer", "NULL");
    return Finish(c);
  }
  rssm_conv_args a = *in;
  CheckLaunch(c, a.launch);
  CheckConvShape(c, a.shape);
  if (!c.ok()) return Finish(c);
  c.NotNull(a.weight, "weight");
  CheckConvState(c, a.state, a.shape);
  if (a.mode != RSSM_CONV_APPEND && a.mode != RSSM_CONV_PREFILL) {
    c.Fail("mode", "RSSM_CONV_APPEND (0) or RSSM_CONV_PREFILL (1)", std::to_string(a.mode));
  }
  c.Range(a.batch, 0, 65535, "batch");
  if (!c.ok() || a.batch == 0) return Finish(c);
  const bool append = a.mode == RSSM_CONV_APPEND;
  c.NotNull(a.slot_idx, "slot_idx");
  if (append || a.initial != nullptr) {
    c.NotNull(a.write_pos, append ? "write_pos" : "write_pos (required with initial)");
  }
  if (a.cu_seqlens == nullptr) {
    c.Range(a.num_tokens, 1, append ? a.shape.ring_len : 1 << 20,
            "num_tokens (tokens per row without cu_seqlens)");
  } else {
    c.Range(a.num_tokens, 0, 1 << 20, "num_tokens (the longest row, with cu_seqlens)");
  }
  c.NotNull(a.x, "x");
  c.NotNull(a.y, "y");
  c.Stride(&a.x_token_stride, a.shape.channels, "x_token_stride");
  c.Stride(&a.y_token_stride, a.shape.channels, "y_token_stride");
  if (c.ok() && a.x == a.y) c.Fail("y", "a buffer other than x", "y == x");
  if (c.ok() && IsCpu(a.launch)) {
    CheckSlots(c, a.slot_idx, a.batch, a.state.num_slots);
    if (!append) CheckFlags(c, a.initial, a.batch, "initial");
    if (a.cu_seqlens != nullptr && a.cu_seqlens[0] != 0) {
      c.Fail("cu_seqlens[0]", "0", std::to_string(a.cu_seqlens[0]));
    }
    for (int32_t r = 0; r < a.batch && c.ok(); ++r) {
      const int64_t len =
          a.cu_seqlens ? int64_t{a.cu_seqlens[r + 1]} - a.cu_seqlens[r] : a.num_tokens;
      if (len < 0 || len > a.num_tokens) {
        c.Fail("cu_seqlens[" + std::to_string(r + 1) + "] - cu_seqlens[" + std::to_string(r) +
                   "] (row length)",
               "a value in [0, num_tokens = " + std::to_string(a.num_tokens) + "]",
               std::to_string(len));
      }
      const bool reads = append || (a.initial != nullptr && a.initial[r]);
      if (!c.ok() || a.slot_idx[r] < 0 || !reads) continue;
      const int64_t max_pos = append ? a.shape.ring_len - len : a.shape.ring_len;
      c.Range(a.write_pos[r], 0, max_pos,
              "write_pos[" + std::to_string(r) + "]" +
                  (append ? " (w + tokens <= ring_len " + std::to_string(a.shape.ring_len) + ")"
                          : std::string()));
    }
  }
  if (!c.ok()) return Finish(c);
  g_last_error.clear();
  if (IsCpu(a.launch)) return cpu::ShortConv(a);
  if (const rssm_status st = UseStreamDevice(&a.launch, "rssm_short_conv"); st != RSSM_OK) return st;
  return cuda::ShortConv(a);
}

rssm_status rssm_conv_fold(const rssm_conv_fold_args* in) {
  Check c("rssm_conv_fold");
  if (in == nullptr) {
    c.Fail("args", "a non-null pointer", "NULL");
    return Finish(c);
  }
  rssm_conv_fold_args a = *in;
  CheckLaunch(c, a.launch);
  CheckConvShape(c, a.shape);
  if (!c.ok()) return Finish(c);
  CheckConvState(c, a.state, a.shape);
  c.Range(a.count, 0, 1 << 24, "count");
  if (!c.ok() || a.count == 0) return Finish(c);
  c.NotNull(a.slot_idx, "slot_idx");
  c.NotNull(a.write_pos, "write_pos");
  if (c.ok() && IsCpu(a.launch)) {
    CheckSlots(c, a.slot_idx, a.count, a.state.num_slots);
    CheckCursors(c, a.slot_idx, a.write_pos, a.count, a.shape.ring_len, "[0, L]");
  }
  if (!c.ok()) return Finish(c);
  g_last_error.clear();
  if (IsCpu(a.launch)) return cpu::ConvFold(a);
  if (const rssm_status st = UseStreamDevice(&a.launch, "rssm_conv_fold"); st != RSSM_OK) return st;
  return cuda::ConvFold(a);
}

rssm_status rssm_count_nonfinite(const rssm_launch* launch, const void* const* parts,
                                 const void* const* parts_device, size_t count,
                                 size_t part_elems, int32_t dtype, uint32_t* result) {
  Check c("rssm_count_nonfinite");
  if (launch == nullptr) {
    c.Fail("launch", "a non-null pointer", "NULL");
    return Finish(c);
  }
  CheckLaunch(c, *launch);
  if (!ValidDtype(dtype)) {
    c.Fail("dtype", "RSSM_DTYPE_F32 (0), RSSM_DTYPE_BF16 (1) or RSSM_DTYPE_F16 (2)",
           std::to_string(dtype));
  }
  c.NotNull(result, "result");
  if (c.ok() && (reinterpret_cast<uintptr_t>(result) & 3u) != 0) {
    c.Fail("result", "a 4-byte aligned pointer", "a misaligned one");
  }
  if (c.ok() && count > 0 && part_elems > 0) {
    c.NotNull(parts, "parts");
    c.NotNull(parts_device, "parts_device");
    const size_t es = rssm_dtype_size(dtype);
    for (size_t i = 0; c.ok() && i < count; ++i) {
      const std::string field = "parts[" + std::to_string(i) + "]";
      c.NotNull(parts[i], field);
      if (c.ok() && (reinterpret_cast<uintptr_t>(parts[i]) % es) != 0) {
        c.Fail(field, "aligned to its dtype (" + std::to_string(es) + " bytes)", "misaligned");
      }
    }
  }
  if (!c.ok()) return Finish(c);
  g_last_error.clear();
  if (IsCpu(*launch)) {
    if (CpuFailureInjected("rssm_count_nonfinite")) {
      SetLastError("rssm_count_nonfinite: cpu: a failure injected (REPLAYSSM_CPU_FAIL_CALLS)");
      return RSSM_ERR_DEVICE;
    }
    return cpu::CountNonfinite(parts, count, part_elems, dtype, result);
  }
  if (const rssm_status st = UseStreamDevice(launch, "rssm_count_nonfinite"); st != RSSM_OK) {
    return st;
  }
  return cuda::CountNonfinite(*launch, parts_device, count, part_elems, dtype, result);
}

int64_t rssm_conv_window_elems(const rssm_conv_shape* s) {
  return s == nullptr || s->width < 2 ? 0 : int64_t{s->width - 1} * s->channels;
}
int64_t rssm_conv_ring_elems(const rssm_conv_shape* s) {
  return s == nullptr ? 0 : int64_t{s->ring_len} * s->channels;
}

rssm_status rssm_segment_digests_parts(const rssm_launch* launch, const void* const* parts,
                                       const void* const* parts_device, size_t count,
                                       size_t part_bytes, size_t segment_bytes,
                                       uint64_t* digests) {
  Check c("rssm_segment_digests_parts");
  CheckDigestCall(c, launch, segment_bytes);
  if (c.ok() && part_bytes != 0 && count > SIZE_MAX / part_bytes) {
    c.Fail("part_bytes", "count * part_bytes to fit in size_t (count " + std::to_string(count) +
           ")", std::to_string(part_bytes));
  }
  if (!c.ok() || count == 0 || part_bytes == 0) return Finish(c);
  CheckSegmentCount(c, count * part_bytes, "count * part_bytes", segment_bytes);
  c.NotNull(parts, "parts (count * part_bytes > 0)");
  if (count > 1 && part_bytes % 16 != 0) {
    c.Fail("part_bytes", "a multiple of 16 when count > 1 (count " + std::to_string(count) + ")",
           std::to_string(part_bytes));
  }
  for (size_t j = 0; c.ok() && j < count; ++j) {
    const std::string field = "parts[" + std::to_string(j) + "]";
    c.NotNull(parts[j], field);
    CheckAligned16(c, parts[j], field);
  }
  c.NotNull(parts_device, "parts_device");
  if (c.ok() && reinterpret_cast<uintptr_t>(parts_device) % alignof(void*) != 0) {
    c.Fail("parts_device", "an 8-byte aligned pointer", "a misaligned one");
  }
  c.NotNull(digests, "digests");
  if (!c.ok()) return Finish(c);
  return RunSegmentDigests(*launch, parts, parts_device, count, part_bytes, segment_bytes,
                           digests);
}

const char* rssm_status_name(rssm_status status) {
  switch (status) {
    case RSSM_OK: return "OK";
    case RSSM_ERR_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case RSSM_ERR_UNSUPPORTED: return "UNSUPPORTED";
    case RSSM_ERR_DEVICE: return "DEVICE";
  }
  return "UNKNOWN";
}

const char* rssm_dtype_name(int32_t dtype) {
  switch (dtype) {
    case RSSM_DTYPE_F32: return "f32";
    case RSSM_DTYPE_BF16: return "bf16";
    case RSSM_DTYPE_F16: return "f16";
  }
  return "unknown";
}

size_t rssm_dtype_size(int32_t dtype) {
  switch (dtype) {
    case RSSM_DTYPE_F32: return 4;
    case RSSM_DTYPE_BF16:
    case RSSM_DTYPE_F16: return 2;
  }
  return 0;
}

const char* rssm_last_error(void) { return g_last_error.c_str(); }

int rssm_backend_available(int32_t backend) {
  if (backend == RSSM_BACKEND_CPU) return 1;
  if (backend == RSSM_BACKEND_CUDA) return cuda::Available() ? 1 : 0;
  return 0;
}

rssm_status rssm_check_shape(const rssm_layer_shape* shape) {
  Check c("rssm_check_shape");
  if (shape == nullptr) {
    c.Fail("shape", "a non-null pointer", "NULL");
  } else {
    CheckShape(c, *shape);
  }
  return Finish(c);
}

int64_t rssm_checkpoint_elems(const rssm_layer_shape* s) {
  return int64_t{s->num_v_heads} * s->head_v * s->head_k;
}
int64_t rssm_ring_d_elems(const rssm_layer_shape* s) {
  return int64_t{s->num_v_heads} * s->ring_len * s->head_v;
}
int64_t rssm_ring_k_elems(const rssm_layer_shape* s) {
  return int64_t{s->num_qk_heads} * s->ring_len * s->head_k;
}
int64_t rssm_ring_g_elems(const rssm_layer_shape* s) {
  const int64_t per = s->gate == RSSM_GATE_KDA ? s->head_k : 1;
  return int64_t{s->num_v_heads} * s->ring_len * per;
}

int64_t rssm_slot_layer_bytes(const rssm_layer_shape* s) {
  if (s == nullptr) return 0;
  Check c("rssm_slot_layer_bytes");
  CheckShape(c, *s);
  if (!c.ok()) return 0;
  const int64_t es = static_cast<int64_t>(rssm_dtype_size(s->state_dtype));
  const int64_t rs = static_cast<int64_t>(rssm_dtype_size(rssm_ring_storage_dtype(s)));
  return es * rssm_checkpoint_elems(s) + rs * (rssm_ring_d_elems(s) + rssm_ring_k_elems(s)) +
         4 * rssm_ring_g_elems(s);
}

int32_t rssm_ring_storage_dtype(const rssm_layer_shape* s) {
  if (s == nullptr) return -1;
  if (s->ring_dtype == RSSM_RING_DTYPE_STATE) return s->state_dtype;
  const int32_t d = s->ring_dtype - RSSM_RING_DTYPE_F32;
  return s->ring_dtype >= RSSM_RING_DTYPE_F32 && ValidDtype(d) ? d : -1;
}

}  // extern "C"

#ifndef REPLAYSSM_WITH_CUDA
namespace replayssm::kernels::cuda {
namespace {
rssm_status NotBuilt() {
  SetLastError("the CUDA backend is not built into this library (configure with REPLAYSSM_CUDA=ON)");
  return RSSM_ERR_UNSUPPORTED;
}
}  // namespace
bool Available() { return false; }
rssm_status ReplayDecode(const rssm_decode_args&, const LaunchOverrides&, LaunchPlan*) {
  return NotBuilt();
}
rssm_status BaselineDecode(const rssm_decode_args&, const LaunchOverrides&, LaunchPlan*) {
  return NotBuilt();
}
rssm_status Fold(const rssm_fold_args&) { return NotBuilt(); }
rssm_status ShortConv(const rssm_conv_args&) { return NotBuilt(); }
rssm_status ConvFold(const rssm_conv_fold_args&) { return NotBuilt(); }
rssm_status CountNonfinite(const rssm_launch&, const void* const*, size_t, size_t, int32_t,
                           uint32_t*) {
  return NotBuilt();
}
rssm_status Prefill(const rssm_prefill_args&) { return NotBuilt(); }
rssm_status Verify(const rssm_verify_args&, const LaunchOverrides&, LaunchPlan*) {
  return NotBuilt();
}
rssm_status SegmentDigests(const rssm_launch&, const void* const*, size_t, size_t, size_t,
                           uint64_t*) {
  return NotBuilt();
}
}  // namespace replayssm::kernels::cuda
#endif
