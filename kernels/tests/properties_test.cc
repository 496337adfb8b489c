// Properties that tie the operations together: replay with every step folding is the
// baseline bit for bit; fold is idempotent; prefill of T tokens is T steps; verify + accept(n)
// is n decode steps, for every n.
#include <gtest/gtest.h>

#include <cstring>

#include "harness.h"

namespace replayssm::kernels::testing {
namespace {

const rssm_dtype kDtypes[] = {RSSM_DTYPE_F32, RSSM_DTYPE_BF16, RSSM_DTYPE_F16};

struct Call {
  explicit Call(Layer& layer) : layer(layer) {}
  Layer& layer;

  rssm_decode_args Decode(const std::vector<int32_t>& slots, const std::vector<int32_t>& w,
                          const Tokens& tok, Buffer& out, const uint8_t* force = nullptr) {
    return layer.DecodeArgs(static_cast<int32_t>(slots.size()), slots.data(), w.data(), tok, out,
                            force);
  }
};

std::vector<Config> AllDtypePairs(int l) {
  std::vector<Config> out;
  for (rssm_gate gate : {RSSM_GATE_GDN, RSSM_GATE_KDA}) {
    for (auto [sd, rd] : kStoragePairs) {
      for (rssm_dtype ad : kDtypes) {
        Config c;
        c.gate = gate;
        c.state_dtype = sd;
        c.ring_dtype = rd;
        c.act_dtype = ad;
        c.h = 2;
        c.hv = 4;
        c.k = 64;
        c.v = 48;
        c.l = l;
        out.push_back(c);
      }
    }
  }
  return out;
}

TEST(Properties, ReplayWithEveryStepFoldingIsBaselineBitForBit) {
  for (const Config& c : AllDtypePairs(1)) {
    SCOPED_TRACE(c.Name());
    std::mt19937_64 rng(std::hash<std::string>{}(c.Name()));
    Layer replay(c, 4, rng);
    for (int s = 0; s < 4; ++s) replay.RandomCheckpoint(s, rng);
    Layer baseline = replay;
    const std::vector<int32_t> slots = {2, -1, 0, 3}, w = {0, 0, 0, 0};
    for (int step = 0; step < 5; ++step) {
      Tokens tok(replay, 4, rng);
      Buffer o1(c.act_dtype, 4LL * c.hv * c.v), o2 = o1;
      o1.FillNaN();
      o2.FillNaN();
      rssm_decode_args a1 = Call(replay).Decode(slots, w, tok, o1);
      rssm_decode_args a2 = Call(baseline).Decode(slots, w, tok, o2);
      ASSERT_EQ(rssm_replay_decode(&a1), RSSM_OK) << rssm_last_error();
      ASSERT_EQ(rssm_baseline_decode(&a2), RSSM_OK) << rssm_last_error();
      ASSERT_EQ(o1.bytes(), o2.bytes()) << "outputs differ at step " << step;
      ASSERT_EQ(replay.checkpoint.bytes(), baseline.checkpoint.bytes()) << "step " << step;
    }
  }
}

// Runs n appending steps on every slot of `layer` (L > n): returns the cursor.
int AppendSteps(Layer& layer, int n, std::mt19937_64& rng) {
  std::vector<int32_t> slots(layer.num_slots), w(layer.num_slots, 0);
  for (int s = 0; s < layer.num_slots; ++s) slots[s] = s;
  for (int step = 0; step < n; ++step) {
    Tokens tok(layer, layer.num_slots, rng);
    Buffer out(layer.cfg.act_dtype, int64_t{layer.num_slots} * layer.cfg.hv * layer.cfg.v);
    rssm_decode_args a = Call(layer).Decode(slots, w, tok, out);
    EXPECT_EQ(rssm_replay_decode(&a), RSSM_OK) << rssm_last_error();
    for (auto& x : w) ++x;
  }
  return n;
}

TEST(Properties, FoldMaterializesAndIsIdempotent) {
  for (const Config& c : AllDtypePairs(8)) {
    SCOPED_TRACE(c.Name());
    std::mt19937_64 rng(std::hash<std::string>{}(c.Name()) + 1);
    Layer layer(c, 3, rng);
    for (int s = 0; s < 3; ++s) layer.RandomCheckpoint(s, rng);
    const int w = AppendSteps(layer, 5, rng);
    const std::vector<double> logical = layer.LogicalState(1, w);
    const std::vector<uint8_t> untouched = layer.SlotBytes(2);
    const std::vector<int32_t> slots = {1, -1}, pos = {w, 3};
    rssm_fold_args f{{RSSM_BACKEND_CPU, nullptr}, layer.shape, layer.Pool(), 2, slots.data(),
                     pos.data()};
    ASSERT_EQ(rssm_fold(&f), RSSM_OK) << rssm_last_error();
    EXPECT_LE(RelErr(layer.CheckpointState(1), logical), StateTolerance(c));
    EXPECT_EQ(layer.SlotBytes(2), untouched);
    const std::vector<uint8_t> once = layer.SlotBytes(1);
    const std::vector<int32_t> zero = {0, 0};
    f.write_pos = zero.data();
    ASSERT_EQ(rssm_fold(&f), RSSM_OK) << rssm_last_error();
    EXPECT_EQ(layer.SlotBytes(1), once) << "a second fold changed the slot";
  }
}

TEST(Properties, PrefillEqualsSingleSteps) {
  for (const Config& c : AllDtypePairs(4)) {
    SCOPED_TRACE(c.Name());
    std::mt19937_64 rng(std::hash<std::string>{}(c.Name()) + 2);
    Layer pre(c, 5, rng);
    for (int s = 0; s < 5; ++s) pre.RandomCheckpoint(s, rng);
    AppendSteps(pre, 2, rng);  // every slot at cursor 2
    Layer steps = pre;
    // Rows: slot 3 from its state (7 tokens), slot 0 from zero (0 tokens), padding (2),
    // slot 4 from zero (9 tokens), slot 1 from its state (1 token).
    const std::vector<int32_t> slots = {3, 0, -1, 4, 1}, cu = {0, 7, 7, 9, 18, 19};
    const std::vector<uint8_t> initial = {1, 0, 0, 0, 1};
    const std::vector<int32_t> w = {2, 2, 2, 2, 2};
    Tokens tok(pre, cu.back(), rng);
    Buffer out(c.act_dtype, int64_t{cu.back()} * c.hv * c.v);
    out.FillNaN();
    rssm_prefill_args p =
        pre.PrefillArgs(5, slots.data(), cu.data(), 9, tok, out, initial.data(), w.data());
    ASSERT_EQ(rssm_prefill(&p), RSSM_OK) << rssm_last_error();
    // The same with single steps: fold to the starting state, then one baseline step per token.
    const Reference ref(pre);
    for (int r = 0; r < 5; ++r) {
      if (slots[r] < 0) {
        for (int t = cu[r]; t < cu[r + 1]; ++t) {
          EXPECT_EQ(RelErr(OutputOf(out, t, c.hv, c.v), std::vector<double>(c.hv * c.v, 0.0)), 0.0);
        }
        continue;
      }
      std::vector<double> st = initial[r] ? steps.LogicalState(slots[r], 2)
                                          : std::vector<double>(int64_t{c.hv} * c.v * c.k, 0.0);
      for (int t = cu[r]; t < cu[r + 1]; ++t) {
        std::vector<double> o;
        ref.Step(st, tok, t, o);
        EXPECT_LE(RelErr(OutputOf(out, t, c.hv, c.v), o), OutputTolerance(c))
            << "row " << r << " token " << t;
      }
      EXPECT_LE(RelErr(pre.CheckpointState(slots[r]), st), StateTolerance(c)) << "row " << r;
    }
    if (c.state_dtype != RSSM_DTYPE_F32) continue;
    // fp32 state: bit for bit against fold + baseline steps on the CPU backend.
    for (int r : {0, 1, 3, 4}) {
      const int32_t slot = slots[r];
      const std::vector<int32_t> one = {slot}, pos = {initial[r] ? 2 : 0};
      if (initial[r]) {
        rssm_fold_args f{{RSSM_BACKEND_CPU, nullptr}, steps.shape, steps.Pool(), 1, one.data(),
                         pos.data()};
        ASSERT_EQ(rssm_fold(&f), RSSM_OK);
      } else {
        std::memset(static_cast<char*>(steps.checkpoint.data()) + slot * steps.cp_stride * 4, 0,
                    int64_t{c.hv} * c.v * c.k * 4);
      }
      for (int t = cu[r]; t < cu[r + 1]; ++t) {
        Tokens one_tok(steps, 1, rng);
        tok.CopyTokenTo(t, one_tok, 0);
        Buffer o(c.act_dtype, int64_t{c.hv} * c.v);
        const std::vector<int32_t> w0 = {0};  // outlives the args that point at it
        rssm_decode_args a = Call(steps).Decode(one, w0, one_tok, o);
        ASSERT_EQ(rssm_baseline_decode(&a), RSSM_OK);
        std::vector<uint8_t> expect(o.bytes().size());
        std::memcpy(expect.data(), static_cast<const char*>(out.data()) + t * expect.size(), expect.size());
        EXPECT_EQ(o.bytes(), expect) << "row " << r << " token " << t;
      }
      EXPECT_EQ(pre.CheckpointState(slot), steps.CheckpointState(slot)) << "row " << r;
    }
  }
}

TEST(Properties, VerifyThenAcceptEqualsDecodeSteps) {
  for (const Config& c : AllDtypePairs(7)) {  // w + T == L when all 4 drafts are accepted
    SCOPED_TRACE(c.Name());
    std::mt19937_64 rng(std::hash<std::string>{}(c.Name()) + 3);
    constexpr int kT = 4;
    Layer base(c, 3, rng);
    for (int s = 0; s < 3; ++s) base.RandomCheckpoint(s, rng);
    const int w0 = AppendSteps(base, 3, rng);  // w + T = 7 <= L
    const std::vector<int32_t> slots = {2, -1, 0};
    Tokens drafts(base, 3 * kT, rng);
    for (int n = 0; n <= kT; ++n) {
      SCOPED_TRACE("accept " + std::to_string(n));
      Layer ver = base, dec = base;
      Buffer vo(c.act_dtype, 3LL * kT * c.hv * c.v);
      vo.FillNaN();
      const std::vector<int32_t> w = {w0, 0, w0};
      rssm_verify_args v = ver.VerifyArgs(3, kT, slots.data(), w.data(), drafts, vo);
      ASSERT_EQ(rssm_verify(&v), RSSM_OK) << rssm_last_error();
      for (int t = 0; t < kT; ++t) {  // the padding row's outputs are zeros
        EXPECT_EQ(RelErr(OutputOf(vo, kT + t, c.hv, c.v), std::vector<double>(c.hv * c.v, 0.0)), 0.0);
      }
      // n decode steps with the first n drafts of each row.
      std::vector<int32_t> dw = w;
      for (int t = 0; t < n; ++t) {
        Tokens tok(dec, 3, rng);
        for (int r = 0; r < 3; ++r) drafts.CopyTokenTo(r * kT + t, tok, r);
        Buffer o(c.act_dtype, 3LL * c.hv * c.v);
        rssm_decode_args a = Call(dec).Decode(slots, dw, tok, o);
        ASSERT_EQ(rssm_replay_decode(&a), RSSM_OK) << rssm_last_error();
        for (int r : {0, 2}) {
          const size_t row_bytes = size_t{rssm_dtype_size(c.act_dtype)} * c.hv * c.v;
          EXPECT_EQ(0, std::memcmp(static_cast<const char*>(o.data()) + r * row_bytes,
                                   static_cast<const char*>(vo.data()) + (r * kT + t) * row_bytes,
                                   row_bytes))
              << "row " << r << " draft " << t;
          dw[r] = dw[r] + 1 >= c.l ? 0 : dw[r] + 1;  // the step at w = L-1 folds
        }
      }
      const bool dec_folded = w0 + n >= c.l;
      // An fp32 checkpoint: the same records (a fold adds its own as the ring holds it), only
      // the order of the fp32 sums differs.
      const double fold_tol = c.state_dtype == RSSM_DTYPE_F32 ? 1e-6 : StateTolerance(c) / 4;
      for (int r : {0, 2}) {  // accept(n): cursor w + n; the logical states agree
        if (dec_folded) {  // the decode path folded on its last step: equal up to rounding
          EXPECT_LE(RelErr(ver.LogicalState(slots[r], w0 + n), dec.LogicalState(slots[r], dw[r])),
                    fold_tol);
        } else {  // the same records: bit for bit
          EXPECT_EQ(ver.LogicalState(slots[r], w0 + n), dec.LogicalState(slots[r], dw[r]));
        }
        if (n == 0) {  // rejecting everything costs nothing
          EXPECT_EQ(ver.SlotBytes(slots[r]).size(), base.SlotBytes(slots[r]).size());
          EXPECT_EQ(ver.CheckpointState(slots[r]), base.CheckpointState(slots[r]));
          EXPECT_EQ(ver.LogicalState(slots[r], w0), base.LogicalState(slots[r], w0));
        }
      }
      // The next decode step (it folds when the accepted drafts filled the ring).
      Tokens next(base, 3, rng);
      Buffer o1(c.act_dtype, 3LL * c.hv * c.v), o2 = o1;
      const std::vector<int32_t> vw = {w0 + n, 0, w0 + n};
      rssm_decode_args a1 = Call(ver).Decode(slots, vw, next, o1);
      rssm_decode_args a2 = Call(dec).Decode(slots, dw, next, o2);
      ASSERT_EQ(rssm_replay_decode(&a1), RSSM_OK) << rssm_last_error();
      ASSERT_EQ(rssm_replay_decode(&a2), RSSM_OK) << rssm_last_error();
      const int after_ver = w0 + n + 1 >= c.l ? 0 : w0 + n + 1;
      const int after_dec = dw[0] + 1 >= c.l ? 0 : dw[0] + 1;
      if (!dec_folded) {
        EXPECT_EQ(o1.bytes(), o2.bytes());
      } else {
        for (int r : {0, 2}) {
          EXPECT_LE(RelErr(OutputOf(o1, r, c.hv, c.v), OutputOf(o2, r, c.hv, c.v)),
                    fold_tol + OutputTolerance(c) / 4);
        }
      }
      for (int r : {0, 2}) {
        EXPECT_LE(RelErr(ver.LogicalState(slots[r], after_ver), dec.LogicalState(slots[r], after_dec)),
                  dec_folded ? fold_tol : 0.0);
      }
    }
  }
}

}  // namespace
}  // namespace replayssm::kernels::testing
