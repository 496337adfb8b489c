#include "radix_tree.h"

#include <algorithm>

namespace replayssm::cache {

RadixTree::RadixTree() : root_(std::make_unique<Node>()) {}
RadixTree::~RadixTree() = default;

bool RadixTree::Insert(absl::Span<const int32_t> key, int32_t value) {
  if (key.empty() || value < 0) return false;
  Node* node = root_.get();
  size_t pos = 0;
  while (pos < key.size()) {
    auto it = node->children.find(key[pos]);
    if (it == node->children.end()) {  // a new leaf for the rest of the key
      auto leaf = std::make_unique<Node>();
      leaf->edge.assign(key.begin() + pos, key.end());
      leaf->parent = node;
      leaf->value = value;
      node->children.emplace(key[pos], std::move(leaf));
      ++size_;
      return true;
    }
    Node* child = it->second.get();
    const size_t n = std::min(child->edge.size(), key.size() - pos);
    size_t common = 0;
    while (common < n && child->edge[common] == key[pos + common]) ++common;
    if (common < child->edge.size()) {  // split the edge at `common`
      auto mid = std::make_unique<Node>();
      mid->edge.assign(child->edge.begin(), child->edge.begin() + common);
      mid->parent = node;
      std::unique_ptr<Node> old = std::move(it->second);
      old->edge.erase(old->edge.begin(), old->edge.begin() + common);
      old->parent = mid.get();
      mid->children.emplace(old->edge.front(), std::move(old));
      it->second = std::move(mid);
      child = it->second.get();
    }
    node = child;
    pos += common;
  }
  if (node->value >= 0) return false;
  node->value = value;
  ++size_;
  return true;
}

RadixTree::Match RadixTree::LongestPrefix(absl::Span<const int32_t> tokens) const {
  Match best;
  const Node* node = root_.get();
  size_t pos = 0;
  while (pos < tokens.size()) {
    auto it = node->children.find(tokens[pos]);
    if (it == node->children.end()) break;
    const Node* child = it->second.get();
    if (child->edge.size() > tokens.size() - pos ||
        !std::equal(child->edge.begin(), child->edge.end(), tokens.begin() + pos)) {
      break;
    }
    pos += child->edge.size();
    node = child;
    if (node->value >= 0) best = Match{static_cast<int64_t>(pos), node->value};
  }
  return best;
}

RadixTree::Node* RadixTree::FindNode(absl::Span<const int32_t> key) const {
  Node* node = root_.get();
  size_t pos = 0;
  while (pos < key.size()) {
    auto it = node->children.find(key[pos]);
    if (it == node->children.end()) return nullptr;
    Node* child = it->second.get();
    if (child->edge.size() > key.size() - pos ||
        !std::equal(child->edge.begin(), child->edge.end(), key.begin() + pos)) {
      return nullptr;
    }
    pos += child->edge.size();
    node = child;
  }
  return node;
}

int32_t RadixTree::Find(absl::Span<const int32_t> key) const {
  const Node* node = key.empty() ? nullptr : FindNode(key);
  return node != nullptr ? node->value : -1;
}

bool RadixTree::Erase(absl::Span<const int32_t> key) {
  Node* node = key.empty() ? nullptr : FindNode(key);
  if (node == nullptr || node->value < 0) return false;
  node->value = -1;
  --size_;
  Compact(node);
  return true;
}

void RadixTree::Compact(Node* node) {
  while (node != root_.get() && node->value < 0) {
    Node* parent = node->parent;
    if (node->children.empty()) {  // an empty leaf: remove it, then look at the parent
      parent->children.erase(node->edge.front());
      node = parent;
      continue;
    }
    if (node->children.size() == 1) {  // a pass-through node: merge it with its child
      std::unique_ptr<Node> child = std::move(node->children.begin()->second);
      child->edge.insert(child->edge.begin(), node->edge.begin(), node->edge.end());
      child->parent = parent;
      parent->children[child->edge.front()] = std::move(child);  // destroys `node`
    }
    return;
  }
}

int64_t RadixTree::node_count() const {
  int64_t n = 0;
  std::vector<const Node*> stack = {root_.get()};
  while (!stack.empty()) {
    const Node* x = stack.back();
    stack.pop_back();
    for (const auto& [tok, child] : x->children) {
      ++n;
      stack.push_back(child.get());
    }
  }
  return n;
}

}  // namespace replayssm::cache
