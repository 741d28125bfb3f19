// Optimizer updates of a contiguous fp32 span, with exactly the arithmetic of PyTorch's
// single-tensor torch.optim.Adam, AdamW and SGD (momentum, dampening 0, optional Nesterov):
// the same operations in the same order, fp32 element math with the step's scalars computed
// in double and rounded to fp32 as torch passes them. The learning rate and weight decay come
// per call (a param group's at a step of the schedule, common/param_groups.h), as torch reads
// them from each group on every step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "common/job_spec.h"
#include "common/param_groups.h"

namespace shard {

class OptimizerKernel {
 public:
  explicit OptimizerKernel(OptimizerConfig config);

  // State tensors per parameter element, by their PyTorch names: exp_avg and exp_avg_sq for
  // Adam/AdamW, momentum_buffer for SGD with momentum, none for plain SGD.
  const std::vector<std::string>& state_names() const { return state_names_; }

  // Applies update number `step` (1-based) to param[0, n) with grad[0, n), with the learning
  // rate and weight decay of `hyper` (the config's own are not read); state[k] points at the
  // k-th state tensor's span (zero before the first step).
  void Update(int64_t step, const StepHyperParameters& hyper, float* param, const float* grad,
              float* const* state, size_t n) const;
  // The same with the config's lr and weight_decay as they are: no group, no schedule.
  void Update(int64_t step, float* param, const float* grad, float* const* state,
              size_t n) const {
    Update(step, StepHyperParameters{config_.lr, config_.weight_decay}, param, grad, state, n);
  }

  const OptimizerConfig& config() const { return config_; }

 private:
  OptimizerConfig config_;
  std::vector<std::string> state_names_;
};

}  // namespace shard
