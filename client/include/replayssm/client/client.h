// The C++ client of replayssm.v1: typed wrappers over the gRPC stubs that return
// absl::Status / StatusOr (the server's gRPC code carried over), fill a fresh request id into
// every mutating call that has none (each call: a request retried by hand must carry its own
// id to be applied once), and a stream helper for layer-by-layer forwards (decode, prefill,
// verify). Begins the caller builds (BeginWith, SendBegin) go as built, their ids too.
//
// Streams have no deadline of their own (set_timeout bounds unary calls); the channel's
// keepalive pings (Connect) end them when the server stops answering.
//
// Thread safety: a Client may be shared by threads (each call has its own context) once it is
// configured: set_timeout and set_token are not synchronized with calls, so set them before
// sharing it. A ForwardStream is driven by one thread at a time.
#ifndef REPLAYSSM_CLIENT_CLIENT_H_
#define REPLAYSSM_CLIENT_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "replayssm/v1/regions.grpc.pb.h"
#include "replayssm/v1/replayssm.grpc.pb.h"
#include "replayssm/v1/transfer.grpc.pb.h"

namespace replayssm::client {

// grpc::Status -> absl::Status with the same code and message.
absl::Status FromGrpc(const grpc::Status& status);
// A random 128-bit id, hex.
std::string NewRequestId();

// One forward stream (the DecodeStream RPC): forwards one after another, each a begin (decode,
// prefill or verify), RunLayer per layer in any order — each layer's inputs may be computed
// from the previous layer's outputs — and Commit. After an error the stream is dead (the
// server ended it and abandoned the open forward); Finish reports the server's status.
class ForwardStream {
 public:
  ForwardStream(
      std::unique_ptr<grpc::ClientContext> context,
      std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeStreamRequest, v1::DecodeStreamResponse>>
          stream);
  // A stream that could not be opened (Client::OpenStream with a token set_token refused):
  // every call returns `failed`.
  explicit ForwardStream(absl::Status failed);
  ~ForwardStream();

  // A decode forward: one token per row; layer messages carry B tokens.
  absl::StatusOr<v1::DecodeBegun> Begin(const std::vector<v1::DecodeRow>& rows,
                                        std::string request_id = "");
  // A prefill forward: layer messages carry the rows' tokens packed in row order
  // (begun.tokens() in all); the commit advances each slot by its tokens.
  absl::StatusOr<v1::DecodeBegun> BeginPrefill(const std::vector<v1::PrefillRow>& rows,
                                               std::string request_id = "");
  // A verify forward: num_draft drafts per slot, layer messages carry them in (slot, draft)
  // order; after the commit the drafts wait for Client::Accept.
  absl::StatusOr<v1::DecodeBegun> BeginVerify(absl::Span<const uint64_t> slots, int32_t num_draft,
                                              absl::Span<const int32_t> draft_tokens,
                                              std::string request_id = "");
  // Any begin the caller built: e.g. one carrying a ForwardPlan (regions + doorbells, no
  // layer messages: Commit next; docs/data-plane.md).
  absl::StatusOr<v1::DecodeBegun> BeginWith(const v1::DecodeStreamRequest& begin);
  // A pipelined begin, for a planned forward (docs/data-plane.md, "Pipelined begins"): writes
  // the begin and returns without its reply, so the engine queues its GPU work at once;
  // AwaitBegun reads the reply (before any other call on this stream). A begin while a
  // planned forward is open commits that forward first: its reply is in begun.closed(). If
  // the begin is refused, the server rings the plan's done doorbells and AwaitBegun returns
  // the error: the outputs written (or not) under that plan are not valid.
  absl::Status SendBegin(const v1::DecodeStreamRequest& begin);
  absl::StatusOr<v1::DecodeBegun> AwaitBegun();
  absl::StatusOr<v1::LayerOutput> RunLayer(const v1::LayerInput& input);
  absl::StatusOr<v1::DecodeCommitted> Commit();
  // Whole forwards, for callers that have every layer's inputs: begin, every layer in order,
  // commit. The reply holds every layer's outputs and the rows' states after the commit.
  absl::StatusOr<v1::DecodeResponse> Forward(const std::vector<v1::DecodeRow>& rows,
                                             absl::Span<const v1::LayerInput> layers,
                                             std::string request_id = "");
  absl::StatusOr<v1::DecodeResponse> Prefill(const std::vector<v1::PrefillRow>& rows,
                                             absl::Span<const v1::LayerInput> layers,
                                             std::string request_id = "");
  absl::StatusOr<v1::DecodeResponse> Verify(absl::Span<const uint64_t> slots, int32_t num_draft,
                                            absl::Span<const int32_t> draft_tokens,
                                            absl::Span<const v1::LayerInput> layers,
                                            std::string request_id = "");
  // Cancels the call: the server abandons the open forward; the stream is dead.
  void Cancel();
  // Closes the stream (an open forward is abandoned) and returns the server's status.
  absl::Status Finish();

 private:
  // The reply due, INTERNAL unless it is of the kind `expect` (the request's answer).
  absl::StatusOr<v1::DecodeStreamResponse> RoundTrip(const v1::DecodeStreamRequest& request,
                                                     v1::DecodeStreamResponse::MsgCase expect);
  absl::Status Send(const v1::DecodeStreamRequest& request);  // one message; its reply is due
  absl::StatusOr<v1::DecodeStreamResponse> Receive(v1::DecodeStreamResponse::MsgCase expect);
  absl::Status End();  // the server ended the stream: its status, kept in final_
  // Every layer, then the commit, of the forward `begin` opens.
  absl::StatusOr<v1::DecodeResponse> Run(const v1::DecodeStreamRequest& begin,
                                         absl::Span<const v1::LayerInput> layers);

  std::unique_ptr<grpc::ClientContext> context_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeStreamRequest, v1::DecodeStreamResponse>>
      stream_;
  bool finished_ = false;
  bool awaiting_ = false;  // a message was sent whose reply is not read yet
  absl::Status final_;
};

// A prefill forward's row.
v1::PrefillRow MakePrefillRow(uint64_t slot, absl::Span<const int32_t> tokens);

// TLS for a client's channel (docs/operations.md, "Security and resource bounds"). Empty:
// an insecure channel. ca_file: the PEM CA the server's certificate must chain to (empty: the
// system roots); cert_file + key_file: this client's certificate, for a server that requires
// one (mTLS).
struct ChannelSecurity {
  std::string ca_file, cert_file, key_file;
  bool enabled() const { return !ca_file.empty() || !cert_file.empty() || !key_file.empty(); }
};
// INVALID_ARGUMENT naming the option (tls_ca, tls_cert, tls_key) for a file that cannot be
// read or a certificate without its key.
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ChannelSecurity& security);

// The bearer token in a token file (--token-file): the file's text without surrounding
// whitespace; INVALID_ARGUMENT naming `option` for an unreadable or empty file, or one whose
// token is not a valid header value (CheckToken).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path,
                                          const std::string& option = "token_file");

// OK when `token` can travel as `authorization: Bearer <token>`: printable ASCII without
// spaces. Else INVALID_ARGUMENT naming `field` and the first bad byte (gRPC aborts the process
// on a header value with a newline or another control character).
absl::Status CheckToken(absl::string_view token, absl::string_view field);

class Client {
 public:
  // `address` host:port; messages up to `max_message_bytes` each way; `credentials` null:
  // insecure (see ChannelCredentialsFor).
  static std::unique_ptr<Client> Connect(
      const std::string& address, int64_t max_message_bytes = int64_t{256} << 20,
      std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr);
  explicit Client(std::shared_ptr<grpc::Channel> channel);

  void set_timeout(absl::Duration timeout) { timeout_ = timeout; }
  // Sends `authorization: Bearer <token>` with every call (a server with --auth-tokens
  // requires it; the token names the tenant whose slots this client sees). "": none. A token
  // CheckToken refuses is not sent: unary calls return its error, and a stream opened with it
  // fails at once with that error.
  void set_token(std::string token);
  // Waits until the channel is connected (true) or the deadline passes.
  bool WaitForConnected(absl::Duration timeout);

  absl::StatusOr<v1::GetInfoResponse> Info();
  absl::StatusOr<v1::GetStatsResponse> Stats();
  absl::StatusOr<v1::AllocateResponse> Allocate(std::string request_id = "");
  absl::StatusOr<v1::AllocateResponse> AllocateFromPrefix(absl::Span<const int32_t> tokens,
                                                          std::string request_id = "");
  absl::Status Free(uint64_t slot, std::string request_id = "");
  absl::StatusOr<v1::SlotState> GetSlot(uint64_t slot);
  // Every live slot the server handed out, with its idle time; renews no lease.
  absl::StatusOr<v1::ListSlotsResponse> ListSlots();
  absl::StatusOr<v1::SlotState> Import(v1::ImportRequest request);
  absl::StatusOr<v1::ExportResponse> Export(uint64_t slot);
  // With checkpoints_out: the checkpoints written into registered regions.
  absl::StatusOr<v1::ExportResponse> Export(const v1::ExportRequest& request);
  absl::StatusOr<v1::PrefillResponse> Prefill(v1::PrefillRequest request);
  absl::StatusOr<v1::DecodeResponse> Decode(v1::DecodeRequest request);
  absl::StatusOr<v1::VerifyResponse> Verify(v1::VerifyRequest request);
  absl::StatusOr<v1::SlotState> Accept(uint64_t slot, int32_t num_accepted,
                                       std::string request_id = "");
  absl::StatusOr<int64_t> MatchPrefix(absl::Span<const int32_t> tokens);
  absl::Status Donate(uint64_t slot, std::string request_id = "");
  // Moves `slot` to the server at `peer_address` over UCX (SlotTransfer.TransferSlot); the
  // reply carries the slot's handle on the peer.
  absl::StatusOr<v1::TransferSlotResponse> TransferSlot(uint64_t slot,
                                                        const std::string& peer_address,
                                                        bool keep_source,
                                                        std::string request_id = "");
  // The receiver's form: this server asks the server at `peer_address` to move its slot
  // `slot` here (SlotTransfer.PullSlot); the reply carries the slot's handle on this server.
  // self_address: this server's address as the peer reaches it ("" = its listen address).
  absl::StatusOr<v1::PullSlotResponse> PullSlot(uint64_t slot, const std::string& peer_address,
                                                bool keep_source,
                                                const std::string& self_address = "",
                                                std::string request_id = "");
  // grpc.health.v1 Check; `service` "" = the whole server.
  absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Health(
      const std::string& service = "");

  std::unique_ptr<ForwardStream> OpenStream();

  // Registered memory regions (replayssm.v1.Regions; docs/data-plane.md).
  absl::Status RegisterSystemRegion(const v1::RegisterSystemRegionRequest& request);
  absl::Status RegisterCudaRegion(const v1::RegisterCudaRegionRequest& request);
  absl::Status UnregisterRegion(const std::string& name);
  absl::StatusOr<v1::RegionStatusResponse> RegionStatus(const std::string& name = "");

 private:
  std::unique_ptr<grpc::ClientContext> NewContext() const;
  template <typename Resp, typename F>
  absl::StatusOr<Resp> Call(F&& rpc);

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::ReplaySsm::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::unique_ptr<v1::SlotTransfer::Stub> transfer_;
  std::unique_ptr<v1::Regions::Stub> regions_;
  absl::Duration timeout_ = absl::Seconds(60);
  std::string token_;
  absl::Status token_error_;  // set_token's CheckToken
};

}  // namespace replayssm::client

#endif  // REPLAYSSM_CLIENT_CLIENT_H_
