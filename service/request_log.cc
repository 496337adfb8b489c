#include "service/request_log.h"

#include <utility>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"

namespace replayssm::service {

namespace {

std::string Key(absl::string_view method, absl::string_view request_id) {
  return absl::StrCat(method, "/", request_id);
}

}  // namespace

uint64_t Fingerprint(absl::string_view bytes) { return absl::Hash<absl::string_view>{}(bytes); }

RequestLog::RequestLog(int64_t max_entries, int64_t max_bytes)
    : max_entries_(max_entries), max_bytes_(max_bytes) {}

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
  const bool retained = static_cast<int64_t>(reply.size()) <= max_bytes_;
  absl::MutexLock lock(&mutex_);
  CompleteLocked(Key(method, request_id), retained ? std::move(reply) : "", retained);
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
  bytes_ += static_cast<int64_t>(reply.size());
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
    bytes_ -= static_cast<int64_t>(it->second.reply.size());
    entries_.erase(it);
    lru_.pop_back();
  }
}

}  // namespace replayssm::service
