// The fuzz target over request validation: the bytes of a request message, parsed as the
// server parses them, then the checks its handlers run before touching the cache
// (service/request_checks.h, service/tensors.h). What passes must be safe for the cache: every
// inline tensor has exactly the bytes the kernels will read, every value is finite.
#include <string>

#include "fuzz/fuzz_targets.h"
#include "replayssm/cache/model.h"
#include "replayssm/v1/replayssm.pb.h"
#include "service/finite.h"
#include "service/request_checks.h"
#include "service/tensors.h"

namespace replayssm::fuzz {
namespace {

namespace v1 = ::replayssm::v1;
using service::LayerInputs;

// Small limits: a passing request's outputs are allocated below.
service::ServiceLimits Limits() {
  service::ServiceLimits l;
  l.max_batch = 8;
  l.max_prefill_tokens = 64;
  l.max_import_tokens = 1024;
  return l;
}

// tiny-gdn or tiny-kda, with activations and states in any dtype.
cache::ModelSpec Model(uint8_t choice) {
  const int32_t dtypes[] = {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16};
  absl::StatusOr<cache::ModelSpec> m =
      cache::ModelPreset(choice & 1 ? "tiny-kda" : "tiny-gdn", dtypes[((choice >> 1) & 3) % 3]);
  Check(m.ok(), "the preset exists");
  m->shape.act_dtype = dtypes[((choice >> 3) & 3) % 3];
  return *std::move(m);
}

int64_t Bytes(int64_t elements, int32_t dtype) {
  return elements * static_cast<int64_t>(rssm_dtype_size(dtype));
}

// A checked inline tensor: the bytes of its shape, all finite.
void CheckInline(const v1::Tensor& t, int64_t elements, int32_t dtype) {
  Check(static_cast<int64_t>(t.data().size()) == Bytes(elements, dtype),
        "a checked tensor holds its shape's bytes");
  Check(service::FirstNonFinite(t.data().data(), elements, dtype) < 0,
        "a checked tensor is finite");
}

// What the cache gets from checked layers of N tokens: views of exactly the checked bytes.
void CheckLayers(const LayerInputs& layers, const cache::ModelSpec& m, int64_t n) {
  const int32_t act = m.shape.act_dtype;
  for (const v1::LayerInput& in : layers) {
    if (in.mixed_qkv().has_region()) continue;  // resolved against registered regions later
    CheckInline(in.mixed_qkv(), n * m.QkvWidth(), act);
    CheckInline(in.a(), n * m.AWidth(), act);
    CheckInline(in.b(), n * m.BWidth(), act);
    v1::LayerOutput out;
    const cache::LayerIo io = service::LayerView(in, m, n, &out);
    Check(io.mixed_qkv == in.mixed_qkv().data().data(), "the view is the request's bytes");
    Check(static_cast<int64_t>(out.out().data().size()) == Bytes(n * m.OutWidth(), act),
          "the output holds [N, HV, V]");
  }
  (void)service::PayloadBytes(layers);
}

template <typename Message>
bool Parse(const std::string& bytes, Message* msg) {
  return msg->ParseFromString(bytes);
}

void Import(const std::string& bytes, const cache::ModelSpec& m) {
  v1::ImportRequest req;
  if (!Parse(bytes, &req) || !service::CheckImportRequest(req, m, Limits()).ok()) return;
  Check(req.checkpoints_size() == m.num_layers, "one checkpoint per layer");
  const int64_t elements = m.shape.num_v_heads * int64_t{m.shape.head_v} * m.shape.head_k;
  for (const v1::Tensor& t : req.checkpoints()) {
    if (!t.has_region()) CheckInline(t, elements, m.shape.state_dtype);
  }
}

void Stream(const std::string& bytes, const cache::ModelSpec& m) {
  v1::DecodeStreamRequest req;
  if (!Parse(bytes, &req)) return;
  const service::ServiceLimits limits = Limits();
  if (req.has_begin()) (void)service::CheckRows(req.begin().rows(), limits);
  if (req.has_prefill_begin()) (void)service::CheckPrefillRows(req.prefill_begin().rows(), limits);
  if (req.has_verify_begin()) {
    const v1::VerifyBegin& v = req.verify_begin();
    (void)service::CheckVerifyRows(v.slots(), v.num_draft(), v.draft_tokens_size(), m, limits);
  }
  if (req.has_layer()) {
    // The session's token count comes from its begin; here from the tensor, within limits.
    const int64_t n =
        req.layer().mixed_qkv().shape_size() > 0 ? req.layer().mixed_qkv().shape(0) : 1;
    if (n < 1 || n > limits.max_prefill_tokens) return;
    if (!service::CheckLayerInput(req.layer(), "layer", m, n).ok()) return;
    LayerInputs one;
    *one.Add() = req.layer();
    CheckLayers(one, m, n);
  }
}

}  // namespace

int FuzzRequests(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t kind = data[0];
  const cache::ModelSpec m = Model(data[1]);
  const std::string bytes(reinterpret_cast<const char*>(data + 2), size - 2);
  const service::ServiceLimits limits = Limits();
  switch (kind % 7) {
    case 0: {
      v1::AllocateRequest req;
      if (Parse(bytes, &req)) (void)service::CheckAllocateRequest(req);
      break;
    }
    case 1: Import(bytes, m); break;
    case 2: {
      v1::PrefillRequest req;
      if (Parse(bytes, &req) && service::CheckPrefillRequest(req, m, limits).ok()) {
        CheckLayers(req.layers(), m, req.tokens_size());
      }
      break;
    }
    case 3: {
      v1::DecodeRequest req;
      if (Parse(bytes, &req) && service::CheckDecodeRequest(req, m, limits).ok()) {
        CheckLayers(req.layers(), m, req.rows_size());
      }
      break;
    }
    case 4: {
      v1::VerifyRequest req;
      if (Parse(bytes, &req) && service::CheckVerifyRequest(req, m, limits).ok()) {
        CheckLayers(req.layers(), m, int64_t{req.slots_size()} * req.num_draft());
      }
      break;
    }
    case 5: {
      v1::AcceptRequest req;
      if (Parse(bytes, &req)) (void)service::CheckAcceptRequest(req, m);
      break;
    }
    default: Stream(bytes, m);
  }
  return 0;
}

}  // namespace replayssm::fuzz
