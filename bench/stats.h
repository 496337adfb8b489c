// The benchmarks' one median: the middle sample, or the mean of the two middle ones for an
// even count (the 0.5 quantile interpolated, as cache_bench's quartiles); 0 for no samples.
#ifndef REPLAYSSM_BENCH_STATS_H_
#define REPLAYSSM_BENCH_STATS_H_

#include <algorithm>
#include <cstddef>
#include <vector>

namespace replayssm::bench {

template <typename T>
double Median(std::vector<T> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  if (n % 2 == 1) return static_cast<double>(v[n / 2]);
  return 0.5 * (static_cast<double>(v[n / 2 - 1]) + static_cast<double>(v[n / 2]));
}

}  // namespace replayssm::bench

#endif  // REPLAYSSM_BENCH_STATS_H_
