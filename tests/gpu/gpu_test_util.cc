#include "tests/gpu/gpu_test_util.h"

#include <cmath>

namespace shard {

double RelativeError(const std::vector<float>& a, const std::vector<float>& b) {
  double difference = 0;
  double norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    difference += d * d;
    norm += static_cast<double>(b[i]) * b[i];
  }
  if (a.size() != b.size()) return INFINITY;
  return norm == 0 ? std::sqrt(difference) : std::sqrt(difference / norm);
}

}  // namespace shard
