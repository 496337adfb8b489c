// For cache tests: deterministic per-token activations (a function of token id, position and
// layer, so a state depends only on its token sequence and prefixes can be shared) and the
// fp64 reference state of any token sequence.
#ifndef REPLAYSSM_CACHE_TEST_MODEL_H_
#define REPLAYSSM_CACHE_TEST_MODEL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "replayssm/cache/model.h"
#include "replayssm/cache/state_cache.h"

namespace replayssm::cache::testing {

// A token as the cache sees it: its id and its position in the request.
struct Tok {
  int32_t id;
  int64_t pos;
};

// Host buffers for N tokens of every layer, and the LayerIo views over them.
struct Batch {
  std::vector<std::vector<uint8_t>> qkv, a, b, out;  // [layers]
  std::vector<LayerIo> io;                            // [layers]
  // Output of token i in layer l, as fp64.
  std::vector<double> Output(const ModelSpec& m, int layer, int64_t i) const;
};

// A Batch copied into backend memory (device memory on CUDA): io views it as
// IoMemory::kBackend. Copies wait for themselves (the legacy stream + a synchronize).
struct BackendBatch {
  BackendBatch(int32_t backend, const Batch& host);
  ~BackendBatch();
  BackendBatch(const BackendBatch&) = delete;
  BackendBatch& operator=(const BackendBatch&) = delete;
  // host.out <- the outputs (once the work writing them is done).
  void CopyOutputsTo(Batch& host) const;
  // The inputs <- host's (same shapes), into the same buffers.
  void CopyInputsFrom(const Batch& host);

  int32_t backend;
  std::vector<void*> buffers;  // every allocation, freed by the destructor
  std::vector<LayerIo> io;     // [layers]
};

// `n` doorbell words in backend memory, zero at first, set and read from the host (the legacy
// stream, waited for). A failed backend call aborts, naming it.
class BackendWords {
 public:
  BackendWords(int32_t backend, size_t n);
  ~BackendWords();
  BackendWords(const BackendWords&) = delete;
  BackendWords& operator=(const BackendWords&) = delete;
  uint32_t* at(size_t i) const { return static_cast<uint32_t*>(p_) + i; }
  // Words [from, to) <- v.
  void Fill(uint32_t v, size_t from = 0, size_t to = SIZE_MAX);
  std::vector<uint32_t> Read() const;

 private:
  int32_t backend_;
  size_t n_;
  void* p_ = nullptr;
};

class Oracle {
 public:
  // [layers][HV*V*K, then the conv window (W-1)*C when the model has a convolution]
  using State = std::vector<std::vector<double>>;
  using Outputs = std::vector<std::vector<double>>;  // [layers][HV*V]

  explicit Oracle(const ModelSpec& m) : m_(m) {}
  Batch MakeBatch(const std::vector<Tok>& toks) const;
  State Zero() const;
  // Advances s by one token; returns its outputs.
  Outputs Step(State& s, Tok t) const;
  // The state after tokens[0..n) from zero.
  State Run(const std::vector<int32_t>& tokens, int64_t n) const;
  // The state held in exported checkpoints, as fp64.
  State FromExport(const ExportedState& e) const;
  const ModelSpec& model() const { return m_; }

 private:
  // Token t's fp32 inputs for layer l (values already rounded to the act dtype).
  void Inputs(Tok t, int layer, std::vector<float>& qkv, std::vector<float>& a,
              std::vector<float>& b) const;
  // The short convolution of one token in layer `layer`: qkv (pre-convolution) becomes its
  // output, the window slides.
  void Convolve(std::vector<double>& window, int layer, std::vector<float>& qkv) const;
  const ModelSpec& m_;
};

// The backend the cache tests run on: CPU, or CUDA when REPLAYSSM_TEST_BACKEND=cuda (the
// same suite runs on the H200 through the device tool).
int32_t TestBackend();

// The small model of the cache's rule tests: tiny-gdn, fp32, ring length `ring`, cut to two
// layers; and options for a cache of `slots` of its slots on TestBackend().
ModelSpec TwoLayerTinyGdn(int32_t ring = 4);
CacheOptions TestOptions(const ModelSpec& m, int64_t slots);

// ‖x − ref‖ / ‖ref‖ over all layers (NaN if any value is NaN).
double RelErr(const std::vector<std::vector<double>>& x, const std::vector<std::vector<double>>& ref);
double RelErr(const std::vector<double>& x, const std::vector<double>& ref);

}  // namespace replayssm::cache::testing

#endif  // REPLAYSSM_CACHE_TEST_MODEL_H_
