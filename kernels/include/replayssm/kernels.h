/* replayssm kernels: the C ABI.
 *
 * What this is for: the numerics of one linear-attention layer (Gated DeltaNet = GDN, Kimi
 * Delta Attention = KDA) for a batch of requests whose recurrent states live in a pool of
 * slots. The math is ../../../docs/math-and-abi.md; every backend matches it.
 *
 * Ownership: the caller owns every buffer. Nothing here keeps a pointer past the call or
 * synchronizes the stream (but rssm_synchronize). On the CPU backend every pointer is a host
 * pointer and `stream` must be NULL; on the CUDA backend every tensor and index array is
 * device memory and work is enqueued on `stream` (NULL = the legacy default stream).
 * No kernel call (decode, verify, fold, prefill, segment digests) allocates: the kernels work
 * in the caller's buffers (and shared memory), so every such call may be captured into a CUDA
 * graph.
 *
 * Thread safety: every function may be called concurrently from several threads as long as
 * the calls touch disjoint slots (or only read the same ones). The error message is
 * thread-local.
 *
 * Errors: every function returns an rssm_status. On any error nothing was written (arguments
 * are checked before any work starts) and rssm_last_error() says which field was wrong, what
 * was expected and what came. The CUDA backend validates host-visible fields; values inside
 * device arrays (slot indices, cursors) cannot be read without a sync, so there the kernels
 * treat an out-of-range slot index as padding and clamp cursors to [0, L] instead (no
 * out-of-bounds access, documented as undefined results). The CPU backend checks them too.
 *
 * Shapes use: B rows, H qk-heads, HV v-heads (HV % H == 0, v-head h reads qk-head
 * h / (HV / H)), K key dim, V value dim, L ring length, S the number of slots in a pool.
 * Strides are in elements; 0 means dense.
 */
#ifndef REPLAYSSM_KERNELS_H_
#define REPLAYSSM_KERNELS_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: rssm_layer_shape.ring_dtype, rssm_decode_args.conv; 3: rssm_layer_params.round_beta */
#define RSSM_ABI_VERSION 3
#define RSSM_MAX_HEAD_DIM 256 /* K and V: multiples of 16 in [16, 256] */
#define RSSM_MAX_RING_LEN 64  /* L in [1, 64] */

typedef enum rssm_status {
  RSSM_OK = 0,
  RSSM_ERR_INVALID_ARGUMENT = 1, /* a field is out of range, null, or inconsistent */
  RSSM_ERR_UNSUPPORTED = 2,      /* valid, but the backend is not built or has no device */
  RSSM_ERR_DEVICE = 3,           /* a CUDA call or kernel launch failed */
} rssm_status;

typedef enum rssm_dtype {
  RSSM_DTYPE_F32 = 0,
  RSSM_DTYPE_BF16 = 1,
  RSSM_DTYPE_F16 = 2,
} rssm_dtype;

/* rssm_layer_shape.ring_dtype: the dtype of ring d and k. 0 (what a zero-initialized shape
 * holds) keeps them in the state dtype, as in ABI 1; a ring dtype of its own is named with the
 * codes below (16 + its rssm_dtype), so that an rssm_dtype written there by mistake (BF16 = 1,
 * F16 = 2) is refused rather than read as another dtype. Supported pairs: an fp32 state with an
 * fp32, bf16 or fp16 ring; a bf16 or fp16 state with a ring of its own dtype (other pairs are
 * RSSM_ERR_INVALID_ARGUMENT naming shape.ring_dtype). */
typedef enum rssm_ring_dtype {
  RSSM_RING_DTYPE_STATE = 0, /* the state dtype */
  RSSM_RING_DTYPE_F32 = 16,
  RSSM_RING_DTYPE_BF16 = 17,
  RSSM_RING_DTYPE_F16 = 18,
} rssm_ring_dtype;

typedef enum rssm_gate {
  RSSM_GATE_GDN = 0, /* g is one scalar per v-head */
  RSSM_GATE_KDA = 1, /* g is one value per v-head and key channel */
} rssm_gate;

typedef enum rssm_backend {
  RSSM_BACKEND_CPU = 0,
  RSSM_BACKEND_CUDA = 1,
} rssm_backend;

/* Enum-valued fields are int32_t (not the enum types) so that the struct layout is fixed
 * across compilers and a bad value from a caller is a checked error, not undefined behaviour. */

/* The shape of one layer and the dtypes of its state and activations. */
typedef struct rssm_layer_shape {
  int32_t gate; /* rssm_gate */
  int32_t num_qk_heads; /* H  >= 1 */
  int32_t num_v_heads;  /* HV, a multiple of H */
  int32_t head_k;       /* K, multiple of 16, <= 256 */
  int32_t head_v;       /* V, multiple of 16, <= 256 */
  int32_t ring_len;     /* L in [1, 64] */
  int32_t state_dtype;  /* rssm_dtype: the checkpoint (and ring d, k unless ring_dtype says) */
  int32_t act_dtype;   /* rssm_dtype: mixed_qkv, a, b and the outputs */
  int32_t ring_dtype;  /* rssm_ring_dtype of ring d and k, 0 = the state dtype (ring g is
                          always fp32) */
} rssm_layer_shape;

/* Per-layer learned parameters (device memory on CUDA), fp32. */
typedef struct rssm_layer_params {
  const float* a_log;   /* [HV] */
  const float* dt_bias; /* GDN [HV], KDA [HV, K] */
  float scale;          /* q multiplier, usually K^-1/2 */
  int32_t use_qk_l2norm; /* 0 or 1 */
  int32_t round_beta;    /* 0: beta = sigmoid(b) in fp32; 1: beta rounded to the act dtype before
                            the rule, as Hugging Face's Qwen3-Next computes it in a bf16 model
                            (b.sigmoid() on a bf16 tensor). No effect with fp32 activations. */
} rssm_layer_params;

/* One layer's state for a pool of S slots. Slot s's tensors start at base + s * stride. */
typedef struct rssm_state_pool {
  void* checkpoint;  /* [S, HV, V, K] state dtype (the full state S0 of the checkpoint) */
  void* ring_d;      /* [S, HV, L, V] ring dtype: d_j = beta (v - S'k) of record j */
  void* ring_k;      /* [S, H, L, K]  ring dtype: the (normalized) key of record j */
  float* ring_g;     /* GDN [S, HV, L], KDA [S, HV, L, K]: log-decay g_j of record j */
  int64_t num_slots; /* S >= 1 */
  int64_t checkpoint_slot_stride; /* >= HV*V*K, 0 = dense */
  int64_t ring_d_slot_stride;     /* >= HV*L*V, 0 = dense */
  int64_t ring_k_slot_stride;     /* >= H*L*K, 0 = dense */
  int64_t ring_g_slot_stride;     /* >= HV*L (GDN) or HV*L*K (KDA), 0 = dense */
} rssm_state_pool;

/* Per-token activations, act dtype. N tokens: B for decode, B*T for verify (row-major in
 * (row, draft)), the sum of lengths for prefill. */
typedef struct rssm_token_inputs {
  const void* mixed_qkv; /* [N, 2*H*K + HV*V]: q [H,K] | k [H,K] | v [HV,V] */
  const void* a;         /* GDN [N, HV], KDA [N, HV, K] */
  const void* b;         /* [N, HV] */
  int64_t qkv_token_stride; /* 0 = dense */
  int64_t a_token_stride;   /* 0 = dense */
  int64_t b_token_stride;   /* 0 = dense */
} rssm_token_inputs;

/* Outputs o = S_new q, act dtype: [N, HV, V]. */
typedef struct rssm_token_outputs {
  void* o;
  int64_t token_stride; /* >= HV*V, 0 = dense */
} rssm_token_outputs;

/* Common to every call. */
typedef struct rssm_launch {
  int32_t backend; /* rssm_backend */
  void* stream; /* cudaStream_t on CUDA, NULL on CPU */
} rssm_launch;

/* 1. Replay decode step. Row r (slot s = slot_idx[r], cursor w = write_pos[r] in [0, L])
 * reads S0 and records 0..w-1 of slot s and writes o[r]. Then:
 *   if w + 1 >= L or force_fold[r]: checkpoint <- fold(S0, records 0..w-1, this token's
 *       record); the caller sets the cursor to 0;
 *   else: this token's record is written at ring index w; the caller sets the cursor to w+1.
 * The kernel never writes cursors. slot_idx[r] == -1 marks a padding row: o[r] = 0 and no
 * state is read or written. Slots of a call must be distinct. */
typedef struct rssm_decode_args {
  rssm_launch launch;
  rssm_layer_shape shape;
  rssm_layer_params params;
  rssm_state_pool pool;
  int32_t batch;              /* B >= 0 */
  const int32_t* slot_idx;    /* [B], -1 = padding */
  const int32_t* write_pos;   /* [B] in [0, L]; ignored (may be NULL) by the baseline */
  const uint8_t* force_fold;  /* [B] 0/1, or NULL = none; ignored by the baseline. CPU: any
                                other value is RSSM_ERR_INVALID_ARGUMENT (the host reads it;
                                on CUDA it is device memory the host does not read) */
  rssm_token_inputs in;       /* N = B */
  rssm_token_outputs out;     /* N = B */
  /* NULL: in.mixed_qkv is already convolved. Otherwise (replay decode only) the short
   * convolution joined to the step (section 6, rssm_decode_conv): in.mixed_qkv holds the
   * pre-convolution inputs. */
  const struct rssm_decode_conv* conv;
} rssm_decode_args;

rssm_status rssm_replay_decode(const rssm_decode_args* args);

/* 2. Baseline decode step: the checkpoint of slot s IS the full state; it is read, advanced
 * by one token and written back (ring and cursors unused). Same arithmetic order as a replay
 * step that folds at w = 0, so the two agree bit for bit there. */
rssm_status rssm_baseline_decode(const rssm_decode_args* args);

/* 3. Fold (materialize): for each listed slot, checkpoint <- logical state of (S0, records
 * 0..w-1). The caller sets the cursors to 0. w == 0 leaves the checkpoint unchanged, so fold
 * is idempotent. slot_idx[i] == -1 is skipped. */
typedef struct rssm_fold_args {
  rssm_launch launch;
  rssm_layer_shape shape;
  rssm_state_pool pool;
  int32_t count;            /* n >= 0 */
  const int32_t* slot_idx;  /* [n] */
  const int32_t* write_pos; /* [n] in [0, L] */
} rssm_fold_args;

rssm_status rssm_fold(const rssm_fold_args* args);

/* 4. Prefill: row r runs the plain recurrence over its tokens cu_seqlens[r]..cu_seqlens[r+1]
 * starting from zero (initial == NULL or initial[r] == 0) or from the logical state of its
 * slot at cursor write_pos[r] (initial[r] == 1), writes the final state to the checkpoint
 * (the caller sets the cursor to 0) and, when out.o != NULL, the per-token outputs. The state
 * is carried in fp32 across the tokens (each token's d and k added as the ring dtype holds
 * them, as a decode step's) and rounded to the state dtype once, at the end. */
typedef struct rssm_prefill_args {
  rssm_launch launch;
  rssm_layer_shape shape;
  rssm_layer_params params;
  rssm_state_pool pool;
  int32_t batch;             /* B >= 0 */
  const int32_t* slot_idx;   /* [B], -1 = padding (its tokens are skipped, outputs zeroed) */
  const int32_t* cu_seqlens; /* [B+1], non-decreasing, cu_seqlens[0] == 0, N = cu_seqlens[B] */
  const uint8_t* initial;    /* [B] 0/1 or NULL = all start from zero (CPU: other values are
                                RSSM_ERR_INVALID_ARGUMENT, as force_fold) */
  const int32_t* write_pos;  /* [B] cursor of each slot; needed only where initial[r] == 1 */
  int32_t max_seqlen;        /* >= max length of a row (a launch hint for CUDA) */
  rssm_token_inputs in;      /* N tokens */
  rssm_token_outputs out;    /* N tokens, or o == NULL for no outputs */
} rssm_prefill_args;

rssm_status rssm_prefill(const rssm_prefill_args* args);

/* 5. Speculative verify: row r scores T draft tokens (inputs and outputs in (r, t) order)
 * output-only from S0 and records 0..w-1; draft t's output equals what a replay decode step
 * at cursor w+t would give after drafts 0..t-1. The drafts' records are appended at ring
 * indices w..w+T-1 and NOTHING is folded, so accepting n drafts is "cursor += n" and
 * rejecting costs nothing. Rule: w + T <= L for every row (the caller folds first when a
 * row lacks room; the cache does this). A cursor may then equal L: the next decode step
 * folds. */
typedef struct rssm_verify_args {
  rssm_launch launch;
  rssm_layer_shape shape;
  rssm_layer_params params;
  rssm_state_pool pool;
  int32_t batch;            /* B >= 0 */
  int32_t num_draft;        /* T in [1, L] */
  const int32_t* slot_idx;  /* [B], -1 = padding */
  const int32_t* write_pos; /* [B], w + T <= L */
  rssm_token_inputs in;     /* N = B*T */
  rssm_token_outputs out;   /* N = B*T */
} rssm_verify_args;

rssm_status rssm_verify(const rssm_verify_args* args);

/* 6. The short convolution in front of the recurrence (docs/math-and-abi.md, "The short
 * convolution"): a causal depthwise convolution of width W over the C = 2*H*K + HV*V channels
 * of mixed_qkv, then SiLU, per token:
 *     y[t, c] = silu(bias[c] + sum_{i<W} weight[c, i] * x[t - W + 1 + i, c])
 * accumulated in fp32 in the order i = 0..W-1 and rounded once to the act dtype (what the
 * recurrence then reads as its mixed_qkv). A slot's convolution state mirrors the replay
 * state: `window` holds the inputs of the W-1 tokens before the checkpoint (oldest first,
 * zeros before the first token) and `ring_x` the input of each ring record j < w. The inputs
 * before a row's first token are therefore window[0..W-2] followed by ring_x[0..w-1].
 * Like the recurrence it never writes a cursor and never writes anything the cursor makes
 * visible, except where said. */
#define RSSM_MAX_CONV_WIDTH 8 /* W in [2, 8] */

typedef enum rssm_conv_mode {
  /* Decode and verify: row r's T tokens' inputs are written at ring_x[w .. w+T-1] (w + T <= L;
   * the window is unchanged); accepting n of them is the recurrence's "cursor += n". */
  RSSM_CONV_APPEND = 0,
  /* Prefill: the row's tokens continue from its history (or from zeros where initial[r] is 0
   * or initial is NULL); the window becomes the last W-1 inputs of history + tokens and the
   * ring is not written (the caller sets the cursor to 0, as after rssm_prefill). */
  RSSM_CONV_PREFILL = 1,
} rssm_conv_mode;

typedef struct rssm_conv_shape {
  int32_t channels;  /* C >= 1, a multiple of 8 */
  int32_t width;     /* W in [2, RSSM_MAX_CONV_WIDTH] */
  int32_t ring_len;  /* L in [1, 64]: the records ring_x holds per slot */
  int32_t act_dtype; /* rssm_dtype of x, y, window and ring_x */
} rssm_conv_shape;

/* One layer's convolution state for a pool of S slots (act dtype). */
typedef struct rssm_conv_state {
  void* window;               /* [S, W-1, C] */
  void* ring_x;               /* [S, L, C] */
  int64_t num_slots;          /* S >= 1 */
  int64_t window_slot_stride; /* >= (W-1)*C, 0 = dense */
  int64_t ring_x_slot_stride; /* >= L*C, 0 = dense */
} rssm_conv_state;

typedef struct rssm_conv_args {
  rssm_launch launch;
  rssm_conv_shape shape;
  const float* weight; /* [C, W] fp32 (Hugging Face's conv1d weight [C, 1, W]) */
  const float* bias;   /* [C] fp32, or NULL for none */
  rssm_conv_state state;
  int32_t mode;              /* rssm_conv_mode */
  int32_t batch;             /* B in [0, 65535] */
  const int32_t* slot_idx;   /* [B], -1 = padding: y = 0, no state read or written */
  const int32_t* write_pos;  /* [B] cursors in [0, L]; with APPEND w + T <= L */
  const int32_t* cu_seqlens; /* [B+1] as rssm_prefill, or NULL: num_tokens tokens per row */
  int32_t num_tokens;        /* without cu_seqlens: T >= 1 tokens per row (decode 1, verify T);
                                with it: >= the longest row (a launch hint, as max_seqlen) */
  const uint8_t* initial;    /* PREFILL: [B] 0/1 or NULL = every row starts from zeros (as
                                rssm_prefill); ignored by APPEND */
  const void* x;             /* [N, C] pre-convolution inputs, rows' tokens in row order */
  int64_t x_token_stride;    /* 0 = dense */
  void* y;                   /* [N, C] outputs (may not alias x) */
  int64_t y_token_stride;    /* 0 = dense */
} rssm_conv_args;

rssm_status rssm_short_conv(const rssm_conv_args* args);

/* The convolution joined to rssm_replay_decode (rssm_decode_args.conv): the call is
 * rssm_short_conv (RSSM_CONV_APPEND, one token per row) of in.mixed_qkv into y followed by the
 * step on y, bit for bit the same as the two calls (outputs, records, checkpoint, window,
 * ring_x, y), but on CUDA the step's launch overlaps the convolution's (it streams its state
 * while the convolution runs and waits for y only where it reads it; docs/math-and-abi.md).
 * Rule: w + 1 <= L for every row (the input needs a ring entry; the cache folds a full ring
 * first). A row that folds (force_fold) does not fold the window: the caller calls
 * rssm_conv_fold with w + 1, as after rssm_short_conv. rssm_baseline_decode refuses it. */
typedef struct rssm_decode_conv {
  int32_t width;         /* W in [2, RSSM_MAX_CONV_WIDTH] */
  const float* weight;   /* [C, W] fp32, C = 2*H*K + HV*V */
  const float* bias;     /* [C] fp32, or NULL for none */
  rssm_conv_state state; /* act dtype, L = shape.ring_len, num_slots = pool.num_slots */
  void* y;               /* [B, C] act dtype, dense: receives the convolved inputs (scratch
                            the step reads; not in.mixed_qkv) */
} rssm_decode_conv;

/* Folds the convolution state with the recurrence's fold: for each listed slot, window <- the
 * last W-1 inputs of window + ring_x[0..w-1] (w == 0: unchanged). The caller folds the
 * recurrence (rssm_fold) with the same cursors and then sets them to 0. */
typedef struct rssm_conv_fold_args {
  rssm_launch launch;
  rssm_conv_shape shape;
  rssm_conv_state state;
  int32_t count;            /* n >= 0 */
  const int32_t* slot_idx;  /* [n], -1 skipped */
  const int32_t* write_pos; /* [n] in [0, L] */
} rssm_conv_fold_args;

rssm_status rssm_conv_fold(const rssm_conv_fold_args* args);

/* Dense element counts per slot of one layer's convolution state: (W-1)*C and L*C (0 for a
 * null shape). */
int64_t rssm_conv_window_elems(const rssm_conv_shape* shape);
int64_t rssm_conv_ring_elems(const rssm_conv_shape* shape);

/* Memory of a backend, so that layers above never call a device runtime themselves: host
 * memory (64-byte aligned) on CPU, device memory on CUDA (cudaMalloc: call it outside hot
 * paths). Copies and memsets are ordered on launch->stream; rssm_synchronize waits for it.
 * On CPU they run at once. The kinds say where the source and destination live. */
typedef enum rssm_copy_kind {
  RSSM_COPY_HOST_TO_DEVICE = 0,
  RSSM_COPY_DEVICE_TO_HOST = 1,
  RSSM_COPY_DEVICE_TO_DEVICE = 2,
} rssm_copy_kind;

rssm_status rssm_alloc(int32_t backend, size_t bytes, void** out);
rssm_status rssm_free(int32_t backend, void* ptr); /* NULL is a no-op */
rssm_status rssm_memcpy(const rssm_launch* launch, void* dst, const void* src, size_t bytes,
                        int32_t kind /* rssm_copy_kind */);
rssm_status rssm_memset(const rssm_launch* launch, void* dst, int32_t value, size_t bytes);
rssm_status rssm_synchronize(const rssm_launch* launch);

/* Host staging memory for copies to and from a backend: page-locked (cudaHostAlloc, portable
 * and mapped) on CUDA, so that rssm_memcpy from or to it is a true asynchronous DMA on the
 * stream, and kernels read and write it at the same address (rssm_stream_wait_value32_or's
 * release words); plain 64-byte aligned host memory on CPU. Allocation is slow (pins pages):
 * keep and reuse it. */
rssm_status rssm_alloc_host(int32_t backend, size_t bytes, void** out);
rssm_status rssm_free_host(int32_t backend, void* ptr); /* NULL is a no-op */

/* Streams, so that callers can run independent work (one forward, one transfer) concurrently
 * without touching a device runtime. CUDA: a non-blocking stream (does not synchronize with
 * the legacy default stream). CPU: *out = NULL (CPU work runs at once; NULL is the only
 * CPU stream). Destroying NULL is a no-op. A stream is destroyed only when nothing is queued
 * on it any more (synchronize first). CUDA: the runtime making a stream while doorbell waits
 * run (either kind) can wait until they end: it grows its streams about 43 at a time, and a
 * growth waits for the running kernels (on an H100 the process's 36th, 164th, 207th and 250th
 * did; the others did not). So a device's first
 * rssm_stream_create makes 128 streams at once, before any wait can run on that device, and
 * hands them out; rssm_stream_destroy gives an idle stream back to them (one with work still
 * queued, or recording, is destroyed). Only more than 128 streams out at once on a device make
 * the runtime make another. */
rssm_status rssm_stream_create(int32_t backend, void** out);
rssm_status rssm_stream_destroy(int32_t backend, void* stream);

/* Events: a point on a stream, to learn later without waiting whether the work queued on it
 * before that point has finished -- the server's own proof, where a doorbell word in a
 * client's memory could have been written by the client.
 * rssm_event_record: *out = a new event at the end of what launch->stream holds now (CUDA: an
 *   event without timing; CPU: NULL, since CPU work has run when the call queueing it returns).
 * rssm_event_query: *done = 1 once that work has finished, else 0; never waits. NULL is done.
 * rssm_event_destroy: NULL is a no-op; an event whose work still runs may be destroyed. */
rssm_status rssm_event_record(const rssm_launch* launch, void** out);
rssm_status rssm_event_query(int32_t backend, void* event, int* done);
rssm_status rssm_event_destroy(int32_t backend, void* event);

/* Devices, for one process over several GPUs (a tensor-parallel group: one cache shard per
 * GPU). rssm_set_device makes `device` (0 .. rssm_device_count - 1) the calling thread's current
 * device: where rssm_alloc and rssm_stream_create allocate from then on. Work on a stream
 * created by rssm_stream_create runs on the stream's device whatever the calling thread's is:
 * every call that takes a launch makes that device current first. rssm_get_device: the calling
 * thread's current device (a new thread starts on device 0: a thread that allocates or makes
 * streams for a cache on another device sets it first). CPU: one device, 0. */
rssm_status rssm_set_device(int32_t backend, int32_t device);
rssm_status rssm_get_device(int32_t backend, int32_t* device);
int rssm_device_count(int32_t backend);

/* Whether `device` (0 .. rssm_device_count - 1) still takes work: RSSM_OK, or RSSM_ERR_DEVICE
 * with the reason in rssm_last_error when its context has failed for good (CUDA: a sticky error
 * — a kernel faulted, uncorrectable ECC, the GPU fell off the bus — which every later call
 * returns too). It queues nothing on other streams and waits for nothing, so it may be called
 * from any thread while work runs. Like rssm_set_device it leaves `device` the calling thread's
 * current one (restoring another would create a context there): call it from a thread of its
 * own, as the server does. CPU: RSSM_OK, unless the environment names a file in
 * REPLAYSSM_CPU_FAULT_FILE and that file exists (a failure injected for tests of what a server
 * does when its device fails). */
rssm_status rssm_device_check(int32_t backend, int32_t device);

/* Shared memory of co-located clients (registered regions) and GPU-side doorbells, so that a
 * client's GPU work and ours hand over without a host round trip (docs/data-plane.md).
 *
 * rssm_ipc_open maps device memory another process exported with cudaIpcGetMemHandle:
 *   handle:       the RSSM_IPC_HANDLE_BYTES bytes of the cudaIpcMemHandle_t
 *   device:       the device the client allocated on; must be this process's current device
 *                 (RSSM_ERR_INVALID_ARGUMENT naming both otherwise)
 *   *out, *out_bytes: the base and size of the whole exported allocation in this process
 * CPU: RSSM_ERR_UNSUPPORTED (use POSIX shared memory: it is host memory already).
 * rssm_ipc_close unmaps what rssm_ipc_open returned (after everything using it has finished).
 * Slow (driver calls): once per registration, never per step. */
#define RSSM_IPC_HANDLE_BYTES 64
rssm_status rssm_ipc_open(int32_t backend, const void* handle, size_t handle_bytes,
                          int32_t device, void** out, size_t* out_bytes);
rssm_status rssm_ipc_close(int32_t backend, void* ptr);

/* Doorbells: 32-bit words in backend memory (device memory on CUDA, host memory on CPU),
 * 4-byte aligned. Values compare cyclically, as CUDA's stream memory operations do: a wait
 * for `value` ends once (int32_t)(*addr - value) >= 0.
 * rssm_stream_wait_value32: work queued on launch->stream after it runs once the word
 *   reaches `value` (CUDA: cuStreamWaitValue32, queued, returns at once; CPU: blocks the
 *   calling thread, polling, until it does — there is no timeout: whoever gives up on a
 *   doorbell writes its value itself, which releases the wait on both backends).
 * rssm_stream_write_value32: writes `value` once the work queued before it on the stream has
 *   finished and its writes are visible (CUDA: cuStreamWriteValue32 with its memory barrier;
 *   CPU: a release store, at once).
 * rssm_stream_raise_value32: as rssm_stream_write_value32, but never sets a word back: the word
 *   becomes `value` only if it has not reached it yet, checked and written as one atomic step,
 *   so a ring further than `value` that lands before or while it runs is kept (CUDA: a
 *   one-thread kernel's compare-and-swap loop on device memory, loaded with the device's
 *   first rssm_stream_create so that a raise behind a blocked wait need not load it; CPU: the
 *   same, at once). For whoever rings a word on another's behalf (a wait given up on) while
 *   its owner may ring it on for its next use. */
rssm_status rssm_stream_wait_value32(const rssm_launch* launch, const uint32_t* addr,
                                     uint32_t value);
/* rssm_stream_wait_value32_or: as rssm_stream_wait_value32, but the wait also ends once the
 *   word at release->word reaches release->ticket, whatever its own word does; a wait that
 *   ends that way with its own word still short of `value` writes the ticket into
 *   release->outcome[ticket % 2] (two words; NULL: not recorded), so that whoever released it
 *   learns, once the stream has run past it, which waits were never rung. release->word and
 *   release->outcome are host memory (on CUDA from rssm_alloc_host, which the device reads and
 *   writes), so that a release is a store on the host: no stream, no device work. CUDA: a
 *   one-thread kernel that polls both words (never a stream memory operation: an unrung one of
 *   those holds its hardware queue until the device sees the word, however the host gives up);
 *   loaded with the device's first rssm_stream_create, like the raise's; recorded in a sequence
 *   it is one whose value and ticket rssm_graph_launch sets. CPU: blocks the calling thread,
 *   polling both. Giving each use of a release word a later ticket (cyclically, within 2^31 of
 *   the word) makes one release end the waits of that use and of those before it, never of a
 *   later one. */
typedef struct rssm_release {
  const uint32_t* word; /* 4-byte aligned host memory */
  uint32_t ticket;
  uint32_t* outcome; /* 2 words of 4-byte aligned host memory, or NULL */
} rssm_release;
rssm_status rssm_stream_wait_value32_or(const rssm_launch* launch, const uint32_t* addr,
                                        uint32_t value, const rssm_release* release);
rssm_status rssm_stream_write_value32(const rssm_launch* launch, uint32_t* addr, uint32_t value);
rssm_status rssm_stream_raise_value32(const rssm_launch* launch, uint32_t* addr, uint32_t value);
/* 1 when this process's CUDA work goes through an MPS server (its control pipe is where
 * CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps, says), else 0. Without MPS, two processes
 * on one GPU time-slice and every cross-process doorbell costs ~280 us instead of ~5 us. */
int rssm_mps_active(void);

/* Recorded sequences (CUDA graphs), so that a caller who queues the same calls again and
 * again (a whole decode forward: a doorbell wait, the layer's kernels and a doorbell write per
 * layer) pays the host's cost of queueing them once (docs/math-and-abi.md, "Recorded
 * sequences"). CPU: RSSM_ERR_UNSUPPORTED (CPU calls run at once; run them directly).
 * rssm_capture_begin: the calls queued on launch->stream from now on (kernels, copies, memsets,
 *   doorbell operations) are recorded instead of run, until rssm_capture_end on the same
 *   thread. Nothing in between may synchronize or allocate (rssm_synchronize, rssm_alloc and
 *   rssm_memcpy to or from pageable host memory fail and spoil the recording).
 * rssm_capture_end: ends the recording; the stream runs calls again and nothing recorded has
 *   run. keep = 1: *out is the recording, ready to launch (RSSM_ERR_DEVICE, *out = NULL, when
 *   a call in between spoiled it); keep = 0 (a call in between failed): discarded, *out = NULL.
 * rssm_graph_doorbells: how many doorbell operations (waits of either kind, and writes) the
 *   recording holds.
 * rssm_graph_launch: queues the recording on launch->stream (any stream of its backend;
 *   launches of one recording run one after the other). Every doorbell operation in it waits
 *   for, or writes, `doorbell_value`, whatever value it was recorded with, and every
 *   rssm_stream_wait_value32_or in it compares its release word with `release_ticket` (its
 *   release word and outcome words stay those it was recorded with): one recording serves
 *   forwards whose doorbells ring with different values.
 * rssm_graph_destroy: frees it (launches already queued still run). Beside running waits it
 *   returned in ~0.1 ms on an H100, whether the recording's launches had run or one still
 *   waited on its doorbell (docs/data-plane.md, known limits). NULL is a no-op.
 * A recording is used by one thread at a time. */
typedef struct rssm_graph rssm_graph;
rssm_status rssm_capture_begin(const rssm_launch* launch);
rssm_status rssm_capture_end(const rssm_launch* launch, int32_t keep, rssm_graph** out);
int64_t rssm_graph_doorbells(const rssm_graph* graph);
rssm_status rssm_graph_launch(const rssm_launch* launch, rssm_graph* graph, uint32_t doorbell_value,
                              uint32_t release_ticket);
rssm_status rssm_graph_destroy(rssm_graph* graph);

/* Slot checksums (docs/transfer.md): the segment hash (replayssm/segment_hash.h; bit-identical
 * to the host's) of each segment of a payload held as parts[0] | parts[1] | ... |
 * parts[count - 1] (count * part_bytes bytes), hashed where the parts lie (no gather):
 * digests[i] is the hash of payload bytes [i * segment_bytes, min((i + 1) * segment_bytes,
 * bytes)), a segment may span parts. Like every other call it only queues work on
 * launch->stream: nothing is allocated and nothing synchronizes; the caller copies the
 * digests back once the stream is done (on CPU they are written before the call returns).
 *   parts:           HOST array of count backend pointers (host on CPU, device on CUDA), read
 *                    during the call; may be NULL only when count * part_bytes == 0. Each
 *                    part is 16-byte aligned (the device loads 16 bytes at a time and a 16-byte
 *                    load never spans two parts)
 *   part_bytes:      any size when count == 1, else a multiple of 16; count * part_bytes must
 *                    not overflow size_t
 *   segment_bytes:   a positive multiple of 64 (so only the last segment can have a tail), at
 *                    most 2^31 - 1 segments
 *   parts_device:    BACKEND memory, 8-byte aligned, holding the same count pointers as parts:
 *                    the table the device reads (the caller copies it there, queued on the
 *                    same stream before this call; on CPU it may be parts itself). parts is
 *                    what the call validates
 *   digests:         BACKEND memory of ceil(bytes / segment_bytes) entries, written by the
 *                    queued work */
rssm_status rssm_segment_digests_parts(const rssm_launch* launch, const void* const* parts,
                                       const void* const* parts_device, size_t count,
                                       size_t part_bytes, size_t segment_bytes,
                                       uint64_t* digests);

/* Non-finite values (NaN, +-Inf) of a state held in `count` parts of `part_elems` elements of
 * `dtype` each (e.g. one layer's checkpoint per part), where the parts lie: *result (BACKEND
 * memory, 4-byte aligned) becomes the number of non-finite elements (saturating at
 * UINT32_MAX). As rssm_segment_digests_parts: `parts` is the HOST array the call validates,
 * `parts_device` the same pointers in BACKEND memory (the table the device reads, uploaded by
 * the caller on the same stream; on CPU it may be parts itself); nothing is allocated and
 * nothing synchronizes (CUDA: the count is there once the stream has reached it). Each part
 * is aligned to its dtype. The cache runs it on every state that would be shared (a snapshot,
 * a donation, a transfer) so that one request's NaN never reaches another's prefix. CPU: a
 * failure (RSSM_ERR_DEVICE) is injected while the environment's REPLAYSSM_CPU_FAIL_CALLS, a
 * comma-separated list of function names, holds "rssm_count_nonfinite" (tests of what the
 * cache does when a device call fails mid-operation; rssm_synchronize and rssm_fold take it
 * too). */
rssm_status rssm_count_nonfinite(const rssm_launch* launch, const void* const* parts,
                                 const void* const* parts_device, size_t count,
                                 size_t part_elems, int32_t dtype, uint32_t* result);

/* Helpers. */
const char* rssm_status_name(rssm_status status);
const char* rssm_dtype_name(int32_t dtype); /* "unknown" for an unknown dtype */
size_t rssm_dtype_size(int32_t dtype);      /* 0 for an unknown dtype */
/* The message of the last failed call on this thread ("" when none). */
const char* rssm_last_error(void);
/* 1 when the backend is built and (CUDA) a device is visible, else 0. */
int rssm_backend_available(int32_t backend);
/* Validates a shape; RSSM_OK or RSSM_ERR_INVALID_ARGUMENT with the message set. */
rssm_status rssm_check_shape(const rssm_layer_shape* shape);
/* Dense element counts per slot of one layer's tensors, and the bytes one slot of one layer
 * costs (checkpoint + ring d, k, g): what capacity planning counts. 0 for an invalid shape. */
int64_t rssm_checkpoint_elems(const rssm_layer_shape* shape);
int64_t rssm_ring_d_elems(const rssm_layer_shape* shape);
int64_t rssm_ring_k_elems(const rssm_layer_shape* shape);
int64_t rssm_ring_g_elems(const rssm_layer_shape* shape);
int64_t rssm_slot_layer_bytes(const rssm_layer_shape* shape);
/* The rssm_dtype ring d and k are stored in (shape.ring_dtype resolved), or -1 when
 * shape.ring_dtype is not a valid code (the pair itself is rssm_check_shape's to judge). */
int32_t rssm_ring_storage_dtype(const rssm_layer_shape* shape);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* REPLAYSSM_KERNELS_H_ */
