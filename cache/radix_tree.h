// A compressed radix tree over token ids that maps whole keys (token prefixes of requests)
// to values (snapshot slot indices). It answers "the longest stored key that is a prefix of
// these tokens".
//
// Thread safety: none; StateCache guards it with its mutex.
#ifndef REPLAYSSM_CACHE_RADIX_TREE_H_
#define REPLAYSSM_CACHE_RADIX_TREE_H_

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/types/span.h"

namespace replayssm::cache {

class RadixTree {
 public:
  RadixTree();
  ~RadixTree();
  RadixTree(const RadixTree&) = delete;
  RadixTree& operator=(const RadixTree&) = delete;

  // Stores value (>= 0) under key. Returns false, changing nothing, if the key has a value.
  bool Insert(absl::Span<const int32_t> key, int32_t value);

  struct Match {
    int64_t length = 0;  // tokens of the matched key (0 = none; the empty key never stores)
    int32_t value = -1;
  };
  // The longest stored key that is a prefix of `tokens`.
  Match LongestPrefix(absl::Span<const int32_t> tokens) const;

  // The value stored under exactly `key`, or -1.
  int32_t Find(absl::Span<const int32_t> key) const;

  // Removes key's value; returns false if it had none. Prunes and merges emptied nodes.
  bool Erase(absl::Span<const int32_t> key);

  int64_t size() const { return size_; }
  int64_t node_count() const;  // for tests: nodes besides the root

 private:
  struct Node {
    std::vector<int32_t> edge;  // tokens on the edge from the parent
    std::unordered_map<int32_t, std::unique_ptr<Node>> children;  // by first edge token
    Node* parent = nullptr;
    int32_t value = -1;
  };
  // The node whose key is exactly `key`, or null.
  Node* FindNode(absl::Span<const int32_t> key) const;
  // Deletes or merges `node` if it no longer carries information.
  void Compact(Node* node);

  std::unique_ptr<Node> root_;
  int64_t size_ = 0;
};

// One RadixTree per namespace (a service's tenants, StateCache's PrefixNamespace): a key
// stored in one namespace is never found from another. Same methods, namespace first.
class PrefixForest {
 public:
  bool Insert(uint32_t ns, absl::Span<const int32_t> key, int32_t value) {
    std::unique_ptr<RadixTree>& t = trees_[ns];
    if (t == nullptr) t = std::make_unique<RadixTree>();
    return t->Insert(key, value);
  }
  RadixTree::Match LongestPrefix(uint32_t ns, absl::Span<const int32_t> tokens) const {
    auto it = trees_.find(ns);
    return it == trees_.end() ? RadixTree::Match{} : it->second->LongestPrefix(tokens);
  }
  int32_t Find(uint32_t ns, absl::Span<const int32_t> key) const {
    auto it = trees_.find(ns);
    return it == trees_.end() ? -1 : it->second->Find(key);
  }
  // Drops a namespace's tree once it is empty, so that the forest never outgrows the snapshots.
  bool Erase(uint32_t ns, absl::Span<const int32_t> key) {
    auto it = trees_.find(ns);
    if (it == trees_.end() || !it->second->Erase(key)) return false;
    if (it->second->size() == 0) trees_.erase(it);
    return true;
  }
  int64_t size() const {
    int64_t n = 0;
    for (const auto& [ns, t] : trees_) n += t->size();
    return n;
  }

 private:
  std::unordered_map<uint32_t, std::unique_ptr<RadixTree>> trees_;
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_RADIX_TREE_H_
