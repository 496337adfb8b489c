// The CPU backend: every operation of kernels.h, multithreaded over (row, v-head), fp32
// accumulation, with the O(VK + L(V+K)) output formula of docs/math-and-abi.md, "Replay"
// (head_math.h). It is the reference the CUDA kernels are tested against, and the embedded
// default without a GPU.
#include <algorithm>
#include <cstring>

#include "../src/backend.h"
#include "head_math.h"
#include "replayssm/segment_hash.h"
#include "thread_pool.h"

namespace replayssm::kernels::cpu {
namespace {

// Per-thread buffers, sized on first use and reused.
struct Workspace {
  Records records;
  TokenHead token;
  StepScratch scratch;
  std::vector<float> state, o, d;

  void Reserve(const HeadDims& h, int record_capacity) {
    records.Reserve(h, record_capacity);
    records.n = 0;
    scratch.Reserve(h);
    token.q.resize(h.k);
    token.k.resize(h.k);
    token.g.resize(h.k);
    token.v.resize(h.v);
    state.resize(static_cast<size_t>(h.v) * h.k);
    o.resize(h.v);
    d.resize(h.v);
  }
};

Workspace& LocalWorkspace() {
  thread_local Workspace ws;
  return ws;
}

// The segment hash (segment_hash.h) of payload bytes [begin, end) of parts[0] | parts[1] |
// ... (part_bytes each), fed part by part.
uint64_t RangeDigest(const uint8_t* const* parts, size_t part_bytes, size_t begin, size_t end) {
  segment_hash::Stream h;
  for (size_t off = begin; off < end;) {
    const size_t part = off / part_bytes, in_part = off - part * part_bytes;
    const size_t n = std::min(part_bytes - in_part, end - off);
    h.Update(parts[part] + in_part, n);
    off += n;
  }
  return h.Digest();
}

HeadDims DimsOf(const rssm_layer_shape& s) {
  return HeadDims{s.head_k, s.head_v, s.ring_len, s.gate == RSSM_GATE_KDA,
                  rssm_ring_storage_dtype(&s)};
}

// Typed access to one layer's pool and activations for state dtype S (the checkpoint), ring
// dtype R (records' d and k) and activation dtype A.
template <typename S, typename R, typename A>
class Layer {
 public:
  Layer(const rssm_layer_shape& shape, const rssm_state_pool& pool)
      : sh_(shape), pool_(pool), dims_(DimsOf(shape)), group_(shape.num_v_heads / shape.num_qk_heads) {}

  const HeadDims& dims() const { return dims_; }
  int QkHead(int h) const { return h / group_; }
  bool KWriter(int h) const { return h % group_ == 0; }

  S* Checkpoint(int64_t slot, int h) const {
    return static_cast<S*>(pool_.checkpoint) + slot * pool_.checkpoint_slot_stride +
           static_cast<int64_t>(h) * dims_.v * dims_.k;
  }
  R* RingD(int64_t slot, int h, int j) const {
    return static_cast<R*>(pool_.ring_d) + slot * pool_.ring_d_slot_stride +
           (static_cast<int64_t>(h) * dims_.l + j) * dims_.v;
  }
  R* RingK(int64_t slot, int hq, int j) const {
    return static_cast<R*>(pool_.ring_k) + slot * pool_.ring_k_slot_stride +
           (static_cast<int64_t>(hq) * dims_.l + j) * dims_.k;
  }
  float* RingG(int64_t slot, int h, int j) const {
    const int per = dims_.kda ? dims_.k : 1;
    return pool_.ring_g + slot * pool_.ring_g_slot_stride +
           (static_cast<int64_t>(h) * dims_.l + j) * per;
  }

  void LoadState(int64_t slot, int h, float* state) const {
    const S* src = Checkpoint(slot, h);
    for (int64_t i = 0, n = int64_t{dims_.v} * dims_.k; i < n; ++i) state[i] = ToFloat(src[i]);
  }
  void StoreState(int64_t slot, int h, const float* state) const {
    S* dst = Checkpoint(slot, h);
    for (int64_t i = 0, n = int64_t{dims_.v} * dims_.k; i < n; ++i) {
      dst[i] = FromFloat<S>(state[i]);
    }
  }

  // Records 0..n-1 of (slot, h) into r.
  void LoadRecords(int64_t slot, int h, int n, Records& r) const {
    r.n = n;
    for (int j = 0; j < n; ++j) {
      const R* d = RingD(slot, h, j);
      const R* k = RingK(slot, QkHead(h), j);
      const float* g = RingG(slot, h, j);
      for (int i = 0; i < dims_.v; ++i) r.d[static_cast<size_t>(j) * dims_.v + i] = ToFloat(d[i]);
      for (int c = 0; c < dims_.k; ++c) {
        r.k[static_cast<size_t>(j) * dims_.k + c] = ToFloat(k[c]);
        r.g[static_cast<size_t>(j) * dims_.k + c] = dims_.kda ? g[c] : g[0];
      }
    }
  }

  // Appends the record (d, k, g) of token t as record r.n of r, rounded as it is stored.
  void AppendRecord(const float* d, const TokenHead& t, Records& r) const {
    const int j = r.n++;
    for (int i = 0; i < dims_.v; ++i) r.d[static_cast<size_t>(j) * dims_.v + i] = RoundTo<R>(d[i]);
    for (int c = 0; c < dims_.k; ++c) {
      r.k[static_cast<size_t>(j) * dims_.k + c] = RoundTo<R>(t.k[c]);
      r.g[static_cast<size_t>(j) * dims_.k + c] = t.g[c];
    }
  }

  // Writes record j of r into the ring of (slot, h) at index pos. Only one v-head of each
  // qk-head group writes the shared k row, so concurrent heads never write the same bytes.
  void StoreRecord(int64_t slot, int h, int pos, const Records& r, int j) const {
    R* d = RingD(slot, h, pos);
    for (int i = 0; i < dims_.v; ++i)
      d[i] = FromFloat<R>(r.d[static_cast<size_t>(j) * dims_.v + i]);
    if (KWriter(h)) {
      R* k = RingK(slot, QkHead(h), pos);
      for (int c = 0; c < dims_.k; ++c)
        k[c] = FromFloat<R>(r.k[static_cast<size_t>(j) * dims_.k + c]);
    }
    float* g = RingG(slot, h, pos);
    const int per = dims_.kda ? dims_.k : 1;
    for (int c = 0; c < per; ++c) g[c] = r.g[static_cast<size_t>(j) * dims_.k + c];
  }

  // Token `tok` for v-head h: normalized, scaled q and k of its qk-head, v, g, beta.
  void LoadToken(const rssm_layer_params& p, const rssm_token_inputs& in, int64_t tok, int h,
                 TokenHead& t) const {
    const A* row = static_cast<const A*>(in.mixed_qkv) + tok * in.qkv_token_stride;
    const int hq = QkHead(h);
    const A* q = row + static_cast<int64_t>(hq) * dims_.k;
    const A* k = row + static_cast<int64_t>(sh_.num_qk_heads + hq) * dims_.k;
    const A* v = row + 2LL * sh_.num_qk_heads * dims_.k + static_cast<int64_t>(h) * dims_.v;
    for (int c = 0; c < dims_.k; ++c) {
      t.q[c] = ToFloat(q[c]);
      t.k[c] = ToFloat(k[c]);
    }
    for (int i = 0; i < dims_.v; ++i) t.v[i] = ToFloat(v[i]);
    if (p.use_qk_l2norm) {
      L2Normalize(t.q.data(), dims_.k);
      L2Normalize(t.k.data(), dims_.k);
    }
    for (int c = 0; c < dims_.k; ++c) t.q[c] *= p.scale;
    const float decay = -std::exp(p.a_log[h]);
    const A* a = static_cast<const A*>(in.a) + tok * in.a_token_stride;
    if (dims_.kda) {
      for (int c = 0; c < dims_.k; ++c) {
        const int64_t i = static_cast<int64_t>(h) * dims_.k + c;
        t.g[c] = decay * Softplus(ToFloat(a[i]) + p.dt_bias[i]);
      }
    } else {
      const float g = decay * Softplus(ToFloat(a[h]) + p.dt_bias[h]);
      std::fill(t.g.begin(), t.g.end(), g);
    }
    const A* b = static_cast<const A*>(in.b) + tok * in.b_token_stride;
    t.beta = Sigmoid(ToFloat(b[h]));
    if (p.round_beta) t.beta = ToFloat(FromFloat<A>(t.beta));
  }

  void StoreOutput(const rssm_token_outputs& out, int64_t tok, int h, const float* o) const {
    if (out.o == nullptr) return;
    A* dst = static_cast<A*>(out.o) + tok * out.token_stride + static_cast<int64_t>(h) * dims_.v;
    for (int i = 0; i < dims_.v; ++i) dst[i] = o == nullptr ? FromFloat<A>(0.f) : FromFloat<A>(o[i]);
  }

 private:
  const rssm_layer_shape& sh_;
  const rssm_state_pool& pool_;
  HeadDims dims_;
  int group_;
};

// Calls fn.template operator()<S, R, A>() for the runtime dtypes: the (state, ring) pairs
// api.cc admits (an fp32 state with any ring, a 16-bit state with its own) x every act dtype.
template <typename Fn>
rssm_status Dispatch(const rssm_layer_shape& s, Fn&& fn) {
  auto with_act = [&]<typename S, typename R>() {
    switch (s.act_dtype) {
      case RSSM_DTYPE_F32: fn.template operator()<S, R, float>(); break;
      case RSSM_DTYPE_BF16: fn.template operator()<S, R, Bf16>(); break;
      case RSSM_DTYPE_F16: fn.template operator()<S, R, F16>(); break;
    }
  };
  const int32_t ring = rssm_ring_storage_dtype(&s);
  switch (s.state_dtype) {
    case RSSM_DTYPE_F32:
      switch (ring) {
        case RSSM_DTYPE_F32: with_act.template operator()<float, float>(); break;
        case RSSM_DTYPE_BF16: with_act.template operator()<float, Bf16>(); break;
        case RSSM_DTYPE_F16: with_act.template operator()<float, F16>(); break;
      }
      break;
    case RSSM_DTYPE_BF16: with_act.template operator()<Bf16, Bf16>(); break;
    case RSSM_DTYPE_F16: with_act.template operator()<F16, F16>(); break;
  }
  return RSSM_OK;
}

// Runs body(row, h) for every (row, v-head) pair in parallel.
template <typename Body>
void ForEachHead(int64_t rows, int heads, Body&& body) {
  ThreadPool::Default().ParallelFor(rows * heads, [&](int64_t i) {
    body(i / heads, static_cast<int>(i % heads));
  });
}

rssm_status Decode(const rssm_decode_args& a, bool baseline) {
  return Dispatch(a.shape, [&]<typename S, typename R, typename A>() {
    const Layer<S, R, A> layer(a.shape, a.pool);
    const HeadDims& dims = layer.dims();
    ForEachHead(a.batch, a.shape.num_v_heads, [&](int64_t row, int h) {
      const int32_t slot = a.slot_idx[row];
      if (slot < 0) return layer.StoreOutput(a.out, row, h, nullptr);
      Workspace& ws = LocalWorkspace();
      ws.Reserve(dims, dims.l);
      const int w = baseline ? 0 : a.write_pos[row];
      const bool fold = baseline || w + 1 >= dims.l || (a.force_fold && a.force_fold[row]);
      layer.LoadState(slot, h, ws.state.data());
      layer.LoadRecords(slot, h, w, ws.records);
      layer.LoadToken(a.params, a.in, row, h, ws.token);
      StepHead(dims, ws.state.data(), ws.records, ws.token, fold, ws.scratch, ws.o.data(),
               ws.d.data());
      layer.StoreOutput(a.out, row, h, ws.o.data());
      if (fold) {
        layer.StoreState(slot, h, ws.state.data());
      } else {
        layer.AppendRecord(ws.d.data(), ws.token, ws.records);
        layer.StoreRecord(slot, h, w, ws.records, w);
      }
    });
  });
}

}  // namespace

// A joined convolution (args.conv): the APPEND call into conv->y, then the step on it.
rssm_status ReplayDecode(const rssm_decode_args& args) {
  if (args.conv == nullptr) return Decode(args, false);
  const rssm_conv_args c = JoinedConvArgs(args);
  const rssm_status st = ShortConv(c);
  if (st != RSSM_OK) return st;
  rssm_decode_args d = args;
  d.conv = nullptr;
  d.in.mixed_qkv = c.y;
  d.in.qkv_token_stride = c.y_token_stride;
  return Decode(d, false);
}
rssm_status BaselineDecode(const rssm_decode_args& args) { return Decode(args, true); }

rssm_status Fold(const rssm_fold_args& a) {
  return Dispatch(a.shape, [&]<typename S, typename R, typename A>() {
    const Layer<S, R, A> layer(a.shape, a.pool);
    ForEachHead(a.count, a.shape.num_v_heads, [&](int64_t i, int h) {
      const int32_t slot = a.slot_idx[i];
      const int w = a.write_pos[i];
      if (slot < 0 || w == 0) return;  // nothing to fold: the checkpoint stays bit-identical
      Workspace& ws = LocalWorkspace();
      ws.Reserve(layer.dims(), layer.dims().l);
      layer.LoadState(slot, h, ws.state.data());
      layer.LoadRecords(slot, h, w, ws.records);
      FoldRecords(layer.dims(), ws.state.data(), ws.records, ws.scratch);
      layer.StoreState(slot, h, ws.state.data());
    });
  });
}

rssm_status Prefill(const rssm_prefill_args& a) {
  return Dispatch(a.shape, [&]<typename S, typename R, typename A>() {
    const Layer<S, R, A> layer(a.shape, a.pool);
    const HeadDims& dims = layer.dims();
    ForEachHead(a.batch, a.shape.num_v_heads, [&](int64_t row, int h) {
      const int32_t slot = a.slot_idx[row];
      const int64_t begin = a.cu_seqlens[row], end = a.cu_seqlens[row + 1];
      if (slot < 0) {
        for (int64_t t = begin; t < end; ++t) layer.StoreOutput(a.out, t, h, nullptr);
        return;
      }
      Workspace& ws = LocalWorkspace();
      ws.Reserve(dims, dims.l);
      if (a.initial != nullptr && a.initial[row]) {
        layer.LoadState(slot, h, ws.state.data());
        layer.LoadRecords(slot, h, a.write_pos[row], ws.records);
        FoldRecords(dims, ws.state.data(), ws.records, ws.scratch);
        ws.records.n = 0;
      } else {
        std::fill(ws.state.begin(), ws.state.end(), 0.f);
      }
      for (int64_t t = begin; t < end; ++t) {  // a plain step per token, state kept in fp32
        layer.LoadToken(a.params, a.in, t, h, ws.token);
        StepHead(dims, ws.state.data(), ws.records, ws.token, true, ws.scratch, ws.o.data(),
                 ws.d.data());
        layer.StoreOutput(a.out, t, h, ws.o.data());
      }
      layer.StoreState(slot, h, ws.state.data());
    });
  });
}

rssm_status Verify(const rssm_verify_args& a) {
  return Dispatch(a.shape, [&]<typename S, typename R, typename A>() {
    const Layer<S, R, A> layer(a.shape, a.pool);
    const HeadDims& dims = layer.dims();
    const int T = a.num_draft;
    ForEachHead(a.batch, a.shape.num_v_heads, [&](int64_t row, int h) {
      const int32_t slot = a.slot_idx[row];
      if (slot < 0) {
        for (int t = 0; t < T; ++t) layer.StoreOutput(a.out, row * T + t, h, nullptr);
        return;
      }
      Workspace& ws = LocalWorkspace();
      ws.Reserve(dims, dims.l);
      const int w = a.write_pos[row];
      layer.LoadState(slot, h, ws.state.data());
      layer.LoadRecords(slot, h, w, ws.records);
      for (int t = 0; t < T; ++t) {  // draft t sees drafts 0..t-1 as stored records
        layer.LoadToken(a.params, a.in, row * T + t, h, ws.token);
        StepHead(dims, ws.state.data(), ws.records, ws.token, false, ws.scratch, ws.o.data(),
                 ws.d.data());
        layer.StoreOutput(a.out, row * T + t, h, ws.o.data());
        layer.AppendRecord(ws.d.data(), ws.token, ws.records);
        layer.StoreRecord(slot, h, w + t, ws.records, w + t);
      }
    });
  });
}

rssm_status SegmentDigests(const void* const* parts, size_t count, size_t part_bytes,
                           size_t segment_bytes, uint64_t* digests) {
  const size_t bytes = count * part_bytes;
  const size_t segments = (bytes + segment_bytes - 1) / segment_bytes;
  const auto* p = reinterpret_cast<const uint8_t* const*>(parts);
  ThreadPool::Default().ParallelFor(static_cast<int64_t>(segments), [&](int64_t i) {
    const size_t off = static_cast<size_t>(i) * segment_bytes;
    digests[i] = RangeDigest(p, part_bytes, off, off + std::min(segment_bytes, bytes - off));
  });
  return RSSM_OK;
}

}  // namespace replayssm::kernels::cpu
