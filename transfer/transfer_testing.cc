#include "transfer_testing.h"

#include <random>

#include "absl/time/clock.h"
#include "replayssm/cache/slot_io.h"

namespace replayssm::transfer::testing {
namespace {

absl::Status Unanswered(const char* what, absl::Time deadline) {
  absl::SleepFor(deadline - absl::Now());
  return absl::DeadlineExceededError(std::string("peer ") + what + ": no answer");
}

}  // namespace

std::unique_ptr<cache::StateCache> MakeCache(const char* preset, int32_t layers) {
  absl::StatusOr<cache::ModelSpec> m = cache::ModelPreset(preset, RSSM_DTYPE_F32, 4);
  EXPECT_TRUE(m.ok());
  m->num_layers = layers;
  m->layers.resize(layers);
  cache::CacheOptions o;
  o.memory_budget_bytes = 4 * m->SlotBytes();
  return std::move(*cache::StateCache::Create(*m, o));
}

cache::SlotId RandomSlot(cache::StateCache& c, uint32_t seed) {
  const size_t per = cache::SlotPayloadBytes(c.model()) / c.model().num_layers;
  std::mt19937 rng(seed);
  std::vector<std::vector<uint8_t>> layers(c.model().num_layers, std::vector<uint8_t>(per));
  std::vector<absl::Span<const uint8_t>> spans;
  for (auto& l : layers) {
    for (auto& x : l) x = static_cast<uint8_t>(rng() & 0x3f);
    spans.push_back(absl::MakeConstSpan(l));
  }
  const cache::SlotId s = *c.Allocate();
  EXPECT_TRUE(c.Import(s, {1, 2, 3}, spans).ok());
  return s;
}

void DirtyEverySlot(cache::StateCache& c) {
  std::vector<cache::SlotId> slots;
  for (absl::StatusOr<cache::SlotId> s = c.Allocate(); s.ok(); s = c.Allocate()) {
    slots.push_back(*s);
  }
  const size_t per = cache::SlotPayloadBytes(c.model()) / c.model().num_layers;
  std::vector<uint8_t> junk(per, 0x3c);
  std::vector<absl::Span<const uint8_t>> cps(c.model().num_layers, absl::MakeConstSpan(junk));
  for (cache::SlotId s : slots) {
    EXPECT_TRUE(c.Import(s, {9, 9}, cps).ok());
    EXPECT_TRUE(c.Free(s).ok());
  }
}

std::vector<uint8_t> Payload(const cache::ExportedState& e) {
  std::vector<uint8_t> payload;
  for (const auto& l : e.checkpoints) payload.insert(payload.end(), l.begin(), l.end());
  return payload;
}

uint64_t Checksum(const std::vector<uint8_t>& payload) {
  return cache::PayloadChecksum(payload.data(), payload.size());
}

void TwoInstancesTest::SetUp() {
  a_ = MakeCache("tiny-gdn", 2);
  b_ = MakeCache("tiny-gdn", 2);
  ucx_a_ = std::move(*UcxTransport::Create());
  ucx_b_ = std::move(*UcxTransport::Create());
  oracle_ = std::make_unique<cache::testing::Oracle>(a_->model());
}

cache::SlotId TwoInstancesTest::Prepare(int steps) {
  const cache::SlotId s = *a_->Allocate();
  cache::testing::Batch p = oracle_->MakeBatch({{1, 0}, {2, 1}, {3, 2}});
  EXPECT_TRUE(a_->Prefill(s, {1, 2, 3}, p.io).ok());
  for (int t = 0; t < steps; ++t) Step(*a_, s, 10 + t, 3 + t);
  return s;
}

std::vector<std::vector<uint8_t>> TwoInstancesTest::Step(cache::StateCache& c, cache::SlotId s,
                                                         int32_t tok, int64_t pos) {
  cache::testing::Batch b = oracle_->MakeBatch({{tok, pos}});
  auto f = c.BeginForward({{s, tok}});
  EXPECT_TRUE(f.ok()) << f.status();
  for (int l = 0; l < c.model().num_layers; ++l) EXPECT_TRUE((*f)->RunLayer(l, b.io[l]).ok());
  EXPECT_TRUE((*f)->Commit().ok());
  return b.out;
}

absl::StatusOr<Reservation> DirectPeer::Reserve(const std::string& id, const StateFormat& f,
                                                int64_t seq_len, uint32_t version,
                                                absl::Duration budget, absl::Time) {
  ++reserves;
  return r_->Reserve(id, f, seq_len, version, budget);
}

absl::StatusOr<uint64_t> DirectPeer::Commit(const std::string& id,
                                            const std::vector<int32_t>& tokens, uint64_t checksum,
                                            absl::Time) {
  if (before_commit) before_commit();
  if (drop_commit) return absl::UnavailableError("peer CommitTransfer: connection reset");
  absl::StatusOr<Decision> c = r_->Commit(id, tokens, corrupt_checksum ? checksum ^ 1 : checksum);
  if (lose_commit_reply) return absl::UnavailableError("peer CommitTransfer: reply lost");
  if (!c.ok()) return c.status();
  return c->slot;
}

absl::StatusOr<Decision> DirectPeer::Abort(const std::string& id, absl::Time) {
  if (before_abort) before_abort();
  if (drop_abort) return absl::UnavailableError("peer AbortTransfer: connection reset");
  return r_->Abort(id);
}

void DirectPeer::Acknowledge(const std::string& id) {
  ++acknowledged;
  r_->Acknowledge(id, "");
}

absl::StatusOr<Reservation> HungPeer::Reserve(const std::string&, const StateFormat&, int64_t,
                                              uint32_t, absl::Duration, absl::Time deadline) {
  return Unanswered("ReserveTransfer", deadline);
}

absl::StatusOr<uint64_t> HungPeer::Commit(const std::string&, const std::vector<int32_t>&, uint64_t,
                                          absl::Time deadline) {
  return Unanswered("CommitTransfer", deadline);
}

absl::StatusOr<Decision> HungPeer::Abort(const std::string&, absl::Time deadline) {
  return Unanswered("AbortTransfer", deadline);
}

}  // namespace replayssm::transfer::testing
