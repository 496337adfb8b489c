#include "service/cache_events.h"

#include <openssl/evp.h>
#include <sys/random.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/time/clock.h"

namespace replayssm::service {

namespace {

uint64_t RandomEpoch() {
  uint64_t e = 0;
  while (e == 0) {
    if (getrandom(&e, sizeof(e), 0) != static_cast<ssize_t>(sizeof(e))) {
      e = static_cast<uint64_t>(absl::ToUnixNanos(absl::Now()));
    }
  }
  return e;
}

}  // namespace

uint64_t BlockHash(uint64_t parent, absl::Span<const int32_t> tokens) {
  std::vector<unsigned char> in(8 + 4 * tokens.size());
  for (int i = 0; i < 8; ++i) in[i] = static_cast<unsigned char>(parent >> (8 * i));
  for (size_t t = 0; t < tokens.size(); ++t) {
    const uint32_t v = static_cast<uint32_t>(tokens[t]);
    for (int i = 0; i < 4; ++i) in[8 + 4 * t + i] = static_cast<unsigned char>(v >> (8 * i));
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(in.data(), in.size(), digest, &n, EVP_sha256(), nullptr);
  uint64_t h = 0;
  for (int i = 0; i < 8; ++i) h = (h << 8) | digest[i];
  return h;
}

const char* MediumName(cache::Medium medium) {
  switch (medium) {
    case cache::Medium::kBackend: return "GPU";
    case cache::Medium::kHost: return "CPU";
    case cache::Medium::kDisk: return "DISK";
  }
  return "GPU";
}

CacheEventLog::CacheEventLog(CacheEventLogOptions options)
    : options_(options), epoch_(RandomEpoch()) {
  thread_ = std::thread([this] { Run(); });
}

CacheEventLog::~CacheEventLog() {
  {
    absl::MutexLock lock(&stop_mu_);
    stop_ = true;
  }
  thread_.join();
}

cache::CacheEventSink CacheEventLog::Sink() {
  return [this](const cache::CacheEvent& e) {
    absl::MutexLock lock(&queue_mu_);
    queue_.push_back(e);
  };
}

KvEvent CacheEventLog::Convert(const cache::CacheEvent& e) const {
  const int64_t p = static_cast<int64_t>(e.tokens.size());
  const int64_t b = options_.block_size;
  const int64_t full = p == 0 ? 0 : (p - 1) / b;  // whole blocks before the key's last one
  uint64_t h = 0;
  for (int64_t j = 0; j < full; ++j) {
    h = BlockHash(h, absl::MakeConstSpan(e.tokens).subspan(j * b, b));
  }
  KvEvent k;
  k.type = e.type == cache::CacheEvent::Type::kStored ? KvEvent::Type::kStored
                                                      : KvEvent::Type::kRemoved;
  k.medium = e.medium;
  k.num_tokens = p;
  if (full > 0) k.parent_hash = h;
  k.token_ids.assign(e.tokens.begin() + full * b, e.tokens.end());
  k.block_hash = BlockHash(h, k.token_ids);
  if (k.type == KvEvent::Type::kRemoved) k.token_ids.clear();
  return k;
}

KvEventBatch CacheEventLog::ResyncLocked(const Tenant& t) const {
  KvEventBatch b;
  b.seq = t.last_seq;
  b.ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  b.resync = true;
  b.events.push_back(KvEvent{KvEvent::Type::kAllCleared});
  for (const auto& [key, e] : t.stored) b.events.push_back(e);
  // Parents before children (shorter keys first), so a router can link them as they come.
  std::stable_sort(b.events.begin() + 1, b.events.end(), [](const KvEvent& x, const KvEvent& y) {
    return x.num_tokens < y.num_tokens;
  });
  return b;
}

std::vector<KvEventBatch> CacheEventLog::Watch(TenantId tenant, uint64_t epoch, uint64_t from_seq,
                                               KvEventListener* listener, size_t max_batches) {
  absl::MutexLock lock(&mu_);
  Tenant& t = tenants_[tenant];
  listeners_[listener] = tenant;
  const uint64_t oldest = t.kept.empty() ? t.last_seq + 1 : t.kept.front()->seq;
  if (from_seq == 0 || epoch != epoch_ || from_seq < oldest || from_seq > t.last_seq + 1 ||
      t.last_seq + 1 - from_seq > max_batches) {
    return {ResyncLocked(t)};
  }
  std::vector<KvEventBatch> out;
  for (auto b = t.kept.begin() + static_cast<ptrdiff_t>(from_seq - oldest); b != t.kept.end();
       ++b) {
    out.push_back(**b);
  }
  return out;
}

std::vector<std::shared_ptr<const KvEventBatch>> CacheEventLog::Replay(TenantId tenant,
                                                                       uint64_t from_seq) {
  absl::MutexLock lock(&mu_);
  const Tenant& t = tenants_[tenant];
  const uint64_t oldest = t.kept.empty() ? t.last_seq + 1 : t.kept.front()->seq;
  // What the router asks for is gone (older than the kept batches: it aged out, the start's
  // AllBlocksCleared among them) or never was (ahead of the last: a router that missed this
  // server's restart, ZMQ carrying no epoch): it would rebuild a wrong picture from the rest.
  // It gets what WatchCache gives then, a resync numbered the last batch.
  if (from_seq < oldest || from_seq > t.last_seq + 1) {
    return {std::make_shared<const KvEventBatch>(ResyncLocked(t))};
  }
  // The kept batches themselves, shared: a replay copies no event (there may be 8 at once,
  // each as long as the log).
  return {t.kept.begin() + static_cast<ptrdiff_t>(from_seq - oldest), t.kept.end()};
}

void CacheEventLog::Unwatch(KvEventListener* listener) {
  absl::MutexLock lock(&mu_);
  listeners_.erase(listener);
}

void CacheEventLog::TokensChanged() {
  absl::MutexLock lock(&mu_);
  for (const auto& [listener, tenant] : listeners_) listener->OnTokensChanged();
}

void CacheEventLog::Flush() {
  absl::MutexLock flush(&flush_mu_);
  FlushHeld();
}

void CacheEventLog::FlushHeld() {
  std::vector<cache::CacheEvent> queued;
  {
    absl::MutexLock lock(&queue_mu_);
    queued.swap(queue_);
  }
  if (queued.empty()) return;
  // Hashing happens here, outside every lock: a key is as long as its request.
  std::vector<std::pair<TenantId, KvEvent>> converted;
  converted.reserve(queued.size());
  for (const cache::CacheEvent& e : queued) converted.emplace_back(e.ns, Convert(e));
  const double ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  absl::MutexLock lock(&mu_);
  absl::flat_hash_map<TenantId, KvEventBatch> open;
  std::vector<std::pair<TenantId, KvEventBatch>> done;  // in the order they closed
  auto close = [&](TenantId tenant) {
    auto it = open.find(tenant);
    if (it == open.end()) return;
    done.emplace_back(tenant, std::move(it->second));
    open.erase(it);
  };
  for (auto& [tenant, e] : converted) {
    Tenant& t = tenants_[tenant];
    const std::pair<uint64_t, int32_t> key{e.block_hash, static_cast<int32_t>(e.medium)};
    if (e.type == KvEvent::Type::kStored) {
      t.stored[key] = e;
    } else {
      t.stored.erase(key);
    }
    KvEventBatch& b = open[tenant];
    b.events.push_back(std::move(e));
    if (static_cast<int32_t>(b.events.size()) >= options_.max_batch_events) close(tenant);
  }
  std::vector<TenantId> rest;
  for (const auto& [tenant, b] : open) rest.push_back(tenant);
  std::sort(rest.begin(), rest.end());
  for (TenantId tenant : rest) close(tenant);
  for (auto& [tenant, b] : done) {
    b.ts = ts;
    PublishLocked(tenant, std::move(b));
  }
}

void CacheEventLog::PublishLocked(TenantId tenant, KvEventBatch b) {
  Tenant& t = tenants_[tenant];
  b.seq = ++t.last_seq;
  t.kept.push_back(std::make_shared<const KvEventBatch>(std::move(b)));
  while (static_cast<int64_t>(t.kept.size()) > options_.retain) t.kept.pop_front();
  ++batches_;
  for (const auto& [listener, watched] : listeners_) {
    if (watched == tenant) listener->OnBatch(tenant, *t.kept.back());
  }
}

void CacheEventLog::Clear(TenantId tenant) {
  // One hold of flush_mu_ for both: a flush by the log's thread in between would publish
  // newer batches ahead of the AllBlocksCleared, and routers would drop what they said.
  absl::MutexLock flush(&flush_mu_);
  FlushHeld();
  absl::MutexLock lock(&mu_);
  KvEventBatch b;
  b.ts = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  b.events.push_back(KvEvent{KvEvent::Type::kAllCleared});
  PublishLocked(tenant, std::move(b));
}

void CacheEventLog::Run() {
  absl::MutexLock lock(&stop_mu_);
  while (!stop_) {
    stop_mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.flush_interval);
    stop_mu_.Unlock();
    Flush();
    stop_mu_.Lock();
  }
}

int64_t CacheEventLog::batches() const {
  absl::MutexLock lock(&mu_);
  return batches_;
}

int64_t CacheEventLog::watchers() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(listeners_.size());
}

}  // namespace replayssm::service
