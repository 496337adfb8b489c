#include "tp_slot_io.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "slot_checksum.h"

namespace replayssm::cache {

TpLayerMap TpLayerMap::Of(const ModelSpec& full, const std::vector<ModelSpec>& shards,
                          const std::vector<std::vector<SliceRun>>& runs) {
  TpLayerMap m;
  m.layer_bytes = full.LayerStateBytes();
  m.num_layers = full.num_layers;
  for (size_t r = 0; r < shards.size(); ++r) {
    m.shard_bytes.push_back(shards[r].LayerStateBytes());
    m.ckpt_bytes.push_back(shards[r].LayerStateBytes() - shards[r].ConvWindowBytes());
    for (const SliceRun& x : runs[r]) {
      m.runs.push_back({x.full, x.shard, x.count, static_cast<int32_t>(r)});
    }
  }
  std::sort(m.runs.begin(), m.runs.end(), [](const Run& a, const Run& b) { return a.full < b.full; });
  return m;
}

std::vector<absl::Status> OnEachRank(const TpSlotIoHost& host, size_t n,
                                     absl::FunctionRef<absl::Status(size_t)> f) {
  std::vector<absl::Status> out(n);
  if (!host.ranks_at_once()) {
    for (size_t r = 0; r < n; ++r) {
      host.Use(r);
      out[r] = f(r);
    }
    return out;
  }
  std::vector<std::thread> threads;
  for (size_t r = 1; r < n; ++r) {
    threads.emplace_back([&, r] {
      host.Use(r);
      out[r] = f(r);
    });
  }
  if (n > 0) {
    host.Use(0);
    out[0] = f(0);
  }
  for (std::thread& t : threads) t.join();
  return out;
}

namespace {

// Calls f(run, begin, n) for the parts of `map`'s runs inside [lo, hi) of a layer: the
// part [begin, begin + n) of the layer lies in `run`.
template <typename F>
void ForRuns(const TpLayerMap& map, int64_t lo, int64_t hi, F f) {
  auto it = std::upper_bound(map.runs.begin(), map.runs.end(), lo,
                             [](int64_t v, const TpLayerMap::Run& r) { return v < r.full; });
  if (it != map.runs.begin()) --it;
  for (; it != map.runs.end() && it->full < hi; ++it) {
    const int64_t b = std::max(lo, it->full), e = std::min(hi, it->full + it->count);
    if (e > b) f(*it, b, e - b);
  }
}

// A feeder thread per rank takes that rank's chunks in order (as many at once as the rank's
// reader lends) and hands them to kCopyThreads copier threads, which copy each chunk's runs to
// their places in the unsharded layers; a chunk of layer l is handed out once every byte of
// layer l is in place. kHashThreads more hash the 1 MiB segments of the unsharded payload as
// the layers under them complete (the checksum's segments are independent:
// CombineSegmentDigests mixes them).
class TpReader final : public SlotReader {
 public:
  static constexpr int kHashThreads = 4;
  static constexpr int kCopyThreads = 6;

  TpReader(TpSlotIoHost* host, SlotId group, std::vector<std::unique_ptr<SlotReader>> ranks,
           const TpLayerMap* map, size_t chunk_bytes)
      : host_(host),
        group_(group),
        ranks_(std::move(ranks)),
        map_(*map),
        bytes_(static_cast<size_t>(map->layer_bytes) * map->num_layers),
        payload_(host->TakePayloadBuffer()),
        segments_((bytes_ + kChecksumSegmentBytes - 1) / kChecksumSegmentBytes),
        digests_(segments_),
        layer_bytes_(map->num_layers, 0),
        given_back_(ranks_.size()) {
    for (size_t r = 0; r < ranks_.size(); ++r) given_back_[r].assign(ranks_[r]->num_chunks(), 0);
    const size_t layer = static_cast<size_t>(map_.layer_bytes);
    for (size_t at = 0; at < bytes_; at += layer) {
      for (size_t o = 0; o < layer; o += chunk_bytes) {
        chunks_.push_back({at + o, std::min(chunk_bytes, layer - o)});
      }
    }
    for (size_t r = 0; r < ranks_.size(); ++r) threads_.emplace_back([this, r] { Feed(r); });
    for (int c = 0; c < kCopyThreads; ++c) threads_.emplace_back([this] { CopyChunks(); });
    for (int h = 0; h < kHashThreads; ++h) threads_.emplace_back([this] { HashSegments(); });
  }
  ~TpReader() override { Finish(false); }

  int64_t seq_len() const override { return ranks_[0]->seq_len(); }
  const std::vector<int32_t>& tokens() const override { return ranks_[0]->tokens(); }
  size_t bytes() const override { return bytes_; }
  SlotIoPath path() const override { return SlotIoPath::kHostDirect; }
  size_t num_chunks() const override { return chunks_.size(); }
  size_t depth() const override { return chunks_.size(); }

  absl::StatusOr<SlotChunk> Next() override {
    absl::MutexLock lock(&mu_);
    if (next_ >= chunks_.size()) {
      return absl::OutOfRangeError(absl::StrCat("chunks: all ", chunks_.size(), " were read"));
    }
    const auto [offset, size] = chunks_[next_];
    const int64_t layers = static_cast<int64_t>(offset) / map_.layer_bytes + 1;
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return copied_ >= layers || !error_.ok();
    };
    mu_.Await(absl::Condition(&ready));
    if (copied_ < layers) return error_;
    return SlotChunk{next_++, offset, size, payload_.get() + offset, false};
  }
  void Done(size_t) override {}
  absl::StatusOr<uint64_t> Checksum() override {
    absl::MutexLock lock(&mu_);
    auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return hashed_ == segments_ || !error_.ok();
    };
    mu_.Await(absl::Condition(&ready));
    if (hashed_ < segments_) return error_;
    return CombineSegmentDigests(digests_.data(), segments_, bytes_);
  }
  void Finish(bool moved) override {
    if (finished_.exchange(true)) return;
    {
      absl::MutexLock lock(&mu_);  // wakes the threads that wait: they stop
      if (error_.ok() && copied_ < map_.num_layers) error_ = absl::CancelledError("move finished");
    }
    for (std::thread& t : threads_) t.join();
    absl::MutexLock ops(&host_->ops_mu());
    for (size_t r = 0; r < ranks_.size(); ++r) {
      host_->Use(r);
      ranks_[r]->Finish(moved);
    }
    if (moved) host_->Unbind(group_);
    host_->ReturnPayloadBuffer(std::move(payload_));  // no chunk is held past Finish
  }

 private:
  // Rank r's chunks in order, lent to the copiers. A staged reader's chunk i takes the
  // buffer of chunk i - depth, so it is asked for once that one is given back (copiers give
  // chunks back in any order).
  void Feed(size_t r) {
    host_->Use(r);
    const size_t depth = ranks_[r]->depth();
    const size_t count = ranks_[r]->num_chunks();
    for (size_t i = 0; i < count; ++i) {
      {
        absl::MutexLock lock(&mu_);
        auto room = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return i < depth || given_back_[r][i - depth] != 0 || !error_.ok();
        };
        mu_.Await(absl::Condition(&room));
        if (!error_.ok()) break;
      }
      absl::StatusOr<SlotChunk> c = ranks_[r]->Next();
      absl::MutexLock lock(&mu_);
      if (!c.ok()) {
        if (error_.ok()) {
          error_ = absl::Status(c.status().code(),
                                absl::StrCat("tp rank ", r, ": ", c.status().message()));
        }
        break;
      }
      work_.push_back({r, *c});
    }
    absl::MutexLock lock(&mu_);
    ++feeders_done_;
  }

  // Copies lent chunks to their places, gives them back, and counts each layer's bytes.
  void CopyChunks() {
    for (;;) {
      std::pair<size_t, SlotChunk> job;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return !work_.empty() || feeders_done_ >= ranks_.size() || !error_.ok();
        };
        mu_.Await(absl::Condition(&ready));
        if (work_.empty() || !error_.ok()) return;
        job = work_.front();
        work_.pop_front();
      }
      const auto& [r, c] = job;
      const int64_t l = static_cast<int64_t>(c.offset) / map_.shard_bytes[r];  // never crosses
      const int64_t in_layer = static_cast<int64_t>(c.offset) - l * map_.shard_bytes[r];
      uint8_t* layer = payload_.get() + l * map_.layer_bytes;
      const auto* src = static_cast<const uint8_t*>(c.data);
      for (const TpLayerMap::Run& run : map_.runs) {
        if (run.rank != static_cast<int32_t>(r)) continue;
        const int64_t b = std::max(in_layer, run.shard);
        const int64_t e = std::min<int64_t>(in_layer + c.size, run.shard + run.count);
        if (e > b) std::memcpy(layer + run.full + (b - run.shard), src + (b - in_layer), e - b);
      }
      ranks_[r]->Done(c.index);
      absl::MutexLock lock(&mu_);
      given_back_[r][c.index] = 1;
      layer_bytes_[l] += static_cast<int64_t>(c.size);
      while (copied_ < map_.num_layers && layer_bytes_[copied_] == map_.layer_bytes) ++copied_;
    }
  }

  // Claims segments in order and hashes each once the layers under it are in place.
  void HashSegments() {
    for (;;) {
      size_t s = 0, end = 0;
      {
        absl::MutexLock lock(&mu_);
        if (claimed_ == segments_) return;
        s = claimed_++;
        end = std::min(bytes_, (s + 1) * kChecksumSegmentBytes);
        const int64_t layers = (static_cast<int64_t>(end) + map_.layer_bytes - 1) / map_.layer_bytes;
        auto ready = [&]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return copied_ >= layers || !error_.ok();
        };
        mu_.Await(absl::Condition(&ready));
        if (copied_ < layers) return;
      }
      const size_t begin = s * kChecksumSegmentBytes;
      digests_[s] = segment_hash::Digest(payload_.get() + begin, end - begin);
      absl::MutexLock lock(&mu_);
      ++hashed_;
    }
  }

  TpSlotIoHost* const host_;
  const SlotId group_;
  std::vector<std::unique_ptr<SlotReader>> ranks_;  // Next: rank r's feeder only
  const TpLayerMap& map_;
  const size_t bytes_;
  std::unique_ptr<uint8_t[]> payload_;  // the host's; a layer is handed out once assembled
  const size_t segments_;
  std::vector<uint64_t> digests_;  // [segments_], each written by the thread that hashed it
  std::vector<std::pair<size_t, size_t>> chunks_;  // offset, size
  absl::Mutex mu_;
  std::vector<int64_t> layer_bytes_ ABSL_GUARDED_BY(mu_);  // bytes of each layer in place
  std::vector<std::vector<char>> given_back_ ABSL_GUARDED_BY(mu_);  // [rank][chunk]: Done
  std::deque<std::pair<size_t, SlotChunk>> work_ ABSL_GUARDED_BY(mu_);  // (rank, chunk)
  size_t feeders_done_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t copied_ ABSL_GUARDED_BY(mu_) = 0;   // layers [0, copied_) are in payload_
  size_t claimed_ ABSL_GUARDED_BY(mu_) = 0;   // segments taken by a hash thread
  size_t hashed_ ABSL_GUARDED_BY(mu_) = 0;    // segments hashed
  size_t next_ ABSL_GUARDED_BY(mu_) = 0;      // the mover's next chunk
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> finished_{false};
  std::vector<std::thread> threads_;  // last: they start once everything else is set
};

class TpWriter final : public SlotWriter {
 public:
  TpWriter(TpSlotIoHost* host, std::vector<std::unique_ptr<ShardSlotWriter>> ranks,
           const TpLayerMap* map)
      : host_(host),
        ranks_(std::move(ranks)),
        map_(*map),
        bytes_(static_cast<size_t>(map->layer_bytes) * map->num_layers),
        sum_(bytes_) {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      const int64_t window = map_.shard_bytes[r] - map_.ckpt_bytes[r];
      for (int32_t l = 0; l < map_.num_layers && window > 0; ++l) {
        windows_.push_back(std::make_unique<Window>(window));
      }
    }
  }
  ~TpWriter() override {
    absl::MutexLock ops(&host_->ops_mu());  // uncommitted ranks free their slots: in order
    DropRanksLocked();
  }

  size_t bytes() const override { return bytes_; }
  SlotIoPath path() const override { return SlotIoPath::kHostDirect; }

  absl::Status Write(size_t offset, const void* src, size_t size, bool backend_memory) override {
    if (ended_.load()) return absl::FailedPreconditionError("slot writer: already committed");
    if (offset > bytes_ || size > bytes_ - offset) {
      return absl::InvalidArgumentError(absl::StrCat("offset: expected a range inside the ",
                                                     bytes_, "-byte payload, got [", offset, ", ",
                                                     offset + size, ")"));
    }
    if (backend_memory && host_->backend() != RSSM_BACKEND_CPU) {
      return absl::InvalidArgumentError(
          "src: a tensor-parallel group takes the unsharded payload from host memory only");
    }
    const auto* p = static_cast<const uint8_t*>(src);
    const int64_t lb = map_.layer_bytes;
    absl::Status st;
    // Layer by layer, split at the ranks' runs: each byte is read once, by the rank writer's
    // copy that hashes it (a checkpoint run: one contiguous part of up to a whole layer's, so
    // the rank's staging buffers fill as a TP = 1 writer's do) or by the window's gathering.
    for (int64_t at = offset, end = offset + size; at < end && st.ok();) {
      const int64_t l = at / lb;
      const int64_t stop = std::min(end, (l + 1) * lb);
      ForRuns(map_, at - l * lb, stop - l * lb, [&](const TpLayerMap::Run& run, int64_t b, int64_t n) {
        if (!st.ok()) return;
        const uint8_t* piece = p + (l * lb + b - static_cast<int64_t>(offset));
        st = Put(run, l, run.shard + (b - run.full), piece, n, l * lb + b);
      });
      at = stop;
    }
    if (st.ok()) written_.fetch_add(size);
    return st;
  }

  // Final, as a rank's: the first Commit ends the writer; a failed one frees every rank's
  // reserved slot at once (it used to leave them reserved, and a second Commit could still
  // make the slot live: an outside review).
  absl::StatusOr<SlotId> Commit(absl::Span<const int32_t> tokens, uint64_t checksum) override {
    if (ended_.exchange(true))
      return absl::FailedPreconditionError("slot writer: already committed");
    absl::Status refused;
    if (written_.load() != bytes_) {
      refused = absl::DataLossError(
          absl::StrCat("payload: expected ", bytes_, " bytes written, got ", written_.load()));
    } else if (const uint64_t got = sum_.Digest(); got != checksum) {
      refused = absl::DataLossError(absl::StrCat("checksum: expected 0x", absl::Hex(checksum),
                                                 " (the sender's), got 0x", absl::Hex(got)));
    }
    absl::MutexLock ops(&host_->ops_mu());
    if (!refused.ok()) {
      DropRanksLocked();
      return refused;
    }
    // The ranks drain their copies and commit together; if one fails, the others' slots are
    // freed (an uncommitted rank's writer frees its own).
    std::vector<SlotId> ids(ranks_.size(), 0);
    const std::vector<absl::Status> st = OnEachRank(*host_, ranks_.size(), [&](size_t r) {
      // Opened without a checksum (the unsharded payload's was checked above): any value.
      absl::StatusOr<SlotId> id = ranks_[r]->Commit(tokens, 0);
      if (!id.ok()) return id.status();
      ids[r] = *id;
      return absl::OkStatus();
    });
    for (size_t r = 0; r < st.size(); ++r) {
      if (!st[r].ok()) return host_->FreeAll(ids, RankStatus(r, st[r]));
    }
    return host_->Bind(std::move(ids));
  }

 private:
  // Each rank's writer dropped on its device (an uncommitted one frees its reserved slot);
  // the caller holds ops_mu.
  void DropRanksLocked() {
    for (size_t r = 0; r < ranks_.size(); ++r) {
      host_->Use(r);
      ranks_[r].reset();
    }
  }

  // A rank's conv window of one layer, gathered until whole, then written as one piece.
  struct Window {
    explicit Window(int64_t n) : bytes(n) {}
    std::vector<uint8_t> bytes;
    std::atomic<int64_t> have{0};
  };

  // `n` bytes of rank run.rank's layer l state at in-layer offset `shard`: the unsharded
  // payload's bytes [at, at + n).
  absl::Status Put(const TpLayerMap::Run& run, int64_t l, int64_t shard, const uint8_t* src,
                   int64_t n, int64_t at) {
    const size_t r = static_cast<size_t>(run.rank);
    const int64_t ckpt = map_.ckpt_bytes[r];
    const int64_t dst = l * map_.shard_bytes[r] + shard;
    host_->Use(r);
    if (shard < ckpt) {  // a checkpoint run never reaches into the window
      return RankStatus(r, ranks_[r]->WriteAndHash(static_cast<size_t>(dst), src,
                                                   static_cast<size_t>(n), sum_,
                                                   static_cast<size_t>(at)));
    }
    Window& w = *windows_[r * map_.num_layers + l];
    sum_.CopyAndAdd(w.bytes.data() + (shard - ckpt), src, static_cast<size_t>(at),
                    static_cast<size_t>(n));
    if (w.have.fetch_add(n) + n != static_cast<int64_t>(w.bytes.size())) return absl::OkStatus();
    return RankStatus(r, ranks_[r]->Write(static_cast<size_t>(l * map_.shard_bytes[r] + ckpt),
                                          w.bytes.data(), w.bytes.size()));
  }
  // As TpGroup's: rank 0's refusals are the group's (every rank checks the same fields, and
  // rank 0 answers first), so they name no rank.
  static absl::Status RankStatus(size_t r, const absl::Status& st) {
    if (r == 0 || st.ok()) return st;
    return absl::Status(st.code(), absl::StrCat("tp rank ", r, ": ", st.message()));
  }

  TpSlotIoHost* const host_;
  std::vector<std::unique_ptr<ShardSlotWriter>> ranks_;
  std::atomic<bool> ended_{false};  // the first Commit ends the writer
  const TpLayerMap& map_;
  const size_t bytes_;
  SegmentedChecksum sum_;  // of the unsharded payload (the sender's checksum): rank writers add
  std::vector<std::unique_ptr<Window>> windows_;               // [rank][layer]
  std::atomic<size_t> written_{0};
};

}  // namespace

std::unique_ptr<SlotReader> NewTpReader(TpSlotIoHost* host, SlotId group,
                                        std::vector<std::unique_ptr<SlotReader>> ranks,
                                        const TpLayerMap* map, size_t chunk_bytes) {
  return std::make_unique<TpReader>(host, group, std::move(ranks), map,
                                    std::max<size_t>(chunk_bytes, 1));
}

std::unique_ptr<SlotWriter> NewTpWriter(TpSlotIoHost* host,
                                        std::vector<std::unique_ptr<ShardSlotWriter>> ranks,
                                        const TpLayerMap* map) {
  return std::make_unique<TpWriter>(host, std::move(ranks), map);
}

}  // namespace replayssm::cache
