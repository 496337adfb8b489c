#include "transfer_proxy.h"

#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace replayssm::testing {

std::unique_ptr<TransferProxy> TransferProxy::Start(const std::string& target, int at) {
  std::unique_ptr<TransferProxy> p(new TransferProxy());
  p->set_target(target);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort(absl::StrCat("127.0.0.1:", at), grpc::InsecureServerCredentials(),
                           &port);
  builder.RegisterService(p.get());
  p->server_ = builder.BuildAndStart();
  if (p->server_ == nullptr || port == 0) return nullptr;
  p->address_ = absl::StrCat("127.0.0.1:", port);
  return p;
}

TransferProxy::~TransferProxy() {
  stopping_ = true;
  if (server_ != nullptr) server_->Shutdown(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
}

void TransferProxy::set_target(const std::string& target) {
  absl::MutexLock lock(&mu_);
  target_ = target;
}

std::vector<std::pair<std::string, std::string>> TransferProxy::reserve_metadata() const {
  absl::MutexLock lock(&mu_);
  return reserve_metadata_;
}

void TransferProxy::set_hooks(Hooks hooks) {
  absl::MutexLock lock(&mu_);
  hooks_ = std::move(hooks);
}

std::unique_ptr<v1::SlotTransfer::Stub> TransferProxy::Stub() {
  absl::MutexLock lock(&mu_);
  return v1::SlotTransfer::NewStub(
      grpc::CreateChannel(target_, grpc::InsecureChannelCredentials()));
}

template <typename Req, typename Resp>
grpc::Status TransferProxy::Handle(grpc::ServerContext* c, const Req& req, Resp* resp,
                                   std::function<Action(Req&)> Hooks::*hook,
                                   Forwarder<Req, Resp> call,
                                   std::function<void(Resp&)> Hooks::*reply) {
  std::function<Action(Req&)> before;
  std::function<void(Resp&)> after;
  {
    absl::MutexLock lock(&mu_);
    before = hooks_.*hook;
    if (reply != nullptr) after = hooks_.*reply;
  }
  Req forwarded = req;
  const Action action = before ? before(forwarded) : Action::kForward;
  if (action == Action::kRefuse) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "proxy: the peer went away");
  }
  if (action == Action::kHang) {
    while (!stopping_ && !c->IsCancelled()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "proxy: held until the caller gave up");
  }
  if (action == Action::kAnswer) {
    if (after) after(*resp);
    return grpc::Status::OK;
  }
  grpc::ClientContext cc;
  cc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  // The sender's proof of the peer token (--peer-token) goes on to the receiver.
  for (const auto& [key, value] : c->client_metadata()) {
    if (key == "replayssm-peer-proof") {
      cc.AddMetadata(std::string(key.data(), key.size()), std::string(value.data(), value.size()));
    }
  }
  const grpc::Status forwarded_status = ((*Stub()).*call)(&cc, forwarded, resp);
  if (action == Action::kForwardLoseReply) {
    return grpc::Status(grpc::StatusCode::UNAVAILABLE, "proxy: the peer's reply was lost");
  }
  if (forwarded_status.ok() && after) after(*resp);
  return forwarded_status;
}

grpc::Status TransferProxy::ReserveTransfer(grpc::ServerContext* c,
                                            const v1::ReserveTransferRequest* req,
                                            v1::ReserveTransferResponse* resp) {
  ++reserves_;
  {
    absl::MutexLock lock(&mu_);
    reserve_metadata_.clear();
    for (const auto& [key, value] : c->client_metadata()) {
      reserve_metadata_.emplace_back(std::string(key.data(), key.size()),
                                     std::string(value.data(), value.size()));
    }
  }
  return Handle(c, *req, resp, &Hooks::reserve, &v1::SlotTransfer::Stub::ReserveTransfer,
                &Hooks::reserve_reply);
}

grpc::Status TransferProxy::CommitTransfer(grpc::ServerContext* c,
                                           const v1::CommitTransferRequest* req,
                                           v1::CommitTransferResponse* resp) {
  ++commits_;
  return Handle(c, *req, resp, &Hooks::commit, &v1::SlotTransfer::Stub::CommitTransfer,
                &Hooks::commit_reply);
}

grpc::Status TransferProxy::AbortTransfer(grpc::ServerContext* c,
                                          const v1::AbortTransferRequest* req,
                                          v1::AbortTransferResponse* resp) {
  ++aborts_;
  return Handle(c, *req, resp, &Hooks::abort, &v1::SlotTransfer::Stub::AbortTransfer,
                &Hooks::abort_reply);
}

grpc::Status TransferProxy::AcknowledgeTransfer(grpc::ServerContext* c,
                                                const v1::AcknowledgeTransferRequest* req,
                                                v1::AcknowledgeTransferResponse* resp) {
  return Handle(c, *req, resp, &Hooks::acknowledge,
                &v1::SlotTransfer::Stub::AcknowledgeTransfer);
}

}  // namespace replayssm::testing
