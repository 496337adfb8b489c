// ForwardGraphs: the recorded decode forwards of one lane (docs/cache.md, "A forward as one
// graph"). A decode forward whose every layer is queued at once (Forward::RunLayers) on
// backend memory is the same sequence of calls each time its key repeats: the key holds every
// argument of those calls that can change between forwards (the batch, the lane's scratch
// addresses, each layer's input and output addresses, the doorbells' addresses); everything
// else in them (the pool, the weights, the model) is fixed for the cache's life. The first
// forward of a key runs eagerly (the backend loads its kernels then, and a one-off key never
// pays for a recording); the second records the calls and launches the recording; later ones
// launch it. The doorbells' value is the launch's argument (rssm_graph_launch), not the key's.
//
// Thread safety: none; it belongs to a lane, used by one operation at a time.
#ifndef REPLAYSSM_CACHE_FORWARD_GRAPHS_H_
#define REPLAYSSM_CACHE_FORWARD_GRAPHS_H_

#include <cstddef>
#include <list>
#include <string>
#include <utility>

#include "replayssm/kernels.h"

namespace replayssm::cache {

class ForwardGraphs {
 public:
  static constexpr size_t kKeep =
      4;  // recordings kept: an engine cycling through a few region sets

  ForwardGraphs() = default;
  ~ForwardGraphs();  // frees the recordings (launches already queued still run)
  ForwardGraphs(const ForwardGraphs&) = delete;
  ForwardGraphs& operator=(const ForwardGraphs&) = delete;

  // The recording of `key` (now the most recently used), or null.
  rssm_graph* Find(const std::string& key);
  // Whether `key` is among the last kKeep keys run eagerly; remembers it.
  bool Repeats(const std::string& key);
  // Keeps `graph` (owned from now on) as the recording of `key`, dropping the least recently
  // used one beyond kKeep.
  void Add(std::string key, rssm_graph* graph);
  // The backend cannot record (CPU) or a recording failed: this lane's forwards run eagerly.
  void Disable() { disabled_ = true; }
  bool disabled() const { return disabled_; }
  size_t size() const { return graphs_.size(); }

 private:
  std::list<std::pair<std::string, rssm_graph*>> graphs_;  // most recently used first
  std::list<std::string> seen_;                            // eager keys, newest first
  bool disabled_ = false;
};

}  // namespace replayssm::cache

#endif  // REPLAYSSM_CACHE_FORWARD_GRAPHS_H_
