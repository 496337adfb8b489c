#include "replayssm/transfer/manager.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace replayssm::transfer {

struct TransferManager::Entry {
  enum class State { kQueued, kRunning, kInDoubt, kSucceeded };
  TransferRequest request;
  State state = State::kQueued;
  std::vector<Done> waiters;
  SendResult result;                            // kSucceeded
  std::unique_ptr<cache::SlotReader> in_doubt;  // kInDoubt, and while it is resolved
  bool resolving = false;  // a thread took in_doubt to ask the peer: still in doubt until Finish
  bool asked = false;      // the run in progress began with callers waiting (not the resolver's)
  std::string transfer_id;                      // the last attempt's
  absl::Time deadline;                          // of the run queued or running
};

namespace {

bool SameMove(const TransferRequest& a, const TransferRequest& b) {
  return a.slot == b.slot && a.peer_address == b.peer_address && a.keep_source == b.keep_source;
}

}  // namespace

TransferManager::TransferManager(Sender* sender, PeerFactory peers, ManagerOptions options)
    : sender_(sender),
      peers_(std::move(peers)),
      options_(options),
      nonce_(std::random_device{}() ^ (static_cast<uint64_t>(std::random_device{}()) << 32)) {
  for (int32_t i = 0; i < std::max(options_.max_concurrent, 1); ++i) {
    workers_.emplace_back([this] { Work(); });
  }
  resolver_ = std::thread([this] { ResolveLoop(); });
}

TransferManager::~TransferManager() { Stop(); }

void TransferManager::Stop() {
  std::vector<Done> refused;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    stop_ = true;
    for (const std::string& id : queue_) {
      auto it = entries_.find(id);
      if (it == entries_.end()) continue;
      Entry& e = *it->second;
      for (Done& d : e.waiters) refused.push_back(std::move(d));
      e.waiters.clear();
      if (e.in_doubt != nullptr) {
        e.state = Entry::State::kInDoubt;
      } else {
        entries_.erase(it);
      }
    }
    queue_.clear();
  }
  for (Done& d : refused) d(absl::UnavailableError("transfers: the server is stopping"));
  for (std::thread& t : workers_) t.join();
  resolver_.join();
}

int TransferManager::in_doubt() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [id, e] : entries_) n += e->in_doubt != nullptr || e->resolving;
  return n;
}

void TransferManager::Transfer(const TransferRequest& request, Done done) {
  absl::StatusOr<SendResult> answer;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) {
      answer = absl::UnavailableError("transfers: the server is stopping");
    } else if (auto it = entries_.find(request.request_id); it == entries_.end()) {
      auto e = std::make_unique<Entry>();
      e->request = request;
      e->deadline = absl::Now() + options_.timeout;
      e->waiters.push_back(std::move(done));
      entries_.emplace(request.request_id, std::move(e));
      queue_.push_back(request.request_id);
      return;
    } else if (Entry& e = *it->second; !SameMove(e.request, request)) {
      answer = absl::InvalidArgumentError(absl::StrCat(
          "request_id: ", request.request_id,
          " names a transfer of another slot, peer or keep_source; expected a new id"));
    } else if (e.state == Entry::State::kSucceeded) {
      answer = e.result;  // the original reply
    } else {
      e.waiters.push_back(std::move(done));  // joins the move in flight
      if (e.state == Entry::State::kInDoubt) {
        e.state = Entry::State::kQueued;
        e.deadline = absl::Now() + options_.timeout;
        queue_.push_back(request.request_id);
      }
      return;
    }
  }
  done(answer);
}

void TransferManager::Work() {
  for (;;) {
    std::string id;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](TransferManager* m)
               ABSL_NO_THREAD_SAFETY_ANALYSIS { return m->stop_ || !m->queue_.empty(); },
          this));
      if (queue_.empty()) return;  // stopping
      id = queue_.front();
      queue_.pop_front();
      entries_.at(id)->state = Entry::State::kRunning;
    }
    Finish(id, Run(id));
  }
}

SendOutcome TransferManager::Run(const std::string& id) {
  TransferRequest req;
  std::unique_ptr<cache::SlotReader> in_doubt;
  std::string transfer_id;
  absl::Time deadline;
  bool waited_for = false;
  {
    absl::MutexLock lock(&mu_);
    Entry& e = *entries_.at(id);
    req = e.request;
    in_doubt = std::move(e.in_doubt);
    e.resolving = in_doubt != nullptr;
    transfer_id = e.transfer_id;
    deadline = e.deadline;
    waited_for = !e.waiters.empty();
    e.asked = waited_for;
  }
  std::unique_ptr<Peer> peer = peers_(req.peer_address);
  if (in_doubt != nullptr) {
    SendOutcome o = sender_->Resolve(*peer, std::move(in_doubt), id, transfer_id, req.keep_source,
                                     std::max(deadline, absl::Now()));
    // Aborted: the source is released; a caller waiting for the move gets a fresh attempt.
    if (o.result.ok() || o.in_doubt != nullptr || !waited_for) return o;
    absl::MutexLock lock(&mu_);
    entries_.at(id)->resolving = false;  // resolved (aborted): a fresh attempt follows
  }
  if (absl::Now() >= deadline) {
    return SendOutcome{absl::DeadlineExceededError(absl::StrCat(
                           "transfer of request id ", id,
                           ": --transfer-timeout passed before a transfer thread was free")),
                       nullptr};
  }
  {
    absl::MutexLock lock(&mu_);
    transfer_id = absl::StrFormat("%s#%016x.%d", id, nonce_, ++attempts_);
    entries_.at(id)->transfer_id = transfer_id;
  }
  SendOptions o;
  o.keep_source = req.keep_source;
  o.chunk_bytes = options_.chunk_bytes;
  o.deadline = deadline;
  return sender_->Send(*peer, req.slot, id, transfer_id, o);
}

void TransferManager::Finish(const std::string& id, SendOutcome outcome) {
  if (outcome.result.ok() && options_.on_moved) {
    // Before the entry says succeeded: a retry answered from it finds the move's effects
    // (the source's handle retired) in place.
    TransferRequest request;
    {
      absl::MutexLock lock(&mu_);
      request = entries_.at(id)->request;
    }
    options_.on_moved(request, *outcome.result);
  }
  std::vector<Done> waiters;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(id);
    Entry& e = *it->second;
    waiters = std::move(e.waiters);
    e.waiters.clear();
    e.resolving = false;
    if (!outcome.result.ok() && !e.asked && !waiters.empty() && !stop_) {
      // Callers joined a run the resolver began on its own (it asked the peer before they
      // did, perhaps of a peer since restarted): they get a run of their own, not its answer.
      // In doubt still, it asks the peer again; resolved as aborted, it moves afresh.
      e.waiters = std::move(waiters);
      e.in_doubt = std::move(outcome.in_doubt);
      e.state = Entry::State::kQueued;
      e.deadline = absl::Now() + options_.timeout;
      queue_.push_back(id);
      return;
    }
    if (outcome.result.ok()) {
      e.state = Entry::State::kSucceeded;
      e.result = *outcome.result;
      succeeded_.push_back(id);
      while (static_cast<int32_t>(succeeded_.size()) > std::max(options_.remembered, 1)) {
        entries_.erase(succeeded_.front());
        succeeded_.pop_front();
      }
    } else if (outcome.in_doubt != nullptr) {
      e.state = Entry::State::kInDoubt;
      e.in_doubt = std::move(outcome.in_doubt);
    } else {
      entries_.erase(it);  // a failed move changed nothing: a retry runs anew
    }
  }
  for (Done& d : waiters) d(outcome.result);
}

void TransferManager::ResolveLoop() {
  absl::MutexLock lock(&mu_);
  while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.resolve_interval)) {
    for (auto& [id, e] : entries_) {
      if (e->state != Entry::State::kInDoubt) continue;
      e->state = Entry::State::kQueued;
      e->deadline = absl::Now() + options_.timeout;
      queue_.push_back(id);
    }
  }
}

}  // namespace replayssm::transfer
