// The sweep: replay decode against the fp64 reference over gates, GQA ratios, ring lengths,
// head dims and every (state, ring) × activation dtype pair, with advancing cursors, random forced
// folds, padding rows, rows that skip a step, and rows in a new order every step. Outputs
// and the logical state of every request are checked after every step; slots outside the
// batch must keep every byte.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <map>

#include "harness.h"

namespace replayssm::kernels::testing {
namespace {

uint64_t BaseSeed() {
  const char* env = std::getenv("REPLAYSSM_TEST_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 0x5eed2026ULL;
}

struct Request {
  int slot;
  int w = 0;
  std::vector<double> ref;  // fp64 reference state
};

struct Stats {
  double out = 0.0, state = 0.0;
};

// Runs ≥ 3L + 2 replay steps of `cfg` and checks every one; the largest errors go to *worst.
void RunReplayCase(const Config& cfg, int num_requests, uint64_t seed, Stats* worst) {
  SCOPED_TRACE("config " + cfg.Name() + " seed " + std::to_string(seed));
  std::mt19937_64 rng(seed);
  const int num_slots = num_requests + 3;
  Layer layer(cfg, num_slots, rng);
  std::vector<int> slots(num_slots);
  for (int i = 0; i < num_slots; ++i) slots[i] = i;
  std::shuffle(slots.begin(), slots.end(), rng);
  std::vector<Request> reqs;
  for (int i = 0; i < num_requests; ++i) {
    layer.RandomCheckpoint(slots[i], rng);
    reqs.push_back(Request{slots[i], 0, layer.CheckpointState(slots[i])});
  }
  const Reference ref(layer);
  const double out_tol = OutputTolerance(cfg);
  const double state_tol = StateTolerance(cfg);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  for (int step = 0; step < 3 * cfg.l + 2; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // Batch: the requests that take part, in a random order, plus 1-2 padding rows (-1).
    std::vector<int> rows;
    for (int r = 0; r < num_requests; ++r) {
      if (coin(rng) > 0.15) rows.push_back(r);
    }
    const int pads = 1 + static_cast<int>(coin(rng) * 2);
    for (int p = 0; p < pads; ++p) rows.push_back(-1);
    std::shuffle(rows.begin(), rows.end(), rng);
    const int B = static_cast<int>(rows.size());
    Tokens tok(layer, B, rng);
    std::vector<int32_t> slot_idx(B), write_pos(B);
    std::vector<uint8_t> force(B);
    for (int i = 0; i < B; ++i) {
      slot_idx[i] = rows[i] < 0 ? -1 : reqs[rows[i]].slot;
      write_pos[i] = rows[i] < 0 ? 0 : reqs[rows[i]].w;
      // Long-memory cases fold early rarely: their rings fill, so every record back to the
      // checkpoint counts in the outputs (w reached 40 of L = 64 about once in 700 rows).
      force[i] = coin(rng) < (cfg.long_memory ? 0.01 : 0.15) ? 1 : 0;
    }
    std::map<int, std::vector<uint8_t>> before;
    for (int s = 0; s < num_slots; ++s) before[s] = layer.SlotBytes(s);
    Buffer out(cfg.act_dtype, int64_t{B} * cfg.hv * cfg.v);
    out.FillNaN();
    rssm_decode_args args =
        layer.DecodeArgs(B, slot_idx.data(), write_pos.data(), tok, out, force.data());
    ASSERT_EQ(rssm_replay_decode(&args), RSSM_OK) << rssm_last_error();
    std::vector<bool> in_batch(num_slots, false);
    for (int i = 0; i < B; ++i) {
      if (rows[i] < 0) {
        for (int64_t e = 0; e < int64_t{cfg.hv} * cfg.v; ++e) {
          ASSERT_EQ(out.Get(i * int64_t{cfg.hv} * cfg.v + e), 0.f) << "padding row " << i;
        }
        continue;
      }
      Request& q = reqs[rows[i]];
      in_batch[q.slot] = true;
      std::vector<double> o_ref;
      ref.Step(q.ref, tok, i, o_ref);
      const double err = RelErr(OutputOf(out, i, cfg.hv, cfg.v), o_ref);
      ASSERT_LE(err, out_tol) << "output of row " << i << " (slot " << q.slot << ", w " << q.w << ")";
      worst->out = std::max(worst->out, err);
      const bool folded = force[i] || q.w + 1 >= cfg.l;
      if (!folded) {  // a step that appends must leave the checkpoint alone
        std::vector<uint8_t> now = layer.SlotBytes(q.slot);
        const size_t cp_bytes = layer.cp_stride * rssm_dtype_size(cfg.state_dtype);
        ASSERT_TRUE(std::equal(now.begin(), now.begin() + cp_bytes, before[q.slot].begin()))
            << "checkpoint of slot " << q.slot << " changed without a fold";
      }
      q.w = folded ? 0 : q.w + 1;
    }
    for (int s = 0; s < num_slots; ++s) {
      if (!in_batch[s]) {
        ASSERT_EQ(layer.SlotBytes(s), before[s]) << "slot " << s << " is not in the batch";
      }
    }
    for (const Request& q : reqs) {
      const double err = RelErr(layer.LogicalState(q.slot, q.w), q.ref);
      ASSERT_LE(err, state_tol) << "logical state of slot " << q.slot << " at w " << q.w;
      worst->state = std::max(worst->state, err);
    }
  }
}

// The main sweep: every gate × (state, ring) pair × activation dtype × ring length, with head dims,
// GQA ratio, strides and l2norm rotating through their values so that each appears with
// every ring length and gate.
std::vector<Config> MainSweep() {
  const std::vector<std::pair<int, int>> dims = {{16, 16}, {64, 64},  {128, 128},
                                                 {96, 96}, {64, 96}, {128, 16}};
  const int ratios[] = {1, 2, 4};
  const rssm_dtype dtypes[] = {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16};
  std::vector<Config> out;
  int n = 0;
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (auto [sd, rd] : kStoragePairs) {
      for (rssm_dtype ad : dtypes) {
        for (int l : {1, 2, 8, 16, 64}) {
          Config c;
          c.gate = gate;
          c.state_dtype = sd;
          c.ring_dtype = rd;
          c.act_dtype = ad;
          c.l = l;
          c.k = dims[n % dims.size()].first;
          c.v = dims[n % dims.size()].second;
          if (l == 64 && c.k * c.v > 64 * 96) c.k = c.v = 64;  // keep the longest rings cheap
          c.h = 2;
          c.hv = 2 * ratios[(n / 2) % 3];
          c.slot_pad = n % 3 == 0 ? 48 : 0;
          c.l2norm = n % 7 != 3;
          // Not n % 5: L is the innermost of five, so rounded betas met only L = 2.
          c.round_beta = (n / 5) % 3 == 1;
          c.long_memory = n % 4 == 2;
          out.push_back(c);
          ++n;
        }
      }
    }
  }
  return out;
}

// Every K × V pair and GQA ratio for both gates at a short ring.
std::vector<Config> DimsSweep() {
  std::vector<Config> out;
  int n = 0;
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (int k : {16, 64, 96, 128}) {
      for (int v : {16, 64, 96, 128}) {
        for (int ratio : {1, 2, 4}) {
          Config c;
          c.gate = gate;
          c.k = k;
          c.v = v;
          c.h = 1;
          c.hv = ratio;
          c.l = 2;
          c.state_dtype = n % 2 ? RSSM_DTYPE_BF16 : RSSM_DTYPE_F32;
          if (n % 4 == 2) c.ring_dtype = RSSM_DTYPE_BF16;  // fp32 state, bf16 ring
          c.act_dtype = n % 3 == 0 ? RSSM_DTYPE_F32 : RSSM_DTYPE_BF16;
          c.round_beta = n % 5 == 2;
          out.push_back(c);
          ++n;
        }
      }
    }
  }
  return out;
}

class ReplaySweep : public ::testing::TestWithParam<Config> {};

TEST_P(ReplaySweep, MatchesFp64ReferenceEveryStep) {
  const Config& c = GetParam();
  const uint64_t seed = BaseSeed() ^ std::hash<std::string>{}(c.Name());
  Stats s;
  RunReplayCase(c, 3, seed, &s);
  RecordProperty("max_output_err", std::to_string(s.out));
  RecordProperty("max_state_err", std::to_string(s.state));
}

std::string ParamName(const ::testing::TestParamInfo<Config>& info) { return info.param.Name(); }

INSTANTIATE_TEST_SUITE_P(Main, ReplaySweep, ::testing::ValuesIn(MainSweep()), ParamName);
INSTANTIATE_TEST_SUITE_P(Dims, ReplaySweep, ::testing::ValuesIn(DimsSweep()), ParamName);

}  // namespace
}  // namespace replayssm::kernels::testing
