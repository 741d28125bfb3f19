// Optimizer updates of a contiguous fp32 span, with exactly the arithmetic of PyTorch's
// single-tensor torch.optim.Adam, AdamW and SGD (momentum, dampening 0, optional Nesterov):
// the same operations in the same order, fp32 element math with the step's scalars computed
// in double and rounded to fp32 as torch passes them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/job_spec.h"

namespace shard {

class OptimizerKernel {
 public:
  explicit OptimizerKernel(OptimizerConfig config);

  // State tensors per parameter element, by their PyTorch names: exp_avg and exp_avg_sq for
  // Adam/AdamW, momentum_buffer for SGD with momentum, none for plain SGD.
  const std::vector<std::string>& state_names() const { return state_names_; }

  // Applies update number `step` (1-based) to param[0, n) with grad[0, n); state[k] points at
  // the k-th state tensor's span (zero before the first step).
  void Update(int64_t step, float* param, const float* grad, float* const* state,
              size_t n) const;

  const OptimizerConfig& config() const { return config_; }

 private:
  OptimizerConfig config_;
  std::vector<std::string> state_names_;
};

}  // namespace shard
