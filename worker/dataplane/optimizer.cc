#include "worker/dataplane/optimizer.h"

#include <cmath>

namespace shard {

OptimizerKernel::OptimizerKernel(OptimizerConfig config)
    : config_(config), state_names_(OptimizerStateNames(config)) {}

// The loops below are written so the compiler vectorises them (this file is built with -O3
// -fno-math-errno), for AVX2 where the CPU has it; every expression keeps torch's operation
// order, and without FMA contraction the wider vectors round exactly as scalar code does.
__attribute__((target_clones("avx2", "default")))
void OptimizerKernel::Update(int64_t step, const StepHyperParameters& hyper,
                             float* __restrict param, const float* __restrict grad,
                             float* const* state, size_t n) const {
  const OptimizerConfig& c = config_;
  const double lr = hyper.lr;
  if (c.kind == OptimizerKind::kSgd) {
    const float weight_decay = static_cast<float>(hyper.weight_decay);
    const float momentum = static_cast<float>(c.momentum);
    const float neg_lr = static_cast<float>(-lr);
    if (c.momentum <= 0) {
      for (size_t i = 0; i < n; ++i) {
        const float d = weight_decay != 0 ? grad[i] + weight_decay * param[i] : grad[i];
        param[i] = param[i] + neg_lr * d;
      }
      return;
    }
    float* __restrict buffer = state[0];
    const bool first = step == 1;  // torch: buf = clone(d_p) on the first step
    for (size_t i = 0; i < n; ++i) {
      float d = weight_decay != 0 ? grad[i] + weight_decay * param[i] : grad[i];
      const float b = first ? d : buffer[i] * momentum + d;
      buffer[i] = b;
      d = c.nesterov ? d + momentum * b : b;
      param[i] = param[i] + neg_lr * d;
    }
    return;
  }

  // Adam / AdamW.
  const double bias_correction1 = 1.0 - std::pow(c.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(c.beta2, static_cast<double>(step));
  const float step_size_neg = static_cast<float>(-(lr / bias_correction1));
  const float bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  const float one_minus_beta1 = static_cast<float>(1.0 - c.beta1);
  // torch's lerp(self, end, w) is self + w * (end - self) for |w| < 0.5, else
  // end - (end - self) * (1 - w).
  const bool lerp_from_self = one_minus_beta1 < 0.5f;
  const float lerp_complement = 1.0f - one_minus_beta1;
  const float beta2 = static_cast<float>(c.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - c.beta2);
  const float eps = static_cast<float>(c.eps);
  const bool decoupled = c.kind == OptimizerKind::kAdamW;
  const float l2 = decoupled ? 0.0f : static_cast<float>(hyper.weight_decay);
  const float decay = static_cast<float>(1.0 - lr * hyper.weight_decay);
  float* __restrict exp_avg = state[0];
  float* __restrict exp_avg_sq = state[1];
  for (size_t i = 0; i < n; ++i) {
    float p = param[i];
    if (decoupled) p = p * decay;                 // param.mul_(1 - lr * weight_decay)
    const float g = l2 != 0 ? grad[i] + l2 * p : grad[i];  // grad.add(param, alpha=wd)
    // exp_avg.lerp_(grad, 1 - beta1)
    const float m = lerp_from_self ? exp_avg[i] + one_minus_beta1 * (g - exp_avg[i])
                                   : g - (g - exp_avg[i]) * lerp_complement;
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    const float v = exp_avg_sq[i] * beta2 + one_minus_beta2 * g * g;
    // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    const float denom = std::sqrt(v) / bias_correction2_sqrt + eps;
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    param[i] = p + step_size_neg * m / denom;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
  }
}

}  // namespace shard
