#include "host_tier.h"

#include "absl/strings/str_cat.h"
#include "replayssm/cache/kernel_status.h"

namespace replayssm::cache {

HostTier::HostTier(int32_t backend, size_t entry_bytes, int64_t capacity, HostPolicy policy,
                   int64_t ns_bound)
    : backend_(backend),
      entry_bytes_(entry_bytes),
      policy_(policy),
      ns_bound_(ns_bound),
      entries_(capacity) {
  for (int64_t i = capacity - 1; i >= 0; --i) free_.push_back(static_cast<int32_t>(i));
}

HostTier::~HostTier() {
  for (Entry& e : entries_) rssm_free_host(backend_, e.data);
}

double HostTier::Priority(const Entry& e) {
  if (policy_ == HostPolicy::kLru) return tick_ += 1;
  // GreedyDual-Size-Frequency: what keeping it saves (prefill tokens per hit, times its hits)
  // per byte it holds, on top of the clock, which rises to each victim's priority so that
  // entries not hit for a while age out.
  return clock_ + static_cast<double>(e.tokens.size()) * static_cast<double>(e.hits + 1) /
                      static_cast<double>(entry_bytes_);
}

int32_t HostTier::Victim(bool only_ns, PrefixNamespace ns) const {
  // Linear: the table holds host_snapshot_bytes / ~77 MB entries (a few thousand at most).
  int32_t best = -1;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.state != Entry::State::kStored || e.refs > 0 || (only_ns && e.ns != ns)) continue;
    if (best < 0 || e.priority < entries_[best].priority) best = static_cast<int32_t>(i);
  }
  return best;
}

int32_t HostTier::Reserve(PrefixNamespace ns, std::vector<Entry>* evicted) {
  int32_t e = -1;
  const bool ns_full = ns_bound_ > 0 && ns_count_[ns] >= ns_bound_;
  if (!ns_full && !free_.empty()) {
    e = free_.back();
    free_.pop_back();
  } else {
    e = Victim(ns_full, ns);
    if (e < 0) return -1;
    evicted->push_back(entries_[e]);
    if (policy_ == HostPolicy::kValue) clock_ = entries_[e].priority;
    Drop(e);
    free_.pop_back();  // Drop returned it to the free list (its buffer kept)
  }
  Entry& r = entries_[e];
  r.state = Entry::State::kReserved;
  r.ns = ns;
  ++ns_count_[ns];
  return e;
}

absl::StatusOr<void*> HostTier::Buffer(int32_t e) {
  Entry& r = entries_[e];
  if (r.data == nullptr) {
    absl::Status s = KernelStatus(rssm_alloc_host(backend_, entry_bytes_, &r.data),
                                  "pinned host memory for the host tier");
    if (!s.ok()) return s;
  }
  return r.data;
}

void HostTier::Store(int32_t e, PrefixNamespace ns, std::vector<int32_t> tokens) {
  Entry& r = entries_[e];
  r.state = Entry::State::kStored;
  r.ns = ns;
  r.tokens = std::move(tokens);
  r.hits = 0;
  r.priority = Priority(r);
  radix_.Insert(ns, r.tokens, e);
  ++stored_;
}

void HostTier::Unreserve(int32_t e) {
  Entry& r = entries_[e];
  if (--ns_count_[r.ns] == 0) ns_count_.erase(r.ns);
  void* data = r.data;
  r = Entry{};
  r.data = data;
  free_.push_back(e);
}

void HostTier::Drop(int32_t e) {
  Entry& r = entries_[e];
  radix_.Erase(r.ns, r.tokens);
  --stored_;
  Unreserve(e);
}

void HostTier::Hit(int32_t e) {
  Entry& r = entries_[e];
  ++r.hits;
  r.priority = Priority(r);
}

}  // namespace replayssm::cache
