#include "bench/echo_service.h"

#include <string>

namespace replayssm::bench {

namespace {

grpc::ServerUnaryReactor* Ok(grpc::CallbackServerContext* c) {
  grpc::ServerUnaryReactor* r = c->DefaultReactor();
  r->Finish(grpc::Status::OK);
  return r;
}

size_t ActSize(v1::DType d) { return d == v1::DTYPE_F32 ? 4 : 2; }

class EchoStreamReactor final
    : public grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse> {
 public:
  explicit EchoStreamReactor(const EchoService* echo) : echo_(echo) { StartRead(&request_); }
  void OnReadDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::OK);
    response_.Clear();
    switch (request_.msg_case()) {
      case v1::DecodeStreamRequest::kBegin:
        batch_ = request_.begin().rows_size();
        response_.mutable_begun()->set_batch(static_cast<int32_t>(batch_));
        break;
      case v1::DecodeStreamRequest::kLayer:
        *response_.mutable_layer() = echo_->Output(request_.layer().layer(), batch_);
        break;
      default:
        for (int64_t i = 0; i < batch_; ++i) response_.mutable_committed()->add_rows();
    }
    StartWrite(&response_);
  }
  void OnWriteDone(bool ok) override {
    if (!ok) return Finish(grpc::Status::CANCELLED);
    StartRead(&request_);
  }
  void OnDone() override { delete this; }

 private:
  const EchoService* echo_;
  int64_t batch_ = 0;
  v1::DecodeStreamRequest request_;
  v1::DecodeStreamResponse response_;
};

}  // namespace

v1::LayerOutput EchoService::Output(int32_t layer, int64_t batch) const {
  const v1::ModelInfo& m = info_.model();
  v1::LayerOutput out;
  out.set_layer(layer);
  v1::Tensor* t = out.mutable_out();
  t->set_dtype(m.act_dtype());
  t->add_shape(batch);
  t->add_shape(m.num_v_heads());
  t->add_shape(m.head_v());
  t->mutable_data()->assign(batch * m.num_v_heads() * m.head_v() * ActSize(m.act_dtype()), '\0');
  return out;
}

grpc::ServerUnaryReactor* EchoService::GetInfo(grpc::CallbackServerContext* c,
                                               const v1::GetInfoRequest*,
                                               v1::GetInfoResponse* resp) {
  *resp = info_;
  return Ok(c);
}

grpc::ServerUnaryReactor* EchoService::Allocate(grpc::CallbackServerContext* c,
                                                const v1::AllocateRequest*,
                                                v1::AllocateResponse* resp) {
  resp->set_slot(next_slot_++);
  return Ok(c);
}

grpc::ServerUnaryReactor* EchoService::Free(grpc::CallbackServerContext* c, const v1::FreeRequest*,
                                            v1::FreeResponse*) {
  return Ok(c);
}

grpc::ServerUnaryReactor* EchoService::Decode(grpc::CallbackServerContext* c,
                                              const v1::DecodeRequest* req,
                                              v1::DecodeResponse* resp) {
  for (const v1::LayerInput& l : req->layers())
    *resp->add_layers() = Output(l.layer(), req->rows_size());
  for (int i = 0; i < req->rows_size(); ++i) resp->add_rows();
  return Ok(c);
}

grpc::ServerBidiReactor<v1::DecodeStreamRequest, v1::DecodeStreamResponse>*
EchoService::DecodeStream(grpc::CallbackServerContext*) {
  return new EchoStreamReactor(this);
}

}  // namespace replayssm::bench
