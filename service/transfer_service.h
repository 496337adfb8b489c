// The gRPC face of replayssm.v1.SlotTransfer: thin handlers over the transfer layer
// (replayssm/transfer/: Receiver, Sender, TransferManager), a gRPC Peer for the sender's side,
// lease expiry in the background, and the transfer metrics. TransferSlot and PullSlot never
// hold a gRPC thread: the move runs on the transfer layer's threads (the pull's call to the
// peer is asynchronous) and finishes the reactor from there.
#ifndef REPLAYSSM_SERVICE_TRANSFER_SERVICE_H_
#define REPLAYSSM_SERVICE_TRANSFER_SERVICE_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "prometheus/counter.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "replayssm/transfer/manager.h"
#include "replayssm/transfer/receiver.h"
#include "replayssm/transfer/sender.h"
#include "replayssm/transfer/ucx_transport.h"
#include "replayssm/v1/transfer.grpc.pb.h"
#include "service/secrets.h"
#include "service/service_context.h"

namespace replayssm::service {

struct TransferOptions {
  size_t chunk_bytes = 4 << 20;                // UCX put granularity
  absl::Duration timeout = absl::Seconds(30);  // a whole outgoing transfer, waiting included
  absl::Duration lease = absl::Seconds(30);    // an uncommitted reservation, receiver side
  int32_t max_open = 16;                       // concurrent reservations
  int32_t max_open_per_peer = 4;               // of them held by one peer (0: no bound)
  // Sender threads (each with its own UCX context, worker and endpoint) that put a slot's
  // chunks at once, 1..16 (docs/transfer.md, "The put path").
  int32_t lanes = 4;
  // Receiver threads that write (and hash) landed chunks into the reserved slot, 1..32.
  int32_t import_threads = 8;
  // Outgoing transfers running at once, 1..64 (others wait, their timeout running).
  int32_t max_concurrent = 8;
  // How peers are dialled (service/tls.h): insecure when null.
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials;
  // The peers this server may dial (TransferSlot's and PullSlot's peer_address, host:port as
  // given); empty: any (--transfer-peers).
  std::vector<std::string> allowed_peers;
  // --peer-token: peers prove its token, and this server proves it to them (secrets.h). Null:
  // peer calls carry no proof; they are then refused when clients_authenticated.
  std::shared_ptr<const PeerTokens> peer_tokens;
  bool clients_authenticated = false;  // --auth-tokens or --tls-client-ca
};

// Whose move failed, in replayssm_transfer_failures_total's `role`: a TransferSlot or PullSlot
// this server was asked for (kInitiator: a scheduler's move failed), or a peer's
// ReserveTransfer / CommitTransfer it refused, or the push a peer's PullSlot asked it for
// (kPeer: the initiator counts the move too).
enum class TransferRole { kInitiator, kPeer };

class TransferService final : public v1::SlotTransfer::CallbackService {
 public:
  static absl::StatusOr<std::unique_ptr<TransferService>> Create(const ServiceContext* ctx,
                                                                 TransferOptions options);
  ~TransferService() override;
  // This server's gRPC address (host:port bound), the default for PullSlot's self_address.
  void set_self_address(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);
  // Refuses new outgoing transfers, answers the waiting ones and waits for the running ones.
  void Stop();
  // Incoming transfers reserved and not yet decided (committed, aborted or expired).
  int incoming_open() const { return receiver_->open(); }
  // Frees an idle slot (slot leases) through the receiver: a commit its sender has not
  // acknowledged becomes an abort with it (transfer::Receiver::FreeSlot).
  absl::Status FreeIdleSlot(cache::SlotId slot) { return receiver_->FreeSlot(slot); }

  grpc::ServerUnaryReactor* TransferSlot(grpc::CallbackServerContext* c,
                                         const v1::TransferSlotRequest* req,
                                         v1::TransferSlotResponse* resp) override;
  // The receiver's pull form: asks the peer's TransferSlot to push its slot here.
  grpc::ServerUnaryReactor* PullSlot(grpc::CallbackServerContext* c, const v1::PullSlotRequest* req,
                                     v1::PullSlotResponse* resp) override;
  grpc::ServerUnaryReactor* ReserveTransfer(grpc::CallbackServerContext* c,
                                            const v1::ReserveTransferRequest* req,
                                            v1::ReserveTransferResponse* resp) override;
  grpc::ServerUnaryReactor* CommitTransfer(grpc::CallbackServerContext* c,
                                           const v1::CommitTransferRequest* req,
                                           v1::CommitTransferResponse* resp) override;
  grpc::ServerUnaryReactor* AbortTransfer(grpc::CallbackServerContext* c,
                                          const v1::AbortTransferRequest* req,
                                          v1::AbortTransferResponse* resp) override;
  grpc::ServerUnaryReactor* AcknowledgeTransfer(grpc::CallbackServerContext* c,
                                                const v1::AcknowledgeTransferRequest* req,
                                                v1::AcknowledgeTransferResponse* resp) override;

 private:
  TransferService(const ServiceContext* ctx, TransferOptions options);
  // Who is calling, for the per-peer reservation bound: the mTLS identity, else the host.
  static std::string PeerIdentity(const grpc::CallbackServerContext& c);
  // A peer method's caller must be a peer: with --peer-token it presents a proof of that
  // token for this method, transfer id, tenant and the request's `content` (secrets.h;
  // UNAUTHENTICATED otherwise, counted as an auth failure of reason peer_missing or
  // peer_unknown, not as a transfer failure), and its `nonce` (when the method has one) is
  // 16..128 bytes (INVALID_ARGUMENT); without one, a server that authenticates its clients
  // takes no peer calls at all (PERMISSION_DENIED).
  absl::Status AuthenticatePeer(const grpc::CallbackServerContext& c, absl::string_view method,
                                const std::string& transfer_id, absl::string_view tenant,
                                absl::string_view content,
                                const std::string* nonce = nullptr) const;
  // The manager's id of a caller's move: request ids are the tenant's own (with tenants,
  // "<tenant id>/<request id>"; another tenant's id never joins or replays its move).
  std::string MoveId(TenantId tenant, const std::string& request_id) const;
  // The name of the tenant that owns a move (from its transfer id, which starts with MoveId);
  // "" without tenants. Carried to the receiver in ReserveTransfer.
  std::string TenantOf(const std::string& transfer_id) const;
  // Receiver side: the tenant that gets an incoming slot, by the sender's tenant name: the
  // implicit tenant without --auth-tokens, else the tenant of that name or PERMISSION_DENIED.
  absl::StatusOr<TenantId> ReceivingTenant(const std::string& name) const;
  // PERMISSION_DENIED naming peer_address unless `address` is an allowed peer: one of
  // --transfer-peers, or without them any address, except on a server that authenticates its
  // clients without --peer-token (nothing then proves a client-named peer's replies).
  absl::Status CheckPeer(const std::string& address) const;
  // Finishes `reactor` with `status` and counts the call.
  void Finish(grpc::ServerUnaryReactor* reactor, absl::string_view method,
              const absl::Status& status);
  grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* c, absl::string_view method,
                                  const absl::Status& status);
  void CountFailure(TransferRole role, const absl::Status& status);
  // A channel to `address`, made once and kept (peers are few).
  std::shared_ptr<grpc::Channel> Channel(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_);

  const ServiceContext* ctx_;
  const TransferOptions options_;
  std::unique_ptr<transfer::UcxTransport> ucx_;
  std::vector<std::unique_ptr<transfer::UcxTransport>> lanes_;  // the sender's lanes 1..N-1
  std::unique_ptr<transfer::Receiver> receiver_;
  std::unique_ptr<transfer::Sender> sender_;
  std::unique_ptr<transfer::TransferManager> manager_;
  prometheus::Family<prometheus::Counter>* failures_ = nullptr;
  prometheus::Counter* bytes_ = nullptr;
  prometheus::Histogram* seconds_ = nullptr;
  prometheus::Gauge* open_ = nullptr;
  prometheus::Gauge* in_doubt_ = nullptr;
  prometheus::Gauge* channels_gauge_ = nullptr;
  prometheus::Gauge* held_buffers_ = nullptr;    // the receiver's dropped device-direct buffers
  prometheus::Counter* forced_frees_ = nullptr;  // of them freed while planned forwards ran
  mutable absl::Mutex mu_;
  std::string self_address_ ABSL_GUARDED_BY(mu_);
  // One channel a peer address, the least recently used dropped past kMaxChannels (a call
  // running on it keeps it alive): every address a client named, and every address a peer
  // that moved came back on, used to stay with its threads for good (an outside review's
  // soak: ~30 KB and a thread every few addresses).
  struct PeerChannel {
    std::shared_ptr<grpc::Channel> channel;
    uint64_t used = 0;
  };
  static constexpr size_t kMaxChannels = 64;
  std::map<std::string, PeerChannel> channels_ ABSL_GUARDED_BY(mu_);
  uint64_t channel_clock_ ABSL_GUARDED_BY(mu_) = 0;

 public:
  size_t cached_channels() ABSL_LOCKS_EXCLUDED(mu_);  // tests

 private:
  std::atomic<int> pulls_{0};  // PullSlot calls waiting for their peer
  absl::Notification stop_;
  std::thread janitor_;  // expires leases, updates the gauges
};

}  // namespace replayssm::service

#endif  // REPLAYSSM_SERVICE_TRANSFER_SERVICE_H_
