#include "common/step_boundary.h"

#include <algorithm>

namespace shard {

StepBoundary DecideStepBoundary(int64_t step, int64_t total_steps, int64_t every,
                                const StepOrders& agreed, int64_t* satisfied) {
  StepBoundary boundary;
  const bool periodic = every > 0 && step % every == 0;
  if (periodic || agreed.save_request > *satisfied) {
    boundary.save = true;
    boundary.request = std::max(agreed.save_request, *satisfied);
    *satisfied = boundary.request;
  }
  boundary.pause = agreed.pause_request > 0 && *satisfied >= agreed.pause_request &&
                   step < total_steps;
  return boundary;
}

}  // namespace shard
