#include "replayssm/transfer/sender.h"

#include <algorithm>
#include <chrono>
#include <deque>
#include <thread>

#include "absl/strings/str_cat.h"

namespace replayssm::transfer {
namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point* t) {
  const Clock::time_point now = Clock::now();
  const double s = std::chrono::duration<double>(now - *t).count();
  *t = now;
  return s;
}

// One send's lanes: which chunks are queued for their lane, which have landed (put and
// flushed), the doorbell's last value and the first failure.
struct Lanes {
  absl::Mutex mu;
  std::vector<cache::SlotChunk> queued ABSL_GUARDED_BY(mu);  // per chunk; data null: not yet
  std::vector<char> landed ABSL_GUARDED_BY(mu);              // per chunk
  size_t prefix ABSL_GUARDED_BY(mu) = 0;                     // chunks [0, prefix) all landed
  int32_t running ABSL_GUARDED_BY(mu) = 0;                   // lane threads not ended
  absl::Status error ABSL_GUARDED_BY(mu);                    // the first failure
  bool stop ABSL_GUARDED_BY(mu) = false;                     // a failure: every lane ends
  absl::Mutex bell_mu;                                       // one ring at a time, flushed
  uint64_t rung ABSL_GUARDED_BY(bell_mu) = 0;                // the doorbell's last value

  void Fail(absl::Status st) {
    absl::MutexLock lock(&mu);
    if (error.ok()) error = std::move(st);
    stop = true;
  }
  // Waits until ready(*this, i) or the send stopped; false when it stopped.
  bool Await(size_t i, bool (*ready)(const Lanes&, size_t)) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    struct Arg {
      Lanes* l;
      size_t i;
      bool (*ready)(const Lanes&, size_t);
    } arg{this, i, ready};
    mu.Await(absl::Condition(
        +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->l->stop || a->ready(*a->l, a->i); },
        &arg));
    return !stop;
  }
  // Waits until chunk i landed or the send failed.
  absl::Status WaitLanded(size_t i) {
    absl::MutexLock lock(&mu);
    const bool landed_it = Await(i, [](const Lanes& l, size_t k) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return l.landed[k] != 0;
    });
    return landed_it ? absl::OkStatus() : error;
  }
  // Waits for chunk i to be queued; nullopt when the send stopped.
  std::optional<cache::SlotChunk> WaitQueued(size_t i) {
    absl::MutexLock lock(&mu);
    if (!Await(i, [](const Lanes& l, size_t k)
                      ABSL_NO_THREAD_SAFETY_ANALYSIS { return l.queued[k].data != nullptr; })) {
      return std::nullopt;
    }
    return queued[i];
  }
  // Marks chunk i landed; the end of the landed prefix when it grew, else 0.
  uint64_t Land(size_t i) {
    absl::MutexLock lock(&mu);
    landed[i] = 1;
    const size_t before = prefix;
    while (prefix < landed.size() && landed[prefix]) ++prefix;
    if (prefix == before) return 0;
    return queued[prefix - 1].offset + queued[prefix - 1].size;
  }
};

// Lane k of n: puts chunks k, k + n, ... in order, each once queued, hands each back to the
// reader once its source may be reused and rings the doorbell when the landed prefix grew.
// A doorbell must never overtake its bytes: with one lane (one endpoint) a fence orders it
// behind them; across lanes only a flush does, so each lane flushes every chunk first.
absl::Status RunLane(size_t k, size_t n, PutStream& put, const Reservation& r, Lanes& st,
                     cache::SlotReader& reader) {
  const size_t count = reader.num_chunks();
  const bool one_endpoint = n == 1;
  std::deque<uint64_t> rung;  // one endpoint: the doorbell puts' sources, until Finish
  for (size_t i = k; i < count; i += n) {
    std::optional<cache::SlotChunk> c = st.WaitQueued(i);
    if (!c) return absl::OkStatus();  // another lane's failure is the one reported
    absl::StatusOr<uint64_t> ticket = put.Write(c->data, c->size, r.remote_addr + c->offset);
    if (!ticket.ok()) return ticket.status();
    absl::Status s = one_endpoint ? put.WaitFor(*ticket) : put.Flush();
    if (!s.ok()) return s;
    reader.Done(i);
    const uint64_t value = st.Land(i);
    if (r.doorbell_addr == 0 || value == 0) continue;
    if (one_endpoint) {
      rung.push_back(value);
      s = put.Fence();
      if (s.ok()) s = put.Write(&rung.back(), sizeof(uint64_t), r.doorbell_addr).status();
      if (!s.ok()) return s;
      continue;
    }
    absl::MutexLock lock(&st.bell_mu);
    if (value <= st.rung) continue;  // a later ring covered it already
    uint64_t v = value;              // the put's source: valid until the flush below
    absl::StatusOr<uint64_t> t = put.Write(&v, sizeof(v), r.doorbell_addr);
    s = t.ok() ? put.Flush() : t.status();
    if (!s.ok()) return s;
    st.rung = value;
  }
  return put.Finish();
}

}  // namespace

Sender::Sender(cache::StateCache* cache, std::vector<PutLane*> lanes)
    : cache_(cache), lanes_(std::move(lanes)) {}

bool Sender::LockPeer(const std::string& worker, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  struct Arg {
    Sender* s;
    const std::string* w;
  } arg{this, &worker};
  if (!mu_.AwaitWithDeadline(
          absl::Condition(
              +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return !a->s->putting_.count(*a->w); },
              &arg),
          deadline)) {
    return false;
  }
  putting_.insert(worker);
  return true;
}

void Sender::UnlockPeer(const std::string& worker) {
  absl::MutexLock lock(&mu_);
  putting_.erase(worker);
}

absl::Status Sender::PutChunks(const Reservation& r, cache::SlotReader& reader,
                               absl::Time deadline) {
  const size_t n = lanes_.size(), count = reader.num_chunks(), depth = reader.depth();
  std::vector<std::unique_ptr<PutStream>> streams;
  for (PutLane* lane : lanes_) {
    absl::StatusOr<std::unique_ptr<PutStream>> s =
        lane->OpenPutStream(r.worker_address, r.rkey, deadline);
    if (!s.ok()) return s.status();
    streams.push_back(*std::move(s));
  }
  Lanes st;
  {
    absl::MutexLock lock(&st.mu);
    st.queued.assign(count, cache::SlotChunk{});
    st.landed.assign(count, 0);
    st.running = static_cast<int32_t>(n);
  }
  std::vector<std::thread> threads;
  // On every way out the lanes stop and are joined before the reader or the streams go.
  struct Join {
    Lanes& st;
    std::vector<std::thread>& threads;
    ~Join() {
      {
        absl::MutexLock lock(&st.mu);
        st.stop = true;
      }
      for (std::thread& t : threads) t.join();
    }
  } join{st, threads};
  for (size_t k = 0; k < n; ++k) {
    threads.emplace_back([&, k] {
      absl::Status s = RunLane(k, n, *streams[k], r, st, reader);
      if (!s.ok()) st.Fail(std::move(s));
      absl::MutexLock lock(&st.mu);
      --st.running;
    });
  }
  // Feeds the lanes in order, holding at most `depth` chunks not yet landed.
  for (size_t i = 0; i < count; ++i) {
    absl::Status s = i >= depth ? st.WaitLanded(i - depth) : absl::OkStatus();
    absl::StatusOr<cache::SlotChunk> c = s.ok() ? reader.Next() : s;
    if (!c.ok()) {
      st.Fail(c.status());
      break;
    }
    absl::MutexLock lock(&st.mu);
    st.queued[i] = *c;
  }
  absl::MutexLock lock(&st.mu);
  st.mu.Await(absl::Condition(
      +[](Lanes* l) ABSL_NO_THREAD_SAFETY_ANALYSIS { return l->running == 0; }, &st));
  if (!st.error.ok()) return st.error;
  if (st.prefix != count) {
    return absl::InternalError(
        absl::StrCat("transfer: ", st.prefix, " of ", count, " chunks landed"));
  }
  return absl::OkStatus();
}

SendOutcome Sender::Decided(const Decision& d, std::unique_ptr<cache::SlotReader> reader,
                            bool keep_source, const absl::Status& why) const {
  SendOutcome out;
  if (!d.committed) {
    reader->Finish(/*moved=*/false);  // the source as it was (folded: the same logical state)
    out.result = why;
    return out;
  }
  SendResult r;
  r.remote_slot = d.slot;
  r.seq_len = d.seq_len;
  r.bytes = static_cast<int64_t>(reader->bytes());
  r.path = reader->path();
  reader->Finish(/*moved=*/!keep_source);
  out.result = r;
  return out;
}

SendOutcome Sender::Send(Peer& peer, cache::SlotId slot, const std::string& move_id,
                         const std::string& transfer_id, const SendOptions& options) {
  Clock::time_point t = Clock::now();
  const Clock::time_point t0 = t;
  SendResult out;
  cache::SlotIoOptions io;
  io.chunk_bytes = options.chunk_bytes == 0 ? size_t{4} << 20 : options.chunk_bytes;
  io.transport_takes_backend_memory = lanes_.front()->takes_device_memory();
  io.path = options.path;
  io.staging_buffers = std::max(4, 2 * lanes());  // lanes putting while as many are staged
  // The guarded path: folds the slot (write_pos -> 0) or refuses; then it is MOVING.
  absl::StatusOr<std::unique_ptr<cache::SlotReader>> opened = cache_->OpenExport(slot, move_id, io);
  if (!opened.ok()) return SendOutcome{opened.status(), nullptr};
  std::unique_ptr<cache::SlotReader> reader = *std::move(opened);
  out.export_seconds = Since(&t);
  const absl::Duration budget = options.deadline - absl::Now();
  const absl::Time commit_deadline = options.deadline - AbortReserve(budget);
  if (budget <= absl::ZeroDuration()) {
    reader->Finish(false);
    return SendOutcome{absl::DeadlineExceededError("transfer: no time left to start it"), nullptr};
  }
  const StateFormat format = StateFormat::Of(cache_->model());
  absl::StatusOr<Reservation> r = peer.Reserve(transfer_id, format, reader->seq_len(),
                                               cache::kChecksumVersion, budget, commit_deadline);
  out.reserve_seconds = Since(&t);
  absl::Status st = r.status();
  if (st.ok() && r->bytes != static_cast<int64_t>(reader->bytes())) {
    st = absl::FailedPreconditionError(
        absl::StrCat("reservation.bytes: expected ", reader->bytes(), ", got ", r->bytes));
  }
  if (st.ok() && !LockPeer(r->worker_address, commit_deadline)) {
    st = absl::DeadlineExceededError("transfer: other transfers to this peer took the time");
  }
  if (st.ok()) {
    st = PutChunks(*r, *reader, commit_deadline);
    UnlockPeer(r->worker_address);
  }
  absl::StatusOr<uint64_t> checksum = reader->Checksum();
  if (st.ok()) st = checksum.status();
  out.put_seconds = Since(&t);
  if (!st.ok()) {
    // Nothing was committed: a reservation the peer may hold is dropped (or expires).
    peer.Abort(transfer_id, options.deadline).IgnoreError();
    reader->Finish(/*moved=*/false);
    return SendOutcome{st, nullptr};
  }
  absl::StatusOr<uint64_t> remote =
      peer.Commit(transfer_id, reader->tokens(), *checksum, commit_deadline);
  SendOutcome done;
  if (remote.ok()) {
    const Decision committed{true, *remote, reader->seq_len()};
    done = Decided(committed, std::move(reader), options.keep_source, absl::OkStatus());
  } else {
    done = Resolve(peer, std::move(reader), move_id, transfer_id, options.keep_source,
                   options.deadline);
    if (!done.result.ok() && done.in_doubt == nullptr) done.result = remote.status();
  }
  out.commit_seconds = Since(&t);
  if (!done.result.ok()) return done;
  out.remote_slot = done.result->remote_slot;
  out.seq_len = done.result->seq_len;
  out.bytes = done.result->bytes;
  out.path = done.result->path;
  out.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  done.result = out;
  if (remote.ok()) peer.Acknowledge(transfer_id);  // (Resolve acknowledges what it learns)
  return done;
}

SendOutcome Sender::Resolve(Peer& peer, std::unique_ptr<cache::SlotReader> in_doubt,
                            const std::string& move_id, const std::string& transfer_id,
                            bool keep_source, absl::Time deadline) {
  absl::StatusOr<Decision> d = peer.Abort(transfer_id, deadline);
  if (d.ok()) {
    if (d->committed) peer.Acknowledge(transfer_id);
    return Decided(
        *d, std::move(in_doubt), keep_source,
        absl::AbortedError(absl::StrCat("transfer ", transfer_id, ": the peer aborted it")));
  }
  return SendOutcome{absl::UnavailableError(absl::StrCat(
                         "transfer of request id ", move_id,
                         ": the peer answered neither the commit nor the "
                         "abort (",
                         d.status().message(),
                         "), so whether it holds the slot is unknown; the "
                         "source slot stays locked until that is known: retry with request_id ",
                         move_id)),
                     std::move(in_doubt)};
}

}  // namespace replayssm::transfer
