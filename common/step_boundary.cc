#include "common/step_boundary.h"

#include <algorithm>

namespace shard {

bool SaveDue(int64_t step, const StepBoundaryRules& rules, const StepOrders& agreed,
             const StepBoundaryState& state) {
  return (rules.checkpoint_every > 0 && step % rules.checkpoint_every == 0) ||
         agreed.save_request > state.satisfied;
}

StepBoundary DecideStepBoundary(int64_t step, const StepBoundaryRules& rules,
                                const StepOrders& agreed, bool snapshots_busy,
                                StepBoundaryState* state) {
  return DecideStepBoundary(step, rules, agreed, BoundaryWork{snapshots_busy, 0}, state);
}

StepBoundary DecideStepBoundary(int64_t step, const StepBoundaryRules& rules,
                                const StepOrders& agreed, const BoundaryWork& work,
                                StepBoundaryState* state) {
  const bool snapshots_busy = work.snapshots_busy;
  StepBoundary boundary;
  const bool periodic = rules.checkpoint_every > 0 && step % rules.checkpoint_every == 0;
  if (periodic || agreed.save_request > state->satisfied) {
    if (work.saving_step > 0) {
      // Queued behind a write that has not finished, saves would pile up without bound on a
      // slow disk, and starting one would wait for it: a periodic one is skipped, a requested
      // one (satisfied stays) is taken at the first boundary nobody is writing at.
      boundary.save_skipped = periodic;
    } else {
      boundary.save = true;
      boundary.request = std::max(agreed.save_request, state->satisfied);
      state->satisfied = boundary.request;
    }
  }
  if (agreed.pause_in_memory && agreed.pause_request > state->snapshotted_pause) {
    boundary.snapshot = true;
    boundary.snapshot_request = agreed.pause_request;
    state->snapshotted_pause = agreed.pause_request;
  } else if (rules.snapshot_every > 0 && !snapshots_busy &&
             step / rules.snapshot_every > state->last_snapshot_step / rules.snapshot_every) {
    boundary.snapshot = true;
  }
  if (boundary.snapshot) state->last_snapshot_step = step;
  const int64_t answered = agreed.pause_in_memory ? state->snapshotted_pause : state->satisfied;
  boundary.pause = agreed.pause_request > 0 && answered >= agreed.pause_request &&
                   step < rules.total_steps;
  return boundary;
}

}  // namespace shard
