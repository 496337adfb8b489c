#include "service/malformed_requests.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/interceptor.h"
#include "grpcpp/support/status.h"

namespace replayssm::service {

namespace {

using grpc::experimental::InterceptionHookPoints;

class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  MalformedRequestInterceptor(Metrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE)) {
      unparsed_ = methods->GetRecvMessage() == nullptr;
    }
    if (unparsed_ && methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status sent = methods->GetSendStatus();
      if (sent.error_code() == grpc::StatusCode::UNIMPLEMENTED && sent.error_message().empty()) {
        methods->ModifySendStatus(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         absl::StrCat("request: expected a serialized replayssm.v1 ", method_,
                                      " request, got bytes that do not parse")));
        metrics_->CountRpc(method_, grpc::StatusCode::INVALID_ARGUMENT);
      }
    }
    methods->Proceed();
  }

 private:
  Metrics* metrics_;
  const std::string method_;  // "Allocate"
  bool unparsed_ = false;     // the request came and did not deserialize
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(Metrics* metrics) : metrics_(metrics) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // Unary calls of our services only: streams and other services pay nothing.
    const absl::string_view method = info->method();
    if (info->type() != grpc::experimental::ServerRpcInfo::Type::UNARY ||
        !absl::StartsWith(method, "/replayssm.v1.")) {
      return nullptr;
    }
    return new MalformedRequestInterceptor(metrics_,
                                           std::string(method.substr(method.rfind('/') + 1)));
  }

 private:
  Metrics* metrics_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MalformedRequestsFactory(
    Metrics* metrics) {
  return std::make_unique<Factory>(metrics);
}

}  // namespace replayssm::service
