// The benchmarks' one way to stop on an error: every status and kernel-ABI call checked, the
// program exiting non-zero naming the call and where, rather than printing a figure it did
// not measure. CUDA runtime calls: CHECK_CUDA in bench/cuda_util.h.
#ifndef REPLAYSSM_BENCH_CHECK_H_
#define REPLAYSSM_BENCH_CHECK_H_

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "replayssm/kernels.h"

#define CHECK_OK(x)                                                                       \
  do {                                                                                    \
    const absl::Status s_ = (x);                                                          \
    if (!s_.ok()) {                                                                       \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, s_.ToString().c_str()); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)
#define CHECK_RSSM(x)                                                                     \
  do {                                                                                    \
    const rssm_status s_ = (x);                                                           \
    if (s_ != RSSM_OK) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, rssm_last_error()); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

namespace replayssm::bench {

// Stops the program: `what` on stderr, exit 1.
[[noreturn]] inline void Die(const std::string& what) {
  std::fprintf(stderr, "%s\n", what.c_str());
  std::exit(1);
}

// The call-site forms, for a call whose expression says less than a word does.
inline void CheckOk(const absl::Status& s, const char* what) {
  if (!s.ok()) Die(std::string(what) + ": " + s.ToString());
}
inline void CheckRssm(rssm_status s, const char* what) {
  if (s != RSSM_OK) Die(std::string(what) + ": " + rssm_last_error());
}

// The value of `v`, or Die naming `what` and the status.
template <typename T>
T ValueOrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) Die(std::string(what) + ": " + v.status().ToString());
  return *std::move(v);
}

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_CHECK_H_
