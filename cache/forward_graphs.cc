#include "forward_graphs.h"

#include <algorithm>

namespace replayssm::cache {

ForwardGraphs::~ForwardGraphs() {
  for (auto& [key, graph] : graphs_) rssm_graph_destroy(graph);
}

rssm_graph* ForwardGraphs::Find(const std::string& key) {
  auto it = std::find_if(graphs_.begin(), graphs_.end(),
                         [&](const auto& entry) { return entry.first == key; });
  if (it == graphs_.end()) return nullptr;
  graphs_.splice(graphs_.begin(), graphs_, it);
  return graphs_.front().second;
}

bool ForwardGraphs::Repeats(const std::string& key) {
  auto it = std::find(seen_.begin(), seen_.end(), key);
  const bool repeats = it != seen_.end();
  if (repeats) seen_.erase(it);
  seen_.push_front(key);
  if (seen_.size() > kKeep) seen_.pop_back();
  return repeats;
}

void ForwardGraphs::Add(std::string key, rssm_graph* graph) {
  graphs_.emplace_front(std::move(key), graph);
  if (graphs_.size() > kKeep) {
    rssm_graph_destroy(graphs_.back().second);
    graphs_.pop_back();
  }
}

}  // namespace replayssm::cache
