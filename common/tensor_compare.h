// Element-wise comparison of two safetensors files with the same tensors: for each tensor the
// largest absolute difference and its element, and the tensor's largest magnitude (so the
// difference can be read relative to the tensor's scale). Floating-point tensors (F32, F16,
// BF16, F64) are compared as doubles. `shardctl compare` prints it; the GPU cluster script uses
// it to check a GPU run against a CPU run.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shard {

struct TensorDifference {
  std::string name;
  int64_t numel = 0;
  double max_abs_diff = 0;  // max |a - b|; infinity where exactly one of them is not finite
  int64_t worst_element = 0;
  double max_magnitude = 0;  // max |a| over the tensor
  // Element pairs where a and b are not bitwise equal.
  int64_t differing = 0;
};

// One entry per tensor of `a`, in `a`'s order. FailedPrecondition naming the tensor when the
// files do not hold the same tensor names, dtypes and shapes; the files' errors otherwise.
absl::StatusOr<std::vector<TensorDifference>> CompareSafetensorsFiles(const std::string& a,
                                                                      const std::string& b);

}  // namespace shard
