#include "replayssm/client/client.h"

#include <errno.h>
#include <sys/random.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"

namespace replayssm::client {

absl::Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

std::string NewRequestId() {
  // 128 bits from the kernel for every id: nothing a forked child could share with its
  // parent or a sibling (a seeded generator's state is copied by fork, and the copies
  // repeat each other's ids: two workers' Allocates answered with one slot).
  uint64_t words[2] = {0, 0};
  size_t got = 0;
  while (got < sizeof(words)) {
    const ssize_t n = getrandom(reinterpret_cast<char*>(words) + got, sizeof(words) - got, 0);
    if (n > 0) {
      got += static_cast<size_t>(n);
    } else if (n < 0 && errno != EINTR) {
      std::abort();  // no kernel randomness: a repeated id would corrupt another request
    }
  }
  return absl::StrFormat("%016x%016x", words[0], words[1]);
}

namespace {

std::string OrNew(std::string id) { return id.empty() ? NewRequestId() : id; }

}  // namespace

// ---- ForwardStream ----

ForwardStream::ForwardStream(
    std::unique_ptr<grpc::ClientContext> context,
    std::unique_ptr<grpc::ClientReaderWriter<v1::DecodeStreamRequest, v1::DecodeStreamResponse>>
        stream)
    : context_(std::move(context)), stream_(std::move(stream)) {}

ForwardStream::ForwardStream(absl::Status failed) : finished_(true), final_(std::move(failed)) {}

ForwardStream::~ForwardStream() { Finish().IgnoreError(); }

absl::StatusOr<v1::DecodeStreamResponse> ForwardStream::RoundTrip(
    const v1::DecodeStreamRequest& request, v1::DecodeStreamResponse::MsgCase expect) {
  absl::Status s = Send(request);
  if (!s.ok()) return s;
  return Receive(expect);
}

absl::Status ForwardStream::Send(const v1::DecodeStreamRequest& request) {
  if (finished_) return final_.ok() ? absl::FailedPreconditionError("stream closed") : final_;
  if (awaiting_) {
    return absl::FailedPreconditionError(
        "forward stream: a pipelined begin awaits its reply "
        "(call AwaitBegun first)");
  }
  if (stream_->Write(request)) {
    awaiting_ = true;
    return absl::OkStatus();
  }
  return End();
}

absl::StatusOr<v1::DecodeStreamResponse> ForwardStream::Receive(
    v1::DecodeStreamResponse::MsgCase expect) {
  if (finished_) return final_.ok() ? absl::FailedPreconditionError("stream closed") : final_;
  awaiting_ = false;
  v1::DecodeStreamResponse response;
  if (!stream_->Read(&response)) return End();
  if (response.msg_case() != expect) {  // a begin answered by a commit, say, is not an empty begun
    // Out of step with the server from here: the stream is dead, as after any error (the
    // cancel ends the server's side, abandoning an open forward).
    context_->TryCancel();
    v1::DecodeStreamResponse ignored;
    while (stream_->Read(&ignored)) {
    }
    (void)stream_->Finish();  // CANCELLED: the mismatch is what the caller learns
    finished_ = true;
    final_ = absl::InternalError(absl::StrCat("forward stream: expected reply case ", expect,
                                              ", got ", response.msg_case()));
    return final_;
  }
  return response;
}

absl::Status ForwardStream::End() {
  finished_ = true;
  awaiting_ = false;
  final_ = FromGrpc(stream_->Finish());
  if (final_.ok()) final_ = absl::UnavailableError("forward stream ended by the server");
  return final_;
}

absl::Status ForwardStream::SendBegin(const v1::DecodeStreamRequest& begin) { return Send(begin); }

absl::StatusOr<v1::DecodeBegun> ForwardStream::AwaitBegun() {
  if (!awaiting_ && !finished_) {
    return absl::FailedPreconditionError("forward stream: no pipelined begin was sent");
  }
  absl::StatusOr<v1::DecodeStreamResponse> resp = Receive(v1::DecodeStreamResponse::kBegun);
  if (!resp.ok()) return resp.status();
  return resp->begun();
}

absl::StatusOr<v1::DecodeBegun> ForwardStream::BeginWith(const v1::DecodeStreamRequest& begin) {
  absl::StatusOr<v1::DecodeStreamResponse> resp =
      RoundTrip(begin, v1::DecodeStreamResponse::kBegun);
  if (!resp.ok()) return resp.status();
  return resp->begun();
}

namespace {

v1::DecodeStreamRequest DecodeBeginOf(const std::vector<v1::DecodeRow>& rows,
                                      std::string request_id) {
  v1::DecodeStreamRequest req;
  req.mutable_begin()->set_request_id(OrNew(std::move(request_id)));
  req.mutable_begin()->mutable_rows()->Assign(rows.begin(), rows.end());
  return req;
}

v1::DecodeStreamRequest PrefillBeginOf(const std::vector<v1::PrefillRow>& rows,
                                       std::string request_id) {
  v1::DecodeStreamRequest req;
  req.mutable_prefill_begin()->set_request_id(OrNew(std::move(request_id)));
  req.mutable_prefill_begin()->mutable_rows()->Assign(rows.begin(), rows.end());
  return req;
}

v1::DecodeStreamRequest VerifyBeginOf(absl::Span<const uint64_t> slots, int32_t num_draft,
                                      absl::Span<const int32_t> draft_tokens,
                                      std::string request_id) {
  v1::DecodeStreamRequest req;
  v1::VerifyBegin* begin = req.mutable_verify_begin();
  begin->set_request_id(OrNew(std::move(request_id)));
  begin->mutable_slots()->Assign(slots.begin(), slots.end());
  begin->set_num_draft(num_draft);
  begin->mutable_draft_tokens()->Assign(draft_tokens.begin(), draft_tokens.end());
  return req;
}

}  // namespace

v1::PrefillRow MakePrefillRow(uint64_t slot, absl::Span<const int32_t> tokens) {
  v1::PrefillRow row;
  row.set_slot(slot);
  row.mutable_tokens()->Assign(tokens.begin(), tokens.end());
  return row;
}

absl::StatusOr<v1::DecodeBegun> ForwardStream::Begin(const std::vector<v1::DecodeRow>& rows,
                                                     std::string request_id) {
  return BeginWith(DecodeBeginOf(rows, std::move(request_id)));
}

absl::StatusOr<v1::DecodeBegun> ForwardStream::BeginPrefill(const std::vector<v1::PrefillRow>& rows,
                                                            std::string request_id) {
  return BeginWith(PrefillBeginOf(rows, std::move(request_id)));
}

absl::StatusOr<v1::DecodeBegun> ForwardStream::BeginVerify(absl::Span<const uint64_t> slots,
                                                           int32_t num_draft,
                                                           absl::Span<const int32_t> draft_tokens,
                                                           std::string request_id) {
  return BeginWith(VerifyBeginOf(slots, num_draft, draft_tokens, std::move(request_id)));
}

absl::StatusOr<v1::LayerOutput> ForwardStream::RunLayer(const v1::LayerInput& input) {
  v1::DecodeStreamRequest req;
  *req.mutable_layer() = input;
  absl::StatusOr<v1::DecodeStreamResponse> resp = RoundTrip(req, v1::DecodeStreamResponse::kLayer);
  if (!resp.ok()) return resp.status();
  return resp->layer();
}

absl::StatusOr<v1::DecodeCommitted> ForwardStream::Commit() {
  v1::DecodeStreamRequest req;
  req.mutable_commit();
  absl::StatusOr<v1::DecodeStreamResponse> resp =
      RoundTrip(req, v1::DecodeStreamResponse::kCommitted);
  if (!resp.ok()) return resp.status();
  return resp->committed();
}

absl::StatusOr<v1::DecodeResponse> ForwardStream::Run(const v1::DecodeStreamRequest& begin,
                                                      absl::Span<const v1::LayerInput> layers) {
  absl::StatusOr<v1::DecodeBegun> begun = BeginWith(begin);
  if (!begun.ok()) return begun.status();
  v1::DecodeResponse out;
  for (const v1::LayerInput& in : layers) {
    absl::StatusOr<v1::LayerOutput> o = RunLayer(in);
    if (!o.ok()) return o.status();
    *out.add_layers() = *std::move(o);
  }
  absl::StatusOr<v1::DecodeCommitted> committed = Commit();
  if (!committed.ok()) return committed.status();
  *out.mutable_rows() = committed->rows();
  return out;
}

absl::StatusOr<v1::DecodeResponse> ForwardStream::Forward(const std::vector<v1::DecodeRow>& rows,
                                                          absl::Span<const v1::LayerInput> layers,
                                                          std::string request_id) {
  return Run(DecodeBeginOf(rows, std::move(request_id)), layers);
}

absl::StatusOr<v1::DecodeResponse> ForwardStream::Prefill(const std::vector<v1::PrefillRow>& rows,
                                                          absl::Span<const v1::LayerInput> layers,
                                                          std::string request_id) {
  return Run(PrefillBeginOf(rows, std::move(request_id)), layers);
}

absl::StatusOr<v1::DecodeResponse> ForwardStream::Verify(absl::Span<const uint64_t> slots,
                                                         int32_t num_draft,
                                                         absl::Span<const int32_t> draft_tokens,
                                                         absl::Span<const v1::LayerInput> layers,
                                                         std::string request_id) {
  return Run(VerifyBeginOf(slots, num_draft, draft_tokens, std::move(request_id)), layers);
}

void ForwardStream::Cancel() {
  if (context_ != nullptr) context_->TryCancel();
}

absl::Status ForwardStream::Finish() {
  if (finished_) return final_;
  finished_ = true;
  stream_->WritesDone();
  v1::DecodeStreamResponse ignored;
  while (stream_->Read(&ignored)) {
  }
  final_ = FromGrpc(stream_->Finish());
  return final_;
}

// ---- Client ----

namespace {

absl::StatusOr<std::string> ReadPem(const std::string& path, const char* option) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": expected a readable PEM file, got \"", path, "\""));
  }
  return text.str();
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(
    const ChannelSecurity& security) {
  if (!security.enabled()) return grpc::InsecureChannelCredentials();
  if (security.cert_file.empty() != security.key_file.empty()) {
    return absl::InvalidArgumentError(
        security.cert_file.empty() ? "tls_cert: expected the certificate of tls_key, got none"
                                   : "tls_key: expected the private key of tls_cert, got none");
  }
  grpc::SslCredentialsOptions o;
  const struct {
    const std::string& path;
    const char* option;
    std::string* out;
  } files[] = {{security.ca_file, "tls_ca", &o.pem_root_certs},
               {security.cert_file, "tls_cert", &o.pem_cert_chain},
               {security.key_file, "tls_key", &o.pem_private_key}};
  for (const auto& f : files) {
    if (f.path.empty()) continue;
    absl::StatusOr<std::string> pem = ReadPem(f.path, f.option);
    if (!pem.ok()) return pem.status();
    *f.out = *std::move(pem);
  }
  return grpc::SslCredentials(o);
}

std::unique_ptr<Client> Client::Connect(const std::string& address, int64_t max_message_bytes,
                                        std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  const int limit =
      static_cast<int>(std::min<int64_t>(max_message_bytes, std::numeric_limits<int>::max()));
  args.SetMaxReceiveMessageSize(limit);
  args.SetMaxSendMessageSize(limit);
  // Keepalive: a stream (no deadline: it lives as long as its engine) against a server that
  // stopped answering fails within ~40 s instead of waiting for ever. The server permits
  // pings every 10 s.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30'000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10'000);
  // On, also while the client sends nothing (a watch only receives): gRPC stops pinging after
  // two pings without data of its own unless told otherwise.
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  return std::make_unique<Client>(grpc::CreateCustomChannel(address, credentials, args));
}

Client::Client(std::shared_ptr<grpc::Channel> channel)
    : channel_(std::move(channel)),
      stub_(v1::ReplaySsm::NewStub(channel_)),
      health_(grpc::health::v1::Health::NewStub(channel_)),
      transfer_(v1::SlotTransfer::NewStub(channel_)),
      regions_(v1::Regions::NewStub(channel_)) {}

bool Client::WaitForConnected(absl::Duration timeout) {
  return channel_->WaitForConnected(absl::ToChronoTime(absl::Now() + timeout));
}

std::unique_ptr<grpc::ClientContext> Client::NewContext() const {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  if (!token_.empty()) context->AddMetadata("authorization", "Bearer " + token_);
  return context;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path, const std::string& option) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  const std::string token(absl::StripAsciiWhitespace(text.str()));
  if (!in || token.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(option, ": expected a readable file holding a token, got \"", path, "\""));
  }
  if (absl::Status s = CheckToken(token, option); !s.ok()) return s;
  return token;
}

absl::Status CheckToken(absl::string_view token, absl::string_view field) {
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ": expected a token of printable ASCII without spaces, got byte 0x",
                       absl::Hex(c, absl::kZeroPad2), " at offset ", i));
    }
  }
  return absl::OkStatus();
}

void Client::set_token(std::string token) {
  token_error_ = CheckToken(token, "token");
  token_ = token_error_.ok() ? std::move(token) : std::string();
}

template <typename Resp, typename F>
absl::StatusOr<Resp> Client::Call(F&& rpc) {
  if (!token_error_.ok()) return token_error_;
  std::unique_ptr<grpc::ClientContext> context = NewContext();
  Resp resp;
  absl::Status s = FromGrpc(rpc(context.get(), &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::GetInfoResponse> Client::Info() {
  return Call<v1::GetInfoResponse>(
      [&](auto* c, auto* r) { return stub_->GetInfo(c, v1::GetInfoRequest(), r); });
}

absl::StatusOr<v1::GetStatsResponse> Client::Stats() {
  return Call<v1::GetStatsResponse>(
      [&](auto* c, auto* r) { return stub_->GetStats(c, v1::GetStatsRequest(), r); });
}

absl::StatusOr<v1::AllocateResponse> Client::Allocate(std::string request_id) {
  v1::AllocateRequest req;
  req.set_request_id(OrNew(std::move(request_id)));
  return Call<v1::AllocateResponse>([&](auto* c, auto* r) { return stub_->Allocate(c, req, r); });
}

absl::StatusOr<v1::AllocateResponse> Client::AllocateFromPrefix(absl::Span<const int32_t> tokens,
                                                                std::string request_id) {
  v1::AllocateRequest req;
  req.set_request_id(OrNew(std::move(request_id)));
  req.set_from_prefix(true);
  req.mutable_prefix_tokens()->Assign(tokens.begin(), tokens.end());
  return Call<v1::AllocateResponse>([&](auto* c, auto* r) { return stub_->Allocate(c, req, r); });
}

absl::Status Client::Free(uint64_t slot, std::string request_id) {
  v1::FreeRequest req;
  req.set_request_id(OrNew(std::move(request_id)));
  req.set_slot(slot);
  return Call<v1::FreeResponse>([&](auto* c, auto* r) { return stub_->Free(c, req, r); }).status();
}

absl::StatusOr<v1::ListSlotsResponse> Client::ListSlots() {
  v1::ListSlotsRequest req;
  return Call<v1::ListSlotsResponse>([&](auto* c, auto* r) { return stub_->ListSlots(c, req, r); });
}

absl::StatusOr<v1::SlotState> Client::GetSlot(uint64_t slot) {
  v1::GetSlotRequest req;
  req.set_slot(slot);
  auto resp =
      Call<v1::GetSlotResponse>([&](auto* c, auto* r) { return stub_->GetSlot(c, req, r); });
  if (!resp.ok()) return resp.status();
  return resp->state();
}

absl::StatusOr<v1::SlotState> Client::Import(v1::ImportRequest request) {
  if (request.request_id().empty()) request.set_request_id(NewRequestId());
  auto resp =
      Call<v1::ImportResponse>([&](auto* c, auto* r) { return stub_->Import(c, request, r); });
  if (!resp.ok()) return resp.status();
  return resp->state();
}

absl::StatusOr<v1::ExportResponse> Client::Export(uint64_t slot) {
  v1::ExportRequest req;
  req.set_slot(slot);
  return Export(req);
}

absl::StatusOr<v1::ExportResponse> Client::Export(const v1::ExportRequest& request) {
  return Call<v1::ExportResponse>([&](auto* c, auto* r) { return stub_->Export(c, request, r); });
}

absl::StatusOr<v1::PrefillResponse> Client::Prefill(v1::PrefillRequest request) {
  if (request.request_id().empty()) request.set_request_id(NewRequestId());
  return Call<v1::PrefillResponse>([&](auto* c, auto* r) { return stub_->Prefill(c, request, r); });
}

absl::StatusOr<v1::DecodeResponse> Client::Decode(v1::DecodeRequest request) {
  if (request.request_id().empty()) request.set_request_id(NewRequestId());
  return Call<v1::DecodeResponse>([&](auto* c, auto* r) { return stub_->Decode(c, request, r); });
}

absl::StatusOr<v1::VerifyResponse> Client::Verify(v1::VerifyRequest request) {
  if (request.request_id().empty()) request.set_request_id(NewRequestId());
  return Call<v1::VerifyResponse>([&](auto* c, auto* r) { return stub_->Verify(c, request, r); });
}

absl::StatusOr<v1::SlotState> Client::Accept(uint64_t slot, int32_t num_accepted,
                                             std::string request_id) {
  v1::AcceptRequest req;
  req.set_request_id(OrNew(std::move(request_id)));
  req.set_slot(slot);
  req.set_num_accepted(num_accepted);
  auto resp = Call<v1::AcceptResponse>([&](auto* c, auto* r) { return stub_->Accept(c, req, r); });
  if (!resp.ok()) return resp.status();
  return resp->state();
}

absl::StatusOr<int64_t> Client::MatchPrefix(absl::Span<const int32_t> tokens) {
  v1::MatchPrefixRequest req;
  req.mutable_tokens()->Assign(tokens.begin(), tokens.end());
  auto resp = Call<v1::MatchPrefixResponse>(
      [&](auto* c, auto* r) { return stub_->MatchPrefix(c, req, r); });
  if (!resp.ok()) return resp.status();
  return resp->matched();
}

absl::Status Client::Donate(uint64_t slot, std::string request_id) {
  v1::DonateRequest req;
  req.set_request_id(OrNew(std::move(request_id)));
  req.set_slot(slot);
  return Call<v1::DonateResponse>([&](auto* c, auto* r) { return stub_->Donate(c, req, r); })
      .status();
}

absl::Status Client::RegisterSystemRegion(const v1::RegisterSystemRegionRequest& request) {
  return Call<v1::RegisterRegionResponse>([&](auto* c, auto* r) {
           return regions_->RegisterSystemRegion(c, request, r);
         })
      .status();
}

absl::Status Client::RegisterCudaRegion(const v1::RegisterCudaRegionRequest& request) {
  return Call<v1::RegisterRegionResponse>([&](auto* c, auto* r) {
           return regions_->RegisterCudaRegion(c, request, r);
         })
      .status();
}

absl::Status Client::UnregisterRegion(const std::string& name) {
  v1::UnregisterRegionRequest req;
  req.set_name(name);
  return Call<v1::UnregisterRegionResponse>(
             [&](auto* c, auto* r) { return regions_->UnregisterRegion(c, req, r); })
      .status();
}

absl::StatusOr<v1::RegionStatusResponse> Client::RegionStatus(const std::string& name) {
  v1::RegionStatusRequest req;
  req.set_name(name);
  return Call<v1::RegionStatusResponse>(
      [&](auto* c, auto* r) { return regions_->GetRegionStatus(c, req, r); });
}

absl::StatusOr<v1::TransferSlotResponse> Client::TransferSlot(uint64_t slot,
                                                             const std::string& peer_address,
                                                             bool keep_source,
                                                             std::string request_id) {
  v1::TransferSlotRequest req;
  req.set_request_id(OrNew(std::move(request_id)));
  req.set_slot(slot);
  req.set_peer_address(peer_address);
  req.set_keep_source(keep_source);
  return Call<v1::TransferSlotResponse>(
      [&](auto* c, auto* r) { return transfer_->TransferSlot(c, req, r); });
}

absl::StatusOr<v1::PullSlotResponse> Client::PullSlot(uint64_t slot,
                                                     const std::string& peer_address,
                                                     bool keep_source,
                                                     const std::string& self_address,
                                                     std::string request_id) {
  v1::PullSlotRequest req;
  req.set_request_id(OrNew(std::move(request_id)));
  req.set_slot(slot);
  req.set_peer_address(peer_address);
  req.set_keep_source(keep_source);
  req.set_self_address(self_address);
  return Call<v1::PullSlotResponse>(
      [&](auto* c, auto* r) { return transfer_->PullSlot(c, req, r); });
}

absl::StatusOr<grpc::health::v1::HealthCheckResponse::ServingStatus> Client::Health(
    const std::string& service) {
  grpc::health::v1::HealthCheckRequest req;
  req.set_service(service);
  auto resp = Call<grpc::health::v1::HealthCheckResponse>(
      [&](auto* c, auto* r) { return health_->Check(c, req, r); });
  if (!resp.ok()) return resp.status();
  return resp->status();
}

std::unique_ptr<ForwardStream> Client::OpenStream() {
  // A token set_token refused: the stream's calls fail with its error, as unary calls do (it
  // used to open the stream without a token, UNAUTHENTICATED on a server with tokens).
  if (!token_error_.ok()) return std::make_unique<ForwardStream>(token_error_);
  auto context = std::make_unique<grpc::ClientContext>();
  if (!token_.empty()) context->AddMetadata("authorization", "Bearer " + token_);
  auto stream = stub_->DecodeStream(context.get());
  return std::make_unique<ForwardStream>(std::move(context), std::move(stream));
}

}  // namespace replayssm::client
