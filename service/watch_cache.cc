#include "service/watch_cache.h"

#include <deque>

#include "absl/synchronization/mutex.h"
#include "service/caller.h"
#include "service/status_map.h"

namespace replayssm::service {

void ToProto(const KvEventBatch& b, uint64_t epoch, int32_t block_size, v1::CacheEventBatch* out) {
  out->set_epoch(epoch);
  out->set_seq(b.seq);
  out->set_ts(b.ts);
  out->set_resync(b.resync);
  for (const KvEvent& e : b.events) {
    v1::CacheEvent* w = out->add_events();
    switch (e.type) {
      case KvEvent::Type::kStored: {
        v1::BlockStored* s = w->mutable_stored();
        s->add_block_hashes(e.block_hash);
        s->set_has_parent(e.parent_hash.has_value());
        s->set_parent_block_hash(e.parent_hash.value_or(0));
        s->mutable_token_ids()->Add(e.token_ids.begin(), e.token_ids.end());
        s->set_block_size(block_size);
        s->set_medium(MediumName(e.medium));
        s->set_num_tokens(e.num_tokens);
        break;
      }
      case KvEvent::Type::kRemoved: {
        v1::BlockRemoved* r = w->mutable_removed();
        r->add_block_hashes(e.block_hash);
        r->set_medium(MediumName(e.medium));
        break;
      }
      case KvEvent::Type::kAllCleared: w->mutable_cleared(); break;
    }
  }
}

namespace {

class WatchCacheReactor final : public grpc::ServerWriteReactor<v1::CacheEventBatch>,
                                public KvEventListener {
 public:
  WatchCacheReactor(const ServiceContext* ctx, grpc::CallbackServerContext* c,
                    const v1::WatchCacheRequest& req)
      : ctx_(ctx), c_(c), caller_(*ctx) {
    absl::StatusOr<ServiceContext> caller = CallerContext(*c, *ctx);
    absl::Status admitted = caller.ok() ? ctx_->watchers->Open(caller->tenant()) : caller.status();
    if (!admitted.ok()) {
      absl::MutexLock lock(&mu_);
      FinishLocked(admitted);
      return;
    }
    caller_ = *caller;
    counted_ = true;
    // A catch-up longer than the backlog this stream may queue is a resync: queued, it would
    // end the stream at once, and the reconnect the error asks for would get the same answer.
    const std::vector<KvEventBatch> first =
        ctx_->events->Watch(caller->tenant(), req.epoch(), req.from_seq(), this, kMaxBacklog / 2);
    watching_ = true;
    // Batches that came meanwhile (OnBatch) are newer: the first ones go before them.
    absl::MutexLock lock(&mu_);
    std::deque<v1::CacheEventBatch> newer;
    newer.swap(pending_);
    for (const KvEventBatch& b : first) QueueLocked(b);
    for (v1::CacheEventBatch& b : newer) pending_.push_back(std::move(b));
    started_ = true;
    NextLocked();
  }

  // A new batch of the caller's tenant (on the log's thread, under its lock).
  void OnBatch(TenantId, const KvEventBatch& b) override {
    absl::MutexLock lock(&mu_);
    QueueLocked(b);
    NextLocked();
  }

  // A revoked token's stream ends now, not at its next batch (an outside review: a quiet
  // tenant's stream stayed open, holding --max-watchers room, until its next event).
  void OnTokensChanged() override {
    absl::MutexLock lock(&mu_);
    if (finished_ || writing_ || !started_) return;  // the next write checks it
    if (absl::Status s = CheckStillAuthorized(*c_, caller_, &tokens_checked_); !s.ok()) {
      FinishLocked(s);
    }
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) return FinishLocked(absl::CancelledError("WatchCache: write failed"));
    pending_.pop_front();
    NextLocked();
  }
  void OnCancel() override {  // a write in flight fails first (OnWriteDone finishes then)
    absl::MutexLock lock(&mu_);
    if (!writing_) FinishLocked(absl::CancelledError("WatchCache: cancelled"));
  }
  void OnDone() override {
    if (watching_) ctx_->events->Unwatch(this);  // no OnBatch runs once it returns
    if (counted_) ctx_->watchers->Close(caller_.tenant());
    delete this;
  }

 private:
  void QueueLocked(const KvEventBatch& b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    if (static_cast<int64_t>(pending_.size()) >= kMaxBacklog) {
      behind_ = true;
      return;
    }
    pending_.emplace_back();
    ToProto(b, ctx_->events->epoch(), ctx_->events->block_size(), &pending_.back());
  }
  // Starts the next write, or ends a client that fell behind once its write is done.
  void NextLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || !started_) return;
    if (behind_) {
      return FinishLocked(absl::ResourceExhaustedError(absl::StrCat(
          "WatchCache: the client fell ", kMaxBacklog,
          " batches behind; reconnect with from_seq = the next batch it needs")));
    }
    // Every batch, and every time the stream goes idle: a token removed from the file since
    // the stream opened (or moved to another tenant) gets none of its tenant's events more;
    // the stream ends UNAUTHENTICATED. Checked before the idle return too, so that a reload
    // told while a write was in flight (OnTokensChanged waits for it) is not lost (an outside
    // review). Cheap when the file did not change: one generation compared.
    if (absl::Status s = CheckStillAuthorized(*c_, caller_, &tokens_checked_); !s.ok()) {
      return FinishLocked(s);
    }
    if (pending_.empty()) return;
    writing_ = true;
    StartWrite(&pending_.front());
  }
  void FinishLocked(const absl::Status& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    ctx_->metrics->CountRpc("WatchCache", ToGrpcStatus(s).error_code());
    Finish(ToGrpcStatus(s));
  }
  static constexpr int64_t kMaxBacklog = 4096;
  const ServiceContext* ctx_;
  const grpc::CallbackServerContext* c_;
  ServiceContext caller_;  // the caller's tenant's view, once admitted
  uint64_t tokens_checked_ ABSL_GUARDED_BY(mu_) = 0;  // CheckStillAuthorized's
  bool counted_ = false;
  bool watching_ = false;
  absl::Mutex mu_;
  std::deque<v1::CacheEventBatch> pending_ ABSL_GUARDED_BY(mu_);
  bool started_ ABSL_GUARDED_BY(mu_) = false;  // the first batches are queued
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool behind_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerWriteReactor<v1::CacheEventBatch>* NewWatchCacheReactor(
    const ServiceContext* ctx, grpc::CallbackServerContext* c, const v1::WatchCacheRequest& req) {
  return new WatchCacheReactor(ctx, c, req);
}

}  // namespace replayssm::service
