#include "radix_tree.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

namespace replayssm::cache {
namespace {

using Key = std::vector<int32_t>;

TEST(RadixTree, LongestPrefixFindsTheDeepestStoredKey) {
  RadixTree t;
  EXPECT_TRUE(t.Insert(Key{1, 2, 3}, 10));
  EXPECT_TRUE(t.Insert(Key{1, 2, 3, 4, 5}, 11));
  EXPECT_TRUE(t.Insert(Key{1, 2, 9}, 12));
  EXPECT_FALSE(t.Insert(Key{1, 2, 3}, 99)) << "a stored key keeps its value";
  EXPECT_EQ(t.LongestPrefix(Key{1, 2, 3, 4, 5, 6}).value, 11);
  EXPECT_EQ(t.LongestPrefix(Key{1, 2, 3, 4}).length, 3);
  EXPECT_EQ(t.LongestPrefix(Key{1, 2, 9, 9}).value, 12);
  EXPECT_EQ(t.LongestPrefix(Key{1, 2}).length, 0);
  EXPECT_EQ(t.LongestPrefix(Key{7}).value, -1);
  EXPECT_EQ(t.Find(Key{1, 2}), -1);
  EXPECT_EQ(t.size(), 3);
}

TEST(RadixTree, ErasePrunesAndMergesNodes) {
  RadixTree t;
  t.Insert(Key{1, 2, 3}, 1);
  t.Insert(Key{1, 2, 4}, 2);
  EXPECT_EQ(t.node_count(), 3);  // [1,2] -> [3], [4]
  EXPECT_TRUE(t.Erase(Key{1, 2, 3}));
  EXPECT_FALSE(t.Erase(Key{1, 2, 3}));
  EXPECT_EQ(t.node_count(), 1) << "[1,2] and [4] merge into one edge";
  EXPECT_EQ(t.LongestPrefix(Key{1, 2, 4, 0}).value, 2);
  EXPECT_TRUE(t.Erase(Key{1, 2, 4}));
  EXPECT_EQ(t.node_count(), 0);
  EXPECT_EQ(t.size(), 0);
}

// Against a brute-force map of keys, over random inserts and erases of related keys.
TEST(RadixTree, MatchesBruteForceOnRandomKeys) {
  std::mt19937 rng(42);
  RadixTree t;
  std::map<Key, int32_t> ref;
  std::vector<Key> pool;
  for (int op = 0; op < 4000; ++op) {
    Key k;
    if (!pool.empty() && rng() % 3 != 0) {  // a prefix or extension of a known key
      k = pool[rng() % pool.size()];
      k.resize(1 + rng() % (k.size() + 3), static_cast<int32_t>(rng() % 3));
    } else {
      k.resize(1 + rng() % 6);
      for (auto& x : k) x = static_cast<int32_t>(rng() % 3);
    }
    pool.push_back(k);
    if (rng() % 3 == 0) {
      EXPECT_EQ(t.Erase(k), ref.erase(k) == 1);
    } else {
      const bool fresh = !ref.count(k);
      EXPECT_EQ(t.Insert(k, op), fresh);
      if (fresh) ref[k] = op;
    }
    Key probe = pool[rng() % pool.size()];
    probe.push_back(static_cast<int32_t>(rng() % 3));
    RadixTree::Match want;
    for (size_t n = 1; n <= probe.size(); ++n) {
      auto it = ref.find(Key(probe.begin(), probe.begin() + n));
      if (it != ref.end()) want = {static_cast<int64_t>(n), it->second};
    }
    const RadixTree::Match got = t.LongestPrefix(probe);
    ASSERT_EQ(got.length, want.length) << "op " << op;
    ASSERT_EQ(got.value, want.value) << "op " << op;
    ASSERT_EQ(t.size(), static_cast<int64_t>(ref.size()));
  }
}

}  // namespace
}  // namespace replayssm::cache
