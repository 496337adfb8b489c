#include "replayssm/client/demo.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "replayssm/client/reference.h"
#include "replayssm/client/tensor.h"

namespace replayssm::client {

namespace {

struct Request {
  uint64_t slot = 0;
  Client* holder = nullptr;  // the client of the server holding `slot`; null: none holds it
  int32_t seq = -1;          // reference sequence
  std::vector<int32_t> tokens;
};

class Demo {
 public:
  Demo(Client& client, const DemoOptions& options, std::ostream& log)
      : client_(&client), options_(options), log_(log) {}

  absl::StatusOr<DemoReport> Run();
  // After a failed Run: every slot the demo still holds is freed (its stream first closed,
  // which abandons an open forward), on whichever server holds it.
  void FreeSlots();

 private:
  absl::Status Check(const v1::Tensor& got, const v1::Tensor& want, const std::string& what);
  // One layer-by-layer prefill forward over the stream: batch[i] runs tokens[i].
  absl::Status Prefill(const std::vector<Request*>& batch,
                       const std::vector<std::vector<int32_t>>& tokens);
  absl::Status DecodeSteps(std::vector<Request*> batch, int32_t steps);
  absl::Status CheckState(const Request& r);
  absl::Status HandOff();
  std::vector<int32_t> RandomTokens(int n) {
    std::vector<int32_t> t(n);
    for (int32_t& x : t) x = static_cast<int32_t>(rng_() % 32000);
    return t;
  }

  Client* client_;  // the prefill server; the decode server after a disaggregated hand-off
  std::unique_ptr<Client> decode_client_;
  DemoOptions options_;
  std::ostream& log_;
  v1::GetInfoResponse info_;
  std::unique_ptr<CpuReference> ref_;
  std::unique_ptr<ForwardStream> stream_;
  std::vector<Request> requests_;
  std::mt19937_64 rng_;
  double tol_ = 0;
  DemoReport report_;
};

absl::Status Demo::Check(const v1::Tensor& got, const v1::Tensor& want, const std::string& what) {
  std::string why;
  if (!AllClose(got, want, tol_, tol_, &why)) {
    return absl::DataLossError(absl::StrCat(what, ": differs from the CPU reference: ", why));
  }
  ++report_.outputs_checked;
  return absl::OkStatus();
}

// Layer l + 1's inputs as a model makes them, from layer l's outputs: its v channels are the
// synthetic ones plus the previous layer's output (both [N, HV*V]).
v1::LayerInput ChainedInput(const v1::ModelInfo& m, v1::LayerInput in, const v1::Tensor& prev) {
  std::vector<float> qkv = ToFloats(in.mixed_qkv());
  const std::vector<float> out = ToFloats(prev);
  const int64_t n = in.mixed_qkv().shape(0), width = in.mixed_qkv().shape(1);
  const int64_t v_width = m.num_v_heads() * m.head_v();
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t j = 0; j < v_width; ++j)
      qkv[t * width + width - v_width + j] += out[t * v_width + j];
  }
  *in.mutable_mixed_qkv() = MakeTensor(m.act_dtype(), {n, width}, qkv);
  return in;
}

absl::Status Demo::Prefill(const std::vector<Request*>& batch,
                           const std::vector<std::vector<int32_t>>& tokens) {
  std::vector<v1::PrefillRow> rows;
  std::vector<int64_t> offset = {0};  // row i's tokens in the packed layer messages
  for (size_t i = 0; i < batch.size(); ++i) {
    rows.push_back(MakePrefillRow(batch[i]->slot, tokens[i]));
    offset.push_back(offset.back() + static_cast<int64_t>(tokens[i].size()));
  }
  absl::StatusOr<v1::DecodeBegun> begun = stream_->BeginPrefill(rows);
  if (!begun.ok()) return begun.status();
  const v1::ModelInfo& m = info_.model();
  const std::vector<v1::LayerInput> synthetic = SyntheticLayers(m, begun->tokens(), rng_());
  v1::Tensor previous;
  for (int l = 0; l < m.num_layers(); ++l) {
    const v1::LayerInput in = l == 0 ? synthetic[0] : ChainedInput(m, synthetic[l], previous);
    absl::StatusOr<v1::LayerOutput> out = stream_->RunLayer(in);
    if (!out.ok()) return out.status();
    for (size_t i = 0; i < batch.size(); ++i) {
      const int64_t n = offset[i + 1] - offset[i];
      absl::StatusOr<v1::Tensor> want =
          ref_->PrefillLayer(batch[i]->seq, SliceTokens(in, offset[i], n));
      if (!want.ok()) return want.status();
      absl::Status s = Check(SliceTokens(out->out(), offset[i], n), *want,
                             absl::StrCat("prefill row ", i, " layer ", l));
      if (!s.ok()) return s;
    }
    previous = out->out();
  }
  absl::StatusOr<v1::DecodeCommitted> committed = stream_->Commit();
  if (!committed.ok()) return committed.status();
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i]->tokens.insert(batch[i]->tokens.end(), tokens[i].begin(), tokens[i].end());
    if (committed->rows(i).seq_len() != static_cast<int64_t>(batch[i]->tokens.size())) {
      return absl::DataLossError(absl::StrCat("prefill row ", i, ": seq_len ",
                                              committed->rows(i).seq_len(), ", expected ",
                                              batch[i]->tokens.size()));
    }
  }
  return absl::OkStatus();
}

absl::Status Demo::DecodeSteps(std::vector<Request*> batch, int32_t steps) {
  for (int32_t step = 0; step < steps; ++step) {
    if (options_.interrupted != nullptr && options_.interrupted->load()) {
      return absl::CancelledError("demo: interrupted; its slots are freed");
    }
    std::vector<v1::DecodeRow> rows;
    std::vector<int32_t> seqs;
    for (Request* r : batch) {
      v1::DecodeRow row;
      row.set_slot(r->slot);
      row.set_token_id(static_cast<int32_t>(rng_() % 32000));
      rows.push_back(row);
      seqs.push_back(r->seq);
    }
    std::vector<v1::LayerInput> layers =
        SyntheticLayers(info_.model(), static_cast<int64_t>(rows.size()), rng_());
    absl::StatusOr<v1::DecodeResponse> got = stream_->Forward(rows, layers);
    if (!got.ok()) return got.status();
    absl::StatusOr<std::vector<v1::Tensor>> want = ref_->Decode(seqs, layers);
    if (!want.ok()) return want.status();
    for (int l = 0; l < info_.model().num_layers(); ++l) {
      absl::Status s =
          Check(got->layers(l).out(), (*want)[l], absl::StrCat("decode step ", step, " layer ", l));
      if (!s.ok()) return s;
    }
    for (size_t i = 0; i < batch.size(); ++i) batch[i]->tokens.push_back(rows[i].token_id());
    ++report_.forwards;
  }
  return absl::OkStatus();
}

absl::Status Demo::CheckState(const Request& r) {
  absl::StatusOr<v1::ExportResponse> state = client_->Export(r.slot);
  if (!state.ok()) return state.status();
  if (state->seq_len() != static_cast<int64_t>(r.tokens.size())) {
    return absl::DataLossError(
        absl::StrCat("export: seq_len ", state->seq_len(), ", expected ", r.tokens.size()));
  }
  for (int l = 0; l < info_.model().num_layers(); ++l) {
    const std::vector<float> want = ref_->State(r.seq, l);
    const v1::Tensor want_t = MakeTensor(v1::DTYPE_F32, {static_cast<int64_t>(want.size())}, want);
    v1::Tensor got = state->checkpoints(l);
    got.clear_shape();
    got.add_shape(static_cast<int64_t>(want.size()));
    // The state holds sums over all tokens: a looser bound than one output.
    absl::Status s = Check(got, want_t, absl::StrCat("exported state layer ", l));
    if (!s.ok()) return s;
    // The short convolution's window: copies of inputs, so bit for bit.
    const std::string window = ref_->ConvWindow(r.seq, l);
    if (!window.empty() &&
        (state->conv_windows_size() <= l || state->conv_windows(l).data() != window)) {
      return absl::DataLossError(
          absl::StrCat("exported conv window of layer ", l, " differs from the reference's"));
    }
  }
  return absl::OkStatus();
}

// Disaggregation: every prefilled request moves to the decode server over UCX, which then
// serves the rest of the demo (its outputs are checked against the same reference).
absl::Status Demo::HandOff() {
  int64_t bytes = 0;
  for (Request& r : requests_) {
    absl::StatusOr<v1::TransferSlotResponse> t =
        client_->TransferSlot(r.slot, options_.decode_address, /*keep_source=*/false);
    if (!t.ok()) return t.status();
    if (t->seq_len() != static_cast<int64_t>(r.tokens.size())) {
      return absl::DataLossError(absl::StrCat("transfer: seq_len ", t->seq_len(), ", expected ",
                                              r.tokens.size()));
    }
    r.slot = t->remote_slot();
    r.holder = decode_client_.get();
    bytes += t->bytes();
  }
  absl::Status s = stream_->Finish();
  if (!s.ok()) return s;
  client_ = decode_client_.get();
  stream_ = client_->OpenStream();
  log_ << "demo: moved " << requests_.size() << " prefilled requests (" << bytes
       << " state bytes) to the decode server " << options_.decode_address << " over UCX\n";
  return absl::OkStatus();
}

absl::StatusOr<DemoReport> Demo::Run() {
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::GetInfoResponse> info = client_->Info();
  if (!info.ok()) return info.status();
  info_ = *info;
  const v1::ModelInfo& m = info_.model();
  const auto unsharded = [](const v1::ModelInfo& model, absl::string_view which) {
    if (model.tp_size() <= 1) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        "demo: the ", which, " serves ", model.tp_size(),
        " tensor-parallel ranks (--tp-size); the demo's activations and CPU reference are "
        "unsharded: run it against a --tp-size=1 server"));
  };
  if (absl::Status s = unsharded(m, "server"); !s.ok()) return s;
  // The decode server too, before anything is prefilled (its first decode failed on the
  // activations' shape, after every request had moved: an outside review).
  if (!options_.decode_address.empty()) {
    decode_client_ =
        Client::Connect(options_.decode_address, int64_t{256} << 20, options_.credentials);
    decode_client_->set_token(options_.token);
    absl::StatusOr<v1::GetInfoResponse> d = decode_client_->Info();
    if (!d.ok()) {
      return absl::Status(d.status().code(),
                          absl::StrCat("demo: the decode server: ", d.status().message()));
    }
    if (absl::Status s = unsharded(d->model(), "decode server"); !s.ok()) return s;
  }
  tol_ =
      std::max(OutputTolerance(m.act_dtype()),
               OutputTolerance(m.state_dtype() == v1::DTYPE_F32 ? m.act_dtype() : v1::DTYPE_BF16));
  const uint64_t seed =
      options_.seed != 0 ? options_.seed : static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  rng_.seed(seed);
  auto ref = CpuReference::Create(m, options_.requests + 1);
  if (!ref.ok()) return ref.status();
  ref_ = *std::move(ref);
  stream_ = client_->OpenStream();
  log_ << "demo: model " << m.name() << " (" << m.num_layers() << " layers, H=" << m.num_qk_heads()
       << " HV=" << m.num_v_heads() << " K=" << m.head_k() << " V=" << m.head_v()
       << " L=" << m.ring_len() << ") on " << info_.backend() << ", seed " << seed
       << " (--seed reruns it)\n";

  // Turn 1: every request's prompt in one layer-by-layer prefill forward (varlen rows).
  std::vector<Request>& requests = requests_;
  requests.resize(options_.requests);
  std::vector<std::vector<int32_t>> prompts;
  for (int32_t i = 0; i < options_.requests; ++i) {
    prompts.push_back(RandomTokens(8 + 3 * i));
    // From nothing, as the reference: a rerun with the same --seed would match the first
    // run's snapshots of these prompts (turn 2 shows a prefix hit).
    absl::StatusOr<v1::AllocateResponse> a = client_->Allocate();
    if (!a.ok()) return a.status();
    absl::StatusOr<int32_t> seq = ref_->NewSequence();
    if (!seq.ok()) return seq.status();
    requests[i].slot = a->slot();
    requests[i].holder = client_;
    requests[i].seq = *seq;
  }
  std::vector<Request*> batch;
  for (Request& r : requests) batch.push_back(&r);
  absl::Status s = Prefill(batch, prompts);
  if (!s.ok()) return s;
  if (!options_.decode_address.empty()) {
    absl::Status h = HandOff();
    if (!h.ok()) return h;
  }
  const int32_t steps = options_.steps > 0 ? options_.steps
                        : info_.track_interval() > 0 && info_.track_interval() <= 256
                            ? info_.track_interval() + 8
                            : 40;
  s = DecodeSteps(batch, steps);
  if (!s.ok()) return s;
  s = CheckState(requests[0]);
  if (!s.ok()) return s;
  log_ << "demo: turn 1: " << options_.requests << " requests prefilled together layer by layer, "
       << steps << " batched decode forwards, outputs match the CPU reference\n";

  // Turn 2: the first request finishes and is donated; its follow-up hits the prefix cache.
  for (Request& r : requests) {
    s = client_->Donate(r.slot);
    if (!s.ok()) return s;
    r.holder = nullptr;  // the prefix cache's now
  }
  Request& first = requests[0];
  const std::vector<int32_t> followup = RandomTokens(4);
  std::vector<int32_t> all = first.tokens;
  all.insert(all.end(), followup.begin(), followup.end());
  absl::StatusOr<v1::AllocateResponse> a = client_->AllocateFromPrefix(all);
  if (!a.ok()) return a.status();
  first.slot = a->slot();  // held from here, whatever it matched: FreeSlots frees it
  first.holder = client_;
  report_.prefix_matched = a->matched();
  report_.prefix_expected = static_cast<int64_t>(first.tokens.size());
  if (a->matched() != report_.prefix_expected) {
    return absl::DataLossError(absl::StrCat("turn 2: prefix hit of ", a->matched(),
                                            " tokens, expected ", report_.prefix_expected));
  }
  s = Prefill({&first}, {followup});
  if (s.ok()) s = DecodeSteps({&first}, options_.turn2_steps);
  if (s.ok()) s = CheckState(first);
  if (s.ok()) s = client_->Free(first.slot);
  if (s.ok()) first.holder = nullptr;
  if (s.ok()) s = stream_->Finish();
  if (!s.ok()) return s;
  report_.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  log_ << "demo: turn 2: prefix hit " << report_.prefix_matched << "/" << report_.prefix_expected
       << " tokens, " << followup.size() << " new tokens prefilled, " << options_.turn2_steps
       << " decode forwards, outputs and state match\n";
  return report_;
}

}  // namespace

void Demo::FreeSlots() {
  if (stream_ != nullptr) stream_->Finish().IgnoreError();
  for (Request& r : requests_) {
    if (r.holder != nullptr) r.holder->Free(r.slot).IgnoreError();
    r.holder = nullptr;
  }
}

absl::StatusOr<DemoReport> RunDemo(Client& client, const DemoOptions& options, std::ostream& log) {
  Demo demo(client, options, log);
  absl::StatusOr<DemoReport> report = demo.Run();
  if (!report.ok()) demo.FreeSlots();
  return report;
}

}  // namespace replayssm::client
