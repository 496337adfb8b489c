// Test support: a SlotTransfer peer in the test process that stands between a sending server
// and the real receiving server. It forwards ReserveTransfer, CommitTransfer and
// AbortTransfer to its target, and a test decides per call what happens first: forward it
// (after a delay, a SIGSTOP of the receiver, an edit of the request, ...), answer it with an
// error without forwarding, or never answer it (a hung peer). The bytes themselves go over
// UCX straight from the sender to the receiver named in the reservation. The sender's proof
// of the peer token (metadata replayssm-peer-proof) is passed on. A test may also edit a reply
// on its way back, or make one up (a fake peer).
#ifndef REPLAYSSM_TESTS_TRANSFER_PROXY_H_
#define REPLAYSSM_TESTS_TRANSFER_PROXY_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/v1/transfer.grpc.pb.h"

namespace replayssm::testing {

class TransferProxy final : public v1::SlotTransfer::Service {
 public:
  enum class Action {
    kForward,           // pass the (possibly edited) request to the target and its answer back
    kRefuse,            // answer UNAVAILABLE without forwarding, as a peer that went away would
    kHang,              // never answer (until the proxy stops or the caller gives up)
    kForwardLoseReply,  // forward it, then answer UNAVAILABLE: the target's reply was lost
    kAnswer,            // answer OK without forwarding: an empty reply, edited by the reply hook
  };
  // Called on the proxy's gRPC thread before a call is forwarded; may block, edit the request.
  struct Hooks {
    std::function<Action(v1::ReserveTransferRequest&)> reserve;
    std::function<Action(v1::CommitTransferRequest&)> commit;
    std::function<Action(v1::AbortTransferRequest&)> abort;
    std::function<Action(v1::AcknowledgeTransferRequest&)> acknowledge;
    // Called on a reply before it goes back (a forwarded OK one, or kAnswer's empty one).
    std::function<void(v1::ReserveTransferResponse&)> reserve_reply;
    std::function<void(v1::CommitTransferResponse&)> commit_reply;
    std::function<void(v1::AbortTransferResponse&)> abort_reply;
  };

  // Listens on a loopback port (0: a free one) and forwards to `target` (host:port).
  static std::unique_ptr<TransferProxy> Start(const std::string& target, int port = 0);
  ~TransferProxy() override;  // ends held calls, then stops

  const std::string& address() const { return address_; }
  void set_target(const std::string& target) ABSL_LOCKS_EXCLUDED(mu_);
  void set_hooks(Hooks hooks) ABSL_LOCKS_EXCLUDED(mu_);
  // Calls seen so far (whatever was done with them).
  int reserves() const { return reserves_.load(); }
  int commits() const { return commits_.load(); }
  int aborts() const { return aborts_.load(); }
  // The metadata of the last ReserveTransfer, as the sender sent it.
  std::vector<std::pair<std::string, std::string>> reserve_metadata() const
      ABSL_LOCKS_EXCLUDED(mu_);

  grpc::Status ReserveTransfer(grpc::ServerContext* c, const v1::ReserveTransferRequest* req,
                               v1::ReserveTransferResponse* resp) override;
  grpc::Status CommitTransfer(grpc::ServerContext* c, const v1::CommitTransferRequest* req,
                              v1::CommitTransferResponse* resp) override;
  grpc::Status AbortTransfer(grpc::ServerContext* c, const v1::AbortTransferRequest* req,
                             v1::AbortTransferResponse* resp) override;
  grpc::Status AcknowledgeTransfer(grpc::ServerContext* c,
                                   const v1::AcknowledgeTransferRequest* req,
                                   v1::AcknowledgeTransferResponse* resp) override;

 private:
  TransferProxy() = default;
  template <typename Req, typename Resp>
  using Forwarder = grpc::Status (v1::SlotTransfer::Stub::*)(grpc::ClientContext*, const Req&,
                                                             Resp*);
  // Runs the hook on a copy of the request, then forwards it (`call`), refuses or hangs.
  template <typename Req, typename Resp>
  grpc::Status Handle(grpc::ServerContext* c, const Req& req, Resp* resp,
                      std::function<Action(Req&)> Hooks::*hook, Forwarder<Req, Resp> call,
                      std::function<void(Resp&)> Hooks::*reply = nullptr);
  std::unique_ptr<v1::SlotTransfer::Stub> Stub() ABSL_LOCKS_EXCLUDED(mu_);

  std::string address_;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> reserves_{0}, commits_{0}, aborts_{0};
  mutable absl::Mutex mu_;
  std::string target_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<std::string, std::string>> reserve_metadata_ ABSL_GUARDED_BY(mu_);
  Hooks hooks_ ABSL_GUARDED_BY(mu_);
};

}  // namespace replayssm::testing

#endif  // REPLAYSSM_TESTS_TRANSFER_PROXY_H_
