#include "service/request_log.h"

#include <string>
#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"

namespace replayssm::service {

namespace {

std::string Key(absl::string_view method, absl::string_view request_id) {
  return absl::StrCat(method, "/", request_id);
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

RequestLog::Claim RequestLog::Begin(absl::string_view method, absl::string_view request_id,
                                    uint64_t fingerprint) {
  const std::string key = Key(method, request_id);
  absl::MutexLock lock(&mutex_);
  auto [it, inserted] = entries_.try_emplace(key);
  Entry& e = it->second;
  if (inserted) {
    e.fingerprint = fingerprint;
    return {Outcome::kNew, ""};
  }
  if (e.fingerprint != fingerprint) return {Outcome::kMismatch, ""};
  if (!e.done) return {Outcome::kInFlight, ""};
  lru_.splice(lru_.begin(), lru_, e.lru);
  if (!e.retained) return {Outcome::kNotRetained, ""};
  return {Outcome::kReplay, e.reply};
}

void RequestLog::Complete(absl::string_view method, absl::string_view request_id,
                          std::string reply) {
  const std::string key = Key(method, request_id);
  const bool retained =
      static_cast<int64_t>(reply.size() + 2 * key.size()) + kEntryOverhead <= max_bytes_;
  absl::MutexLock lock(&mutex_);
  CompleteLocked(key, retained ? std::move(reply) : "", retained);
}

void RequestLog::CompleteWithoutReply(absl::string_view method, absl::string_view request_id) {
  absl::MutexLock lock(&mutex_);
  CompleteLocked(Key(method, request_id), "", false);
}

void RequestLog::CompleteLocked(const std::string& key, std::string reply, bool retained) {
  auto it = entries_.find(key);
  if (it == entries_.end() || it->second.done) return;
  Entry& e = it->second;
  e.done = true;
  e.retained = retained;
  e.cost = static_cast<int64_t>(reply.size() + 2 * key.size()) + kEntryOverhead;
  bytes_ += e.cost;
  e.reply = std::move(reply);
  lru_.push_front(key);
  e.lru = lru_.begin();
  EvictLocked();
}

void RequestLog::Release(absl::string_view method, absl::string_view request_id) {
  absl::MutexLock lock(&mutex_);
  auto it = entries_.find(Key(method, request_id));
  if (it != entries_.end() && !it->second.done) entries_.erase(it);
}

void RequestLog::EvictLocked() {
  while (!lru_.empty() &&
         (static_cast<int64_t>(lru_.size()) > max_entries_ || bytes_ > max_bytes_)) {
    auto it = entries_.find(lru_.back());
    bytes_ -= it->second.cost;
    entries_.erase(it);
    lru_.pop_back();
  }
}

}  // namespace replayssm::service
