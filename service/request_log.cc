#include "service/request_log.h"

#include <string>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"

namespace replayssm::service {

namespace {

std::string Key(const RequestLog::Scope& scope, absl::string_view request_id) {
  if (scope.owner == 0) return absl::StrCat(scope.method, "/", request_id);
  return absl::StrCat(scope.method, "@", scope.owner, "/", request_id);
}

absl::Status CheckLength(absl::string_view id, absl::string_view field, int64_t max) {
  if (!id.empty() && static_cast<int64_t>(id.size()) <= max) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, ": expected a non-empty id of at most ", max, " bytes (--max-request-id-bytes), got ",
      id.empty() ? std::string("\"\"") : absl::StrCat(id.size(), " bytes")));
}

}  // namespace

uint64_t Fingerprint(absl::string_view bytes) { return absl::Hash<absl::string_view>{}(bytes); }

RequestLog::RequestLog(int64_t max_entries, int64_t max_bytes, int64_t max_id_bytes)
    : max_entries_(max_entries), max_bytes_(max_bytes), max_id_bytes_(max_id_bytes) {}

absl::Status RequestLog::CheckId(absl::string_view id, absl::string_view field) const {
  return CheckLength(id, field, max_id_bytes_);
}

absl::Status RequestLog::CheckTransferId(absl::string_view id) const {
  return CheckLength(id, "transfer_id", max_id_bytes_ + kTransferIdSuffix);
}

RequestLog::Claim RequestLog::Begin(const Scope& scope, absl::string_view request_id,
                                    uint64_t fingerprint) {
  const std::string key = Key(scope, request_id);
  absl::MutexLock lock(&mutex_);
  auto [it, inserted] = entries_.try_emplace(key);
  Entry& e = it->second;
  if (inserted) {
    e.owner = scope.owner;
    e.fingerprint = fingerprint;
    return {Outcome::kNew, ""};
  }
  if (e.fingerprint != fingerprint) return {Outcome::kMismatch, ""};
  if (!e.done) return {Outcome::kInFlight, ""};
  std::list<std::string>& lru = shares_[e.owner].lru;
  lru.splice(lru.begin(), lru, e.lru);
  if (!e.retained) return {Outcome::kNotRetained, ""};
  return {Outcome::kReplay, e.reply};
}

void RequestLog::Complete(const Scope& scope, absl::string_view request_id, std::string reply) {
  const std::string key = Key(scope, request_id);
  const bool retained =
      static_cast<int64_t>(reply.size() + 2 * key.size()) + kEntryOverhead <= max_bytes_;
  absl::MutexLock lock(&mutex_);
  CompleteLocked(key, retained ? std::move(reply) : "", retained);
}

void RequestLog::CompleteWithoutReply(const Scope& scope, absl::string_view request_id) {
  absl::MutexLock lock(&mutex_);
  CompleteLocked(Key(scope, request_id), "", false);
}

void RequestLog::CompleteLocked(const std::string& key, std::string reply, bool retained) {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.done) return;
  Entry& e = it->second;
  e.done = true;
  e.retained = retained;
  e.cost = static_cast<int64_t>(reply.size() + 2 * key.size()) + kEntryOverhead;
  e.reply = std::move(reply);
  Share& share = shares_[e.owner];
  share.lru.push_front(key);
  share.bytes += e.cost;
  e.lru = share.lru.begin();
  ++done_;
  bytes_ += e.cost;
  EvictLocked();
}

void RequestLog::Release(const Scope& scope, absl::string_view request_id) {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(Key(scope, request_id));
  if (it != entries_.end() && !it->second.done) entries_.erase(it);
}

int64_t RequestLog::entries_of(uint32_t owner) const {
  absl::MutexLock lock(&mutex_);
  auto it = shares_.find(owner);
  return it == shares_.end() ? 0 : static_cast<int64_t>(it->second.lru.size());
}

void RequestLog::EvictLocked() {
  while (done_ > max_entries_ || bytes_ > max_bytes_) {
    const bool by_entries = done_ > max_entries_;
    auto victim = shares_.end();
    for (auto s = shares_.begin(); s != shares_.end(); ++s) {
      if (victim == shares_.end() || (by_entries ? s->second.lru.size() > victim->second.lru.size()
                                                 : s->second.bytes > victim->second.bytes)) {
        victim = s;
      }
    }
    if (victim == shares_.end()) return;  // (bounds are >= 1 entry; not reached)
    Share& share = victim->second;
    auto it = entries_.find(share.lru.back());
    share.bytes -= it->second.cost;
    bytes_ -= it->second.cost;
    --done_;
    entries_.erase(it);
    share.lru.pop_back();
    if (share.lru.empty()) shares_.erase(victim);
  }
}

}  // namespace replayssm::service
