#include "replayssm/client/reference.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "replayssm/client/tensor.h"

namespace replayssm::client {

namespace {

int32_t RssmDtype(v1::DType dtype) {
  switch (dtype) {
    case v1::DTYPE_BF16:
      return RSSM_DTYPE_BF16;
    case v1::DTYPE_F16:
      return RSSM_DTYPE_F16;
    default:
      return RSSM_DTYPE_F32;
  }
}

absl::Status KernelError(rssm_status s) {
  return absl::InternalError(
      absl::StrCat("reference kernel: ", rssm_status_name(s), ": ", rssm_last_error()));
}

// A layer's inputs for `n` tokens as the model has them (inline tensors of its activation
// dtype and sizes), or INVALID_ARGUMENT naming `field`: the reference reads raw bytes, and a
// short or mistyped tensor was read past its end.
absl::Status CheckInputs(const v1::ModelInfo& m, const v1::LayerInput& in, int64_t n,
                         const std::string& field) {
  const int64_t es = rssm_dtype_size(RssmDtype(m.act_dtype()));
  const int64_t hv = m.num_v_heads();
  const int64_t qkv = 2LL * m.num_qk_heads() * m.head_k() + hv * m.head_v();
  const int64_t a = m.gate() == v1::GATE_KDA ? hv * m.head_k() : hv;
  const struct {
    const char* name;
    const v1::Tensor& t;
    int64_t width;
  } parts[] = {{"mixed_qkv", in.mixed_qkv(), qkv}, {"a", in.a(), a}, {"b", in.b(), hv}};
  for (const auto& p : parts) {
    const int64_t want = n * p.width * es;
    if (p.t.dtype() != m.act_dtype() || static_cast<int64_t>(p.t.data().size()) != want) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference: ", field, ".", p.name, ": expected ", want, " bytes of ",
                       v1::DType_Name(m.act_dtype()), " ([", n, ", ", p.width, "]), got ",
                       p.t.data().size(), " bytes of ", v1::DType_Name(p.t.dtype())));
    }
  }
  return absl::OkStatus();
}

rssm_token_inputs Inputs(const v1::LayerInput& in) {
  rssm_token_inputs t{};
  t.mixed_qkv = in.mixed_qkv().data().data();
  t.a = in.a().data().data();
  t.b = in.b().data().data();
  return t;
}

v1::Tensor OutputTensor(const v1::ModelInfo& m, int64_t n) {
  v1::Tensor t;
  t.set_dtype(m.act_dtype());
  t.add_shape(n);
  t.add_shape(m.num_v_heads());
  t.add_shape(m.head_v());
  t.mutable_data()->assign(n * m.num_v_heads() * m.head_v() * DtypeSize(m.act_dtype()), '\0');
  return t;
}

}  // namespace

CpuReference::CpuReference(const v1::ModelInfo& model, int32_t capacity)
    : model_(model), capacity_(capacity), used_(capacity, false) {
  shape_.gate = model.gate() == v1::GATE_KDA ? RSSM_GATE_KDA : RSSM_GATE_GDN;
  shape_.num_qk_heads = model.num_qk_heads();
  shape_.num_v_heads = model.num_v_heads();
  shape_.head_k = model.head_k();
  shape_.head_v = model.head_v();
  shape_.ring_len = 1;
  shape_.state_dtype = RSSM_DTYPE_F32;
  shape_.act_dtype = RssmDtype(model.act_dtype());
  // The server's records enter its state rounded to its ring dtype: round them the same way
  // (the fp32 state here follows the recurrence with R(d), R(k); docs/math-and-abi.md).
  shape_.ring_dtype = RSSM_RING_DTYPE_F32 + RssmDtype(model.ring_dtype());
  layers_.resize(model.num_layers());
  for (int32_t l = 0; l < model.num_layers(); ++l) {
    Layer& L = layers_[l];
    const v1::LayerParams& p = model.layer_params(l);
    L.a_log.assign(p.a_log().begin(), p.a_log().end());
    L.dt_bias.assign(p.dt_bias().begin(), p.dt_bias().end());
    L.params = {L.a_log.data(), L.dt_bias.data(), p.scale(), p.use_qk_l2norm() ? 1 : 0,
                model.round_beta() ? 1 : 0};
    L.state.assign(rssm_checkpoint_elems(&shape_) * capacity, 0.0f);
    L.ring_d.assign(rssm_ring_d_elems(&shape_) * capacity, 0.0f);
    L.ring_k.assign(rssm_ring_k_elems(&shape_) * capacity, 0.0f);
    L.ring_g.assign(rssm_ring_g_elems(&shape_) * capacity, 0.0f);
    L.pool = {
        L.state.data(), L.ring_d.data(), L.ring_k.data(), L.ring_g.data(), capacity, 0, 0, 0, 0};
    if (model.conv_width() > 0) {
      L.conv_weight.assign(p.conv_weight().begin(), p.conv_weight().end());
      L.conv_bias.assign(p.conv_bias().begin(), p.conv_bias().end());
    }
  }
  if (model.conv_width() > 0) {
    const int32_t c =
        2 * model.num_qk_heads() * model.head_k() + model.num_v_heads() * model.head_v();
    conv_shape_ = {c, model.conv_width(), 1, shape_.act_dtype};
    const size_t es = rssm_dtype_size(shape_.act_dtype);
    for (Layer& L : layers_) {
      L.window.assign(rssm_conv_window_elems(&conv_shape_) * es * capacity, '\0');
      L.ring_x.assign(rssm_conv_ring_elems(&conv_shape_) * es * capacity, '\0');
      L.conv = {L.window.data(), L.ring_x.data(), capacity, 0, 0};
    }
  }
}

absl::Status CpuReference::Convolve(int32_t l, absl::Span<const int32_t> seqs, const int32_t* cu,
                                    int32_t max_tokens, rssm_token_inputs& in) {
  if (conv_shape_.width == 0) return absl::OkStatus();
  Layer& L = layers_[l];
  const int64_t n = cu != nullptr ? cu[seqs.size()] : static_cast<int64_t>(seqs.size());
  L.conv_out.resize(n * conv_shape_.channels * rssm_dtype_size(conv_shape_.act_dtype));
  const std::vector<uint8_t> initial(seqs.size(), 1);
  const std::vector<int32_t> write_pos(seqs.size(), 0);
  rssm_conv_args a{};
  a.launch = {RSSM_BACKEND_CPU, nullptr};
  a.shape = conv_shape_;
  a.weight = L.conv_weight.data();
  a.bias = L.conv_bias.empty() ? nullptr : L.conv_bias.data();
  a.state = L.conv;
  a.mode = RSSM_CONV_PREFILL;  // the window moves on by the tokens (the ring stays empty)
  a.batch = static_cast<int32_t>(seqs.size());
  a.slot_idx = seqs.data();
  a.write_pos = write_pos.data();
  a.cu_seqlens = cu;
  a.num_tokens = max_tokens;
  a.initial = initial.data();
  a.x = in.mixed_qkv;
  a.y = L.conv_out.data();
  const rssm_status s = rssm_short_conv(&a);
  if (s != RSSM_OK) return KernelError(s);
  in.mixed_qkv = L.conv_out.data();
  return absl::OkStatus();
}

std::string CpuReference::ConvWindow(int32_t seq, int32_t layer) const {
  if (conv_shape_.width == 0) return std::string();
  const size_t n = rssm_conv_window_elems(&conv_shape_) * rssm_dtype_size(conv_shape_.act_dtype);
  return layers_[layer].window.substr(seq * n, n);
}

absl::StatusOr<std::unique_ptr<CpuReference>> CpuReference::Create(const v1::ModelInfo& model,
                                                                   int32_t capacity) {
  if (model.layer_params_size() != model.num_layers() || capacity < 1) {
    return absl::InvalidArgumentError("reference: model info lacks layer parameters");
  }
  std::unique_ptr<CpuReference> ref(new CpuReference(model, capacity));
  if (rssm_check_shape(&ref->shape_) != RSSM_OK) return KernelError(RSSM_ERR_INVALID_ARGUMENT);
  return ref;
}

absl::StatusOr<int32_t> CpuReference::NewSequence() {
  auto it = std::find(used_.begin(), used_.end(), false);
  if (it == used_.end()) return absl::ResourceExhaustedError("reference: no free sequence");
  const int32_t seq = static_cast<int32_t>(it - used_.begin());
  used_[seq] = true;
  const int64_t n = rssm_checkpoint_elems(&shape_);
  const size_t w = rssm_conv_window_elems(&conv_shape_) * rssm_dtype_size(conv_shape_.act_dtype);
  for (Layer& L : layers_) {
    std::fill_n(L.state.begin() + seq * n, n, 0.0f);
    std::fill_n(L.window.begin() + seq * w, w, '\0');
  }
  return seq;
}

absl::StatusOr<int32_t> CpuReference::Fork(int32_t seq) {
  absl::StatusOr<int32_t> copy = NewSequence();
  if (!copy.ok()) return copy;
  const int64_t n = rssm_checkpoint_elems(&shape_);
  const size_t w = rssm_conv_window_elems(&conv_shape_) * rssm_dtype_size(conv_shape_.act_dtype);
  for (Layer& L : layers_) {
    std::copy_n(L.state.begin() + seq * n, n, L.state.begin() + *copy * n);
    std::copy_n(L.window.begin() + seq * w, w, L.window.begin() + *copy * w);
  }
  return copy;
}

void CpuReference::Release(int32_t seq) {
  if (seq >= 0 && seq < capacity_) used_[seq] = false;
}

std::vector<float> CpuReference::State(int32_t seq, int32_t layer) const {
  const int64_t n = rssm_checkpoint_elems(&shape_);
  const auto begin = layers_[layer].state.begin() + seq * n;
  return std::vector<float>(begin, begin + n);
}

absl::StatusOr<v1::Tensor> CpuReference::PrefillLayer(int32_t seq, const v1::LayerInput& input) {
  const int32_t l = input.layer();
  if (l < 0 || l >= model_.num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat("reference: layer ", l, " out of range"));
  }
  const int64_t n = input.mixed_qkv().shape_size() > 0 ? input.mixed_qkv().shape(0) : 0;
  if (absl::Status c = CheckInputs(model_, input, n, absl::StrCat("layers[", l, "]")); !c.ok()) {
    return c;
  }
  const int32_t cu[2] = {0, static_cast<int32_t>(n)};
  const uint8_t initial = 1;
  const int32_t write_pos = 0;
  v1::Tensor out = OutputTensor(model_, n);
  rssm_prefill_args args{};
  args.launch = {RSSM_BACKEND_CPU, nullptr};
  args.shape = shape_;
  args.params = layers_[l].params;
  args.pool = layers_[l].pool;
  args.batch = 1;
  args.slot_idx = &seq;
  args.cu_seqlens = cu;
  args.initial = &initial;
  args.write_pos = &write_pos;
  args.max_seqlen = static_cast<int32_t>(n);
  args.in = Inputs(input);
  if (absl::Status c =
          Convolve(l, absl::MakeConstSpan(&seq, 1), cu, static_cast<int32_t>(n), args.in);
      !c.ok()) {
    return c;
  }
  args.out = {out.mutable_data()->data(), 0};
  const rssm_status s = rssm_prefill(&args);
  if (s != RSSM_OK) return KernelError(s);
  return out;
}

absl::StatusOr<std::vector<v1::Tensor>> CpuReference::Prefill(
    int32_t seq, absl::Span<const v1::LayerInput> layers) {
  std::vector<v1::Tensor> outs;
  for (const v1::LayerInput& in : layers) {
    absl::StatusOr<v1::Tensor> out = PrefillLayer(seq, in);
    if (!out.ok()) return out.status();
    outs.push_back(*std::move(out));
  }
  return outs;
}

absl::StatusOr<std::vector<v1::Tensor>> CpuReference::Decode(
    absl::Span<const int32_t> seqs, absl::Span<const v1::LayerInput> layers) {
  if (static_cast<int64_t>(layers.size()) != model_.num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reference: layers: expected ", model_.num_layers(), ", got ", layers.size()));
  }
  const int64_t n = static_cast<int64_t>(seqs.size());
  for (int32_t l = 0; l < model_.num_layers(); ++l) {
    if (absl::Status c = CheckInputs(model_, layers[l], n, absl::StrCat("layers[", l, "]"));
        !c.ok()) {
      return c;
    }
  }
  std::vector<v1::Tensor> outs;
  for (int32_t l = 0; l < model_.num_layers(); ++l) {
    outs.push_back(OutputTensor(model_, static_cast<int64_t>(seqs.size())));
    rssm_decode_args args{};
    args.launch = {RSSM_BACKEND_CPU, nullptr};
    args.shape = shape_;
    args.params = layers_[l].params;
    args.pool = layers_[l].pool;
    args.batch = static_cast<int32_t>(seqs.size());
    args.slot_idx = seqs.data();
    args.in = Inputs(layers[l]);
    if (absl::Status c = Convolve(l, seqs, nullptr, 1, args.in); !c.ok()) return c;
    args.out = {outs.back().mutable_data()->data(), 0};
    const rssm_status s = rssm_baseline_decode(&args);
    if (s != RSSM_OK) return KernelError(s);
  }
  return outs;
}

}  // namespace replayssm::client
