// Test harness for the kernel C ABI: host buffers for one layer's pool, random inputs, an
// fp64 reference of the plain recurrence (written here, independent of the code under test),
// and readers that rebuild a slot's logical state from the documented storage layout.
#ifndef REPLAYSSM_KERNELS_TESTS_HARNESS_H_
#define REPLAYSSM_KERNELS_TESTS_HARNESS_H_

#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "replayssm/kernels.h"

namespace replayssm::kernels::testing {

// Tolerances, in one place. Errors are relative L2 norms ‖x − ref‖ / ‖ref‖ against the fp64
// reference run on the same already-rounded inputs, so the only sources of error are
// (1) fp32 accumulation in the kernel, (2) rounding of the stored state (checkpoint and ring
// d, k) to the state dtype, and (3) rounding of the output to the activation dtype.
//  - fp32 state: fp32 dot products of length <= 256 over <= ~200 steps; observed ~1e-6 on
//    the CPU backend; bound 2e-5 (a wrong term costs >= 1e-2).
//  - fp16 state: each store rounds by <= 2^-11 ~ 4.9e-4 relative; errors of past stores decay
//    with the gates (alpha < 1) and the delta rule's (I - beta k kᵀ), so they stay about one
//    rounding: observed 4e-4; bound 2e-3 (4 roundings).
//  - bf16 state: the same with 2^-8 ~ 3.9e-3: observed 3.4e-3; bound 1.5e-2 (4 roundings).
//  - output rounding adds at most half an ulp per element: fp16 2^-11, bf16 2^-8; bounds
//    1e-3 and 8e-3 (observed 2.9e-4 and 2.5e-3 with an fp32 state).
//  - a ring of its own dtype (fp32 checkpoint, 16-bit ring d, k): the records' roundings are
//    the same as a 16-bit state's, the checkpoint's are fp32; bound: the coarser dtype's.
//    Observed (2026-12-01, a fold adding its own record rounded as well): bf16 ring 3.2e-3
//    state, 8.9e-3 output with bf16 activations (bf16 state: 3.7e-3, 8.8e-3; 3.3e-3 before
//    that rounding); fp16 ring 4.2e-4 state.
// Observed figures: the CPU sweep of 2026-11-30 (max over every case).
double StateTolerance(rssm_dtype dtype);
double OutputTolerance(rssm_dtype state_dtype, rssm_dtype act_dtype);
struct Config;
double StateTolerance(const Config& c);   // the coarser of the state and ring dtypes
double OutputTolerance(const Config& c);  // likewise, plus the act dtype's rounding

// A host buffer of `n` elements of dtype `dt`.
class Buffer {
 public:
  Buffer() = default;
  Buffer(rssm_dtype dt, int64_t n) : dtype_(dt), n_(n), bytes_(n * rssm_dtype_size(dt)) {}
  float Get(int64_t i) const;
  void Set(int64_t i, float v);  // rounds to the dtype
  void FillNaN();
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  int64_t size() const { return n_; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  rssm_dtype dtype() const { return dtype_; }

 private:
  rssm_dtype dtype_ = RSSM_DTYPE_F32;
  int64_t n_ = 0;
  std::vector<uint8_t> bytes_;
};

// One configuration of the sweep.
struct Config {
  rssm_gate gate = RSSM_GATE_GDN;
  rssm_dtype state_dtype = RSSM_DTYPE_F32;
  rssm_dtype act_dtype = RSSM_DTYPE_BF16;
  int32_t ring_dtype = -1;  // rssm_dtype of ring d, k; -1: the state dtype (ring_dtype 0)
  int h = 2, hv = 4, k = 64, v = 64, l = 8;
  bool l2norm = true;
  bool round_beta = false;  // rssm_layer_params.round_beta
  // Gates that forget slowly (decay 0.985..0.99995 per token, as trained heads have): the
  // checkpoint and records many steps back stay visible in every output. The default gates
  // (decay ~0.5) hid them under the tolerances within a few dozen steps: a replay that dropped
  // the checkpoint from w >= 40 on passed most seeds (an outside review). Some tokens also
  // carry a gate input past softplus's linear cut (x > 20).
  bool long_memory = false;
  int64_t slot_pad = 0;  // extra elements between slots, to exercise strides
  std::string Name() const;
  rssm_dtype Ring() const {
    return ring_dtype < 0 ? state_dtype : static_cast<rssm_dtype>(ring_dtype);
  }
};
// The (state, ring) dtype pairs the kernels are built for (ring -1: the state dtype).
struct StoragePair {
  rssm_dtype state;
  int32_t ring;
};
inline constexpr StoragePair kStoragePairs[] = {{RSSM_DTYPE_F32, -1},
                                                {RSSM_DTYPE_F32, RSSM_DTYPE_BF16},
                                                {RSSM_DTYPE_F32, RSSM_DTYPE_F16},
                                                {RSSM_DTYPE_BF16, -1},
                                                {RSSM_DTYPE_F16, -1}};

// Prints a Config by name in test output (instead of its bytes).
inline void PrintTo(const Config& c, std::ostream* os) { *os << c.Name(); }

struct Tokens;

// One layer: shape, parameters, and a pool of slots in host memory (ring poisoned with NaN).
struct Layer {
  Layer(const Config& c, int num_slots, std::mt19937_64& rng);

  Config cfg;
  rssm_layer_shape shape{};
  std::vector<float> a_log, dt_bias;
  float scale = 1.f;
  Buffer checkpoint, ring_d, ring_k;
  std::vector<float> ring_g;
  int64_t cp_stride, d_stride, k_stride, g_stride;
  int num_slots;

  rssm_layer_params Params() const;
  rssm_state_pool Pool();
  // Fills slot s's checkpoint with random values (the ring is left as it is).
  void RandomCheckpoint(int s, std::mt19937_64& rng);
  // The logical state of slot s at cursor w, [HV, V, K] in fp64, rebuilt from storage by
  // applying the stored records one by one: S <- S·diag(exp g_j) + d_j k_jᵀ.
  std::vector<double> LogicalState(int s, int w) const;
  // Slot s's checkpoint as fp64 [HV, V, K].
  std::vector<double> CheckpointState(int s) const;
  // Bytes of slot s in all four tensors (to prove untouched slots stay untouched).
  std::vector<uint8_t> SlotBytes(int s) const;
  // Decode arguments on the CPU backend over this layer's pool: `batch` rows with the given
  // slot indices and cursors (may be null for the baseline), inputs `tok`, outputs `out`.
  rssm_decode_args DecodeArgs(int32_t batch, const int32_t* slots, const int32_t* write_pos,
                              const Tokens& tok, Buffer& out,
                              const uint8_t* force_fold = nullptr);
  // Verify arguments likewise: `batch` rows of `num_draft` drafts each.
  rssm_verify_args VerifyArgs(int32_t batch, int32_t num_draft, const int32_t* slots,
                              const int32_t* write_pos, const Tokens& tok, Buffer& out);
  // Prefill arguments likewise: rows' tokens from cu_seqlens; initial / write_pos as the ABI's
  // (null: every row from zero).
  rssm_prefill_args PrefillArgs(int32_t batch, const int32_t* slots, const int32_t* cu_seqlens,
                                int32_t max_seqlen, const Tokens& tok, Buffer& out,
                                const uint8_t* initial = nullptr,
                                const int32_t* write_pos = nullptr);
};

// Activations for n tokens, already rounded to the act dtype; row-major per token.
struct Tokens {
  Tokens(const Layer& layer, int n, std::mt19937_64& rng);
  Buffer qkv, a, b;
  int n;
  rssm_token_inputs Inputs() const;
  // Token i copied out (to build batches in another order).
  void CopyTokenTo(int i, Tokens& dst, int j) const;
};

// The fp64 plain recurrence for one request: state [HV, V, K].
struct Reference {
  explicit Reference(const Layer& layer) : layer(&layer) {}
  // Advances `state` by token i of `tok` and writes o [HV, V].
  void Step(std::vector<double>& state, const Tokens& tok, int i, std::vector<double>& o) const;
  const Layer* layer;
};

// ‖x − ref‖ / max(‖ref‖, 1e-30); NaN if any element is NaN.
double RelErr(const std::vector<double>& x, const std::vector<double>& ref);
// Output of token i from an output buffer [N, HV, V] in fp64.
std::vector<double> OutputOf(const Buffer& out, int i, int hv, int v);

}  // namespace replayssm::kernels::testing

#endif  // REPLAYSSM_KERNELS_TESTS_HARNESS_H_
